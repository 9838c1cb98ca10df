"""Doubles for entry-point tests: aiohttp apps served on loopback from an asyncio loop in a
thread, and a `Backend` table of replicas set by hand (no Ray, no engine)."""
from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from r9k.deploy.entry import EntryPoint, Route, serve
from r9k.devtools.local_server import free_port
from r9k.core.fleet_status import FleetStatus, ReplicaStatus


class LoopServers:
    """Serves aiohttp apps and entry points on free loopback ports; `close()` stops them all."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runners: list[web.AppRunner] = []

    def run(self, coro, timeout_s: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def app(self, app: web.Application) -> str:
        port = free_port()
        runner = web.AppRunner(app)
        self.run(runner.setup())
        self.run(web.TCPSite(runner, "127.0.0.1", port).start())
        self.runners.append(runner)
        return f"http://127.0.0.1:{port}"

    def entry(self, entry: EntryPoint) -> str:
        port = free_port()
        self.runners.append(self.run(serve(entry, "127.0.0.1", port)))
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        for r in self.runners:
            self.run(r.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)


class Table:
    """A Backend: replicas by hand (`ready` names the ready ones); admin calls recorded."""

    def __init__(self, routes: list[Route]) -> None:
        self.all = routes
        self.ready = {r.name for r in routes}
        self.calls: list[tuple[str, dict]] = []

    def routes(self, model):
        return [r for r in self.all if r.model == model and r.name in self.ready]

    def model_names(self):
        return ["m", "other"]

    def max_model_len(self, model):
        return {"m": 4096, "other": 2048}.get(model)

    def states_line(self, model):
        return ", ".join(f"{r.name} {'ready' if r.name in self.ready else 'loading'}"
                         for r in self.all if r.model == model) or "no replicas configured"

    def status(self):
        return FleetStatus(replicas=[ReplicaStatus(name=r.name, url=r.url, model=r.model,
                                                   state="ready" if r.name in self.ready else "loading",
                                                   tp=1, num_spec=3, page_mode="onepage",
                                                   cards=["0000:03:00.0"]) for r in self.all])

    async def admin(self, action, body):
        self.calls.append((action, body))
        return 200, {"drained": ["m-0"]} if action == "drain" else {"restarted": []}
