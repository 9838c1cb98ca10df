"""The entry point over real HTTP with fake OpenAI replicas (no Ray, no engine): least
outstanding routing, streaming pass-through, 503 and 502, API key, status shape, drain CLI."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import urllib.request
from aiohttp import web
from click.testing import CliRunner

from r9k.cli import main
from r9k.devtools.local_server import free_port
from r9k.core.http_client import http_request
from r9k.deploy.entry import EntryPoint, Route
from r9k.monitoring.replicas import FleetStatus

from doubles.entry_fleet import LoopServers, Table


def fake_replica(name: str, delay_s: float = 0.0) -> web.Application:
    app = web.Application()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if request.headers.get("Authorization") != "Bearer replica-key":
            return web.json_response({"error": "replica wants its key"}, status=401)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(5):
                await resp.write(f"data: {json.dumps({'i': i, 'replica': name})}\n\n".encode())
                await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        await asyncio.sleep(body.get("sleep", delay_s))
        return web.json_response({"replica": name, "model": body["model"]})

    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture(scope="module")
def env():
    servers = LoopServers()
    routes = [Route(name, "m", servers.app(fake_replica(name)), api_key="replica-key")
              for name in ("m-0", "m-1")]
    dead = Route("m-dead", "m", f"http://127.0.0.1:{free_port()}", outstanding=-5, api_key="replica-key")
    table = Table(routes + [dead])
    url = servers.entry(EntryPoint(table, api_key="fleet-key"))
    yield type("Env", (), {"url": url, "table": table, "dead": dead})
    servers.close()


AUTH = {"Authorization": "Bearer fleet-key"}


def post(env, body, headers=AUTH):
    return http_request(env.url + "/v1/completions", method="POST", json_body=body, headers=headers,
                        timeout_s=30)


def get(env, path, headers=None):
    return http_request(env.url + path, headers=headers, timeout_s=5)


def test_api_key_required_on_v1_and_admin(env):
    assert post(env, {"model": "m"}, headers={}).status == 401
    assert post(env, {"model": "m"}, headers={"Authorization": "Bearer wrong"}).status == 401
    assert http_request(env.url + "/fleet/down", method="POST", json_body={}, timeout_s=5).status == 401
    assert get(env, "/fleet/status").status == 200  # read-only, like /metrics


def test_dead_replica_is_skipped_before_an_answer_starts(env):
    env.table.ready = {"m-dead", "m-0"}  # m-dead has the fewest outstanding, so it is tried first
    resp = post(env, {"model": "m"})
    assert resp.status == 200 and resp.json()["replica"] == "m-0"
    env.table.ready = {"m-dead"}
    resp = post(env, {"model": "m"})
    assert resp.status == 502 and "m-dead (ClientConnectorError)" in resp.json()["error"]["message"]


def test_least_outstanding_routing(env):
    env.table.ready = {"m-0", "m-1"}
    with ThreadPoolExecutor(4) as pool:
        slow = pool.submit(post, env, {"model": "m", "sleep": 1.5})
        time.sleep(0.3)
        quick = [post(env, {"model": "m"}).json()["replica"] for _ in range(4)]
        slow_replica = slow.result().json()["replica"]
    other = {"m-0", "m-1"} - {slow_replica}
    assert set(quick) == other  # the busy replica gets nothing while the other is idle
    for r in env.table.all:
        r.last_pick = 0
    # idle replicas tie on outstanding: the one chosen longest ago goes next, so they alternate
    assert [post(env, {"model": "m"}).json()["replica"] for _ in range(6)] == ["m-0", "m-1"] * 3


def test_streaming_passes_through_in_chunks(env):
    env.table.ready = {"m-0"}
    req = urllib.request.Request(env.url + "/v1/completions", method="POST", headers=AUTH,
                                 data=json.dumps({"model": "m", "stream": True}).encode())
    arrivals, events = [], []
    with urllib.request.urlopen(req, timeout=30) as resp:  # read line by line as it arrives
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-R9k-Replica"] == "m-0"
        for line in resp:
            if line.strip():
                arrivals.append(time.monotonic())
                events.append(line.strip())
    assert events[-1] == b"data: [DONE]" and [json.loads(e[6:])["i"] for e in events[:-1]] == [0, 1, 2, 3, 4]
    assert arrivals[-1] - arrivals[0] > 0.15  # delivered as produced, not buffered


def test_503_names_the_replica_states_and_404_unknown_model(env):
    env.table.ready = set()
    resp = post(env, {"model": "m"})
    assert resp.status == 503
    assert resp.json()["error"]["message"] == "no ready replica for model 'm' (m-0 loading, m-1 loading, m-dead loading)"
    assert post(env, {"model": "other"}).json()["error"]["message"].endswith("(no replicas configured)")
    resp = post(env, {"model": "nope"})
    assert resp.status == 404 and "models: m, other" in resp.json()["error"]["message"]
    assert post(env, {"prompt": "no model"}).status == 404
    assert get(env, "/health").status == 503
    env.table.ready = {"m-0"}
    models = get(env, "/v1/models", AUTH).json()["data"]
    assert [(m["id"], m["ready_replicas"]) for m in models] == [("m", 1), ("other", 0)]
    # max_model_len as vLLM's /v1/models gives it: `r9k bench soak` sizes prompts from it
    assert [m["max_model_len"] for m in models] == [4096, 2048]


def test_status_is_monitoring_fleet_status(env):
    st = FleetStatus.model_validate(get(env, "/fleet/status").json())
    assert [(r.name, r.state, r.page_mode, r.cards) for r in st.replicas][:1] == [
        ("m-0", "ready", "onepage", ["0000:03:00.0"])]


def test_drain_cli_by_card_from_ops_hook_env_and_by_name(env, monkeypatch):
    monkeypatch.setenv("R9K_FLEET_API_KEY", "fleet-key")
    runner = CliRunner()
    res = runner.invoke(main, ["fleet", "drain", "--url", env.url],
                        env={"R9K_BDF": "0000:03:00.0", "R9K_EVENT": "mes_timeout"})
    assert res.exit_code == 0, res.output
    assert env.table.calls[-1] == ("drain", {"card": "0000:03:00.0", "host": None, "event": "mes_timeout"})
    res = runner.invoke(main, ["fleet", "drain", "--url", env.url],
                        env={"R9K_BDF": "0000:03:00.0", "R9K_FLEET_HOST": "hB", "R9K_EVENT": ""})
    assert res.exit_code == 0, res.output
    assert env.table.calls[-1] == ("drain", {"card": "0000:03:00.0", "host": "hB"})
    res = runner.invoke(main, ["fleet", "drain", "m-1", "--url", env.url], env={"R9K_BDF": ""})
    assert res.exit_code == 0 and env.table.calls[-1] == ("drain", {"replica": "m-1"})
    res = runner.invoke(main, ["fleet", "drain", "--card", "3:00.0", "--url", env.url])
    assert res.exit_code == 2 and "expected a full PCI address" in res.output
    res = runner.invoke(main, ["fleet", "drain", "--url", env.url], env={"R9K_BDF": ""})
    assert res.exit_code == 2 and "give a REPLICA name or --card BDF" in res.output
    res = runner.invoke(main, ["fleet", "status", "--json", "--url", env.url])
    assert res.exit_code == 0 and json.loads(res.output)["replicas"][0]["name"] == "m-0"


def _metrics_text(url: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = http_request(url, timeout_s=2)
            if resp.status == 200:
                return resp.text
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer within {timeout_s} s")
        time.sleep(0.2)


def test_fleet_exporter_is_supervised_replicas_only_and_off_the_host_exporters_port(tmp_path):
    """The exporter `fleet up` starts runs replicas-only on 9701, off port 9700 (the host
    exporter's, which the README starts); the controller restarts it when it dies (with backoff)
    and reports it in /fleet/status."""
    import os
    import signal

    from r9k.deploy.config import load_fleet, parse_fleet
    from r9k.deploy.controller import FleetController
    from r9k.devtools.tiny_model import build_config
    from r9k.monitoring.cli import DEFAULT_PORT as HOST_EXPORTER_PORT

    one_model = '{"models": [{"name": "m", "path": "/x", "kv_cache_memory_bytes": 1073741824}]}'
    assert parse_fleet(one_model).exporter.port != HOST_EXPORTER_PORT
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_config()))
    port = free_port()
    (tmp_path / "fleet.yaml").write_text(json.dumps({
        "platform": "cpu", "entry": {"port": free_port()}, "exporter": {"port": port},
        "ops_state_dir": str(tmp_path / "ops"),
        "hosts": [{"name": "local", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"}]}],
        "models": [{"name": "tiny", "path": str(model), "kv_cache_memory_bytes": 64 << 20,
                    "state_dtype": "float32"}]}))
    controller = FleetController(load_fleet(tmp_path / "fleet.yaml"), tmp_path / "run")
    controller.run_dir.mkdir()
    sidecar = controller.exporter
    sidecar.start()
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = _metrics_text(url)
        assert 'r9k_exporter_collect_seconds{collector="replicas"}' in text
        assert "r9k_gpu_" not in text and 'collector="cards"' not in text  # the host exporter's job
        # restarts follow the replicas' backoff (health.restart_backoff_s, default 5 s): the
        # first at once, then 5 s, 10 s ...
        base = controller.cfg.health.restart_backoff_s
        first = sidecar.proc.pid
        os.kill(first, signal.SIGKILL)
        sidecar.proc.wait(10)
        sidecar.supervise(now=1000.0)
        assert sidecar.proc is not None and sidecar.proc.pid != first
        assert controller.exporter_status().last_exit == -signal.SIGKILL
        assert 'collector="replicas"' in _metrics_text(url)
        second = sidecar.proc.pid
        os.kill(second, signal.SIGKILL)
        sidecar.proc.wait(10)
        sidecar.supervise(now=1010.0)  # noticed: restart scheduled after the backoff
        assert sidecar.proc is None
        sidecar.supervise(now=1010.0 + base - 0.5)
        assert sidecar.proc is None
        sidecar.supervise(now=1010.0 + base)
        assert sidecar.proc is not None and sidecar.proc.pid not in (first, second)
        assert 'collector="replicas"' in _metrics_text(url)
        status = controller.status().exporter
        assert (status.running, status.restarts, status.pid) == (True, 2, sidecar.proc.pid)
        sidecar.supervise(now=1100.0)  # running: left alone
        assert sidecar.restarts == 2
    finally:
        sidecar.stop()


def test_fleet_check_validates_without_writing_anything(tmp_path, monkeypatch):
    """`fleet check` is validate-only: no model generated into ~/.cache, no run dir, no
    ops state dir."""
    from r9k.devtools.tiny_model import build_config

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_config()))
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({
        "platform": "cpu", "ops_state_dir": "~/.local/state/r9k/ops",
        "hosts": [{"name": "local", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"}]}],
        "models": [{"name": "tiny", "path": str(model), "kv_cache_memory_bytes": 64 << 20}]}))
    before = sorted(p for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(main, ["fleet", "check", "--config", str(fleet)])
    assert result.exit_code == 0 and "ok (1 replicas, 1 cards)" in result.output, result.output
    assert sorted(p for p in tmp_path.rglob("*")) == before
    missing = tmp_path / "no-model.yaml"
    missing.write_text(fleet.read_text().replace(str(model), str(tmp_path / "absent")))
    result = CliRunner().invoke(main, ["fleet", "check", "--config", str(missing)])
    assert result.exit_code == 2 and "no config.json there" in result.output
    assert not (tmp_path / "absent").exists() and not (home / ".cache").exists()
