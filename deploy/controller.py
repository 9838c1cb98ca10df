"""The fleet controller: connects Ray, places replicas, supervises them, drains, restarts, and
serves the entry point. One asyncio loop; Ray calls are awaited.

Replica states (monitoring's vocabulary) ``loading | ready | draining | unhealthy``, plus
``stopped`` (drained, holds no cards; not listed to the exporter).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from r9k.deploy.config import HOST_LABEL, CardSpec, FleetConfig, HostSpec, ModelSpec
from r9k.deploy.engine import PageProof, engine_argv, engine_env, planned_pool, prove_pages
from r9k.deploy.entry import Backend, EntryPoint, Route, serve
from r9k.deploy.health import HealthLimits, ReadyHealth, parse_counters, restart_backoff_s
from r9k.deploy.placement import (Assignment, CardPool, PlacementError, ReplicaSlot, check_fits,
                                  place_one, placement_group_args, plan_placement, replica_slots,
                                  unusable_cards)

log = logging.getLogger("r9k.fleet")
CONTROLLER_FILE = "controller.json"
FAULT_FROM_OPS = "ops: "
# A plugin that did not load is usually a broken install (restarts will not help), but an
# install being rewritten under a starting engine is transient: allow a couple of tries.
MAX_PAGE_FAILURES = 3


def default_run_dir() -> Path:
    return Path(os.environ.get("R9K_FLEET_RUN_DIR") or Path.home() / ".local/state/r9k/fleet")


@dataclass
class Replica:
    name: str
    model: ModelSpec
    assignment: Assignment | None
    state: str = "stopped"
    reason: str | None = None
    route: Route | None = None
    actor: Any = None
    pg: Any = None
    pid: int | None = None
    engine_pids: list[int] = field(default_factory=list)
    proof: PageProof | None = None
    starts: int = 0
    restarts: int = 0
    failures: int = 0
    started_at: float | None = None
    ready_at: float | None = None
    health: ReadyHealth | None = None
    task: asyncio.Task | None = None      # launch / restart / drain in progress
    page_failures: int = 0                # consecutive failed page proofs
    page_failed: bool = False             # proof failed MAX_PAGE_FAILURES times: no more restarts
    history: list[str] = field(default_factory=list)

    def event(self, text: str) -> None:
        self.history.append(f"{time.strftime('%H:%M:%S')} {text}")
        del self.history[:-20]
        log.info("%s: %s", self.name, text)


class FleetController(Backend):
    def __init__(self, cfg: FleetConfig, run_dir: Path | None = None, config_path: str | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run_dir or default_run_dir())
        self.config_path = config_path
        self.api_key = cfg.api_key()
        self.replicas: dict[str, Replica] = {}
        self.hosts: list[HostSpec] = []
        self.pool: CardPool | None = None
        self.entry = EntryPoint(self, api_key=self.api_key)
        self.runner = None
        self.session: aiohttp.ClientSession | None = None
        self.monitor_task: asyncio.Task | None = None
        self.exporter = None
        self.started_ray = False
        self.stopping = asyncio.Event()
        self.plans = {m.name: planned_pool(m, cfg) for m in cfg.models}
        self.limits = HealthLimits(cfg.health.heartbeat_timeout_s, cfg.health.progress_timeout_s,
                                   cfg.health.grace_after_ready_s)

    # -- start-up ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.cfg.entry.host}:{self.cfg.entry.port}"

    def connect_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.cfg.ray.address == "local":
            if len(self.cfg.hosts) > 1:
                raise PlacementError("ray.address local starts one host; the file lists "
                                     f"{len(self.cfg.hosts)} hosts: join a cluster (ray.address: auto)")
            host = self.cfg.hosts[0].name if self.cfg.hosts else os.uname().nodename
            ncards = len(self.cfg.hosts[0].cards) if self.cfg.hosts else len(_local_cards())
            ray.init(num_cpus=self.cfg.ray.num_cpus, resources={self.cfg.placement.card_resource: ncards},
                     labels={HOST_LABEL: host}, include_dashboard=False, namespace=self.cfg.ray.namespace,
                     log_to_driver=False, configure_logging=False)
            self.started_ray = True
        else:
            ray.init(address=self.cfg.ray.address, namespace=self.cfg.ray.namespace, log_to_driver=False,
                     configure_logging=False)

    def inventory(self) -> list[HostSpec]:
        """The fleet file's hosts that are Ray nodes now (by label), else discovered on the nodes."""
        import ray

        resource = self.cfg.placement.card_resource
        nodes = {n["Labels"].get(HOST_LABEL): n for n in ray.nodes()
                 if n["Alive"] and n["Resources"].get(resource, 0) > 0 and n.get("Labels", {}).get(HOST_LABEL)}
        if self.cfg.hosts:
            return [h for h in self.cfg.hosts if h.name in nodes]
        return [discover_host(name, node["NodeID"]) for name, node in sorted(nodes.items())]

    def ops_unhealthy(self) -> dict[str, str]:
        from r9k.ops.state import read_card_states

        return {b: s.unhealthy_reason or "unhealthy" for b, s in read_card_states(self.cfg.ops_state_dir).items()
                if not s.healthy}

    def plan(self) -> dict[str, Assignment]:
        """Validate against the cluster and place every replica; raises before anything starts."""
        self.hosts = self.inventory()
        unusable = unusable_cards(self.cfg, self.ops_unhealthy())
        check_fits(self.cfg, self.hosts, unusable)
        self.pool = CardPool(self.hosts, unusable)
        return plan_placement(replica_slots(self.cfg), self.pool, self.cfg.platform)

    async def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.connect_ray()
        assignments = self.plan()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self.runner = await serve(self.entry, self.cfg.entry.host, self.cfg.entry.port)
        for name, a in assignments.items():
            r = Replica(name, self.cfg.model(a.model), a)
            self.replicas[name] = r
            self._spawn(r, self._launch(r))
        self.monitor_task = asyncio.create_task(self._monitor())
        self._start_exporter()
        (self.run_dir / CONTROLLER_FILE).write_text(json.dumps(
            {"pid": os.getpid(), "url": self.url, "config": self.config_path}))

    def _start_exporter(self) -> None:
        if self.cfg.exporter is None:
            return
        import subprocess
        import sys

        argv = [sys.executable, "-c", "from r9k.cli import main; main()", "exporter", "--port", str(self.cfg.exporter.port),
                "--listen", self.cfg.exporter.listen, "--fleet", f"{self.url}/fleet/status",
                "--state-dir", self.cfg.ops_state_dir]
        self.exporter = subprocess.Popen(argv, stdout=open(self.run_dir / "exporter.log", "w"),
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    # -- replica lifecycle ------------------------------------------------------------------------

    def _spawn(self, r: Replica, coro) -> None:
        r.task = asyncio.create_task(self._guard(r, coro))

    async def _guard(self, r: Replica, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a lifecycle step failed: the replica says why
            r.state, r.reason = "unhealthy", f"{type(exc).__name__}: {exc}"
            r.event(f"lifecycle error: {r.reason}")
            r.failures += 1
        finally:
            r.task = None

    async def _launch(self, r: Replica) -> None:
        """Placement group on the assigned cards, supervisor actor in it, engine started."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from r9k.deploy.supervisor import ReplicaSupervisor

        a = r.assignment
        r.state, r.reason = "loading", f"placing on {a.host} {','.join(a.cards)}"
        pg = placement_group(**placement_group_args(a, self.cfg))
        try:
            await asyncio.wait_for(pg.ready(), timeout=120)
        except asyncio.TimeoutError:
            ray.util.remove_placement_group(pg)
            raise PlacementError(f"placement group for {a.host} {','.join(a.cards)} not ready after 120 s")
        r.pg = pg
        host_cards = [c.bdf for h in self.hosts if h.name == a.host for c in h.cards]
        env = engine_env(r.model, self.cfg, a, host_cards)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        argv = engine_argv(r.model, self.cfg, "{host}", "{port}")
        r.actor = ReplicaSupervisor.options(
            name=f"r9k-{r.name}-{time.monotonic_ns()}", num_cpus=0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            runtime_env={"env_vars": env},
        ).remote(r.name, argv, str(self.run_dir / "logs"), self.cfg.replica_bind, self.cfg.port_range,
                 self._port(r))
        await self._start_engine(r)

    def _port(self, r: Replica) -> int:
        """Each replica its own port in the range (replicas of one host must not race for one)."""
        lo, _ = self.cfg.port_range
        return lo + list(self.replicas).index(r.name)

    async def _start_engine(self, r: Replica) -> None:
        info = await r.actor.start.remote()
        r.starts += 1
        r.route = Route(r.name, r.model.name, info["url"], api_key=self.api_key)
        r.pid, r.proof, r.health, r.ready_at = info["pid"], None, None, None
        r.state, r.reason, r.started_at = "loading", f"engine starting ({info['log']})", time.monotonic()
        r.event(f"engine start {info['start']} pid {info['pid']} at {info['url']}")

    async def _release(self, r: Replica) -> None:
        import ray

        if r.actor is not None:
            try:
                await r.actor.stop.remote(self.cfg.health.drain_timeout_s)
            except Exception:  # the actor (or its node) is gone already
                pass
            ray.kill(r.actor)
        if r.pg is not None:
            ray.util.remove_placement_group(r.pg)
        r.actor = r.pg = r.route = None
        r.pid, r.engine_pids = None, []
        if self.pool is not None and r.assignment is not None:
            for bdf in r.assignment.cards:
                self.pool.in_use.pop(bdf, None)

    async def _fail(self, r: Replica, reason: str) -> None:
        """Unhealthy: kill the engine, restart it on the same cards after the backoff."""
        now = time.monotonic()
        if r.ready_at is not None and now - r.ready_at > self.cfg.health.stable_after_s:
            r.failures = 0
        r.failures += 1
        r.state, r.reason = "unhealthy", reason
        r.event(f"unhealthy: {reason}")
        delay = restart_backoff_s(r.failures, self.cfg.health.restart_backoff_s,
                                  self.cfg.health.restart_backoff_max_s)
        actor_alive = True
        try:
            await r.actor.kill.remote()
        except Exception:
            actor_alive = False
        if r.page_failed:
            return  # the plugin is not active: a restart would be stock again
        await asyncio.sleep(delay)
        if self.stopping.is_set() or r.state != "unhealthy":
            return
        r.restarts += 1
        if actor_alive:
            await self._start_engine(r)
        else:  # node or actor lost: place again
            await self._release(r)
            await self._replace(r, "supervisor lost")

    async def _replace(self, r: Replica, why: str) -> None:
        try:
            r.assignment = place_one(ReplicaSlot(r.name, r.model.name, r.model.tp), self.pool, self.cfg.platform)
        except PlacementError as exc:
            r.state, r.reason = "stopped", f"{why}; not placed again: {exc}"
            r.event(r.reason)
            return
        r.event(f"placed on {r.assignment.host} {','.join(r.assignment.cards)} ({why})")
        await self._launch(r)

    async def drain(self, r: Replica, reason: str, replace: bool = False) -> None:
        """Stop routing, let in-flight requests finish (up to drain_timeout_s), stop the replica."""
        r.state, r.reason = "draining", reason
        r.event(f"draining: {reason}")
        deadline = time.monotonic() + self.cfg.health.drain_timeout_s
        while r.route is not None and r.route.outstanding > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await self._release(r)
        r.state = "stopped"
        r.event("stopped")
        if replace and not self.stopping.is_set():
            await self._replace(r, reason)

    async def restart_rolling(self) -> list[str]:
        """One replica at a time on its own cards: drain, restart, wait until ready."""
        done = []
        for r in list(self.replicas.values()):
            if r.state != "ready" or r.task is not None:
                continue
            r.state, r.reason = "draining", "rolling restart"
            r.event("rolling restart: draining")
            deadline = time.monotonic() + self.cfg.health.drain_timeout_s
            while r.route.outstanding > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await r.actor.stop.remote(self.cfg.health.drain_timeout_s)
            r.restarts += 1
            await self._start_engine(r)
            while r.state == "loading" and not self.stopping.is_set():
                await asyncio.sleep(0.5)
            done.append(f"{r.name}: {r.state}")
            if r.state != "ready":
                break  # do not take down the next one while this one is not back
        return done

    # -- health -----------------------------------------------------------------------------------

    async def _monitor(self) -> None:
        while not self.stopping.is_set():
            try:
                self._ops_poll()
                await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())
                                       if r.task is None and r.state in ("loading", "ready")))
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
        for bdf, why in unhealthy.items():
            self.fence(bdf, FAULT_FROM_OPS + why)
        for bdf in [b for b, why in self.pool.unusable.items() if why.startswith(FAULT_FROM_OPS)]:
            if bdf not in unhealthy:
                del self.pool.unusable[bdf]   # `r9k ops clear` returned it

    def fence(self, bdf: str, why: str) -> list[str]:
        """Mark a card unusable and drain (then re-place) every replica on it."""
        if self.pool is not None and bdf not in self.pool.unusable:
            self.pool.unusable[bdf] = why
        drained = []
        for r in self.replicas.values():
            if r.assignment and bdf in r.assignment.cards and r.state not in ("stopped", "draining"):
                if r.task is not None:
                    r.task.cancel()
                self._spawn(r, self.drain(r, f"card {bdf} fenced: {why}", replace=True))
                drained.append(r.name)
        return drained

    async def _http_ok(self, url: str, timeout_s: float) -> bool:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _metrics(self, r: Replica) -> str | None:
        try:
            async with self.session.get(r.route.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def _probe(self, r: Replica) -> None:
        now = time.monotonic()
        try:
            st = await asyncio.wait_for(r.actor.status.remote(), timeout=10)
        except Exception as exc:
            self._spawn(r, self._fail(r, f"supervisor lost: {type(exc).__name__}"))
            return
        r.engine_pids = st["engine_pids"]
        if not st["alive"]:
            self._spawn(r, self._fail(r, f"engine process exited with {st['returncode']}"))
            return
        heartbeat = await self._http_ok(r.route.url + "/health", min(5.0, self.cfg.health.heartbeat_timeout_s))
        if r.state == "loading":
            if heartbeat:
                await self._prove(r)
            elif now - r.started_at > self.cfg.health.startup_timeout_s:
                self._spawn(r, self._fail(r, f"not ready after {self.cfg.health.startup_timeout_s:.0f} s"))
            return
        text = await self._metrics(r)
        counters = parse_counters(text) if text else None
        verdict = r.health.observe(now, alive=True, heartbeat_ok=heartbeat, counters=counters,
                                   in_flight=r.route.outstanding)
        if verdict and r.state == "ready":
            self._spawn(r, self._fail(r, verdict))

    async def _prove(self, r: Replica) -> None:
        from r9k.monitoring.replicas import parse_vllm_metrics

        text = await self._metrics(r)
        metrics = parse_vllm_metrics(text) if text else None
        num_blocks = metrics.num_blocks if metrics else None
        log_text = await r.actor.read_log.remote()
        r.proof = prove_pages(log_text, num_blocks, self.plans[r.model.name], r.model.gdn_state,
                              block_size=metrics.block_size if metrics else None)
        if not r.proof.ok:
            r.page_failures += 1
            r.page_failed = r.page_failures >= MAX_PAGE_FAILURES
            self._spawn(r, self._fail(r, f"page proof failed: {r.proof.reason}"))
            return
        r.page_failures = 0
        r.state, r.reason, r.ready_at = "ready", r.proof.reason, time.monotonic()
        r.health = ReadyHealth(self.limits, r.ready_at)
        r.event(f"ready, {r.proof.page_mode} pages: {num_blocks} blocks (planner {r.proof.planned_blocks}), "
                f"after {r.ready_at - r.started_at:.0f} s")

    # -- Backend (entry point) --------------------------------------------------------------------

    def routes(self, model: str) -> list[Route]:
        return [r.route for r in self.replicas.values()
                if r.model.name == model and r.state == "ready" and r.route is not None]

    def model_names(self) -> list[str]:
        return [m.name for m in self.cfg.models]

    def states_line(self, model: str) -> str:
        rs = [r for r in self.replicas.values() if r.model.name == model]
        return ", ".join(f"{r.name} {r.state}" + (f" ({r.reason})" if r.reason and r.state != "ready" else "")
                         for r in rs) or "no replicas configured"

    def describe(self, r: Replica) -> dict[str, Any]:
        m = r.model
        proof = r.proof
        return {
            "name": r.name, "url": r.route.url if r.route else None, "model": m.name,
            "model_config": str(m.resolved_path(self.cfg.base_dir)), "tp": m.tp, "num_spec": m.num_spec,
            "page_mode": proof.page_mode if proof and proof.page_mode in ("stock", "onepage") else None,
            "platform": self.cfg.platform, "max_model_len": m.max_model_len,
            "state": r.state if r.state != "stopped" else None,
            "cards": list(r.assignment.cards) if r.assignment else [],
            "host": r.assignment.host if r.assignment else None,
            "reason": r.reason, "page_reason": proof.reason if proof else None,
            "kv": proof.to_json() if proof else None,
            "starts": r.starts, "restarts": r.restarts, "failures": r.failures,
            "outstanding": r.route.outstanding if r.route else 0,
            "served": r.route.served if r.route else 0,
            "pid": r.pid, "engine_pids": r.engine_pids, "history": r.history[-8:],
        }

    def status(self) -> dict[str, Any]:
        live = [self.describe(r) for r in self.replicas.values() if r.state != "stopped" and r.route]
        stopped = [self.describe(r) for r in self.replicas.values() if r.state == "stopped" or not r.route]
        cards = []
        for h in self.hosts:
            for c in h.cards:
                cards.append({"bdf": c.bdf, "host": h.name,
                              "replica": self.pool.in_use.get(c.bdf) if self.pool else None,
                              "usable": not (self.pool and c.bdf in self.pool.unusable),
                              "reason": self.pool.unusable.get(c.bdf) if self.pool else None})
        plans = {name: {"stock_tokens": p.stock.tokens, "onepage_tokens": p.onepage.tokens,
                        "stock_blocks": p.stock.num_blocks, "onepage_blocks": p.onepage.num_blocks}
                 for name, p in self.plans.items()}
        return {"replicas": live, "stopped": stopped, "cards": cards, "capacity": plans, "entry": self.url}

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
        import ray

        self.stopping.set()
        if self.monitor_task:
            self.monitor_task.cancel()
        for r in self.replicas.values():
            if r.task is not None:
                r.task.cancel()
        await asyncio.gather(*(self._release(r) for r in self.replicas.values()), return_exceptions=True)
        for r in self.replicas.values():
            r.state = "stopped"
        if self.exporter is not None:
            self.exporter.terminate()
            self.exporter.wait(timeout=10)
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
        (self.run_dir / CONTROLLER_FILE).unlink(missing_ok=True)
        if self.started_ray:
            ray.shutdown()

    async def run_forever(self) -> None:
        await self.start()
        await self.stopping.wait()
        await self.stop()


def _local_cards() -> list[str]:
    from r9k.ops.sysfs import discover_cards

    return [c.bdf for c in discover_cards("/") if getattr(c, "is_r9700", False)]


def discover_host(name: str, node_id: str) -> HostSpec:
    """Ask the node itself which R9700s it has (sysfs, through ops)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cards = ray.get(ray.remote(num_cpus=0)(_local_cards).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote())
    return HostSpec(name=name, cards=[CardSpec(bdf=b) for b in cards])
