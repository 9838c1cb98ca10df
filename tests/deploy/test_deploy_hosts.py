"""The fleet across hosts on a real multi-node Ray cluster on loopback: a 0-CPU head and raylets
labelled `r9k.host` hA / hB with their R9700 cards; the real controller, host agents,
supervisors, placement groups, entry point and ops watcher. Only the replica's argv is a stub
server (tests/doubles/stub_replica.py: /health, /metrics with the planner's one-page pool,
/v1/completions), so losing a host costs seconds, not engine starts.

One scenario, in order (each step starts from the fleet the previous one left):
freeze a replica -> SIGKILL hB's raylet -> hB joins again -> a fence in hB's state dir.
Hosts have the same PCI addresses (identical servers); a second test places 4 x TP2 on them.
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
from pathlib import Path

import psutil
import pytest

from r9k.deploy.config import parse_fleet
from r9k.core.http_client import http_request

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")]

STUB = Path(__file__).resolve().parents[1] / "doubles" / "stub_replica.py"
CARDS = ["0000:03:00.0", "0000:04:00.0", "0000:05:00.0", "0000:06:00.0"]
PROBE_S = 1.0
HEARTBEAT_S = 5.0   # longer than the chunk bound: a frozen stream ends by the bound, not the verdict
CHUNK_S = 2.0
TOKEN_DELAY_S = 0.05
BACKOFF_S = 30.0
JOIN_BOUND_S = 15.0


def fleet_text(port: int, base: Path, hosts: dict[str, int], models: list[dict]) -> str:
    return json.dumps({
        "platform": "gpu", "ray": {"address": "auto"}, "entry": {
            "port": port, "routing": "least-outstanding", "connect_timeout_s": 2,
            "first_byte_timeout_s": 30, "chunk_timeout_s": CHUNK_S},
        "exporter": None, "replica_bind": "node-ip", "replica_ports": "18800-18899",
        "ops_state_dir": str(base / "{host}" / "ops"), "run_dir": str(base / "run"),
        "hosts": [{"name": h, "cards": CARDS[:n]} for h, n in hosts.items()],
        "placement": {"gpu_resource": False, "cpus_per_card": 0, "timeout_s": 20},
        "health": {"probe_interval_s": PROBE_S, "heartbeat_timeout_s": HEARTBEAT_S,
                   "progress_timeout_s": 30, "grace_after_ready_s": 0,
                   # a long backoff: a waiting replica placed within seconds of a host joining
                   # was placed because the host joined
                   "restart_backoff_s": BACKOFF_S, "restart_backoff_max_s": 60, "drain_timeout_s": 5},
        "models": [{"path": str(base / "tiny"), "max_model_len": 4096,
                    "kv_cache_memory_bytes": 64 << 20, "state_dtype": "float32", **m}
                   for m in models]})


def stub_controller(cfg):
    """The real controller; each replica's argv is the stub server with its planned pool."""
    from r9k.deploy.controller import FleetController

    class StubFleet(FleetController):
        def _launch_spec(self, model, a):
            argv, env, spec = super()._launch_spec(model, a)
            pool = self.plans[model.name].onepage
            stub = [sys.executable, str(STUB), "--host", "{host}", "--port", "{port}",
                    "--blocks", str(pool.num_blocks), "--block-size", str(pool.attention_block_size),
                    "--token-delay-s", str(TOKEN_DELAY_S), "--name", a.replica]
            return stub, env, spec

    return StubFleet(cfg)


