"""The entry point on another host (`r9k fleet entry`): routes from the controller's
/fleet/status over real HTTP, aborts what it has in flight at a replica that leaves the ready
list (a plain request moves to another replica), serves the last state while the controller is
away for `state_stale_s`, then 503 naming it; admin actions are the controller's."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

from aiohttp import web

from r9k.deploy.entry import EntryPoint, Route
from r9k.deploy.remote_entry import RemoteBackend
from r9k.core.http_client import http_request

from doubles.entry_fleet import LoopServers, Table

KEY = "fleet-key"
STALE_S = 2.0
REFRESH_S = 0.2


def replica(name: str) -> web.Application:
    app = web.Application()

    async def completions(request: web.Request) -> web.Response:
        assert request.headers.get("Authorization") == f"Bearer {KEY}"
        body = await request.json()
        await asyncio.sleep(body.get("sleep", {}).get(name, 0))   # seconds, per replica
        return web.json_response({"replica": name})

    app.router.add_post("/v1/completions", completions)
    return app


def post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("X-R9k-Replica"), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None, json.loads(exc.read())


def test_remote_entry_routes_aborts_moves_and_serves_the_last_state_for_a_bounded_time():
    servers = LoopServers()
    try:
        routes = [Route(n, "m", servers.app(replica(n)), api_key=KEY) for n in ("m-0", "m-1")]
        table = Table(routes)
        controller_entry = EntryPoint(table, api_key=KEY)
        controller_url = servers.entry(controller_entry)
        controller_runner = servers.runners[-1]
        backend = RemoteBackend(controller_url, KEY, STALE_S, refresh_s=REFRESH_S)
        servers.run(backend.start())
        url = servers.entry(EntryPoint(backend, api_key=KEY, routing="least-outstanding"))

        served = {post(url, {"model": "m"})[1] for _ in range(4)}
        assert served == {"m-0", "m-1"}
        assert http_request(url + "/fleet/status", timeout_s=5).json()["replicas"][0]["name"] == "m-0"

        # a slow plain request sits at m-1; m-1 leaves the ready list at the controller
        answers = []
        first = threading.Thread(target=lambda: answers.append(post(url, {"model": "m", "sleep": {"m-0": 0.3}})))
        first.start()
        time.sleep(0.05)   # m-0 holds one request: the next goes to m-1
        t0 = time.monotonic()
        slow = threading.Thread(target=lambda: answers.append(post(url, {"model": "m", "sleep": {"m-1": 8}})))
        slow.start()
        time.sleep(0.1)
        assert backend.table["m-1"].outstanding == 1
        table.ready.discard("m-1")
        slow.join(20)
        first.join(5)
        took = time.monotonic() - t0
        code, by, body = answers[-1]
        assert (code, by) == (200, "m-0") and body == {"replica": "m-0"}   # moved, not waited 8 s
        assert took < 3 * REFRESH_S + 1.0, took
        assert "m-1" not in backend.table

        # the controller goes away: the last state is served for STALE_S, then 503 naming it
        servers.run(controller_runner.cleanup())
        t_gone = time.monotonic()
        assert post(url, {"model": "m"})[:2] == (200, "m-0")
        deadline = t_gone + STALE_S + 3 * REFRESH_S + 2
        while time.monotonic() < deadline:
            code, _, body = post(url, {"model": "m"})
            if code == 503:
                break
            time.sleep(0.1)
        assert code == 503 and f"the controller at {controller_url} is away for" in body["error"]["message"]
        assert time.monotonic() - t_gone >= STALE_S - REFRESH_S
        # admin actions are the controller's
        resp = http_request(url + "/fleet/drain", method="POST", json_body={"replica": "m-0"},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout_s=5)
        assert resp.status == 409 and controller_url in resp.json()["error"]
    finally:
        servers.run(backend.stop())
        servers.close()


def test_remote_entry_refuses_bad_bounds():
    import pytest

    with pytest.raises(ValueError, match="stale_s 0"):
        RemoteBackend("http://127.0.0.1:1", None, 0)


def test_fleet_entry_command_serves_from_the_controller_and_refuses_bad_input(tmp_path):
    """`r9k fleet entry` as an operator runs it on another host: a real process serving the
    fleet's /v1 from the controller's state; a controller that is not a URL is refused (exit 2)."""
    import os
    import subprocess
    import sys

    from r9k.devtools.local_server import free_port
    from r9k.devtools.tiny_model import build_config

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(build_config()))
    port = free_port()
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({
        "platform": "cpu", "ray": {"address": "auto"}, "exporter": None,
        "entry": {"port": port, "api_key_env": "R9K_TEST_KEY"},
        "hosts": [{"name": "a", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"}]}],
        "models": [{"name": "m", "path": str(tmp_path / "tiny"), "kv_cache_memory_bytes": 64 << 20}]}))
    servers = LoopServers()
    env = dict(os.environ, R9K_TEST_KEY=KEY)
    cmd = [sys.executable, "-c", "from r9k.cli import main; main()", "fleet", "entry", "--config", str(fleet)]
    proc = None
    try:
        table = Table([Route("m-0", "m", servers.app(replica("m-0")), api_key=KEY)])
        controller_url = servers.entry(EntryPoint(table, api_key=KEY))
        bad = subprocess.run(cmd + ["--controller", "gpu-a:8000"], env=env, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and "expected an http(s)://HOST:PORT URL" in bad.stderr, bad.stderr
        unset = subprocess.run(cmd + ["--controller", controller_url], capture_output=True, text=True,
                               timeout=60, env={k: v for k, v in env.items() if k != "R9K_TEST_KEY"})
        assert unset.returncode == 2 and "R9K_TEST_KEY is not set" in unset.stderr, unset.stderr
        proc = subprocess.Popen(cmd + ["--controller", controller_url], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if http_request(url + "/health", timeout_s=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
            time.sleep(0.2)
        assert post(url, {"model": "m"}) == (200, "m-0", {"replica": "m-0"})
        models = http_request(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                              timeout_s=5).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        assert http_request(url + "/v1/models", timeout_s=5).status == 401   # the fleet's key
    finally:
        if proc is not None:
            proc.terminate()
            assert proc.wait(15) == 0
        servers.close()


def test_remote_entry_routes_pool_aware_from_the_controllers_engine_loads():
    """The controller's status carries each replica's engine load (as its probe read it, with
    its age); the remote entry scores replicas by it as the controller's own entry point does:
    the replica with the freer pool and shorter queue wins, a stale load counts as unknown."""
    from r9k.deploy.routing import STALE_S, choose
    from r9k.core.fleet_status import EngineLoadStatus, FleetStatus, ReplicaStatus

    def replica_status(name, load):
        return ReplicaStatus(name=name, url=f"http://127.0.0.1:1{name[-1]}", model="m", state="ready",
                             tp=1, num_spec=3, page_mode="onepage", engine_load=load)

    busy = EngineLoadStatus(running=6, waiting=4, kv_usage_ratio=0.9, age_s=1.0)
    free = EngineLoadStatus(running=1, waiting=0, kv_usage_ratio=0.2, age_s=1.0)
    backend = RemoteBackend("http://127.0.0.1:1", KEY, STALE_S)
    now = time.monotonic()
    backend.apply(FleetStatus(replicas=[replica_status("m-0", busy), replica_status("m-1", free)]), now)
    routes = backend.table
    assert routes["m-0"].engine.running == 6 and abs(routes["m-0"].engine.read_at_s - (now - 1.0)) < 1e-6
    assert choose(list(routes.values()), "pool-aware", now).name == "m-1"
    backend.apply(FleetStatus(replicas=[replica_status("m-0", free), replica_status("m-1", busy)]), now)
    assert choose(list(routes.values()), "pool-aware", now).name == "m-0"
    old = EngineLoadStatus(running=0, waiting=0, kv_usage_ratio=0.0, age_s=STALE_S + 5)
    backend.apply(FleetStatus(replicas=[replica_status("m-0", busy), replica_status("m-1", old)]), now)
    assert choose(list(routes.values()), "pool-aware", now).name == "m-1"   # unknown beats busy
    backend.apply(FleetStatus(replicas=[replica_status("m-0", None), replica_status("m-1", None)]), now)
    assert routes["m-0"].engine is None and routes["m-1"].engine is None
