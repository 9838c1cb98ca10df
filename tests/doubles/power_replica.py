"""A replica double on one fixture card whose speed follows the card's power cap, and whose draw
the card reports: tokens come at `tokens_per_s(cap)` per request, and the fixture's
`power1_average` reads the cap while requests run and for a quarter second after (a card under
load draws up to its cap), `idle_watts` then. Serves /v1/models, streamed /v1/completions with
usage, and /metrics with `vllm:generation_tokens_total`, as vLLM does. No engine."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from aiohttp import web

from r9k.devtools.local_server import free_port


def tokens_per_s(cap_watts: float) -> float:
    """Per request: speed grows with the cap above a floor (steps of 30 W differ by a fifth or
    more, well above the noise of a busy test machine)."""
    return 0.5 * max(cap_watts - 100.0, 10.0)


class PowerReplica:
    def __init__(self, hwmon_dir: Path, model: str = "tiny", idle_watts: float = 40.0) -> None:
        self.hwmon_dir, self.model, self.idle_watts = Path(hwmon_dir), model, idle_watts
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.generated = 0
        self.active = 0
        self._last_cap_watts = self.idle_watts
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._power = threading.Thread(target=self._report_power, daemon=True)

    def cap_watts(self) -> float:
        # the sweep's write (truncate, then write) can be read half-way here; real sysfs cannot,
        # so a torn read keeps the last cap seen
        text = (self.hwmon_dir / "power1_cap").read_text().strip()
        if text.isdigit():
            self._last_cap_watts = int(text) / 1e6
        return self._last_cap_watts

    def _report_power(self) -> None:
        busy_until_s = 0.0
        while not self._stop.wait(0.02):
            # power1_average is an average (about a quarter second here): the moment between one
            # request's end and the next one's start does not read as idle
            if self.active:
                busy_until_s = time.monotonic() + 0.25
            watts = self.cap_watts() if time.monotonic() < busy_until_s else self.idle_watts
            tmp = self.hwmon_dir / f".power1_average.{id(self)}.tmp"  # two doubles may share a card
            tmp.write_text(f"{int(watts * 1e6)}\n")
            tmp.replace(self.hwmon_dir / "power1_average")

    def __enter__(self) -> "PowerReplica":
        self._thread.start()
        assert self._ready.wait(10)
        self._power.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._power.join(5)
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/metrics", self.metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "max_model_len": 4096}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="# TYPE vllm:generation_tokens_total counter\n"
                                 f'vllm:generation_tokens_total{{model_name="{self.model}"}} '
                                 f"{float(self.generated)}\n")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.active += 1
        loop = asyncio.get_running_loop()
        due_s = loop.time()
        try:
            for _ in range(n):
                # paced to deadlines, not by sleeping a whole interval after each token: the time a
                # busy test machine spends between tokens is caught up, so the speed is the cap's
                due_s += 1.0 / tokens_per_s(self.cap_watts())
                await asyncio.sleep(max(0.0, due_s - loop.time()))
                self.generated += 1
                await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
                                 .encode())
        except ConnectionError:  # the client left (a load stopped mid-request)
            return resp
        finally:
            self.active -= 1
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp
