"""The controller's wiring without Ray or engines: a fake Ray side and fake HTTP probes, the real
lifecycle, placement and page proof. The real thing is test_deploy_fleet_engine.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from r9k.deploy.adoption import adoptable
from r9k.deploy.config import parse_fleet
from r9k.deploy.controller import FleetController, Replica
from r9k.deploy.lifecycle import (DRAINING, LOADING, READY, STOPPED, UNHEALTHY, Observation,
                                  ReplicaLifecycle)
from r9k.deploy.placement import CardPool, plan_placement, replica_slots

CARDS = ("0000:c1:00.0", "0000:c1:00.1")


class FakeRay:
    """RayReplica's interface: a supervisor whose engine is alive until told otherwise."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.alive, self.returncode, self.supervisor_ok, self.starts = True, None, True, 0

    async def start_engine(self) -> dict:
        self.starts += 1
        self.alive, self.returncode = True, None
        self.calls.append("start")
        return {"url": "http://fake:1", "pid": 100 + self.starts, "log": f"r.{self.starts}.log", "start": self.starts}

    async def status(self, timeout_s: float) -> dict:
        if not self.supervisor_ok:
            raise RuntimeError("actor died")
        return {"alive": self.alive, "returncode": self.returncode, "pid": 100 + self.starts,
                "engine_pids": [7] if self.alive else []}

    async def kill_engine(self) -> bool:
        self.calls.append("kill")
        self.alive, self.returncode = False, -9
        return self.supervisor_ok

    async def stop_engine(self, grace_s: float) -> None:
        self.calls.append("stop")

    async def release(self, grace_s: float) -> None:
        self.calls.append("release")

    async def release_lost(self) -> None:
        self.calls.append("release_lost")

    async def describe(self, timeout_s: float) -> dict:
        """What a supervisor left by an earlier controller reports (set by the test)."""
        return self.desc


class FakeRaySide:
    """The controller's Ray side (`ray_backend.RaySide`'s methods) without Ray: replicas placed
    get a FakeRay; `left` are supervisors a previous controller left running."""

    def __init__(self, calls: list[str], placed: list[tuple]) -> None:
        self.calls, self.placed = calls, placed
        self.left: dict[str, FakeRay] = {}
        self.place_error: Exception | None = None

    def connect(self, cfg) -> bool:
        return False

    nodes: dict[str, str] | None = None   # set by a test: the live Ray nodes now

    def live_hosts(self, cfg) -> dict[str, str]:
        if self.nodes is not None:
            return dict(self.nodes)
        return {h.name: f"node-{h.name}" for h in cfg.hosts}

    async def inventory(self, cfg, nodes=None):
        return [h for h in cfg.hosts if nodes is None or h.name in nodes]

    async def host_fences(self, cfg, nodes) -> dict[str, dict[str, str]]:
        from r9k.ops.state import read_card_states

        return {h: read_card_states(cfg.host_state_dir(h)).unhealthy() for h in nodes}

    def fleet_replicas(self, cfg) -> list[str]:
        return sorted(self.left)

    def find(self, name, cfg):
        return self.left.get(name)

    async def place(self, replica, assignment, cfg, argv, env, log_dir, port, spec=None):
        if self.place_error is not None:
            raise self.place_error
        self.placed.append((replica, assignment.cards, env["VLLM_CPU_OMP_THREADS_BIND"]))
        return FakeRay(self.calls)

    def shutdown(self) -> None:
        pass


class FakeProbe:
    def __init__(self) -> None:
        self.heartbeat_ok, self.text, self.metrics_reads = True, "", 0

    async def heartbeat(self, url: str, timeout_s: float) -> bool:
        return self.heartbeat_ok

    async def metrics_text(self, url: str, timeout_s: float = 5.0) -> str | None:
        self.metrics_reads += 1
        return self.text


def metrics_text(pool, mode: str, reason: str = "", tokens: float = 0.0) -> str:
    """A replica's /metrics as vLLM and the plugin write it."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks", "engine"], registry=reg).labels(
        str(pool.attention_block_size), str(pool.num_blocks), "0").set(1)
    Gauge("r9k_plugin_info", "plugin", ["page_mode", "reason"], registry=reg).labels(mode, reason).set(1)
    Counter("vllm:generation_tokens", "tokens", ["engine"], registry=reg).labels("0").inc(tokens)
    return generate_latest(reg).decode()


@pytest.fixture
def fleet(tmp_path):
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny", seed=0)
    cfg = parse_fleet(f"""
