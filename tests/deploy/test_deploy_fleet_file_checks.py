"""The fleet file's checks: flags and environment the fleet owns cannot be overridden in any
spelling; prefix caching is a typed field; a model name is printable without blanks; RCCL
defaults per TP size; install-units hands the API key on without writing it. Also the entry
point against bad bytes, deep JSON, slow clients and replicas on IPv6."""
from __future__ import annotations

import pytest

from r9k.deploy.config import parse_fleet, planned_pool
from r9k.deploy.engine import engine_argv

from test_deploy_config import fleet_text, refused

MODEL = {"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30}


@pytest.mark.parametrize("extra, flag", [
    (["--host 0.0.0.0"], "host"),
    (["--port 9999"], "port"),
    (["--max-num-seqs 8 --port=9999"], "port"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching"),
    (["--tensor-parallel-size", "4"], "tensor_parallel_size"),
    (["--tensor_parallel_size=4"], "tensor_parallel_size"),  # vLLM reads _ as -
    (["--enable_prefix_caching"], "enable_prefix_caching"),
])
def test_owned_flags_are_refused_in_every_spelling(extra, flag):
    needle = f"set vLLM's {flag} "
    assert needle in refused(fleet_text(models=[dict(MODEL, extra_args=extra)]))


@pytest.mark.parametrize("key", ["HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                                 "R9K_GDN_STATE", "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"])
def test_env_cannot_override_card_placement_or_page_mode(key):
    msg = refused(fleet_text(models=[dict(MODEL, env={key: "0"})]))
    assert f"{key} is set by the fleet" in msg


def test_other_flags_and_env_still_pass():
    cfg = parse_fleet(fleet_text(models=[dict(MODEL, extra_args=["--max-num-seqs 8"],
                                              env={"NCCL_P2P_DISABLE": "1"})]))
    assert cfg.models[0].extra_args == ["--max-num-seqs 8"]


def test_prefix_caching_can_be_turned_off_from_the_fleet_file(monkeypatch, tmp_path):
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny")
    on = parse_fleet(fleet_text(models=[dict(MODEL, path=str(tmp_path / "tiny"), tp=1)]))
    off = parse_fleet(fleet_text(models=[dict(MODEL, path=str(tmp_path / "tiny"), tp=1,
                                              prefix_caching=False)]))
    argv_on = engine_argv(on.models[0], on, "127.0.0.1", 8100)
    argv_off = engine_argv(off.models[0], off, "127.0.0.1", 8100)
    assert not any("prefix-caching" in a for a in argv_on)  # vLLM's default: on
    assert "--no-enable-prefix-caching" in argv_off
    # the page proof plans the pool the replica runs: align on, none off
    assert planned_pool(on.models[0], on).onepage.cache_mode == "align"
    assert planned_pool(off.models[0], off).onepage.cache_mode == "none"
    assert "prefix_caching" in refused(fleet_text(models=[dict(MODEL, prefix_caching="no")]))


def test_install_units_gives_the_controller_and_the_drain_hook_the_api_key(tmp_path, monkeypatch):
    """entry.api_key_env: the fleet unit reads the key from a root-only EnvironmentFile (checked:
    exists, 0600, sets the variable), never from its own text; the watcher's unit can get
    R9K_FLEET_API_KEY the same way for the fleet's drain hook."""
    import json
    import os
    import sys
    from pathlib import Path

    from click.testing import CliRunner

    from r9k.cli import main
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({
        "platform": "cpu", "ray": {"address": "auto"}, "entry": {"api_key_env": "R9K_FLEET_API_KEY"},
        "hosts": [{"name": "box1", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"}]}],
        "models": [{"name": "tiny", "path": str(tmp_path / "tiny"), "kv_cache_memory_bytes": 64 << 20}]}))
    monkeypatch.setenv("R9K_FLEET_API_KEY", "k" * 32)
    r9k_bin = str(Path(sys.executable).parent / "r9k")
    env = tmp_path / "fleet.env"

    def install(*extra):
        return CliRunner().invoke(main, ["fleet", "install-units", "--config", str(fleet), "--dest",
                                         str(tmp_path / "system"), "--r9k-bin", r9k_bin,
                                         "--env-file", str(env), *extra])

    res = install()
    assert res.exit_code == 2 and f"--env-file {env}: cannot read it" in res.output
    env.write_text("R9K_FLEET_API_KEY=" + "k" * 32 + "\n")
    os.chmod(env, 0o644)
    res = install()
    assert res.exit_code == 2 and "expected root-owned, mode 0600" in res.output
    os.chmod(env, 0o600)
    env.write_text("# nothing yet\n")
    res = install()
    assert res.exit_code == 2 and "sets no R9K_FLEET_API_KEY" in res.output
    env.write_text("R9K_FLEET_API_KEY=" + "k" * 32 + "\n")
    res = install()
    assert res.exit_code == 0, res.output
    unit = (tmp_path / "system" / "r9k-fleet.service").read_text()
    assert f"EnvironmentFile={env}" in unit and "k" * 32 not in unit
    ops = CliRunner().invoke(main, ["ops", "install-units", "--dest", str(tmp_path / "ops"),
                                    "--r9k-bin", r9k_bin, "--env-file", str(env)])
    assert ops.exit_code == 0, ops.output
    assert f"EnvironmentFile={env}" in (tmp_path / "ops" / "r9k-ops-watch.service").read_text()


def test_rccl_defaults_per_tp_size_overridable_and_shown():
    """NCCL_PROTO=Simple on every R9700 replica (TP 2 deadlocks without it), NCCL_P2P_DISABLE=1
    at TP 4 (4-card peer-to-peer can hang the host); a model's env overrides them; the same
    dict goes into the replica's environment and the fleet status."""
    from test_deploy_placement import fleet, model

    from r9k.deploy.engine import engine_env, rccl_env
    from r9k.deploy.placement import Assignment

    cfg = fleet([model("two", 2, 1), model("four", 4, 1),
                 model("own", 4, 1) | {"env": {"NCCL_P2P_DISABLE": "0"}}])
    two, four, own = cfg.models
    assert rccl_env(two, cfg) == {"NCCL_PROTO": "Simple"}
    assert rccl_env(four, cfg) == {"NCCL_PROTO": "Simple", "NCCL_P2P_DISABLE": "1"}
    assert rccl_env(own, cfg) == {"NCCL_PROTO": "Simple", "NCCL_P2P_DISABLE": "0"}
    cards = [c.bdf for c in cfg.hosts[0].cards]
    env = engine_env(four, cfg, Assignment("four-0", "four", "a", tuple(cards)), cards)
    assert (env["NCCL_PROTO"], env["NCCL_P2P_DISABLE"]) == ("Simple", "1")
    cpu = fleet([model("m", 1, 1)], platform="cpu",
                hosts=[{"name": "a", "cards": [{"bdf": "0000:10:00.0", "cpu_bind": "0"}]}])
    assert rccl_env(cpu.models[0], cpu) == {}


def test_entry_point_answers_bad_bytes_and_deep_json_with_400_not_500():
    """Invalid UTF-8 bodies, JSON nested 100 000 deep (RecursionError in Python's parser), an
    Authorization header with non-ASCII bytes, a non-object admin body: 400 or 401, no 500."""
    import http.client

    from doubles.entry_fleet import LoopServers, Table
    from r9k.deploy.entry import MAX_JSON_DEPTH, EntryPoint, _json_object

    servers = LoopServers()
    url = servers.entry(EntryPoint(Table([]), api_key="fleet-key"))
    host, port = url.removeprefix("http://").split(":")

    def raw(path: str, body: bytes, auth: bytes = b"Bearer fleet-key") -> int:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.putrequest("POST", path)
        conn.putheader("Authorization", auth)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        status = conn.getresponse().status
        conn.close()
        return status

    try:
        assert raw("/v1/completions", b'{"model": "m", "prompt": "caf\xe9"}') == 400
        assert raw("/v1/completions", b"[" * 100_000 + b"]" * 100_000) == 400
        assert raw("/v1/completions", b'{"model": "m"}', auth=b"Bearer caf\xc3\xa9\xff") == 401
        assert raw("/fleet/drain", b'["not", "an", "object"]') == 400
        assert raw("/fleet/drain", b"\xff\xfe") == 400
    finally:
        servers.close()
    nested = {"k": 1}
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = {"k": nested}
    assert _json_object(__import__("json").dumps(nested).encode()) == nested  # at the limit: fine


def test_a_model_name_with_a_newline_or_blank_is_refused():
    for bad in ("tiny\nX-Injected: 1", "two words", ""):
        assert "models.0.name" in refused(fleet_text(models=[dict(MODEL, name=bad)]))


def test_slow_clients_do_not_starve_normal_ones():
    """Clients that open connections and trickle headers, or send a body slowly: the header
    deadline closes them, a new connection beyond the limit takes the slot of the oldest one
    still sending its head (it is served, that one is closed), a slow body gets 408; a normal
    request is answered throughout."""
    import socket
    import time

    from doubles.entry_fleet import LoopServers, Table
    from r9k.deploy.entry import EntryPoint, serve
    from r9k.devtools.local_server import free_port
    from r9k.core.http_client import http_request

    servers = LoopServers()
    entry = EntryPoint(Table([]))
    entry.body_timeout_s = 0.5
    port = free_port()
    servers.runners.append(servers.run(serve(entry, "127.0.0.1", port, max_connections=8,
                                             header_timeout_s=0.5)))
    url = f"http://127.0.0.1:{port}"
    slow = []
    try:
        for _ in range(8):  # every connection slot taken by a client that never finishes its headers
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
        time.sleep(0.1)
        surplus = socket.create_connection(("127.0.0.1", port), timeout=5)
        surplus.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert surplus.recv(4096).startswith(b"HTTP/1.1 503")  # served: it took a slot
        assert slow[0].recv(1) == b""  # the oldest head still arriving gave up its slot
        surplus.close()
        time.sleep(0.7)  # past the header deadline: the slow ones are closed
        assert all(s.recv(1) == b"" for s in slow)
        assert http_request(url + "/health", timeout_s=5).status == 503  # served again (no replica)
        body_slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        body_slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        reply = body_slow.recv(200)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        body_slow.close()
    finally:
        for s in slow:
            s.close()
        servers.close()


def test_ipv6_replica_urls_are_bracketed_reached_and_probed_for_ports():
    """A replica bound to an IPv6 address (replica_bind: node-ip on an IPv6 node) was announced
    as http://::1:8100 (no client parses it) and its port probe bound an IPv4 socket to it
    (no port ever free): bracketed URLs, an IPv6 probe, and the entry point routes to it."""
    import json
    import socket
    import urllib.request

    from aiohttp import web

    from doubles.entry_fleet import LoopServers, Table
    from r9k.deploy.entry import EntryPoint, Route
    from r9k.deploy.server import ApiServerLaunch
    from r9k.deploy.supervisor import _port_free
    from r9k.core.fleet_status import ReplicaDescription
    from r9k.core.http_client import host_url
    from r9k.monitoring.replicas import parse_replica_spec

    assert host_url("::1", 8100) == "http://[::1]:8100" == host_url("[::1]", 8100)
    assert host_url("10.0.0.5", 8100) == "http://10.0.0.5:8100"
    assert ApiServerLaunch("/m", "m", 8100, 4096, 1 << 30, host="::1").url == "http://[::1]:8100"
    assert ReplicaDescription(name="r", url=host_url("fd00::5", 8100)).url == "http://[fd00::5]:8100"
    assert parse_replica_spec("http://[::1]:8100,name=r6").url == "http://[::1]:8100"

    held = socket.socket(socket.AF_INET6)
    held.bind(("::1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        assert not _port_free("::1", port)  # a listener holds it
    finally:
        held.close()
    assert _port_free("::1", port)

    async def completions(request):
        return web.json_response({"served_by": "v6", "model": (await request.json())["model"]})

    servers = LoopServers()
    try:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        servers.run(runner.setup())
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            v6_port = probe.getsockname()[1]
        servers.run(web.TCPSite(runner, "::1", v6_port).start())
        servers.runners.append(runner)
        entry = servers.entry(EntryPoint(Table([Route("m-0", "m", host_url("::1", v6_port))])))
        req = urllib.request.Request(entry + "/v1/completions", data=json.dumps(
            {"model": "m", "prompt": "x"}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read())["served_by"] == "v6"
    finally:
        servers.close()


def test_the_next_request_on_a_kept_alive_connection_has_a_header_deadline_too():
    """Every request head on a kept-alive connection has the header deadline, not only the
    first: after one quick request, a client cannot trickle the next request's headers on the
    same connection for ever."""
    import socket
    import time

    from doubles.entry_fleet import LoopServers, Table
    from r9k.deploy.entry import EntryPoint, serve
    from r9k.devtools.local_server import free_port

    servers = LoopServers()
    port = free_port()
    servers.runners.append(servers.run(serve(EntryPoint(Table([])), "127.0.0.1", port,
                                             header_timeout_s=0.5)))
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 503"), first  # answered, connection kept alive
        time.sleep(0.7)  # idle between requests: the keep-alive timer's business (75 s), not this
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request's headers, unfinished
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the header deadline
        assert time.monotonic() - t0 < 3
        s.close()
        # a client that finishes its next request in time is served on the same connection
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        for _ in range(3):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 503")
            time.sleep(0.6)
        s.close()
    finally:
        servers.close()
