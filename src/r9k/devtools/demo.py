"""`r9k demo`: the stack on its built-in default, end to end, on the CPU.

Generates the tiny hybrid model, serves it with vLLM's OpenAI-compatible server (MTP
speculative decoding, the r9k plugin loaded) once with stock pages and once with one-page
pages, sends the same requests to both, and prints the answers side by side with each engine's
KV-cache capacity (its pool on /metrics, read as the fleet reads a replica) next to the
planner's prediction and the pool share that running requests pin.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from r9k.core import capacity as cap
from r9k.devtools.local_server import LocalServer, http_json

PROMPTS = ["The state of the page is", "Replay the accepted rows", "Hello, R9700 fleet!"]


def ask(server: LocalServer, prompt: str, max_tokens: int) -> tuple[list[int] | None, str]:
    out = http_json(server.url + "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    choice = out["choices"][0]
    return choice.get("token_ids"), choice["text"]


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("demo-out"), show_default=True, help="model, logs and results")
@click.option("--num-spec", type=int, default=3, show_default=True, help="MTP draft tokens k")
@click.option("--kv-mib", type=int, default=64, show_default=True, help="KV cache budget")
@click.option("--max-model-len", type=int, default=4096, show_default=True)
@click.option("--max-tokens", type=int, default=24, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def demo(workdir: Path, num_spec: int, kv_mib: int, max_model_len: int, max_tokens: int,
         as_json: bool) -> None:
    """Serve the tiny model through vLLM with stock and with one-page pages, side by side."""
    from r9k.devtools.tiny_model import make_tiny

    if num_spec < 1 or kv_mib < 1 or max_model_len < 16 or max_tokens < 1:
        from r9k.cli_errors import BadInput
        raise BadInput("--num-spec, --kv-mib, --max-tokens must be >= 1, --max-model-len >= 16")
    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "tiny"
    if not (model / "model.safetensors").exists():
        make_tiny(model, seed=0)
        click.echo(f"generated the tiny model in {model}")
    kv_bytes = kv_mib << 20
    plan = cap.plan(cap.HybridModelShape.from_path(model), tp=1, num_spec=num_spec,
                    kv_bytes_per_rank=kv_bytes, max_model_len=max_model_len, platform="cpu",
                    state_dtype="float32", prefix_caching=False)  # its servers run it off
    result: dict = {"plan": plan.public(), "modes": {}}
    for mode in ("stock", "onepage"):
        click.echo(f"starting vLLM ({mode} pages, MTP k={num_spec}) ...")
        t0 = time.monotonic()
        server = LocalServer(model, mode, num_spec, kv_bytes, max_model_len,
                             workdir / f"vllm-{mode}.log")
        try:
            server.wait_ready()
            started = time.monotonic() - t0
            answers = [ask(server, p, max_tokens) for p in PROMPTS]
            chat = http_json(server.url + "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 8, "temperature": 0})
            page = server.metrics().plugin or {}
            result["modes"][mode] = {
                "ready_s": round(started, 1), "kv_cache_tokens": server.kv_tokens(),
                "page_mode_metric": {k: page.get(k) for k in ("page_mode", "reason",
                                                              "gdn_pages_per_request")},
                "answers": [{"prompt": p, "token_ids": ids, "text": text}
                            for p, (ids, text) in zip(PROMPTS, answers)],
                "chat": chat["choices"][0]["message"]["content"]}
        finally:
            server.stop()
    (workdir / "demo-result.json").write_text(json.dumps(result, indent=2))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print(result, plan)


def _print(result: dict, plan: cap.CapacityPlan) -> None:
    s, o = result["modes"]["stock"], result["modes"]["onepage"]
    click.echo("")
    for a, b in zip(s["answers"], o["answers"]):
        same = "identical" if a["token_ids"] == b["token_ids"] else "DIFFERENT"
        click.echo(f"prompt {a['prompt']!r}: token ids {same}; text {b['text'][:40]!r}")
    click.echo(f"chat answer (one-page): {o['chat'][:40]!r}")
    click.echo("")
    click.echo(f"{'':34}{'stock':>12}{'one-page':>12}")
    click.echo(f"{'KV cache tokens (engine /metrics)':34}{s['kv_cache_tokens']:>12,}"
               f"{o['kv_cache_tokens']:>12,}")
    click.echo(f"{'KV cache tokens (planner)':34}{plan.stock.tokens:>12,}{plan.onepage.tokens:>12,}")
    click.echo(f"{'pool pinned by 8 running requests':34}{plan.stock.pinned_fraction:>12.1%}"
               f"{plan.onepage.pinned_fraction:>12.1%}")
    click.echo(f"{'server ready after (s)':34}{s['ready_s']:>12}{o['ready_s']:>12}")
    sp, op = s["page_mode_metric"], o["page_mode_metric"]
    click.echo(f"{'page mode (r9k_plugin_info)':34}{sp['page_mode'] or '-':>12}"
               f"{op['page_mode'] or '-':>12}")
    click.echo(f"{'GDN pages per request':34}{sp['gdn_pages_per_request'] or '-':>12}"
               f"{op['gdn_pages_per_request'] or '-':>12}")
    ok = (s["kv_cache_tokens"] == plan.stock.tokens and o["kv_cache_tokens"] == plan.onepage.tokens
          and (sp["page_mode"], op["page_mode"]) == ("stock", "onepage")
          and all(a["token_ids"] == b["token_ids"] for a, b in zip(s["answers"], o["answers"])))
    click.echo(f"\none-page holds x{o['kv_cache_tokens'] / s['kv_cache_tokens']:.3f} the tokens; "
               f"outputs identical and planner exact: {'yes' if ok else 'NO'}")
    if not ok:
        raise SystemExit(1)
