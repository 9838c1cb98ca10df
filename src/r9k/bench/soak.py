"""Mixed-length soak (`r9k bench soak`): N clients for S seconds, prompts from a few tokens to
past the model's limit, memory sampled throughout, verdict on whether memory plateaued.

Prompt lengths are drawn log-uniformly in [min_tokens, max_tokens] (many short, some long);
synthetic text is counted at one token per character (exact for the tiny byte-level model, an
upper bound for BPE checkpoints), so a prompt at or past max_model_len is expected to be
rejected (HTTP 400, "maximum context length"): rejected-by-design, not an error. A rejection of
a prompt that should fit is an error.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

from r9k.bench.client import RequestResult, drive, new_session
from r9k.bench.memory import MemorySampler
from r9k.bench.sanity import WORDS
from r9k.bench.stats import memory_plateau, summarize

LENGTH_BUCKETS = ((0, 256, "short"), (256, 2048, "medium"), (2048, 1 << 30, "long"))


def prompt_of_length(rng: random.Random, index: int, n_chars: int) -> str:
    """Exactly `n_chars` characters (one token each for the tiny byte-level model)."""
    text = f"[{index}]"  # distinct per request
    while len(text) < n_chars:
        text += " " + rng.choice(WORDS)
    return text[:n_chars]


def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def bucket(n: int) -> str:
    return next(name for lo, hi, name in LENGTH_BUCKETS if lo <= n < hi)


def run_soak(base: str, model: str, *, clients: int, duration_s: float, min_tokens: int,
             max_tokens: int, max_output_tokens: int, max_model_len: int | None,
             sampler: MemorySampler | None, timeout_s: float = 600, seed: int = 0,
             progress: bool = True, report: Callable[[str], None] = print,
             plateau_args: dict[str, Any] | None = None,
             checkpoint: Callable[[dict[str, Any]], None] | None = None,
             checkpoint_every_s: float = 30,
             outage_tolerance_s: float | None = None) -> dict[str, Any]:
    from tqdm import tqdm
    rng = random.Random(seed)
    results: list[RequestResult] = []
    t0 = time.monotonic()
    if sampler is not None:
        sampler.t0 = t0
        sampler.start()

    def make_payload(i: int) -> tuple[dict, dict]:
        n = log_uniform_int(rng, min_tokens, max_tokens)
        out = rng.randint(1, max_output_tokens)
        payload = {"model": model, "prompt": prompt_of_length(rng, i, n), "max_tokens": out,
                   "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}}
        fits = max_model_len is None or n < max_model_len
        return payload, {"fits": fits, "max_tokens": out}

    bar = tqdm(total=int(duration_s), desc=f"soak x{clients}", unit="s", disable=not progress,
               bar_format="{l_bar}{bar}| {n}/{total} s{postfix}")
    counts = {"served": 0, "rejected_by_design": 0, "errors": 0}
    last_checkpoint = [time.monotonic()]

    def on_result(r: RequestResult) -> None:
        if r.status == "rejected" and not r.extra["fits"]:
            counts["rejected_by_design"] += 1
        elif r.status == "ok":
            counts["served"] += 1
        else:
            counts["errors"] += 1
            if r.status == "rejected":
                r.error_kind = "rejected_but_fits"
            if counts["errors"] <= 20:
                report(f"ERROR request {r.index} ({r.prompt_chars} chars): {r.error_kind}: {r.message}")
        elapsed = min(int(time.monotonic() - t0), int(duration_s))
        bar.update(elapsed - bar.n)
        bar.set_postfix(counts, refresh=False)
        if checkpoint and time.monotonic() - last_checkpoint[0] >= checkpoint_every_s:
            last_checkpoint[0] = time.monotonic()
            checkpoint(summarize_soak(results, None, sampler, t0, partial=True,
                                      plateau_args=plateau_args))

    async def go() -> tuple[list[RequestResult], str | None]:
        async with new_session(clients) as session:
            return await drive(make_payload, session, base, concurrency=clients,
                               duration_s=duration_s, timeout_s=timeout_s, on_result=on_result,
                               t0=t0, results=results, outage_tolerance_s=outage_tolerance_s)

    stop_reason = None
    try:
        _, stop_reason = asyncio.run(go())
    except KeyboardInterrupt:
        stop_reason = "interrupted (Ctrl-C)"
    finally:
        bar.close()
        if sampler is not None:
            sampler.stop()
    summary = summarize_soak(results, stop_reason, sampler, t0, partial=False,
                             plateau_args=plateau_args)
    summary.update(endpoint=base, model=model, clients=clients, duration_s_planned=duration_s,
                   outage_tolerance_s=outage_tolerance_s,
                   prompt_tokens_range=[min_tokens, max_tokens],
                   max_output_tokens=max_output_tokens, max_model_len=max_model_len)
    return summary


def outage_windows(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Runs of transport failures (refused, timeout, disconnected) in start order, each from the
    first failed request's start to the start of the next request that did not fail that way
    (the endpoint answered again by then), with the number of requests that failed."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for r in sorted(results, key=lambda r: r.started_s):
        if r.transport_failure:
            if current is None:
                current = {"from_s": round(r.started_s, 2), "to_s": None, "failed_requests": 0}
                out.append(current)
            current["failed_requests"] += 1
        elif current is not None:
            current["to_s"] = round(r.started_s, 2)
            current["duration_s"] = round(current["to_s"] - current["from_s"], 2)
            current = None
    return out


def summarize_soak(results: list[RequestResult], stop_reason: str | None,
                   sampler: MemorySampler | None, t0: float, *, partial: bool,
                   plateau_args: dict[str, Any] | None = None) -> dict[str, Any]:
    results = sorted(results, key=lambda r: r.index)
    ok = [r for r in results if r.status == "ok"]
    by_design = [r for r in results if r.status == "rejected" and not r.extra.get("fits", True)]
    errors = [r for r in results if r not in ok and r not in by_design]
    wall = time.monotonic() - t0
    kinds: dict[str, int] = {}
    for r in errors:
        kinds[r.error_kind or "unknown"] = kinds.get(r.error_kind or "unknown", 0) + 1
    by_bucket = {}
    for _, _, name in LENGTH_BUCKETS:
        lat = [r.latency_s for r in ok if bucket(r.prompt_chars) == name]
        by_bucket[name] = summarize(lat)
    tpot = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok
            if r.ttft_s is not None and r.completion_tokens and r.completion_tokens > 1]
    memory: dict[str, Any] = {"source": None, "verdict": "not_sampled"}
    if sampler is not None:
        memory = {"source": sampler.source, "interval_s": sampler.interval_s,
                  "errors": sampler.errors,
                  **memory_plateau(sampler.samples, **(plateau_args or {})),
                  "samples_t_s_bytes": list(sampler.samples)}
        if any("is gone" in e for e in sampler.errors):
            # the sampled process died or restarted: what is left says nothing about a plateau
            memory.update(verdict="source_lost", flat=None)
    served_tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "partial": partial, "wall_s": round(wall, 1), "requests_sent": len(results),
        "served": len(ok), "rejected_by_design": len(by_design), "errors": len(errors),
        "errors_by_kind": kinds, "stopped_early": stop_reason,
        "outages": outage_windows(results),
        "output_tokens": served_tokens,
        "output_tokens_per_s": round(served_tokens / wall, 2) if wall else None,
        "latency_s": summarize([r.latency_s for r in ok], (50, 90, 99)),
        "latency_s_by_prompt_length": by_bucket,
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None], (50, 90, 99)),
        "tpot_s": summarize(tpot, (50, 90, 99)),
        "prompt_chars_served": summarize([r.prompt_chars for r in ok], (50, 90, 99)),
        "memory": memory,
        "error_samples": [r.public() for r in errors[:50]],
        "passed": (not partial and not errors and stop_reason is None
                   and memory.get("flat") is not False and memory["verdict"] != "source_lost"),
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(path)
