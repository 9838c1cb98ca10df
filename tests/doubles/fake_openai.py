"""A small OpenAI-compatible server on loopback for the bench tool tests (no engine).

Answers are a deterministic function of the prompt; `behaviour` switches on faults: wrong
answers every Nth request, non-JSON answers, dying after N requests (the listener closes, so
later requests are refused), and vLLM's 400 for over-long prompts.
"""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from r9k.devtools.local_server import free_port

OVER_LENGTH = ("This model's maximum context length is {n} tokens. However, your prompt contains "
               "at least {p} input tokens, which exceeds this limit even without any output tokens.")


def prompt_hash(prompt: str) -> int:
    return sum(prompt.encode()) % 251


def answer_ids(prompt: str, n: int) -> list[int]:
    h = prompt_hash(prompt)
    return [(h + 7 * j) % 256 for j in range(n)]


def margins(prompt: str, n: int) -> list[float]:
    """Top-1 minus top-2 per step: prompts with hash % 4 == 0 are unstable from step 2,
    hash % 4 == 1 from step 6, the rest stable."""
    h = prompt_hash(prompt)
    cut = {0: 2, 1: 6}.get(h % 4, n)
    return [1.0 if j < cut else 0.05 for j in range(n)]


class FakeOpenAI:
    def __init__(self, max_model_len: int = 4096, model: str = "fake", token_delay_s: float = 0.0,
                 port: int | None = None):
        self.max_model_len, self.model, self.token_delay_s = max_model_len, model, token_delay_s
        self.behaviour: dict = {}
        self.completions = 0
        self.peers: list[tuple] = []  # each completion's client address (host, port)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metric_value = 1000.0
        self.metric_step = 0.0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._stopping: asyncio.Future | None = None

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self._loop.is_running():
            async def stopped() -> None:
                await self._stop_serving()

            try:
                asyncio.run_coroutine_threadsafe(stopped(), self._loop).result(30)
            finally:  # the loop stops whatever the cleanup raised
                self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _stop_serving(self) -> asyncio.Future:
        """One cleanup of the server, however many callers ask (a dying server's requests and
        the shutdown): a second cleanup racing the first fails on the half-closed runner."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._runner.cleanup())
        return self._stopping

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/metrics", self.metrics)
        # dying is abrupt, like a killed server: aiohttp's graceful shutdown would hold requests
        # that arrive on kept-alive connections for its default 60 s
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "max_model_len": self.max_model_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        self.metric_value += self.metric_step
        return web.Response(text=f"# TYPE r9k_gpu_vram_used_bytes gauge\n"
                                 f'r9k_gpu_vram_used_bytes{{bdf="0000:03:00.0"}} {self.metric_value}\n'
                                 f'r9k_gpu_vram_used_bytes{{bdf="0000:04:00.0"}} 5\n')

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.completions += 1
        self.peers.append(request.transport.get_extra_info("peername"))
        n_req = self.completions
        b = self.behaviour
        die_after = b.get("die_after")
        if die_after is not None and n_req > die_after:
            self._stop_serving()
            raise ConnectionResetError("dying")
        if b.get("non_json"):
            return web.Response(text="<html>upstream hiccup</html>", content_type="text/html")
        body = await request.json()
        prompt, n = body["prompt"], int(body["max_tokens"])
        if len(prompt) >= self.max_model_len:
            return web.json_response({"error": {"message": OVER_LENGTH.format(
                n=self.max_model_len, p=len(prompt)), "type": "BadRequestError", "code": 400}},
                status=400)
        ids = answer_ids(prompt, n)
        wrong_every = b.get("wrong_every")
        if wrong_every and n_req % wrong_every == 0:
            ids = ids[:-1] + [(ids[-1] + 1) % 256]
        text = "".join(chr(65 + i % 26) for i in ids)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for ch in text:
                await asyncio.sleep(self.token_delay_s)
                await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': ch}]})}\n\n".encode())
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        await asyncio.sleep(self.token_delay_s * n)
        choice: dict = {"index": 0, "text": text, "token_ids": ids, "finish_reason": "length"}
        if body.get("logprobs"):
            ms = margins(prompt, n)
            choice["logprobs"] = {
                "tokens": [f"token_id:{i}" for i in ids],
                "token_logprobs": [-0.5] * n,
                "top_logprobs": [{f"token_id:{i}": -0.5, f"token_id:{(i + 1) % 256}": -0.5 - m}
                                 for i, m in zip(ids, ms)]}
        return web.json_response({"choices": [choice], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": n}})