class Fleet:
    """A Ray cluster of labelled raylets and a controller on its own event loop."""

    def __init__(self, base: Path, hosts: dict[str, int], models: list[dict]) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from r9k.devtools.local_server import free_port
        from r9k.devtools.tiny_model import build_config

        (base / "tiny").mkdir(parents=True, exist_ok=True)
        (base / "tiny" / "config.json").write_text(json.dumps(build_config()))
        for h in hosts:
            (base / h / "ops").mkdir(parents=True, exist_ok=True)
        self.base, self.hosts = base, hosts
        self.cluster = Cluster(initialize_head=True,
                               head_node_args={"num_cpus": 0, "include_dashboard": False})
        self.nodes = {h: self.add_host(h) for h in hosts}
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        self.cfg = parse_fleet(fleet_text(free_port(), base, hosts, models))
        self.controller = stub_controller(self.cfg)
        self.url = self.controller.url
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.call(self.controller.start())

    def add_host(self, name: str):
        return self.cluster.add_node(num_cpus=1, resources={"R9700": self.hosts[name]},
                                     labels={"r9k.host": name})

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def raylet_pid(self, host: str) -> int:
        return self.nodes[host].all_processes["raylet"][0].process.pid

    def close(self) -> None:
        import ray

        if getattr(self, "stop_s", None) is not None:
            return
        t0 = time.monotonic()
        try:
            self.call(self.controller.stop(), 120)
        finally:
            self.stop_s = time.monotonic() - t0
            self.loop.call_soon_threadsafe(self.loop.stop)
            ray.shutdown()
            self.cluster.shutdown()


def status(f: Fleet) -> dict:
    return http_request(f.url + "/fleet/status", timeout_s=10).json()


def replicas(st: dict) -> dict[str, dict]:
    return {r["name"]: r for r in st["replicas"] + st["stopped"]}


def wait_until(f: Fleet, predicate, timeout_s: float, poll_s: float = 0.2) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = status(f)
        if predicate(st):
            return st
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s:\n{json.dumps(status(f), indent=1)[:5000]}")


def all_ready(st: dict, n: int) -> bool:
    rs = replicas(st)
    return len(rs) == n and all(r["state"] == "ready" for r in rs.values())


