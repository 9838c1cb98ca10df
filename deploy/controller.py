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
from r9k.deploy.entry import Backend, EntryPoint, Route, serve
from r9k.deploy.routing import EngineLoad
from r9k.deploy.lifecycle import (LOADING, PROBED_STATES, READY, STOPPED, Action, Fail, KillEngine,
                                  Note, Observation, Replace, ReplicaLifecycle, RestartAfter,
                                  RollingRestart, StartEngine, ops_fence_changes, replicas_to_drain)
from r9k.deploy.placement import (Assignment, CardPool, PlacementError, ReplicaSlot, check_fits,
                                  place_one, plan_placement, replica_slots, unusable_cards)
from r9k.deploy.probes import HttpProbe
from r9k.fleet_status import CardStatus, ExporterStatus, FleetStatus, PlanStatus, ReplicaStatus
from r9k.http_client import host_url
from r9k.deploy.ray_backend import RayReplica
from r9k.vllm_metrics import VllmMetrics, parse_vllm_metrics

log = logging.getLogger("r9k.fleet")
CONTROLLER_FILE = "controller.json"
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
    history: list[str] = field(default_factory=list)

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
        self.pool: CardPool | None = None
        self.entry = EntryPoint(self, api_key=self.api_key, routing=cfg.entry.routing,
                                prefix_chars=cfg.entry.prefix_chars)
        self.runner = None
        self.session: aiohttp.ClientSession | None = None
        self.probe: HttpProbe | None = None
        self.monitor_task: asyncio.Task | None = None
        self.exporter = (ExporterSidecar(cfg.exporter, cfg.health, self.run_dir,
                                         f"{self.url}/fleet/status")
                         if cfg.exporter is not None else None)
        self.started_ray = False
        self.stopping = asyncio.Event()
        self.plans = {m.name: planned_pool(m, cfg) for m in cfg.models}

    # -- start-up ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return host_url(self.cfg.entry.host, self.cfg.entry.port)

    def ops_unhealthy(self) -> dict[str, str]:
        from r9k.ops.state import read_card_states

        return read_card_states(self.cfg.ops_state_dir).unhealthy()  # corrupt card files count as fenced

    async def start(self) -> None:
        """Validate against the cluster (raises before anything starts), adopt the replicas a
        previous controller left running, place and launch the rest, serve the entry point."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_ray = self.ray_side.connect(self.cfg)
        self.hosts = await self.ray_side.inventory(self.cfg)
        unusable = unusable_cards(self.cfg, self.ops_unhealthy())
        check_fits(self.cfg, self.hosts, unusable)
        self.pool = CardPool(self.hosts, unusable)
        slots = replica_slots(self.cfg)
        adopted = await adoptable(self.cfg, self.ray_side, self.hosts, self.pool, slots,
                                  self.api_key)
        for name, (a, _, _) in adopted.items():
            for bdf in a.cards:
                self.pool.in_use[bdf] = name
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
        self.runner = await serve(self.entry, self.cfg.entry.host, self.cfg.entry.port)
        for name, r in self.replicas.items():
            if name not in adopted:
                self._spawn(r, self._launch(r))
        self.monitor_task = asyncio.create_task(self._monitor())
        if self.exporter is not None:
            self.exporter.start()
        (self.run_dir / CONTROLLER_FILE).write_text(json.dumps(
            {"pid": os.getpid(), "url": self.url, "config": self.config_path}))

    def _launch_spec(self, model: ModelSpec, a: Assignment) -> tuple[list[str], dict[str, str], dict]:
        return launch_spec(model, self.cfg, a, self.hosts, self.api_key)

    def _adopt(self, r: Replica, rr: RayReplica, desc: dict) -> None:
        """A running engine from a previous controller: routed once probed ready (the page proof
        runs again), its pid unchanged."""
        eng = desc["engine"]
        r.ray = rr
        r.route = Route(r.name, r.model.name, eng["url"], api_key=self.api_key)
        r.pid, r.engine_pids = eng["pid"], desc.get("engine_pids") or []
        self._note(r, r.lc.adopted(time.monotonic(), eng["start"], eng["pid"], eng["url"]))

    def exporter_status(self) -> ExporterStatus | None:
        return self.exporter.status() if self.exporter is not None else None

    # -- carrying out the lifecycle's actions -----------------------------------------------------

    def _spawn(self, r: Replica, coro: Coroutine) -> None:
        r.task = asyncio.create_task(self._guard(r, coro))

    async def _guard(self, r: Replica, coro: Coroutine) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a lifecycle step failed: the replica says why
            self._note(r, r.lc.step_failed(f"{type(exc).__name__}: {exc}"))
        finally:
            r.task = None

    def _note(self, r: Replica, actions: list[Action]) -> None:
        """Actions that need no waiting: notes, and failures (each in the replica's own task)."""
        for a in actions:
            if isinstance(a, Note):
                r.event(a.text)
            elif isinstance(a, Fail):
                self._spawn(r, self._fail(r, a.reason))
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
        r.route = Route(r.name, r.model.name, info["url"], api_key=self.api_key)
        r.pid = info["pid"]
        self._note(r, r.lc.engine_started(time.monotonic(), info["start"], info["pid"], info["url"], info["log"]))

    async def _release(self, r: Replica) -> None:
        if r.ray is not None:
            await r.ray.release(self.cfg.health.drain_timeout_s)
        r.ray = r.route = None
        r.pid, r.engine_pids = None, []
        if self.pool is not None and r.assignment is not None:
            for bdf in r.assignment.cards:
                self.pool.in_use.pop(bdf, None)

    async def _fail(self, r: Replica, reason: str) -> None:
        await self._carry_out(r, r.lc.fail(time.monotonic(), reason))

    async def _replace(self, r: Replica, why: str) -> None:
        assert self.pool is not None
        try:
            r.assignment = place_one(ReplicaSlot(r.name, r.model.name, r.model.tp), self.pool, self.cfg.platform)
        except PlacementError as exc:
            self._note(r, r.lc.not_placed(why, str(exc)))
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
        while not self.stopping.is_set():
            try:
                if self.exporter is not None and not self.stopping.is_set():
                    self.exporter.supervise()
                self._ops_poll()
                await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())
                                       if r.task is None and r.lc.state in PROBED_STATES))
            except Exception:
                log.exception("health tick failed")
            try:
                await asyncio.wait_for(self.stopping.wait(), self.cfg.health.probe_interval_s)
            except asyncio.TimeoutError:
                pass

    def _ops_poll(self) -> None:
        """Cards ops fenced: not placed on again; replicas on them drained and placed elsewhere."""
        if self.pool is None:
            return
        try:
            unhealthy = self.ops_unhealthy()
        except OSError:
            return
        fence, unfence = ops_fence_changes(unhealthy, self.pool.unusable)
        for bdf, why in fence.items():
            self.fence(bdf, why)
        for bdf in unfence:
            del self.pool.unusable[bdf]   # `r9k ops clear` returned it

    def fence(self, bdf: str, why: str) -> list[str]:
        """Mark a card unusable and drain (then re-place) every replica on it."""
        if self.pool is not None and bdf not in self.pool.unusable:
            self.pool.unusable[bdf] = why
        cards = {n: r.assignment.cards for n, r in self.replicas.items() if r.assignment}
        drained = replicas_to_drain(bdf, cards, {n: r.lc for n, r in self.replicas.items()})
        for name in drained:
            r = self.replicas[name]
            if r.task is not None:
                r.task.cancel()
            self._spawn(r, self.drain(r, f"card {bdf} fenced: {why}", replace=True))
        return drained

    async def _probe(self, r: Replica) -> None:
        """One look at a replica: supervisor report, /health, /metrics once; the lifecycle decides."""
        assert r.ray is not None and r.route is not None and self.probe is not None
        now = time.monotonic()
        try:
            st = await r.ray.status(SUPERVISOR_TIMEOUT_S)
        except Exception as exc:
            self._note(r, r.lc.observe(now, Observation(supervisor_error=type(exc).__name__)))
            return
        r.engine_pids = st["engine_pids"]
        if not st["alive"]:
            self._note(r, r.lc.observe(now, Observation(alive=False, returncode=st["returncode"])))
            return
        heartbeat = await self.probe.heartbeat(r.route.url, min(5.0, self.cfg.health.heartbeat_timeout_s))
        loading = r.lc.state == LOADING
        text = await self.probe.metrics_text(r.route.url) if heartbeat or not loading else None
        # an unreadable /metrics while loading fails the proof (no cache_config_info), as before
        proof = (prove_pages(text or "", self.plans[r.model.name], r.model.gdn_state)
                 if loading and heartbeat else None)
        counters = _counters(text) if text and not loading else None
        if counters is not None and None not in (counters.running, counters.waiting,
                                                 counters.kv_usage_ratio):
            # the router scores replicas by the engine's own pool and queue
            r.route.engine = EngineLoad(counters.running, counters.waiting,
                                        counters.kv_usage_ratio, now)
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
            reason=lc.reason, page_reason=proof.reason if proof else None, kv=proof,
            starts=lc.starts, restarts=lc.restarts, failures=lc.failures,
            outstanding=r.route.outstanding if r.route else 0,
            served=r.route.served if r.route else 0,
            pid=r.pid, engine_pids=r.engine_pids, history=r.history[-8:],
            rccl_env=rccl_env(m, self.cfg))

    def status(self) -> FleetStatus:
        live = [self.describe(r) for r in self.replicas.values() if r.lc.state != STOPPED and r.route]
        stopped = [self.describe(r) for r in self.replicas.values() if r.lc.state == STOPPED or not r.route]
        cards = [CardStatus(bdf=c.bdf, host=h.name,
                            replica=self.pool.in_use.get(c.bdf) if self.pool else None,
                            usable=not (self.pool and c.bdf in self.pool.unusable),
                            reason=self.pool.unusable.get(c.bdf) if self.pool else None)
                 for h in self.hosts for c in h.cards]
        plans = {name: PlanStatus(stock_tokens=p.stock.tokens, onepage_tokens=p.onepage.tokens,
                                  stock_blocks=p.stock.num_blocks, onepage_blocks=p.onepage.num_blocks)
                 for name, p in self.plans.items()}
        return FleetStatus(replicas=live, stopped=stopped, cards=cards, capacity=plans, entry=self.url,
                           exporter=self.exporter_status())

    async def admin(self, action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if action == "drain":
            if body.get("card"):
                drained = self.fence(body["card"], str(body.get("reason") or "drained by operator"))
                return 200, {"card": body["card"], "drained": drained}
            r = self.replicas.get(body.get("replica", ""))
            if r is None:
                return 404, {"error": f"no replica {body.get('replica')!r}; replicas: {', '.join(self.replicas)}"}
            if r.task is not None:
                r.task.cancel()
            self._spawn(r, self.drain(r, "drained by operator"))
            return 200, {"drained": [r.name]}
        if action == "restart":
            return 200, {"restarted": await self.restart_rolling()}
        if action == "down":
            asyncio.get_running_loop().call_later(0.1, self.stopping.set)
            return 200, {"stopping": True}
        return 404, {"error": f"unknown action {action!r}; expected drain, restart or down"}

    # -- shutdown ---------------------------------------------------------------------------------

    async def stop(self) -> None:
        self.stopping.set()
        if self.monitor_task:
            self.monitor_task.cancel()
        for r in self.replicas.values():
            if r.task is not None:
                r.task.cancel()
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
