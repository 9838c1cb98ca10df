"""Controller recovery: the fleet exporter dies with a killed controller (so the next one can bind
its port), an exporter a killed controller left behind is stopped, the systemd unit restarts the
controller by itself. Real processes and signals. (Adoption decisions: test_deploy_controller.py;
the whole recovery on a real Ray cluster: test_deploy_fleet_recovery.py.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from r9k.devtools.local_server import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_child_dies_with_its_parent_even_by_sigkill(tmp_path):
    """r9k.deploy.child: the command (exec'd, same pid) gets SIGTERM when its parent is
    SIGKILLed; an ordinary child of the same parent outlives it (the control)."""
    code = f"""
import subprocess, sys, time
wrapped = subprocess.Popen([sys.executable, "-m", "r9k.deploy.child", str(__import__("os").getpid()),
                            sys.executable, "-c", "import time; time.sleep(120)"])
plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open({str(tmp_path / "pids")!r}, "w").write(f"{{wrapped.pid}} {{plain.pid}}")
time.sleep(120)
"""
    parent = subprocess.Popen([sys.executable, "-c", code])
    pids = tmp_path / "pids"
    deadline = time.monotonic() + 30
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    wrapped, plain = map(int, pids.read_text().split())
    time.sleep(1.0)  # the wrapper has exec'd the command
    assert "sleep(120)" in " ".join(psutil.Process(wrapped).cmdline())
    parent.kill()
    parent.wait(10)
    try:
        assert _gone(wrapped, 10), "the wrapped child outlived its SIGKILLed parent"
        assert not _gone(plain, 1), "control: a plain child should outlive its parent"
    finally:
        for pid in (wrapped, plain):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_child_refuses_when_its_parent_is_already_gone():
    out = subprocess.run([sys.executable, "-m", "r9k.deploy.child", "1", "true"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "parent 1 is gone" in out.stderr


def _controller(tmp_path):
    from r9k.deploy.config import load_fleet
    from r9k.deploy.controller import FleetController
    from r9k.devtools.tiny_model import build_config

    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(build_config()))
    (tmp_path / "fleet.yaml").write_text(json.dumps({
        "platform": "cpu", "entry": {"port": free_port()}, "exporter": {"port": free_port()},
        "ops_state_dir": str(tmp_path / "ops"),
        "hosts": [{"name": "local", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"}]}],
        "models": [{"name": "tiny", "path": str(model), "kv_cache_memory_bytes": 64 << 20,
                    "state_dtype": "float32"}]}))
    c = FleetController(load_fleet(tmp_path / "fleet.yaml"), tmp_path / "run")
    c.run_dir.mkdir(exist_ok=True)
    return c


def test_exporter_a_killed_controller_left_is_stopped_before_a_new_one_starts(tmp_path):
    """The pid file names a process that is still this fleet's exporter: stopped. A pid file
    naming some other process leaves it alone."""
    c = _controller(tmp_path)
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "exporter",
                              "--fleet", "http://127.0.0.1:1/fleet/status"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (c.run_dir / "exporter.pid").write_text(str(other.pid))
        c.exporter.stop_stale()
        assert other.poll() is None, "a process that is not an exporter was stopped"
        (c.run_dir / "exporter.pid").write_text(str(stale.pid))
        c.exporter.start()
        assert stale.wait(15) is not None
        assert int((c.run_dir / "exporter.pid").read_text()) == c.exporter.proc.pid
    finally:
        for p in (stale, other, c.exporter.proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def _fleet_file(tmp_path, address: str, hosts: int = 1):
    from r9k.devtools.tiny_model import build_config

    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(build_config()))
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps({
        "platform": "cpu", "ray": {"address": address, "num_cpus": 4},
        "replica_bind": "node-ip" if hosts > 1 else "127.0.0.1",
        "ops_state_dir": str(tmp_path / "ops"),
        "hosts": [{"name": f"box{i}", "cards": [{"bdf": f"0000:c{i}:00.0", "cpu_bind": "0"},
                                                 {"bdf": f"0000:c{i}:00.1", "cpu_bind": "1"}]}
                  for i in range(1, hosts + 1)],
        "models": [{"name": "tiny", "path": str(model), "kv_cache_memory_bytes": 64 << 20}]}))
    return path


def test_install_units_writes_the_ray_head_and_a_self_restarting_controller(tmp_path):
    import shutil

    from click.testing import CliRunner

    from r9k.cli import main

    fleet = _fleet_file(tmp_path, "auto")
    r9k_bin = str(__import__("pathlib").Path(sys.executable).parent / "r9k")
    dest = tmp_path / "system"
    res = CliRunner().invoke(main, ["fleet", "install-units", "--config", str(fleet), "--dest",
                                    str(dest), "--r9k-bin", r9k_bin, "--run-dir", "/var/lib/r9k"])
    assert res.exit_code == 0, res.output
    controller = (dest / "r9k-fleet.service").read_text()
    head = (dest / "r9k-ray-head.service").read_text()
    assert f"ExecStart={r9k_bin} fleet up --config {fleet} --run-dir /var/lib/r9k" in controller
    assert "Restart=always" in controller and "Requires=r9k-ray-head.service" in controller
    # `r9k fleet down` exits with a status of its own, which the unit does not restart on
    from r9k.deploy.cli import EXIT_FLEET_DOWN
    assert f"RestartPreventExitStatus={EXIT_FLEET_DOWN}" in controller
    assert f"ExecStart={r9k_bin} fleet ray-head --config {fleet}" in head
    assert not any("@" in ln for p in dest.iterdir() for ln in p.read_text().splitlines()
                   if not ln.startswith("#"))
    dry = CliRunner().invoke(main, ["fleet", "ray-head", "--config", str(fleet), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.output.split()[1:] == ["start", "--head", "--block", "--include-dashboard=false",
                                      "--resources", '{"R9700":', "2}", "--labels",
                                      "r9k.host=box1", "--num-cpus", "4"]
    if shutil.which("systemd-analyze"):
        proc = subprocess.run(["systemd-analyze", "verify", "--man=no",
                               *(str(p) for p in sorted(dest.iterdir()))],
                              capture_output=True, text=True, timeout=60)
        problems = [ln for ln in proc.stderr.splitlines() if "r9k-" in ln
                    and "r9k-ops-apply.service" not in ln]  # ordering on an uninstalled unit
        assert proc.returncode == 0 and problems == [], proc.stderr


@pytest.mark.parametrize("address, hosts, error", [
    ("local", 1, "ray.address is local"),
    ("auto", 2, "lists 2 hosts (box1, box2); expected --host NAME"),
])
def test_install_units_refuses_a_fleet_it_cannot_keep_alive(tmp_path, address, hosts, error):
    from click.testing import CliRunner

    from r9k.cli import main

    fleet = _fleet_file(tmp_path, address, hosts)
    dest = tmp_path / "system"
    res = CliRunner().invoke(main, ["fleet", "install-units", "--config", str(fleet), "--dest",
                                    str(dest)])
    assert res.exit_code == 2 and error in res.output, res.output
    assert not dest.exists()


def test_supervisor_never_falls_back_onto_another_replicas_port(tmp_path):
    """Found in the fleet run: a replica whose own port looked busy (TIME_WAIT, probed without
    SO_REUSEADDR) fell back to the next port, another replica's own, and both servers ran on
    one URL. The probe binds as the server does (a TIME_WAIT port is free), and the fallback
    skips the other replicas' ports."""
    import socket

    from r9k.deploy.supervisor import ReplicaProcess, _port_free

    lo = free_port()
    listener = socket.socket()
    listener.bind(("127.0.0.1", lo))
    listener.listen()
    # a port with a closed connection in TIME_WAIT (the server side closed first)
    tw = socket.socket()
    tw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tw_port = lo + 3
    try:
        tw.bind(("127.0.0.1", tw_port))
    except OSError:
        pytest.skip("port range not free")
    tw.listen()
    c = socket.create_connection(("127.0.0.1", tw_port))
    conn, _ = tw.accept()
    conn.close()  # server closes first: TIME_WAIT on tw_port
    c.close()
    tw.close()
    assert _port_free("127.0.0.1", tw_port)
    assert not _port_free("127.0.0.1", lo)
    p = ReplicaProcess("m-0", [sys.executable, "-c", "import time; time.sleep(60)", "{port}"],
                       str(tmp_path), "127.0.0.1", (lo, lo + 9), preferred_port=lo,
                       spec={"avoid_ports": [lo + 1, lo + 2]})
    try:
        info = p.start()
        assert info["url"] == f"http://127.0.0.1:{tw_port}", info
    finally:
        p.kill()
        listener.close()


def test_install_units_for_a_two_host_file_writes_head_and_worker_units(tmp_path):
    """The head host gets Ray's head (its own cards and label) and the controller; a worker
    host its Ray node joining the head and its own entry point routing from the controller."""
    import shutil

    from click.testing import CliRunner

    from r9k.cli import main

    fleet = _fleet_file(tmp_path, "auto", hosts=2)
    r9k_bin = str(__import__("pathlib").Path(sys.executable).parent / "r9k")
    head_dir, worker_dir = tmp_path / "head", tmp_path / "worker"
    base = ["fleet", "install-units", "--config", str(fleet), "--r9k-bin", r9k_bin]
    res = CliRunner().invoke(main, base + ["--dest", str(head_dir), "--host", "box1"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in head_dir.iterdir()) == ["r9k-fleet.service", "r9k-ray-head.service"]
    assert f"ExecStart={r9k_bin} fleet ray-head --config {fleet} --host box1\n" in \
        (head_dir / "r9k-ray-head.service").read_text()
    res = CliRunner().invoke(main, base + ["--dest", str(worker_dir), "--host", "box2", "--head",
                                           "10.0.0.1:6379", "--controller", "http://10.0.0.1:8000"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in worker_dir.iterdir()) == ["r9k-fleet-entry.service", "r9k-ray-worker.service"]
    worker = (worker_dir / "r9k-ray-worker.service").read_text()
    assert f"ExecStart={r9k_bin} fleet ray-worker --config {fleet} --host box2 --head 10.0.0.1:6379\n" in worker
    entry = (worker_dir / "r9k-fleet-entry.service").read_text()
    assert f"ExecStart={r9k_bin} fleet entry --config {fleet} --controller http://10.0.0.1:8000\n" in entry
    dry = CliRunner().invoke(main, ["fleet", "ray-worker", "--config", str(fleet), "--host", "box2",
                                    "--head", "10.0.0.1:6379", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.output.split()[1:] == ["start", "--address", "10.0.0.1:6379", "--block",
                                      "--include-dashboard=false", "--resources", '{"R9700":', "2}",
                                      "--labels", "r9k.host=box2", "--num-cpus", "4"]
    for args, error in [(["--host", "box9"], "--host 'box9' is not in the fleet file's hosts"),
                        (["--host", "box2", "--head", "10.0.0.1"], "expected the Ray head's HOST:PORT"),
                        (["--host", "box2", "--head", "10.0.0.1:6379"], "needs --controller URL"),
                        (["--host", "box2", "--head", "h:1", "--controller", "h:8000"],
                         "expected an http(s)://HOST:PORT URL")]:
        out = tmp_path / "refused"
        res = CliRunner().invoke(main, base + ["--dest", str(out)] + args)
        assert res.exit_code == 2 and error in res.output, (args, res.output)
        assert not out.exists()
    if shutil.which("systemd-analyze"):
        proc = subprocess.run(["systemd-analyze", "verify", "--man=no",
                               *(str(p) for d in (head_dir, worker_dir) for p in sorted(d.iterdir()))],
                              capture_output=True, text=True, timeout=60)
        problems = [ln for ln in proc.stderr.splitlines() if "r9k-" in ln
                    and "r9k-ops-apply.service" not in ln]
        assert proc.returncode == 0 and problems == [], proc.stderr


def test_guarded_engine_group_dies_with_its_supervisor_even_by_sigkill(tmp_path):
    """r9k.deploy.child --guard: the command and its own children (an engine core) are killed
    when the supervisor that started the guard is SIGKILLed; the guard reports the command's
    status, a signal as the same signal; the control (an unguarded child) outlives it."""
    code = f"""
import os, subprocess, sys, time
guarded = subprocess.Popen([sys.executable, "-m", "r9k.deploy.child", "--guard", str(os.getpid()),
                            sys.executable, "-c",
                            "import subprocess, sys, time; "
                            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                            "open({str(tmp_path / 'core')!r}, 'w').write(str(c.pid)); time.sleep(120)"],
                           start_new_session=True)
plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open({str(tmp_path / "pids")!r}, "w").write(f"{{guarded.pid}} {{plain.pid}}")
time.sleep(120)
"""
    supervisor = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not (tmp_path / "core").exists() or not (tmp_path / "core").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    guard, plain = map(int, (tmp_path / "pids").read_text().split())
    core = int((tmp_path / "core").read_text())
    server = [c.pid for c in psutil.Process(guard).children()]
    assert len(server) == 1 and core in [c.pid for c in psutil.Process(server[0]).children()]
    supervisor.kill()
    supervisor.wait(10)
    try:
        for pid in (guard, server[0], core):
            assert _gone(pid, 5), f"{pid} outlived its SIGKILLed supervisor"
        assert not _gone(plain, 1), "control: an unguarded child should outlive it"
    finally:
        for pid in (guard, server[0], core, plain):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_guard_reports_the_commands_exit_and_signals_as_its_own():
    me = str(os.getpid())
    ok = subprocess.run([sys.executable, "-m", "r9k.deploy.child", "--guard", me, sys.executable,
                         "-c", "raise SystemExit(3)"], timeout=60)
    assert ok.returncode == 3
    killed = subprocess.run([sys.executable, "-m", "r9k.deploy.child", "--guard", me, sys.executable,
                             "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], timeout=60)
    assert killed.returncode == -signal.SIGKILL
    bad = subprocess.run([sys.executable, "-m", "r9k.deploy.child", "--guard", "1", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "parent 1 is gone" in bad.stderr


def test_a_model_path_missing_on_the_host_fails_the_start_naming_the_host(tmp_path):
    from r9k.deploy.supervisor import ReplicaProcess

    lo = free_port()
    p = ReplicaProcess("m-0", [sys.executable, "-c", "import time; time.sleep(60)", "{port}"],
                       str(tmp_path), "127.0.0.1", (lo, lo + 9),
                       spec={"host": "gpu-b", "model_path": str(tmp_path / "missing")})
    with pytest.raises(RuntimeError, match=r"model path .*missing has no config.json on host gpu-b"):
        p.start()
    assert p.status()["alive"] is False and p.starts == 0