def complete(f: Fleet, max_tokens: int = 4, stream: bool = False, timeout: float = 60):
    """(status, replica that answered, body) of a completion through the entry point."""
    body = {"model": "m", "prompt": "p", "max_tokens": max_tokens, "stream": stream}
    req = urllib.request.Request(f.url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("X-R9k-Replica"), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("X-R9k-Replica"), exc.read()


def processes_of(r: dict) -> list[int]:
    """The replica's guard, server and engine-core pids (what holds a card on a real host)."""
    return [p for p in [r["pid"], *r["engine_pids"]] if p]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stub_server(r: dict) -> psutil.Process:
    procs = [psutil.Process(p) for p in r["engine_pids"] if alive(p)]
    return next(p for p in procs if str(STUB) in " ".join(p.cmdline()))


def entry_counter(f: Fleet, name: str) -> float:
    text = http_request(f.url + "/metrics", timeout_s=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


class Client:
    """Plain completions one after another in a thread: counts of sent, ok and failed."""

    def __init__(self, f: Fleet) -> None:
        self.f, self.stop = f, threading.Event()
        self.sent = self.ok = 0
        self.failed: list = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            self.sent += 1
            try:
                code, _, body = complete(self.f, max_tokens=2, timeout=60)
            except OSError as exc:
                code, body = type(exc).__name__, b""
            if code == 200:
                self.ok += 1
            else:
                self.failed.append((code, body[:200]))
            time.sleep(0.05)

    def end(self) -> "Client":
        self.stop.set()
        self.thread.join(90)
        return self


@pytest.fixture
def two_hosts(tmp_path):
    # hA 2 cards, hB 3 (the same addresses on both): m-0 hB, m-1 hA, m-2 hB
    f = Fleet(tmp_path, {"hA": 2, "hB": 3}, [{"name": "m", "replicas": 3, "tp": 1}])
    try:
        wait_until(f, lambda st: all_ready(st, 3), 90)
        yield f
    finally:
        f.close()


def frozen_replica_ends_its_requests_in_bound_and_plain_ones_move(f: Fleet) -> None:
    """(d) In-flight requests to a frozen replica: a stream ends with an error event within the
    chunk bound, a plain request is answered by another replica; no probe waits on it."""
    st = status(f)
    victim = replicas(st)["m-1"]
    assert victim["host"] == "hA"
    retries0 = entry_counter(f, "r9k_entry_retries_total")
    results: dict[str, list] = {"stream": [], "plain": []}

    def send(kind: str) -> None:
        try:
            code, replica, body = complete(f, max_tokens=200 if kind == "stream" else 60,
                                           stream=kind == "stream", timeout=90)
        except Exception as exc:  # a cut answer (IncompleteRead) is a failure to see
            code, replica, body = repr(exc), None, b""
        results[kind].append((code, replica, body, time.monotonic()))

    threads = [threading.Thread(target=send, args=(k,)) for k in ["stream"] * 3 + ["plain"] * 3]
    for t in threads:  # one at a time: least-outstanding gives each replica a stream and a plain
        t.start()
        time.sleep(0.25)
    assert replicas(status(f))["m-1"]["outstanding"] == 2
    server = stub_server(victim)
    server.suspend()  # SIGSTOP: the replica neither answers nor closes its sockets
    t_freeze = time.monotonic()
    probe_ok, ages = [], []
    while any(t.is_alive() for t in threads) and time.monotonic() - t_freeze < 60:
        t0 = time.monotonic()
        st = status(f)   # the entry point answers while a replica is frozen
        probe_ok.append(time.monotonic() - t0)
        rs = replicas(st)
        ages.append(max(rs[n]["probe_age_s"] or 0.0 for n in ("m-0", "m-2")))
        time.sleep(0.3)
    for t in threads:
        t.join(30)
    frozen_streams = [r for r in results["stream"] if r[1] == "m-1"]
    assert len(frozen_streams) == 1, results["stream"]
    code, _, body, ended = frozen_streams[0]
    assert code == 200 and b'"code": 502' in body and body.rstrip().endswith(b"data: [DONE]")
    # it ends within the chunk bound (or sooner, when the replica turns unhealthy)
    TIMELINE["frozen_stream_ended_s"] = round(ended - t_freeze, 2)
    assert ended - t_freeze < CHUNK_S + 1.0, ended - t_freeze
    # found unhealthy (the heartbeat timeout, one /health probe's own timeout, two ticks), then
    # answered by another replica
    plain_bound_s = HEARTBEAT_S + min(5.0, HEARTBEAT_S) + 2 * PROBE_S + 60 * TOKEN_DELAY_S + 1.0
    TIMELINE["frozen_plain_answered_s"] = round(max(r[3] for r in results["plain"]) - t_freeze, 2)
    for code, replica, body, ended in results["plain"]:
        assert ended - t_freeze < plain_bound_s, (ended - t_freeze, plain_bound_s)
        assert code == 200 and replica in ("m-0", "m-2"), (code, replica, body[:300])
        assert json.loads(body)["usage"]["completion_tokens"] == 60
    assert entry_counter(f, "r9k_entry_retries_total") >= retries0 + 1
    other = [r for r in results["stream"] if r[1] != "m-1"]
    assert len(other) == 2 and all(b"[DONE]" in r[2] and b'"code": 502' not in r[2] for r in other)
    assert max(probe_ok) < 2.0, probe_ok
    # the frozen replica's probe (its /health timing out) never held up the others'
    assert max(ages) < 2 * PROBE_S + 1.0, ages
    # the frozen replica is found unhealthy, killed and started again on its card
    st = wait_until(f, lambda s: replicas(s)["m-1"]["state"] == "ready"
                    and replicas(s)["m-1"]["starts"] == victim["starts"] + 1, 60)
    assert not alive(server.pid)
    assert replicas(st)["m-1"]["cards"] == victim["cards"] and replicas(st)["m-1"]["host"] == "hA"
    assert any("no heartbeat" in h for h in replicas(st)["m-1"]["history"])


TIMELINE: dict[str, float] = {}


def host_loss_keeps_serving_re_places_and_leaves_no_process(f: Fleet) -> None:
    """(a) the survivor serves through a raylet SIGKILL, (b) a lost replica is placed again on
    the live host's free card, (c, first half) the one that does not fit waits unplaced,
    (g) nothing of hB's replicas survives 10 s."""
    st = status(f)
    on_b = {n: r for n, r in replicas(st).items() if r["host"] == "hB"}
    assert sorted(on_b) == ["m-0", "m-2"]
    pids = [p for r in on_b.values() for p in processes_of(r)]
    assert len(pids) >= 6 and all(alive(p) for p in pids)   # guard, server, core each
    import ray

    agent = f.controller.ray_side.agents[f.controller.nodes["hB"]]
    pids.append(ray.get(agent.pid.remote(), timeout=30))   # hB's agent goes with its raylet too
    assert alive(pids[-1])
    client = Client(f)
    time.sleep(2)
    os.kill(f.raylet_pid("hB"), signal.SIGKILL)
    t0 = time.monotonic()
    gone_at = out_at = back_at = None
    while time.monotonic() - t0 < 90:
        now = time.monotonic() - t0
        if gone_at is None and not any(alive(p) for p in pids):
            gone_at = now
        rs = replicas(status(f))
        if out_at is None and all(rs[n]["state"] != "ready" for n in on_b):
            out_at = now
        moved = [n for n in on_b if rs[n]["state"] == "ready" and rs[n]["host"] == "hA"]
        if back_at is None and moved:
            back_at = now
        if gone_at is not None and back_at is not None and now > 25:
            break
        time.sleep(0.2)
    client.end()
    TIMELINE.update(processes_gone_s=gone_at, out_of_routing_s=out_at, serving_on_hA_s=back_at,
                    requests_sent=client.sent, requests_ok=client.ok, requests_failed=len(client.failed))
    print(f"host loss timeline (s after SIGKILL of hB's raylet): {json.dumps(TIMELINE)}", flush=True)
    assert gone_at is not None and gone_at < 10, gone_at                      # (g)
    assert client.failed == [] and client.ok > 20, (client.ok, client.failed[:5])  # (a)
    assert back_at is not None, json.dumps(status(f), indent=1)[:3000]        # (b)
    rs = replicas(status(f))
    placed = [n for n in on_b if rs[n]["host"] == "hA" and rs[n]["state"] == "ready"]
    waiting = [n for n in on_b if n not in placed]
    assert len(placed) == 1 and len(waiting) == 1, rs
    w = rs[waiting[0]]
    assert w["state"] == "unhealthy" and "waiting for cards" in (w["reason"] or ""), w
    assert any("host hB lost" in h for h in w["history"]), w["history"]
    cards = status(f)["cards"]
    assert {c["host"] for c in cards} == {"hA"}   # the live inventory: hB's cards are gone
    assert sorted(c["replica"] for c in cards) == sorted(["m-1", placed[0]])
    f.waiting = waiting[0]


def rejoined_host_takes_the_waiting_replica(f: Fleet) -> None:
    """(c) a replica stuck unplaced is placed once a node with free cards (re)joins."""
    t0 = time.monotonic()
    f.nodes["hB"] = f.add_host("hB")
    st = wait_until(f, lambda s: replicas(s)[f.waiting]["state"] == "ready", JOIN_BOUND_S)
    r = replicas(st)[f.waiting]
    assert r["host"] == "hB"
    TIMELINE["rejoin_to_ready_s"] = round(time.monotonic() - t0, 1)
    assert all_ready(st, 3)


def fence_on_the_other_host_drains_its_replica_and_clear_returns_it(f: Fleet) -> None:
    """(e) a fence written in hB's state dir (the real watcher, no hook) drains hB's replica
    within two probe intervals, not the replica on hA at the same address; `r9k ops clear`
    there returns the card."""
    from click.testing import CliRunner

    from r9k.cli import main
    from r9k.ops.watch import FileSource, Watcher

    rs = replicas(status(f))
    victim = rs[f.waiting]
    bdf = victim["cards"][0]
    same_address_on_a = [n for n, r in rs.items() if r["host"] == "hA" and r["cards"] == [bdf]]
    state_dir = f.base / "hB" / "ops"
    log = f.base / "hB" / "kern.log"
    log.write_text(f"[ 812.118] amdgpu {bdf}: amdgpu: MES failed to respond to msg=MISC (WAIT_REG_MEM)\n")
    seen = Watcher(FileSource(log), state_dir=state_dir).poll(final=True)
    assert [(s.event.bdf, s.fenced_now) for s in seen] == [(bdf, True)]
    t0 = time.monotonic()
    st = wait_until(f, lambda s: replicas(s)[victim["name"]]["state"] != "ready", 10, poll_s=0.05)
    drained_s = time.monotonic() - t0
    TIMELINE["fence_to_drain_s"] = round(drained_s, 2)
    assert drained_s < 2 * PROBE_S, drained_s
    for n in same_address_on_a:  # the same address on the other host is another card
        assert replicas(st)[n]["state"] == "ready"
    st = wait_until(f, lambda s: replicas(s)[victim["name"]]["state"] == "ready", 30)
    r = replicas(st)[victim["name"]]
    assert r["host"] == "hB" and r["cards"] != [bdf], r
    card = next(c for c in st["cards"] if (c["host"], c["bdf"]) == ("hB", bdf))
    assert card["usable"] is False and "mes_timeout" in card["reason"]
    assert next(c for c in st["cards"] if (c["host"], c["bdf"]) == ("hA", bdf))["usable"] is True
    res = CliRunner().invoke(main, ["ops", "clear", bdf, "--state-dir", str(state_dir)])
    assert res.exit_code == 0, res.output
    t0 = time.monotonic()
    st = wait_until(f, lambda s: next(c for c in s["cards"]
                                      if (c["host"], c["bdf"]) == ("hB", bdf))["usable"], 10, 0.05)
    assert time.monotonic() - t0 < 2 * PROBE_S


STEPS = [
    ("freeze m-1 (hA): its stream ends in bound, plain requests answered elsewhere",
     frozen_replica_ends_its_requests_in_bound_and_plain_ones_move),
    ("SIGKILL hB's raylet: survivor serves, one replica re-placed on hA, one waits, no orphans",
     host_loss_keeps_serving_re_places_and_leaves_no_process),
    ("hB joins again: the waiting replica is placed there", rejoined_host_takes_the_waiting_replica),
    ("MES timeout in hB's state dir: its replica drained, the card returned by ops clear",
     fence_on_the_other_host_drains_its_replica_and_clear_returns_it),
]


def test_two_hosts_freeze_lose_rejoin_fence(two_hosts):
    f = two_hosts
    st = status(f)
    assert {n: r["host"] for n, r in replicas(st).items()} == {"m-0": "hB", "m-1": "hA", "m-2": "hB"}
    served = {complete(f)[1] for _ in range(6)}
    assert served == {"m-0", "m-1", "m-2"}
    for i, (title, step) in enumerate(STEPS, 1):
        t0 = time.monotonic()
        print(f"step {i}/{len(STEPS)}: {title}", flush=True)
        try:
            step(f)
        except AssertionError as exc:
            raise AssertionError(f"step {i}/{len(STEPS)} ({title}) failed: {exc}") from exc
        print(f"step {i}/{len(STEPS)} passed in {time.monotonic() - t0:.0f} s", flush=True)
    f.close()
    assert f.stop_s < 30, f.stop_s   # nothing in flight holds the controller's stop


def test_identical_hosts_place_four_tp2_and_fence_the_right_hosts_card(tmp_path):
    """(f) Two hosts with the same four PCI addresses: 4 x TP2 uses all 8 cards; a fence on
    hB's first card drains hB's replica on it, never hA's on the same address."""
    f = Fleet(tmp_path, {"hA": 4, "hB": 4}, [{"name": "m", "replicas": 4, "tp": 2}])
    try:
        st = wait_until(f, lambda s: all_ready(s, 4), 120)
        rs = replicas(st)
        used = sorted((r["host"], b) for r in rs.values() for b in r["cards"])
        assert used == sorted((h, b) for h in ("hA", "hB") for b in CARDS)
        on = {(r["host"], r["cards"][0]): n for n, r in rs.items()}
        status_code, body = f.call(f.controller.admin("drain", {"card": CARDS[0]}))
        assert status_code == 400 and "is on 2 hosts (hA, hB)" in body["error"]
        status_code, body = f.call(f.controller.admin("drain", {"card": CARDS[0], "host": "hB"}))
        assert status_code == 200 and body == {"card": f"hB/{CARDS[0]}", "drained": [on[("hB", CARDS[0])]]}
        st = status(f)
        assert replicas(st)[on[("hA", CARDS[0])]]["state"] == "ready"
        # the operator's fence is kept for the next controller
        saved = json.loads((tmp_path / "run" / "fences.json").read_text())
        assert saved == {f"hB/{CARDS[0]}": "drained by operator"}
    finally:
        f.close()