platform: cpu
ray: {{address: auto}}
exporter: null
ops_state_dir: {tmp_path / "ops"}
run_dir: {tmp_path / "run"}
hosts: [{{name: h1, cards: [{{bdf: "{CARDS[0]}", cpu_bind: "0"}}, {{bdf: "{CARDS[1]}", cpu_bind: "1"}}]}}]
health: {{restart_backoff_s: 0.01, drain_timeout_s: 1}}
models:
  - {{name: tiny, path: {tmp_path / "tiny"}, replicas: 1, speculative: {{method: mtp, k: 3}},
     max_model_len: 4096, kv_cache_memory_bytes: {64 << 20}, state_dtype: float32}}
""")
    c = fake_controller(cfg)
    c.hosts, c.pool, c.probe = cfg.hosts, CardPool(cfg.hosts), FakeProbe()
    [(name, a)] = plan_placement(replica_slots(cfg), c.pool, "cpu").items()
    r = Replica(name, cfg.model(a.model), a, ReplicaLifecycle(name, cfg.health))
    c.replicas[name] = r
    return c, r


def fake_controller(cfg) -> FleetController:
    """The real controller on the fake Ray side; `calls`, `placed` and the tiny model's plan
    kept on it for the asserts."""
    calls: list[str] = []
    placed: list[tuple] = []
    c = FleetController(cfg, ray_side=FakeRaySide(calls, placed))
    c.calls, c.placed, c.plan_ = calls, placed, c.plans["tiny"]
    return c


def run(coro):
    return asyncio.run(coro)


async def launched_ready(c: FleetController, r: Replica) -> None:
    """Placed, its engine started, and one probe reading one-page pages: ready."""
    await c._launch(r)
    c.probe.text = metrics_text(c.plan_.onepage, "onepage")
    await c._probe(r)


async def settle(r: Replica) -> None:
    while r.task is not None:
        await r.task


def test_launch_then_one_metrics_read_proves_onepage_and_makes_ready(fleet):
    c, r = fleet

    async def scenario():
        await c._launch(r)
        assert (r.lc.state, r.lc.starts, r.route.url) == (LOADING, 1, "http://fake:1")
        c.probe.text = metrics_text(c.plan_.onepage, "onepage")
        await c._probe(r)

    run(scenario())
    assert c.placed == [("tiny-0", (CARDS[0],), "0")]
    assert (r.lc.state, r.lc.proof.page_mode, r.lc.proof.num_blocks) == (READY, "onepage", c.plan_.onepage.num_blocks)
    assert c.probe.metrics_reads == 1
    assert [x.name for x in c.routes("tiny")] == ["tiny-0"]
    d = c.status().replicas[0]
    assert (d.state, d.page_mode, d.starts, d.engine_pids) == ("ready", "onepage", 1, [7])


def test_fleet_status_is_one_typed_model_that_monitoring_reads(fleet):
    """The controller builds r9k.core.fleet_status.FleetStatus (no plain dict), the
    entry point serves its JSON, and the exporter validates the same model back to equal."""
    import json

    from r9k.core.fleet_status import FleetStatus
    from r9k.monitoring import replicas as monitoring_replicas

    c, r = fleet

    async def scenario():
        await launched_ready(c, r)

    run(scenario())
    st = c.status()
    assert type(st) is FleetStatus and monitoring_replicas.FleetStatus is FleetStatus
    back = FleetStatus.model_validate(json.loads(json.dumps(st.model_dump(mode="json"))))
    assert back == st
    (rep,) = back.replicas
    assert (rep.name, rep.url, rep.state, rep.kv.page_mode, rep.kv.num_blocks) == (
        "tiny-0", "http://fake:1", "ready", "onepage", c.plan_.onepage.num_blocks)
    assert rep.model_config_path and rep.cards == [CARDS[0]]
    assert back.capacity["tiny"].onepage_blocks == c.plan_.onepage.num_blocks
    # a routed replica without a URL is not a fleet status the exporter could scrape
    doc = st.model_dump(mode="json")
    doc["replicas"][0]["url"] = None
    with pytest.raises(ValueError, match="tiny-0: a routed replica needs its url"):
        FleetStatus.model_validate(doc)


def test_loading_without_heartbeat_reads_no_metrics(fleet):
    c, r = fleet

    async def scenario():
        await c._launch(r)
        c.probe.heartbeat_ok = False
        await c._probe(r)

    run(scenario())
    assert (r.lc.state, c.probe.metrics_reads, r.task) == (LOADING, 0, None)


def test_stock_pages_fail_the_proof_and_kill_then_restart(fleet):
    c, r = fleet

    async def scenario():
        await c._launch(r)
        c.probe.text = metrics_text(c.plan_.stock, "stock", "prefix caching is on")
        await c._probe(r)
        await settle(r)

    run(scenario())
    assert c.calls == ["start", "kill", "start"]
    assert (r.lc.state, r.lc.page_failures, r.lc.restarts) == (LOADING, 1, 1)
    assert any("unhealthy: page proof failed: prefix caching is on" in h for h in r.history)


def test_dead_engine_restarts_in_place_and_lost_supervisor_is_placed_again(fleet):
    c, r = fleet

    async def scenario():
        await launched_ready(c, r)
        r.ray.alive, r.ray.returncode = False, -9
        await c._probe(r)
        await settle(r)
        assert (r.lc.state, r.lc.restarts, c.calls) == (LOADING, 1, ["start", "kill", "start"])
        await c._probe(r)
        r.ray.supervisor_ok = False
        await c._probe(r)
        await settle(r)

    run(scenario())
    assert any("engine process exited with -9" in h for h in r.history)
    assert any("supervisor lost: RuntimeError" in h for h in r.history)
    # the lost supervisor: released and placed again (the same free card), a new engine started
    assert c.calls[3:] == ["kill", "release", "start"] and len(c.placed) == 2
    assert (r.lc.state, r.lc.starts, r.lc.restarts) == (LOADING, 3, 2)


def test_fenced_card_drains_and_places_the_replica_on_another_card(fleet):
    c, r = fleet

    async def scenario():
        await launched_ready(c, r)
        assert c.fence(("h1", CARDS[0]), "ops: mes_timeout") == ["tiny-0"]
        assert r.lc.state == DRAINING or r.task is not None
        await settle(r)

    run(scenario())
    assert c.placed[-1] == ("tiny-0", (CARDS[1],), "1")
    assert c.pool.unusable == {("h1", CARDS[0]): "ops: mes_timeout"}
    assert c.pool.in_use == {("h1", CARDS[1]): "tiny-0"}
    assert r.lc.state == LOADING and any(f"draining: card h1/{CARDS[0]} fenced" in h for h in r.history)
    card = next(x for x in c.status().cards if x.bdf == CARDS[0])
    assert card.model_dump() == {"bdf": CARDS[0], "host": "h1", "replica": None, "usable": False,
                                 "reason": "ops: mes_timeout"}


def test_operator_drain_stops_without_replacing(fleet):
    c, r = fleet

    async def scenario():
        await c._launch(r)
        status, body = await c.admin("drain", {"replica": "tiny-0"})
        await settle(r)
        return status, body

    assert run(scenario()) == (200, {"drained": ["tiny-0"]})
    assert r.lc.state == STOPPED and c.calls == ["start", "release"] and c.pool.in_use == {}
    assert run(c.admin("drain", {"replica": "nope"}))[0] == 404


def test_rolling_restart_stops_and_starts_each_ready_replica(fleet):
    c, r = fleet

    async def scenario():
        await launched_ready(c, r)

        async def prober():  # the monitor's job while the restart waits for ready
            while True:
                await asyncio.sleep(0.01)
                if r.lc.state == LOADING:
                    await c._probe(r)

        task = asyncio.create_task(prober())
        try:
            return await asyncio.wait_for(c.restart_rolling(), 10)
        finally:
            task.cancel()

    assert run(scenario()) == ["tiny-0: ready"]
    assert c.calls == ["start", "stop", "start"] and (r.lc.restarts, r.lc.starts) == (1, 2)


def test_a_failing_step_leaves_the_replica_unhealthy_with_the_error(fleet):
    c, r = fleet

    async def scenario():
        c.ray_side.place_error = RuntimeError("placement group not ready")
        c._spawn(r, c._launch(r))
        await settle(r)

    run(scenario())
    assert (r.lc.state, r.lc.failures, r.lc.reason) == (UNHEALTHY, 1, "RuntimeError: placement group not ready")


def test_a_restarted_controller_adopts_what_it_would_launch_and_releases_the_rest(fleet):
    """Supervisors left by a killed controller: the one running exactly this fleet file's launch
    on usable cards is adopted (no engine start, its pid kept, proven again before routing);
    one launched differently, one whose engine died, one no longer in the file and one on a
    fenced card are released."""
    from r9k.deploy.placement import replica_slots

    c, r = fleet
    _, _, spec = c._launch_spec(r.model, r.assignment)
    engine = {"url": "http://fake:9", "pid": 4242, "start": 3, "log": "tiny-0.3.log"}

    def left(calls, **desc):
        ray = FakeRay(calls)
        ray.desc = {"spec": spec, "engine": engine, "alive": True, "engine_pids": [7], **desc}
        return ray

    cases = {
        "adopted": left([]),
        "launched differently": left([], spec={**spec, "launch": "0" * 64}),
        "engine dead": left([], alive=False),
        "fenced card": left([]),
    }
    for what, ray in cases.items():
        rays = {"tiny-0": ray, "gone-0": left([])}
        c.ray_side.left = rays
        c.pool.unusable = {("h1", CARDS[0]): "mes timeout"} if what == "fenced card" else {}
        adopted = run(adoptable(c.cfg, c.ray_side, c.hosts, c.pool, replica_slots(c.cfg),
                                c.api_key))
        assert rays["gone-0"].calls == ["release"], what
        if what != "adopted":
            assert adopted == {} and ray.calls == ["release"], what
            continue
        assert list(adopted) == ["tiny-0"] and ray.calls == []
        a, rr, desc = adopted["tiny-0"]
        assert (a.host, a.cards, a.cpu_bind) == ("h1", (CARDS[0],), "0")
        c._adopt(r, rr, desc)
        assert (r.lc.state, r.pid, r.route.url, r.lc.starts) == (LOADING, 4242, "http://fake:9", 3)
        assert c.routes("tiny") == []  # not routed before the page proof
        c.probe.text = metrics_text(c.plan_.onepage, "onepage")
        run(c._probe(r))
        assert r.lc.state == READY and [x.name for x in c.routes("tiny")] == ["tiny-0"]
        assert ray.calls == [] and c.placed == []  # no start, no placement


def test_a_ready_replica_answering_html_on_metrics_does_not_break_the_probe(fleet):
    """/metrics answering a web page (a proxy's error page, say) is 'metrics unreadable this
    time' for a READY replica; the probe goes on (a ValueError out of it would leave the replica
    never judged and still routed)."""
    c, r = fleet

    async def scenario():
        await launched_ready(c, r)
        c.probe.text = "<html><body>502 Bad Gateway</body></html>"
        await c._probe(r)

    run(scenario())
    assert r.lc.state == READY and c.probe.metrics_reads == 2


def two_host_fleet(tmp_path, placement_timeout_s: float = 120):
    """Two hosts with the same addresses (identical servers), one TP1 replica; the real
    controller on a fake Ray side whose live nodes a test sets."""
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny", seed=0)
    cfg = parse_fleet(f"""
