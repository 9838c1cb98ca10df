"""The entry point on any host: the same OpenAI endpoint as the controller's, routing from the
controller's fleet status (`GET /fleet/status`, read every `REFRESH_S`) instead of in-process
state. Stateless: start one on every host (`r9k fleet entry`), put them behind DNS or a load
balancer, and a host's loss takes only its own entry point.

While the controller does not answer, the last routing state it gave is served for
`entry.state_stale_s`, then every request gets 503 naming how long the controller has been
away. A replica that leaves the ready list has its in-flight requests here aborted, as the
controller's own entry point does. Admin actions go to the controller (409 names it).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from r9k.deploy.entry import Route
from r9k.deploy.routing import EngineLoad
from r9k.core.fleet_status import FleetStatus

log = logging.getLogger("r9k.fleet.entry")
REFRESH_S = 1.0
FETCH_TIMEOUT_S = 5.0


class RemoteBackend:
    """`entry.Backend` from the controller's `/fleet/status` (read-only, open like vLLM's
    /metrics); the replicas' key is the fleet's key (the controller gives it to each replica)."""

    def __init__(self, controller_url: str, api_key: str | None, stale_s: float,
                 refresh_s: float = REFRESH_S) -> None:
        if not stale_s > 0 or not refresh_s > 0:
            raise ValueError(f"stale_s {stale_s!r} and refresh_s {refresh_s!r}: expected seconds > 0")
        self.controller_url = controller_url.rstrip("/")
        self.api_key = api_key
        self.stale_s = stale_s
        self.refresh_s = refresh_s
        self.last: FleetStatus | None = None
        self.last_ok: float | None = None        # monotonic time of the last good read
        self.last_error: str | None = None
        self.table: dict[str, Route] = {}        # ready replicas, kept across reads (counts)
        self.task: asyncio.Task | None = None
        self.session: aiohttp.ClientSession | None = None

    # -- refresh ------------------------------------------------------------------------------

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S))
        await self.refresh()
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for route in self.table.values():
            route.abort("the entry point is stopping")
        if self.session is not None:
            await self.session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        assert self.session is not None
        try:
            async with self.session.get(self.controller_url + "/fleet/status") as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                status = FleetStatus.model_validate(await resp.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            if self.fresh is False:
                for route in self.table.values():   # nothing is routed on a state this old
                    route.abort(f"controller {self.controller_url} away: {self.last_error}")
                self.table = {}
            return
        self.apply(status, time.monotonic())

    def apply(self, status: FleetStatus, now: float) -> None:
        """A new view: routes of ready replicas kept (their counts), new ones added, those gone
        from the ready list (or moved to another URL) aborted."""
        ready = {r.name: r for r in status.replicas if r.state == "ready" and r.url}
        for name, route in list(self.table.items()):
            r = ready.get(name)
            if r is None or r.url != route.url:
                route.abort(f"replica {name} is no longer ready")
                del self.table[name]
        for name, r in ready.items():
            if name not in self.table:
                self.table[name] = Route(name, r.model, r.url, api_key=self.api_key, host=r.host)
            load = r.engine_load   # pool-aware routing scores what the controller's probe read
            self.table[name].engine = (None if load is None else EngineLoad(
                load.running, load.waiting, load.kv_usage_ratio, now - load.age_s))
        self.last, self.last_ok, self.last_error = status, now, None

    @property
    def fresh(self) -> bool | None:
        """None: never read; False: older than stale_s."""
        if self.last_ok is None:
            return None
        return time.monotonic() - self.last_ok <= self.stale_s

    # -- Backend ------------------------------------------------------------------------------

    def routes(self, model: str) -> list[Route]:
        if not self.fresh:
            return []
        return [r for r in self.table.values() if r.model == model]

    def model_names(self) -> list[str]:
        if self.last is None:
            return []
        return list(dict.fromkeys(r.model for r in self.last.replicas + self.last.stopped))

    def max_model_len(self, model: str) -> int | None:
        if self.last is None:
            return None
        return next((r.max_model_len for r in self.last.replicas + self.last.stopped
                     if r.model == model), None)

    def states_line(self, model: str) -> str:
        if not self.fresh:
            age = ("never reached" if self.last_ok is None
                   else f"away for {time.monotonic() - self.last_ok:.0f} s")
            return (f"the controller at {self.controller_url} is {age} "
                    f"({self.last_error or 'no answer'}); last state kept {self.stale_s:g} s")
        assert self.last is not None
        rs = [r for r in self.last.replicas + self.last.stopped if r.model == model]
        return ", ".join(f"{r.name} {r.state or 'stopped'}"
                         + (f" ({r.reason})" if r.reason and r.state != "ready" else "")
                         for r in rs) or "no replicas configured"

    def status(self) -> FleetStatus:
        if self.last is None:
            return FleetStatus(replicas=[], stopped=[], cards=[], capacity={}, entry=self.controller_url)
        return self.last

    async def admin(self, action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 409, {"error": f"this entry point only routes; send {action} to the controller at "
                              f"{self.controller_url} (r9k fleet {action} --url {self.controller_url})"}
