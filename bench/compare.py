"""Stock vs one-page side by side (`r9k bench compare`).

The same closed-loop workload (fixed prompts, greedy, fixed output length, so both modes
generate the same tokens and accept the same drafts) at several concurrencies, against one
replica at a time on the same cores, the order alternated over repeats so drift on a shared
host (other jobs, thermal) lands on both modes. Reports decode throughput, time to first
token, KV capacity (engine log and planner) and the pool share running requests pin.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from r9k import capacity as cap
from r9k.bench.client import RequestResult, drive, new_session
from r9k.bench.soak import prompt_of_length
from r9k.bench.stats import spread, summarize

MODES = ("stock", "onepage")


@dataclass
class Workload:
    concurrencies: list[int]
    requests_per_level: int          # at least this many, and at least 2 x concurrency
    prompt_tokens: int
    output_tokens: int
    warmup_requests: int = 4
    timeout_s: float = 600

    def requests_at(self, c: int) -> int:
        return max(self.requests_per_level, 2 * c)


def run_level(base: str, model: str, w: Workload, concurrency: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    n = w.requests_at(concurrency)
    prompts = [prompt_of_length(rng, i, w.prompt_tokens) for i in range(n)]

    def make_payload(i: int) -> tuple[dict, dict]:
        return ({"model": model, "prompt": prompts[i], "max_tokens": w.output_tokens,
                 "temperature": 0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}, {})

    async def go() -> tuple[list[RequestResult], str | None]:
        async with new_session(concurrency) as session:
            return await drive(make_payload, session, base, concurrency=concurrency, total=n,
                               timeout_s=w.timeout_s)
    t0 = time.monotonic()
    results, stop_reason = asyncio.run(go())
    wall = time.monotonic() - t0
    ok = [r for r in results if r.status == "ok"]
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    decode = [(r.completion_tokens - 1) / (r.latency_s - r.ttft_s) for r in ok
              if r.ttft_s is not None and r.completion_tokens and r.completion_tokens > 1
              and r.latency_s > r.ttft_s]
    return {"concurrency": concurrency, "requests": n, "ok": len(ok),
            "errors": len(results) - len(ok), "stopped_early": stop_reason,
            "error_samples": [r.public() for r in results if r.status != "ok"][:5],
            "wall_s": round(wall, 3), "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall if wall else None,
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None], (50, 90)),
            "decode_tokens_per_s_per_request": summarize(decode, (50,))}


Replica = Callable[[str, int], ContextManager[dict[str, Any]]]
"""(mode, repeat) -> context giving {"url", "model", "kv_cache_tokens"?, "ready_s"?}."""


def external_replica(urls: dict[str, str], model: str) -> Replica:
    """Replicas someone else started (a GPU host, the fleet): measured as they are."""
    @contextlib.contextmanager
    def open_(mode: str, repeat: int) -> Iterator[dict[str, Any]]:
        yield {"url": urls[mode], "model": model}
    return open_


def run_compare(replica: Replica, w: Workload, *, repeats: int, progress: bool = True,
                report: Callable[[str], None] = print,
                checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """All repeats; after each replica run `checkpoint` gets the result so far, and Ctrl-C
    returns what was measured (`stopped_early`)."""
    from tqdm import tqdm
    runs: list[dict[str, Any]] = []
    stopped_early = None
    steps = repeats * len(MODES) * len(w.concurrencies)
    bar = tqdm(total=steps, desc="compare", unit="level", disable=not progress)
    try:
        for rep in range(repeats):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                bar.set_postfix(repeat=rep, mode=mode, refresh=True)
                with replica(mode, rep) as r:
                    levels = []
                    run_level(r["url"], r["model"], Workload(
                        [1], w.warmup_requests, w.prompt_tokens, w.output_tokens, 0, w.timeout_s),
                        1, seed=-1)  # warm-up: first requests pay one-time costs
                    for c in w.concurrencies:
                        lv = run_level(r["url"], r["model"], w, c, seed=c)
                        levels.append(lv)
                        bar.update()
                        if lv["errors"]:
                            report(f"{mode} repeat {rep} x{c}: {lv['errors']} errors, e.g. "
                                   f"{lv['error_samples'][:1]}")
                    runs.append({"repeat": rep, "mode": mode, "position": order.index(mode),
                                 "kv_cache_tokens": r.get("kv_cache_tokens"),
                                 "ready_s": r.get("ready_s"), "levels": levels})
                if checkpoint:
                    checkpoint({"workload": w.__dict__, "repeats": repeats, "runs": runs,
                                "partial": True, **aggregate(runs, w)})
    except KeyboardInterrupt:
        stopped_early = f"interrupted after {len(runs)} of {repeats * len(MODES)} replica runs"
    finally:
        bar.close()
    return {"workload": w.__dict__, "repeats": repeats, "runs": runs,
            "stopped_early": stopped_early, **aggregate(runs, w)}


def aggregate(runs: list[dict[str, Any]], w: Workload) -> dict[str, Any]:
    """Per concurrency: throughput and TTFT per mode across repeats, one-page/stock ratios
    paired within each repeat."""
    table = []
    errors = 0
    for c in w.concurrencies:
        row: dict[str, Any] = {"concurrency": c}
        per_mode: dict[str, dict[int, dict]] = {m: {} for m in MODES}
        for run in runs:
            lv = next((lv for lv in run["levels"] if lv["concurrency"] == c), None)
            if lv is None:
                continue
            per_mode[run["mode"]][run["repeat"]] = lv
            errors += lv["errors"]
        for m in MODES:
            lvs = list(per_mode[m].values())
            row[m] = {"output_tokens_per_s": spread([lv["output_tokens_per_s"] for lv in lvs]),
                      "ttft_p50_s": spread([lv["ttft_s"]["p50"] for lv in lvs
                                            if lv["ttft_s"].get("p50") is not None]),
                      "decode_tokens_per_s_per_request_p50": spread(
                          [lv["decode_tokens_per_s_per_request"]["p50"] for lv in lvs
                           if lv["decode_tokens_per_s_per_request"].get("p50") is not None])}
        paired = sorted(set(per_mode["stock"]) & set(per_mode["onepage"]))
        row["throughput_ratio_onepage_over_stock"] = spread(
            [per_mode["onepage"][r]["output_tokens_per_s"] / per_mode["stock"][r]["output_tokens_per_s"]
             for r in paired if per_mode["stock"][r]["output_tokens_per_s"]])
        row["ttft_ratio_onepage_over_stock"] = spread(
            [per_mode["onepage"][r]["ttft_s"]["p50"] / per_mode["stock"][r]["ttft_s"]["p50"]
             for r in paired if per_mode["stock"][r]["ttft_s"].get("p50")
             and per_mode["onepage"][r]["ttft_s"].get("p50") is not None])
        table.append(row)
    return {"by_concurrency": table, "errors": errors}


def capacity_block(model_dir: Path, *, num_spec: int, kv_bytes: int, max_model_len: int,
                   concurrencies: list[int], max_num_seqs: int, platform: str = "cpu",
                   state_dtype: str | None = "float32",
                   prefix_caching: bool = False) -> dict[str, Any]:
    """Planner numbers (r9k.capacity): tokens per mode and the share running requests pin.
    `prefix_caching` is what the compared servers run (the demo's Server: off)."""
    shape = cap.HybridModelShape.from_path(model_dir)
    pinned = {}
    for running in sorted(set(concurrencies) | {max_num_seqs}):
        p = cap.plan(shape, tp=1, num_spec=num_spec, kv_bytes_per_rank=kv_bytes,
                     max_model_len=max_model_len, platform=platform, state_dtype=state_dtype,
                     running=min(running, max_num_seqs), prefix_caching=prefix_caching)
        pinned[running] = {"running": min(running, max_num_seqs),
                           "stock": p.stock.pinned_fraction, "onepage": p.onepage.pinned_fraction}
    p = cap.plan(shape, tp=1, num_spec=num_spec, kv_bytes_per_rank=kv_bytes,
                 max_model_len=max_model_len, platform=platform, state_dtype=state_dtype,
                 running=max_num_seqs, prefix_caching=prefix_caching)
    return {"planner_tokens": {"stock": p.stock.tokens, "onepage": p.onepage.tokens},
            "planner_ratio": p.ratio, "num_blocks": {"stock": p.stock.num_blocks,
                                                     "onepage": p.onepage.num_blocks},
            "pinned_fraction_by_concurrency": pinned, "plan": p.public()}


def markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    lines = [f"# Stock vs one-page: {result.get('title', '')}".rstrip(": "), "",
             f"Workload: prompt {w['prompt_tokens']} tokens, {w['output_tokens']} output tokens "
             f"(greedy, ignore_eos), >= {w['requests_per_level']} requests per level; "
             f"{result['repeats']} repeats, order alternated; errors: {result['errors']}.", "",
             "| concurrency | stock tok/s | one-page tok/s | ratio one-page/stock (min..max) "
             "| TTFT p50 stock | TTFT p50 one-page |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in result["by_concurrency"]:
        s, o = row["stock"], row["onepage"]
        r = row["throughput_ratio_onepage_over_stock"]
        if not r.get("n") or not s["ttft_p50_s"].get("n") or not o["ttft_p50_s"].get("n"):
            continue
        lines.append(
            f"| {row['concurrency']} | {s['output_tokens_per_s']['mean']:.1f} | "
            f"{o['output_tokens_per_s']['mean']:.1f} | {r['mean']:.3f} ({r['min']:.3f}..{r['max']:.3f}) | "
            f"{1000 * s['ttft_p50_s']['mean']:.0f} ms | {1000 * o['ttft_p50_s']['mean']:.0f} ms |")
    capb = result.get("capacity")
    if capb:
        kv = result.get("kv_cache_tokens_logged", {})
        lines += ["", "| KV capacity | stock | one-page | ratio |", "|---|---:|---:|---:|",
                  f"| tokens (planner) | {capb['planner_tokens']['stock']:,} | "
                  f"{capb['planner_tokens']['onepage']:,} | {capb['planner_ratio']:.3f} |"]
        if kv.get("stock") and kv.get("onepage"):
            lines.append(f"| tokens (engine log) | {kv['stock']:,} | {kv['onepage']:,} | "
                         f"{kv['onepage'] / kv['stock']:.3f} |")
        for c, p in capb["pinned_fraction_by_concurrency"].items():
            lines.append(f"| pool pinned by {p['running']} running | {p['stock']:.1%} | "
                         f"{p['onepage']:.1%} | |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["by_concurrency"]
            if r["throughput_ratio_onepage_over_stock"].get("n")]  # paired repeats only
    if not rows:
        return False
    cs = [r["concurrency"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for m, label in (("stock", "stock pages"), ("onepage", "one-page")):
        mean = [r[m]["output_tokens_per_s"]["mean"] for r in rows]
        lo = [r[m]["output_tokens_per_s"]["mean"] - r[m]["output_tokens_per_s"]["min"] for r in rows]
        hi = [r[m]["output_tokens_per_s"]["max"] - r[m]["output_tokens_per_s"]["mean"] for r in rows]
        a1.errorbar(cs, mean, yerr=[lo, hi], marker="o", capsize=3, label=label)
    a1.set_xlabel("concurrency")
    a1.set_ylabel("output tokens/s")
    a1.set_xscale("log", base=2)
    a1.legend()
    a1.set_title("decode throughput (min..max over repeats)")
    ratio = [r["throughput_ratio_onepage_over_stock"] for r in rows]
    a2.errorbar(cs, [x["mean"] for x in ratio],
                yerr=[[x["mean"] - x["min"] for x in ratio], [x["max"] - x["mean"] for x in ratio]],
                marker="o", capsize=3, color="C2")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("concurrency")
    a2.set_title("throughput ratio one-page / stock")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