platform: cpu
ray: {{address: auto}}
exporter: null
replica_bind: node-ip
ops_state_dir: {tmp_path / "{host}" / "ops"}
run_dir: {tmp_path / "run"}
hosts:
  - {{name: hA, cards: [{{bdf: "{CARDS[0]}", cpu_bind: "0"}}]}}
  - {{name: hB, cards: [{{bdf: "{CARDS[0]}", cpu_bind: "1"}}]}}
placement: {{timeout_s: {placement_timeout_s}}}
health: {{restart_backoff_s: 0.01, drain_timeout_s: 1}}
models:
  - {{name: tiny, path: {tmp_path / "tiny"}, replicas: 1, speculative: {{method: mtp, k: 3}},
     max_model_len: 4096, kv_cache_memory_bytes: {64 << 20}, state_dtype: float32}}
""")
    return fake_controller(cfg)


async def _started(c):
    await c.start()
    c.monitor_task.cancel()   # ticks are driven by the test
    c.probe = FakeProbe()
    c.probe.text = metrics_text(c.plan_.onepage, "onepage")
    r = c.replicas["tiny-0"]
    await settle(r)
    await c._probe(r)
    assert r.lc.state == READY
    return r


def test_a_lost_host_releases_its_replica_and_places_it_on_a_live_host(tmp_path):
    c = two_host_fleet(tmp_path)

    async def scenario():
        r = await _started(c)
        first = r.assignment.host
        other = "hB" if first == "hA" else "hA"
        c.ray_side.nodes = {other: f"node-{other}"}
        await c._inventory_tick()
        await settle(r)
        assert [h.name for h in c.hosts] == [other]
        assert (r.assignment.host, r.assignment.cards) == (other, (CARDS[0],))
        assert c.pool.in_use == {(other, CARDS[0]): "tiny-0"}
        assert any(f"host {first} lost" in h for h in r.history)
        # the other host leaves too: nothing fits; it waits, and is placed when one joins
        c.ray_side.nodes = {}
        await c._inventory_tick()
        await settle(r)
        assert r.lc.state == UNHEALTHY and "waiting for cards" in r.lc.reason and r.assignment is None
        assert c.pool.in_use == {}
        c.ray_side.nodes = {first: f"node-{first}-2"}
        await c._inventory_tick()
        assert r.lc.placement_due(time.monotonic(), False)
        await c._replace(r, r.lc.reason)
        assert (r.assignment.host, r.lc.state) == (first, LOADING)
        await c.stop()

    run(scenario())
    assert c.calls.count("release_lost") == 2   # each lost host's supervisor, never asked to stop


def test_a_failed_placement_frees_its_cards_and_is_tried_again(tmp_path):
    from r9k.deploy.placement import PlacementError

    c = two_host_fleet(tmp_path)
    c.ray_side.place_error = PlacementError("placement group for hA 0000:c1:00.0 not ready after 120 s")

    async def scenario():
        await c.start()
        c.monitor_task.cancel()
        r = c.replicas["tiny-0"]
        await settle(r)
        assert r.lc.state == UNHEALTHY and "not ready after 120 s" in r.lc.reason
        assert c.pool.in_use == {} and r.lc.place_due is not None   # cards freed, retried later
        c.ray_side.place_error = None
        await c._replace(r, "retry")
        assert r.lc.state == LOADING and len(c.placed) == 1
        await c.stop()

    run(scenario())


def test_fences_come_from_each_hosts_agent_and_ops_clear_returns_them(tmp_path):
    from r9k.ops.state import clear_card, update_card_state

    c = two_host_fleet(tmp_path)

    def fence_on(host: str) -> None:
        def bad(state):
            state.healthy, state.unhealthy_reason = False, "mes_timeout: MES failed"
        update_card_state(c.cfg.host_state_dir(host), CARDS[0], bad)

    async def scenario():
        r = await _started(c)
        host = r.assignment.host
        other = "hB" if host == "hA" else "hA"
        fence_on(other)   # the same address on the other host: this replica is not touched
        await c._ops_poll()
        assert r.lc.state == READY
        assert c.pool.unusable == {(other, CARDS[0]): "ops: mes_timeout: MES failed"}
        fence_on(host)
        await c._ops_poll()
        await settle(r)
        assert any(f"draining: card {host}/{CARDS[0]} fenced" in h for h in r.history)
        assert r.lc.state == UNHEALTHY and "waiting for cards" in r.lc.reason
        clear_card(c.cfg.host_state_dir(other), CARDS[0])
        await c._ops_poll()
        assert c.pool.unusable == {(host, CARDS[0]): "ops: mes_timeout: MES failed"}
        await c.stop()

    run(scenario())
    # a new controller reads the fences again from the hosts
    c2 = two_host_fleet(tmp_path)

    async def again():
        await c2.start()
        c2.monitor_task.cancel()
        fenced = set(c2.pool.unusable)
        await c2.stop()
        return fenced

    assert len(run(again())) == 1


def test_operator_card_drain_names_the_host_persists_and_undrains(tmp_path):
    import json

    c = two_host_fleet(tmp_path)

    async def scenario():
        r = await _started(c)
        host = r.assignment.host
        assert await c.admin("drain", {"card": CARDS[0]}) == (400, {"error": (
            f"card {CARDS[0]} is on 2 hosts (hA, hB); expected a host (--host, or the ops hook's "
            "R9K_FLEET_HOST)")})
        assert (await c.admin("drain", {"card": CARDS[0], "host": "hC"}))[0] == 400
        status, body = await c.admin("drain", {"card": CARDS[0], "host": host})
        assert (status, body) == (200, {"card": f"{host}/{CARDS[0]}", "drained": ["tiny-0"]})
        await settle(r)
        assert json.loads((c.run_dir / "fences.json").read_text()) == {
            f"{host}/{CARDS[0]}": "drained by operator"}
        assert (await c.admin("undrain", {"card": CARDS[0], "host": "hA" if host == "hB" else "hB"}))[0] == 409
        await c.stop()
        return host

    host = run(scenario())
    c2 = two_host_fleet(tmp_path)   # a restarted controller keeps the operator's fence

    async def again():
        await c2.start()
        c2.monitor_task.cancel()
        kept = dict(c2.pool.unusable)
        undrained = await c2.admin("undrain", {"card": CARDS[0], "host": host})
        after = dict(c2.pool.unusable)
        await c2.stop()
        return kept, undrained, after

    kept, undrained, after = run(again())
    assert kept == {(host, CARDS[0]): "drained by operator"}
    assert undrained == (200, {"card": f"{host}/{CARDS[0]}", "undrained": True}) and after == {}
    assert json.loads((c2.run_dir / "fences.json").read_text()) == {}
    (c2.run_dir / "fences.json").write_text("{not json")
    c3 = two_host_fleet(tmp_path)
    with pytest.raises(Exception, match="fences.json: unreadable"):
        run(c3.start())


def test_status_carries_each_replicas_engine_load_with_its_age(fleet):
    """What an entry point on another host routes by: the engine load the probe read."""
    from r9k.deploy.routing import EngineLoad

    c, r = fleet

    async def scenario():
        await launched_ready(c, r)

    run(scenario())
    assert c.status().replicas[0].engine_load is None   # no load read yet
    r.route.engine = EngineLoad(3, 1, 0.5, time.monotonic() - 2.0)
    load = c.status().replicas[0].engine_load
    assert (load.running, load.waiting, load.kv_usage_ratio) == (3, 1, 0.5) and 2.0 <= load.age_s < 3.0


def test_fleet_down_is_marked_so_the_unit_does_not_start_the_fleet_again(fleet):
    """`r9k fleet down` stops the controller on purpose: `fleet up` then exits with
    EXIT_FLEET_DOWN, which r9k-fleet.service (Restart=always) does not restart on."""
    c, _ = fleet

    async def scenario():
        assert not c.down_requested
        status = await c.admin("down", {})
        await asyncio.wait_for(c.stopping.wait(), 5)
        return status

    assert run(scenario()) == (200, {"stopping": True}) and c.down_requested


def test_the_status_carries_the_health_verdict_beside_its_reason(fleet):
    """The controller hands a failure's typed verdict to the lifecycle and the fleet status
    carries it (the exporter's hung gauge reads `verdict`, not the reason's words)."""
    c, r = fleet

    async def scenario():
        await launched_ready(c, r)
        r.lc.page_failed = True  # not restarted: the unhealthy state stays to be read
        [fail] = r.lc.observe(0.0, Observation(alive=False, returncode=-9))
        await c._fail(r, fail.reason, fail.verdict)

    run(scenario())
    status = c.describe(r)
    assert (status.state, status.verdict) == ("unhealthy", "exited")
    assert status.reason.startswith("engine process exited with -9")
