"""A replica without an engine, for fleet tests on a real Ray cluster: run in place of vLLM's
api_server by the real supervisor. It answers `/health`, `/metrics` with the pool the planner
gives its page mode (so the fleet's page proof passes as for a real one-page replica) and
`/v1/completions` (plain and streamed, `token_delay_s` per token), and starts one child process
standing for the engine core, so tests can check that no process of a replica outlives it.

    python stub_replica.py --host H --port P --blocks N --block-size B [--page-mode onepage]
                           [--token-delay-s S] [--name NAME]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

from aiohttp import web


def metrics_text(blocks: int, block_size: int, page_mode: str, tokens: int, running: int) -> str:
    labels = (f'page_mode="{page_mode}",reason="",cache_mode="align",vllm_version="0.32.0",'
              'num_spec="3"')
    return "\n".join([
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}",'
        f'mamba_cache_mode="align",engine="0"}} 1.0',
        "# TYPE r9k_plugin_info gauge",
        f"r9k_plugin_info{{{labels}}} 1.0",
        "# TYPE vllm:generation_tokens_total counter",
        f'vllm:generation_tokens_total{{engine="0"}} {float(tokens)}',
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="0"}} {float(running)}',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0"} 0.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f'vllm:kv_cache_usage_perc{{engine="0"}} {min(1.0, running / 10):.2f}',
        ""])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--page-mode", default="onepage")
    ap.add_argument("--token-delay-s", type=float, default=0.05)
    ap.add_argument("--name", default="stub")
    args = ap.parse_args(argv)
    # the "engine core": a child in the server's process group, as vLLM's is
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10**6)"])
    state = {"tokens": 0, "running": 0}

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=metrics_text(args.blocks, args.block_size, args.page_mode,
                                              state["tokens"], state["running"]))

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 8))
        state["running"] += 1
        try:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i in range(n):
                    await asyncio.sleep(args.token_delay_s)
                    state["tokens"] += 1
                    event = {"choices": [{"index": 0, "text": f"t{i} "}], "replica_pid": os.getpid()}
                    await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                return resp
            for _ in range(n):
                await asyncio.sleep(args.token_delay_s)
                state["tokens"] += 1
            return web.json_response({
                "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": " ".join(f"t{i}" for i in range(n)),
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": n}, "replica_pid": os.getpid()})
        finally:
            state["running"] -= 1

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, shutdown_timeout=0.5,
                    reuse_address=True)
    finally:
        core.kill()


if __name__ == "__main__":
    main(sys.argv[1:])
