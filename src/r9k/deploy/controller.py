"""The fleet controller: thin orchestration on one asyncio loop. It plans placement
(:mod:`~r9k.deploy.placement`), asks the lifecycle (:mod:`~r9k.deploy.lifecycle`, pure) what to
do with each event and carries the actions out through Ray (:mod:`~r9k.deploy.ray_backend`) and
the HTTP probes (:mod:`~r9k.deploy.probes`), and serves the entry point.

Actor calls are awaited ObjectRefs; the few synchronous Ray calls are listed in ray_backend.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine

import aiohttp

from r9k.deploy import ray_backend
from r9k.deploy.adoption import SUPERVISOR_TIMEOUT_S, adoptable
from r9k.deploy.config import FleetConfig, HostSpec, ModelSpec, planned_pool
from r9k.deploy.engine import launch_spec, prove_pages, rccl_env
from r9k.deploy.exporter_sidecar import ExporterSidecar
from r9k.deploy.entry import Backend, EntryPoint, Route, entry_limits, serve
from r9k.deploy.routing import EngineLoad
from r9k.deploy.lifecycle import (DRAINING, LOADING, PROBED_STATES, READY, STOPPED, Action, Fail, KillEngine,
                                  Note, Observation, Replace, ReplicaLifecycle, RestartAfter,
                                  RollingRestart, StartEngine, ops_fence_changes, replicas_to_drain)
from r9k.deploy.placement import (Assignment, CardKey, CardPool, PlacementError, ReplicaSlot,
                                  card_label, check_fits, parse_card_label, place_one,
                                  plan_placement, replica_slots, unusable_cards)
from r9k.deploy.probes import HttpProbe
from r9k.core.fleet_status import (CardStatus, EngineLoadStatus, ExporterStatus, FleetStatus, PlanStatus,
                              ReplicaStatus)
from r9k.core.http_client import host_url
from r9k.ops.state import BDF_PATTERN
from r9k.deploy.ray_backend import RayReplica
from r9k.core.vllm_metrics import VllmMetrics, parse_vllm_metrics

log = logging.getLogger("r9k.fleet")
CONTROLLER_FILE = "controller.json"
FENCES_FILE = "fences.json"        # cards an operator drained: kept across controller restarts
ADOPT_PROBE_TIMEOUT_S = 20.0      # a restarted controller re-proves adopted replicas before serving
HISTORY_LINES = 20


def _counters(metrics_text: str) -> VllmMetrics | None:
    try:
        return parse_vllm_metrics(metrics_text)
    except ValueError:  # not Prometheus text this time: the heartbeat layer decides
        return None


def default_run_dir() -> Path:
    return Path(os.environ.get("R9K_FLEET_RUN_DIR") or Path.home() / ".local/state/r9k/fleet")


@dataclass
class Replica:
    name: str
    model: ModelSpec
    assignment: Assignment | None
    lc: ReplicaLifecycle
    route: Route | None = None
    ray: RayReplica | None = None
    pid: int | None = None
    engine_pids: list[int] = field(default_factory=list)
    task: asyncio.Task | None = None      # launch / restart / drain in progress
    probe_task: asyncio.Task | None = None  # one probe at a time, never waited on by others
    probed_at: float | None = None         # monotonic time of the last finished probe
    history: list[str] = field(default_factory=list)

    @property
    def card_keys(self) -> list[CardKey]:
        a = self.assignment
        return [(a.host, b) for b in a.cards] if a else []

    def event(self, text: str) -> None:
        self.history.append(f"{time.strftime('%H:%M:%S')} {text}")
        del self.history[:-HISTORY_LINES]
        log.info("%s: %s", self.name, text)


class FleetController(Backend):
    """`ray_side`: Ray's operations (`ray_backend.RaySide`; tests pass a fake)."""

    def __init__(self, cfg: FleetConfig, run_dir: Path | None = None, config_path: str | None = None,
                 ray_side: Any = None) -> None:
        self.cfg = cfg
        self.ray_side = ray_side if ray_side is not None else ray_backend.RaySide()
        self.run_dir = Path(run_dir or cfg.run_dir or default_run_dir())
        self.config_path = config_path
        self.api_key = cfg.api_key()
        self.replicas: dict[str, Replica] = {}
        self.hosts: list[HostSpec] = []
        self.nodes: dict[str, str] = {}          # live host -> Ray node id, read every tick
        self.pool: CardPool | None = None
        self.fences: dict[CardKey, str] = {}     # ops' (every host's) and operators' fences
        self.fence_task: asyncio.Task | None = None
        self.entry = EntryPoint(self, api_key=self.api_key, routing=cfg.entry.routing,
                                prefix_chars=cfg.entry.prefix_chars,
                                connect_timeout_s=cfg.entry.connect_timeout_s,
                                first_byte_timeout_s=cfg.entry.first_byte_timeout_s,
                                chunk_timeout_s=cfg.entry.chunk_timeout_s)
        self.runner = None
        self.session: aiohttp.ClientSession | None = None
        self.probe: HttpProbe | None = None
        self.monitor_task: asyncio.Task | None = None
        self.exporter = (ExporterSidecar(cfg.exporter, cfg.health, self.run_dir,
                                         f"{self.url}/fleet/status")
                         if cfg.exporter is not None else None)
        self.started_ray = False
        self.stopping = asyncio.Event()
        self.down_requested = False  # `r9k fleet down` asked: `fleet up` exits with its own status
        self.plans = {m.name: planned_pool(m, cfg) for m in cfg.models}

    # -- start-up ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return host_url(self.cfg.entry.host, self.cfg.entry.port)

    def _operator_fences(self) -> dict[CardKey, str]:
        try:
            doc = json.loads((self.run_dir / FENCES_FILE).read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise PlacementError(f"{self.run_dir / FENCES_FILE}: unreadable ({exc}); expected "
                                 "the JSON the controller writes, {\"host/BDF\": reason}") from None
        return {parse_card_label(k): str(v) for k, v in doc.items() if "/" in k}

    def _save_operator_fences(self) -> None:
        from r9k.deploy.lifecycle import FAULT_FROM_OPS

        doc = {card_label(k): why for k, why in self.fences.items() if not why.startswith(FAULT_FROM_OPS)}
        tmp = self.run_dir / (FENCES_FILE + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        tmp.replace(self.run_dir / FENCES_FILE)

    def _unusable(self) -> dict[CardKey, str]:
        """Avoided cards on the live hosts, then every fence (ops' on each host, operators')."""
        out = unusable_cards(self.cfg, self.hosts)
        out.update(self.fences)
        return out

    async def start(self) -> None:
        """Validate against the cluster (raises before anything starts), adopt the replicas a
        previous controller left running, place and launch the rest, serve the entry point."""
        from r9k.deploy.lifecycle import FAULT_FROM_OPS

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_ray = self.ray_side.connect(self.cfg)
        self.nodes = self.ray_side.live_hosts(self.cfg)
        self.hosts = await self.ray_side.inventory(self.cfg, self.nodes)
        self._check_reachable(self.hosts)
        self.fences = self._operator_fences()
        for host, states in (await self.ray_side.host_fences(self.cfg, self.nodes)).items():
            self.fences.update({(host, b): FAULT_FROM_OPS + why for b, why in states.items()})
        unusable = self._unusable()
        check_fits(self.cfg, self.hosts, unusable)
        self.pool = CardPool(self.hosts, unusable)
        slots = replica_slots(self.cfg)
        adopted = await adoptable(self.cfg, self.ray_side, self.hosts, self.pool, slots,
                                  self.api_key)
        for name, (a, _, _) in adopted.items():
            for bdf in a.cards:
                self.pool.in_use[(a.host, bdf)] = name
        placed = plan_placement([s for s in slots if s.name not in adopted], self.pool,
                                self.cfg.platform)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self.probe = HttpProbe(self.session)
        for slot in slots:  # config order: replica ports follow it
            a = adopted[slot.name][0] if slot.name in adopted else placed[slot.name]
            self.replicas[slot.name] = Replica(slot.name, self.cfg.model(a.model).for_replica(slot.name), a,
                                               ReplicaLifecycle(slot.name, self.cfg.health))
        for name in adopted:
            self._adopt(self.replicas[name], *adopted[name][1:])
        if adopted:  # proven again before the entry point opens: no window of 503s
            try:
                await asyncio.wait_for(asyncio.gather(
                    *(self._probe(self.replicas[n]) for n in adopted)), ADOPT_PROBE_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("adopted replicas not all proven within %.0f s; the monitor goes on",
                            ADOPT_PROBE_TIMEOUT_S)
        self.runner = await serve(self.entry, self.cfg.entry.host, self.cfg.entry.port,
                                  **entry_limits(self.cfg.entry))
        for name, r in self.replicas.items():
            if name not in adopted:
                self._spawn(r, self._launch(r))
        self.monitor_task = asyncio.create_task(self._monitor())
        if self.exporter is not None:
            self.exporter.start()
        (self.run_dir / CONTROLLER_FILE).write_text(json.dumps(
            {"pid": os.getpid(), "url": self.url, "config": self.config_path}))

    def _check_reachable(self, hosts: list[HostSpec]) -> None:
        """Replicas bound to loopback are reachable from this host only."""
        if self.cfg.replica_bind == "127.0.0.1" and len(hosts) > 1:
            raise PlacementError(f"replica_bind 127.0.0.1 with {len(hosts)} hosts in the cluster "
                                 f"({', '.join(h.name for h in hosts)}): the controller could reach "
                                 "only its own host's replicas; expected replica_bind: node-ip")

    def _launch_spec(self, model: ModelSpec, a: Assignment) -> tuple[list[str], dict[str, str], dict]:
        return launch_spec(model, self.cfg, a, self.hosts, self.api_key)

    def _adopt(self, r: Replica, rr: RayReplica, desc: dict) -> None:
        """A running engine from a previous controller: routed once probed ready (the page proof
        runs again), its pid unchanged."""
        eng = desc["engine"]
        r.ray = rr
        r.route = Route(r.name, r.model.name, eng["url"], api_key=self.api_key,
                        host=r.assignment.host if r.assignment else None)
        r.pid, r.engine_pids = eng["pid"], desc.get("engine_pids") or []
        self._note(r, r.lc.adopted(time.monotonic(), eng["start"], eng["pid"], eng["url"]))

    def exporter_status(self) -> ExporterStatus | None:
        return self.exporter.status() if self.exporter is not None else None

    # -- carrying out the lifecycle's actions -----------------------------------------------------

    def _spawn(self, r: Replica, coro: Coroutine) -> None:
        r.task = asyncio.create_task(self._guard(r, coro))
        r.task.add_done_callback(lambda _t: coro.close())  # cancelled before it began: no warning

    async def _guard(self, r: Replica, coro: Coroutine) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a lifecycle step failed: cards freed, the replica says why
            try:
                await self._release(r, grace_s=0.0)
            except Exception:
                log.exception("%s: release after a failed step", r.name)
            self._note(r, r.lc.step_failed(time.monotonic(), f"{type(exc).__name__}: {exc}"))
        finally:
            if r.task is asyncio.current_task():
                r.task = None

    def _note(self, r: Replica, actions: list[Action]) -> None:
        """Actions that need no waiting: notes, and failures (each in the replica's own task)."""
        if r.route is not None and r.lc.state not in (READY, DRAINING, LOADING):
            # unhealthy or stopped: its in-flight requests end now (retried or an error event)
            r.route.abort(f"replica {r.name} {r.lc.state}: {r.lc.reason}")
        for a in actions:
            if isinstance(a, Note):
                r.event(a.text)
            elif isinstance(a, Fail):
                self._spawn(r, self._fail(r, a.reason, a.verdict))
            else:
                raise TypeError(f"{r.name}: {a!r} must be awaited (_carry_out), not noted")

    async def _carry_out(self, r: Replica, actions: list[Action]) -> None:
        supervisor_alive = True
        for a in actions:
            if isinstance(a, KillEngine):
                supervisor_alive = r.ray is not None and await r.ray.kill_engine()
            elif isinstance(a, RestartAfter):
                await asyncio.sleep(a.delay_s)
                await self._carry_out(r, r.lc.restart_due(self.stopping.is_set(), supervisor_alive))
            elif isinstance(a, StartEngine):
                await self._start_engine(r)
            elif isinstance(a, Replace):
                await self._release(r)
                await self._replace(r, a.why)
            else:
                self._note(r, [a])

    async def _launch(self, r: Replica) -> None:
        """Placement group on the assigned cards, supervisor actor in it, engine started."""
        a = r.assignment
        assert a is not None
        r.lc.placing(a.host, a.cards)
        argv, env, spec = self._launch_spec(r.model, a)
        spec["avoid_ports"] = [self._port(o) for o in self.replicas.values() if o is not r]
        r.ray = await self.ray_side.place(r.name, a, self.cfg, argv, env,
                                          str(self.run_dir / "logs"), self._port(r), spec)
        await self._start_engine(r)

    def _port(self, r: Replica) -> int:
        """Each replica its own port in the range (replicas of one host must not race for one)."""
        lo, _ = self.cfg.port_range
        return lo + list(self.replicas).index(r.name)

    async def _start_engine(self, r: Replica) -> None:
        assert r.ray is not None
        info = await r.ray.start_engine()
        taken = [o.name for o in self.replicas.values()
                 if o is not r and o.route is not None and o.route.url == info["url"]]
        if taken:  # a port race lost: never route two replicas to one server
            await r.ray.kill_engine()
            raise RuntimeError(f"engine started at {info['url']}, which {taken[0]} serves")
        r.route = Route(r.name, r.model.name, info["url"], api_key=self.api_key,
                        host=r.assignment.host if r.assignment else None)
        r.pid = info["pid"]
        self._note(r, r.lc.engine_started(time.monotonic(), info["start"], info["pid"], info["url"], info["log"]))

    async def _release(self, r: Replica, grace_s: float | None = None, lost: bool = False) -> None:
        """Stop and free the replica's Ray side and cards; ``lost``: its host is gone, so its
        supervisor is not asked to stop the engine."""
        if r.route is not None:
            r.route.abort(f"replica {r.name} released")
        if r.ray is not None and lost:
            await r.ray.release_lost()
        elif r.ray is not None:
            await r.ray.release(self.cfg.health.drain_timeout_s if grace_s is None else grace_s)
        r.ray = r.route = None
        r.pid, r.engine_pids = None, []
        if self.pool is not None:
            self.pool.release(r.name)

    async def _fail(self, r: Replica, reason: str, verdict: str | None = None) -> None:
        await self._carry_out(r, r.lc.fail(time.monotonic(), reason, verdict))

    async def _replace(self, r: Replica, why: str) -> None:
        assert self.pool is not None
        self.pool.release(r.name)
        try:
            r.assignment = place_one(ReplicaSlot(r.name, r.model.name, r.model.tp), self.pool, self.cfg.platform)
        except PlacementError as exc:
            r.assignment = None   # it holds no cards while it waits
            self._note(r, r.lc.not_placed(time.monotonic(), why, str(exc)))
            return
        self._note(r, r.lc.placed(r.assignment.host, r.assignment.cards, why))
        await self._launch(r)

    async def _wait_drained(self, r: Replica) -> None:
        while r.lc.drain_waiting(time.monotonic(), r.route.outstanding if r.route else 0):
            await asyncio.sleep(0.2)

    async def drain(self, r: Replica, reason: str, replace: bool = False) -> None:
        """Stop routing, let in-flight requests finish (up to drain_timeout_s), stop the replica."""
        self._note(r, r.lc.begin_drain(time.monotonic(), reason))
        await self._wait_drained(r)
        await self._release(r)
        await self._carry_out(r, r.lc.drained(replace, self.stopping.is_set()))

    async def restart_rolling(self) -> list[str]:
        """One replica at a time on its own cards: drain, restart, wait until ready."""
        rolling = RollingRestart(list(self.replicas))
        while True:
            busy = [n for n, r in self.replicas.items() if r.task is not None]
            name = rolling.next({n: r.lc for n, r in self.replicas.items()}, busy)
            if name is None:
                return rolling.results
            r = self.replicas[name]
            self._note(r, r.lc.begin_rolling_restart(time.monotonic()))
            await self._wait_drained(r)
            await r.ray.stop_engine(self.cfg.health.drain_timeout_s)
            await self._carry_out(r, r.lc.rolling_restart_due())
            while r.lc.state == LOADING and not self.stopping.is_set():
                await asyncio.sleep(0.5)
            rolling.finished(name, r.lc.state)

    # -- health -----------------------------------------------------------------------------------

    async def _monitor(self) -> None:
        """Each tick: the live hosts, each host's fences, placements due, one probe per replica.
        Nothing here waits on a replica or a host: probes and fence reads run as their own
        tasks, so a frozen replica or a vanished host delays no other."""
        while not self.stopping.is_set():
            try:
                if self.exporter is not None and not self.stopping.is_set():
                    self.exporter.supervise()
                await self._inventory_tick()
                if self.fence_task is None or self.fence_task.done():
                    self.fence_task = asyncio.create_task(self._ops_poll())
                now = time.monotonic()
                for r in list(self.replicas.values()):
                    if r.task is None and r.lc.placement_due(now, self.stopping.is_set()):
                        self._spawn(r, self._replace(r, r.lc.reason or "placing again"))
                    elif (r.task is None and r.lc.state in PROBED_STATES
                          and (r.probe_task is None or r.probe_task.done())):
                        r.probe_task = asyncio.create_task(self._probe_guarded(r))
            except Exception:
                log.exception("health tick failed")
            try:
                await asyncio.wait_for(self.stopping.wait(), self.cfg.health.probe_interval_s)
            except asyncio.TimeoutError:
                pass

    async def _inventory_tick(self) -> None:
        """Hosts that left (or came back as a new Ray node) and hosts that joined: replicas of a
        lost host are placed again on a live one; unplaced replicas try again when one joins."""
        if self.pool is None:
            return
        try:
            nodes = self.ray_side.live_hosts(self.cfg)
        except Exception as exc:  # the GCS is away: keep the last view (Ray head loss: README)
            log.warning("cannot list the Ray nodes (%s); keeping the last inventory", exc)
            return
        if nodes == self.nodes:
            return
        lost = {h for h, nid in self.nodes.items() if nodes.get(h) != nid}
        joined = {h for h, nid in nodes.items() if self.nodes.get(h) != nid}
        self.nodes = nodes
        self.hosts = await asyncio.wait_for(self.ray_side.inventory(self.cfg, nodes), 30)
        self.pool.hosts = self.hosts
        self.pool.unusable = self._unusable()
        now = time.monotonic()
        for h in sorted(lost):
            log.warning("host %s left the cluster", h)
        for h in sorted(joined):
            log.info("host %s joined the cluster", h)
        for r in self.replicas.values():
            if r.assignment is not None and r.assignment.host in lost and r.lc.state != STOPPED \
                    and (r.ray is not None or r.task is not None):
                if r.task is not None:
                    r.task.cancel()
                self._spawn(r, self._host_lost(r, r.assignment.host))
            elif joined:
                r.lc.hosts_changed(now)

    async def _host_lost(self, r: Replica, host: str) -> None:
        self._note(r, r.lc.host_lost(time.monotonic(), host))
        await self._release(r, lost=True)
        await self._replace(r, f"host {host} lost")

    async def _ops_poll(self) -> None:
        """Cards ops fenced on any host (read there by its agent): not placed on again; replicas
        on them drained and placed elsewhere; cards `r9k ops clear` returned are used again."""
        if self.pool is None:
            return
        try:
            states = await self.ray_side.host_fences(self.cfg, dict(self.nodes))
        except Exception as exc:
            log.warning("reading the hosts' ops state failed: %s", exc)
            return
        fence, unfence = ops_fence_changes(states, self.fences)
        for key, why in fence.items():
            self.fence(key, why)
        for key in unfence:
            self.fences.pop(key, None)
            self.pool.unusable.pop(key, None)   # `r9k ops clear` returned it
            log.info("card %s returned to service by ops", card_label(key))

    def fence(self, card: CardKey, why: str) -> list[str]:
        """Mark a card (host, BDF) unusable and drain (then re-place) every replica on it."""
        self.fences[card] = why
        if self.pool is not None:
            self.pool.unusable[card] = why
        cards = {n: r.card_keys for n, r in self.replicas.items()}
        drained = replicas_to_drain(card, cards, {n: r.lc for n, r in self.replicas.items()})
        for name in drained:
            r = self.replicas[name]
            if r.task is not None:
                r.task.cancel()
            self._spawn(r, self.drain(r, f"card {card_label(card)} fenced: {why}", replace=True))
        return drained

    def resolve_card(self, bdf: str, host: str | None) -> CardKey:
        """An admin request's card: (host, BDF); without a host, the one host that has it."""
        if host:
            if not any(h.name == host and any(c.bdf == bdf for c in h.cards) for h in self.hosts):
                raise ValueError(f"no card {bdf} on host {host!r}; cards: "
                                 + ", ".join(card_label((h.name, c.bdf)) for h in self.hosts for c in h.cards))
            return host, bdf
        on = [h.name for h in self.hosts if any(c.bdf == bdf for c in h.cards)]
        if len(on) != 1:
            raise ValueError(f"card {bdf} is on {len(on)} hosts ({', '.join(on) or 'none'}); "
                             "expected a host (--host, or the ops hook's R9K_FLEET_HOST)")
        return on[0], bdf

    async def _probe_guarded(self, r: Replica) -> None:
        try:
            if r.task is None and r.ray is not None and r.route is not None:
                await self._probe(r)
        except Exception:
            log.exception("%s: probe failed", r.name)
        finally:
            r.probed_at = time.monotonic()

    async def _probe(self, r: Replica) -> None:
        """One look at a replica: supervisor report, /health, /metrics once; the lifecycle decides."""
        assert r.ray is not None and r.route is not None and self.probe is not None
        now = time.monotonic()
        start, route = r.lc.starts, r.route

        def stale() -> bool:  # the replica moved on while this probe waited (restart, drain)
            return r.lc.starts != start or r.route is not route or r.task is not None

        try:
            st = await r.ray.status(SUPERVISOR_TIMEOUT_S)
        except Exception as exc:
            if not stale():
                self._note(r, r.lc.observe(now, Observation(supervisor_error=type(exc).__name__)))
            return
        if stale():
            return
        r.engine_pids = st["engine_pids"]
        if not st["alive"]:
            self._note(r, r.lc.observe(now, Observation(alive=False, returncode=st["returncode"])))
            return
        heartbeat = await self.probe.heartbeat(r.route.url, min(5.0, self.cfg.health.heartbeat_timeout_s))
        now = time.monotonic()  # when it was seen: a silent replica's probe took its timeout
        loading = r.lc.state == LOADING
        # a replica that did not answer /health is judged by the heartbeat layer alone: its
        # /metrics would cost another timeout before the verdict
        text = await self.probe.metrics_text(r.route.url) if heartbeat else None
        if stale():
            return
        # an unreadable /metrics while loading fails the proof (no cache_config_info), as before
        proof = (prove_pages(text or "", self.plans[r.model.name], r.model.gdn_state)
                 if loading and heartbeat else None)
        counters = _counters(text) if text and not loading else None
        if counters is not None and None not in (counters.running, counters.waiting,
                                                 counters.kv_usage_ratio):
            # the router scores replicas by the engine's own pool and queue
            r.route.engine = EngineLoad(counters.running, counters.waiting,
                                        counters.kv_usage_ratio, now)
        elif counters is not None:  # it answered, but not with a usable load (NaN): unknown now
            r.route.engine = None
        self._note(r, r.lc.observe(now, Observation(
            heartbeat_ok=heartbeat, counters=counters, in_flight=r.route.outstanding, proof=proof)))

    # -- Backend (entry point) --------------------------------------------------------------------

    def routes(self, model: str) -> list[Route]:
        return [r.route for r in self.replicas.values()
                if r.model.name == model and r.lc.state == READY and r.route is not None]

    def model_names(self) -> list[str]:
        return [m.name for m in self.cfg.models]

    def max_model_len(self, model: str) -> int | None:
        return next((m.max_model_len for m in self.cfg.models if m.name == model), None)

    def states_line(self, model: str) -> str:
        rs = [r for r in self.replicas.values() if r.model.name == model]
        return ", ".join(f"{r.name} {r.lc.state}"
                         + (f" ({r.lc.reason})" if r.lc.reason and r.lc.state != READY else "")
                         for r in rs) or "no replicas configured"

    def describe(self, r: Replica) -> ReplicaStatus:
        m, lc, proof = r.model, r.lc, r.lc.proof
        return ReplicaStatus(
            name=r.name, url=r.route.url if r.route else None, model=m.name,
            model_config_path=str(m.resolved_path(self.cfg.base_dir)), tp=m.tp, num_spec=m.num_spec,
            page_mode=proof.page_mode if proof and proof.page_mode in ("stock", "onepage") else None,
            platform=self.cfg.platform, max_model_len=m.max_model_len,
            state=lc.state if lc.state != STOPPED else None,
            cards=list(r.assignment.cards) if r.assignment else [],
            host=r.assignment.host if r.assignment else None,
            reason=lc.reason, verdict=lc.verdict,
            page_reason=proof.reason if proof else None, kv=proof,
            starts=lc.starts, restarts=lc.restarts, failures=lc.failures,
            outstanding=r.route.outstanding if r.route else 0,
            served=r.route.served if r.route else 0,
            pid=r.pid, engine_pids=r.engine_pids, history=r.history[-8:],
            probe_age_s=(round(time.monotonic() - r.probed_at, 2)
                         if r.probed_at is not None and r.route is not None else None),
            engine_load=self._engine_load(r),
            rccl_env=rccl_env(m, self.cfg))

    @staticmethod
    def _engine_load(r: Replica) -> EngineLoadStatus | None:
        e = r.route.engine if r.route is not None else None
        if e is None:
            return None
        return EngineLoadStatus(running=e.running, waiting=e.waiting, kv_usage_ratio=e.kv_usage_ratio,
                                age_s=round(max(0.0, time.monotonic() - e.read_at_s), 3))

    def status(self) -> FleetStatus:
        live = [self.describe(r) for r in self.replicas.values() if r.lc.state != STOPPED and r.route]
        stopped = [self.describe(r) for r in self.replicas.values() if r.lc.state == STOPPED or not r.route]
        cards = [CardStatus(bdf=c.bdf, host=h.name,
                            replica=self.pool.in_use.get((h.name, c.bdf)) if self.pool else None,
                            usable=not (self.pool and (h.name, c.bdf) in self.pool.unusable),
                            reason=self.pool.unusable.get((h.name, c.bdf)) if self.pool else None)
                 for h in self.hosts for c in h.cards]
        plans = {name: PlanStatus(stock_tokens=p.stock.tokens, onepage_tokens=p.onepage.tokens,
                                  stock_blocks=p.stock.num_blocks, onepage_blocks=p.onepage.num_blocks)
                 for name, p in self.plans.items()}
        return FleetStatus(replicas=live, stopped=stopped, cards=cards, capacity=plans, entry=self.url,
                           exporter=self.exporter_status())

    async def admin(self, action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            body = admin_body(action, body)
        except ValueError as exc:
            return 400, {"error": str(exc)}
        if action in ("drain", "undrain") and body.get("card"):
            from r9k.deploy.lifecycle import FAULT_FROM_OPS

            try:
                card = self.resolve_card(str(body["card"]), body.get("host") or None)
            except ValueError as exc:
                return 400, {"error": str(exc)}
            if action == "undrain":
                why = self.fences.get(card)
                if why is None or why.startswith(FAULT_FROM_OPS):
                    return 409, {"error": f"card {card_label(card)} is "
                                 + ("not drained" if why is None else
                                    f"fenced by ops ({why}); `r9k ops clear` on {card[0]} returns it")}
                del self.fences[card]
                self._save_operator_fences()
                if self.pool is not None:
                    self.pool.unusable.pop(card, None)
                return 200, {"card": card_label(card), "undrained": True}
            # the ops hook says which event: an ops fence, undone by `r9k ops clear` there
            event = body.get("event")
            why = (FAULT_FROM_OPS + f"ops event {event}" if event
                   else str(body.get("reason") or "drained by operator"))
            drained = self.fence(card, why)
            if not event:
                self._save_operator_fences()
            return 200, {"card": card_label(card), "drained": drained}
        if action == "drain":
            r = self.replicas.get(body.get("replica") or "")
            if r is None:
                return 404, {"error": f"no replica {body.get('replica')!r}; replicas: {', '.join(self.replicas)}"}
            if r.task is not None:
                r.task.cancel()
            self._spawn(r, self.drain(r, "drained by operator"))
            return 200, {"drained": [r.name]}
        if action == "restart":
            return 200, {"restarted": await self.restart_rolling()}
        if action == "down":
            self.down_requested = True
            asyncio.get_running_loop().call_later(0.1, self.stopping.set)
            return 200, {"stopping": True}
        return 404, {"error": f"unknown action {action!r}; expected drain, undrain (card), restart or down"}

    # -- shutdown ---------------------------------------------------------------------------------

    async def stop(self) -> None:
        self.stopping.set()
        if self.monitor_task:
            self.monitor_task.cancel()
        if self.fence_task:
            self.fence_task.cancel()
        for r in self.replicas.values():
            for t in (r.task, r.probe_task):
                if t is not None:
                    t.cancel()
            if r.route is not None:  # nothing in flight outlives the fleet
                r.route.abort("the fleet is stopping")
        await asyncio.gather(*(self._release(r) for r in self.replicas.values()), return_exceptions=True)
        for r in self.replicas.values():
            r.lc.shut_down()
        if self.exporter is not None:
            self.exporter.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
        (self.run_dir / CONTROLLER_FILE).unlink(missing_ok=True)
        if self.started_ray:
            self.ray_side.shutdown()

    async def run_forever(self) -> None:
        await self.start()
        await self.stopping.wait()
        await self.stop()


# What each admin action takes: names and words of bounded length (a reason or event is kept in
# fences.json and shown in status), a card as a PCI address.
_ADMIN_FIELDS: dict[str, dict[str, Any]] = {
    "drain": {"card": BDF_PATTERN, "host": r"[!-~]{1,200}", "event": r"[a-z_]{1,64}",
              "reason": r"[ -~]{1,200}", "replica": r"[!-~]{1,200}"},
    "undrain": {"card": BDF_PATTERN, "host": r"[!-~]{1,200}"},
    "restart": {}, "down": {},
}


def admin_body(action: str, body: dict[str, Any]) -> dict[str, Any]:
    """An admin request's body, checked for its action: every field known, a string matching its
    form (ValueError naming the field, what was given and what was expected). An unknown action
    passes through (answered 404 by the caller)."""
    import re

    fields = _ADMIN_FIELDS.get(action)
    if fields is None:
        return body
    for key, value in body.items():
        if key not in fields:
            raise ValueError(f"{action}: unknown field {key!r}; expected "
                             + (", ".join(fields) if fields else "an empty object"))
        if value is None:
            continue
        if not isinstance(value, str) or not re.fullmatch(fields[key], value):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ValueError(f"{action}: {key} {shown}: expected "
                             + ("a PCI address such as 0000:03:00.0" if key == "card"
                                else f"a string matching {fields[key]}"))
    if action == "drain" and bool(body.get("card")) == bool(body.get("replica")):
        raise ValueError("drain: expected a card or a replica (one of them)")
    if action == "undrain" and not body.get("card"):
        raise ValueError("undrain: expected a card")
    return body
