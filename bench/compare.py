"""Stock vs one-page side by side (`r9k bench compare`).

The same closed-loop workload (fixed prompts, greedy, fixed output length, so both modes
generate the same tokens and accept the same drafts) at several concurrencies, against one
replica at a time on the same cores, the order alternated over repeats so drift on a shared
host (other jobs, thermal) lands on both modes. Reports decode throughput, time to first
token, KV capacity (engine log and planner) and the pool share running requests pin.

Two workloads: `unique` (every prompt its own) and `shared-prefix` (groups of requests sharing a
prefix several KV blocks long, each with a short unique suffix, the shape of vLLM's
prefix-repetition benchmark dataset), for which each level also reports the prefix-cache hit rate
from the replica's own counters over that level.
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
from r9k.http_client import HttpUnreachable, http_get
from r9k.vllm_metrics import parse_vllm_metrics

MODES = ("stock", "onepage")


@dataclass
class Workload:
    concurrencies: list[int]
    requests_per_level: int          # at least this many, and at least 2 x concurrency
    prompt_tokens: int
    output_tokens: int
    warmup_requests: int = 4
    timeout_s: float = 600
    prefix_tokens: int = 0           # > 0: shared-prefix workload, prompt_tokens is the suffix
    prefix_groups: int = 1           # requests of a level spread over this many prefixes

    @property
    def kind(self) -> str:
        return "shared-prefix" if self.prefix_tokens else "unique"

    def requests_at(self, c: int) -> int:
        return max(self.requests_per_level, 2 * c)

    def public(self) -> dict[str, Any]:
        return {**self.__dict__, "kind": self.kind}


def shared_prefix_prompts(rng: random.Random, n: int, groups: int, prefix_chars: int,
                          suffix_chars: int) -> list[tuple[int, str]]:
    """n (group, prompt) pairs: group g's prefix (`prefix_chars`, the same text for the whole
    group) + a suffix unique to the request (`suffix_chars`). Groups take turns (sizes differ by
    at most one), then the order is shuffled, as vLLM's prefix-repetition dataset does, so a
    group's requests arrive spread over the run, some while another of the group still runs."""
    if n < 1 or groups < 1 or prefix_chars < 1 or suffix_chars < 1:
        raise ValueError(f"shared_prefix_prompts: n {n}, groups {groups}, prefix_chars "
                         f"{prefix_chars}, suffix_chars {suffix_chars}: expected all >= 1")
    prefixes = [prompt_of_length(rng, -1 - g, prefix_chars) for g in range(groups)]
    out = [(i % groups, prefixes[i % groups] + prompt_of_length(rng, i, suffix_chars))
           for i in range(n)]
    rng.shuffle(out)
    return out


def prefix_cache_counts(metrics_text: str) -> dict[str, float] | None:
    """vLLM's prefix-cache counters on one /metrics page, summed over engines: tokens looked up
    (`vllm:prefix_cache_queries`) and tokens found (`vllm:prefix_cache_hits`); None when the page
    has neither."""
    m = parse_vllm_metrics(metrics_text)
    if m.prefix_cache_queries is None or m.prefix_cache_hits is None:
        return None
    return {"queries": m.prefix_cache_queries, "hits": m.prefix_cache_hits}


def prefix_cache_delta(before: dict[str, float] | None,
                       after: dict[str, float] | None) -> dict[str, Any]:
    """Queries, hits and hit rate over an interval from two readings of the counters; all None
    when a reading is missing or the counters went backwards (the replica restarted)."""
    none = {"queries": None, "hits": None, "hit_rate": None}
    if before is None or after is None:
        return none
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    if queries < 0 or hits < 0 or hits > queries:
        return none
    return {"queries": int(queries), "hits": int(hits),
            "hit_rate": hits / queries if queries else None}


def cached_token_counts(results: list[RequestResult]) -> dict[str, int] | None:
    """How many requests had each prefix-cache hit length (tokens, as the server reported it per
    request); None when it reported none."""
    counts: dict[int, int] = {}
    for r in results:
        if r.cached_prompt_tokens is not None:
            counts[r.cached_prompt_tokens] = counts.get(r.cached_prompt_tokens, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)} or None


def read_metrics_text(base: str) -> str | None:
    try:
        return http_get(base + "/metrics", timeout_s=10).decode("utf-8", "replace")
    except (HttpUnreachable, OSError):
        return None


def _prefix_counts_at(base: str) -> dict[str, float] | None:
    text = read_metrics_text(base)
    try:
        return prefix_cache_counts(text) if text is not None else None
    except ValueError:
        return None


def replica_info(base: str) -> dict[str, Any]:
    """What the replica says about itself on /metrics (r9k.vllm_metrics): the plugin's page
    decision and vLLM's cache config; empty when it has no /metrics."""
    text = read_metrics_text(base)
    if text is None:
        return {}
    try:
        m = parse_vllm_metrics(text)
    except ValueError:
        return {}
    plugin = m.plugin or {}
    return {"page_mode": m.page_mode, "page_mode_reason": plugin.get("reason"),
            "cache_mode": m.cache_mode or plugin.get("cache_mode"),
            "gdn_pages_per_request": plugin.get("gdn_pages_per_request"),
            "block_size": m.block_size, "num_blocks": m.num_blocks}


def run_level(base: str, model: str, w: Workload, concurrency: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    n = w.requests_at(concurrency)
    if w.prefix_tokens:
        grouped = shared_prefix_prompts(rng, n, w.prefix_groups, w.prefix_tokens, w.prompt_tokens)
        prompts = [p for _, p in grouped]
    else:
        prompts = [prompt_of_length(rng, i, w.prompt_tokens) for i in range(n)]

    def make_payload(i: int) -> tuple[dict, dict]:
        return ({"model": model, "prompt": prompts[i], "max_tokens": w.output_tokens,
                 "temperature": 0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}, {})

    async def go() -> tuple[list[RequestResult], str | None]:
        async with new_session(concurrency) as session:
            return await drive(make_payload, session, base, concurrency=concurrency, total=n,
                               timeout_s=w.timeout_s)
    counts_before = _prefix_counts_at(base)
    t0 = time.monotonic()
    results, stop_reason = asyncio.run(go())
    wall = time.monotonic() - t0
    prefix_cache = prefix_cache_delta(counts_before, _prefix_counts_at(base))
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
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
            "prefix_cache": prefix_cache,
            "cached_tokens_per_request": cached_token_counts(ok),
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None], (50, 90)),
            "decode_tokens_per_s_per_request": summarize(decode, (50,))}


Replica = Callable[[str, int], ContextManager[dict[str, Any]]]
"""(mode, repeat) -> context giving {"url", "model", "kv_cache_tokens"?, "ready_s"?}."""


def external_replica(urls: dict[str, str], model: str) -> Replica:
    """Replicas someone else started (a GPU host, the fleet): measured as they are (their prefix
    caching is whatever they were started with)."""
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
                    info = replica_info(r["url"])
                    if info.get("page_mode") not in (None, mode):
                        report(f"{mode} repeat {rep}: the replica runs {info['page_mode']} pages "
                               f"({info.get('page_mode_reason')})")
                    # warm-up with unique prompts (first requests pay one-time costs; no prefix
                    # of the measured levels gets cached)
                    run_level(r["url"], r["model"], Workload(
                        [1], w.warmup_requests, w.prompt_tokens, w.output_tokens, 0, w.timeout_s),
                        1, seed=-1)
                    for c in w.concurrencies:
                        lv = run_level(r["url"], r["model"], w, c, seed=c)
                        levels.append(lv)
                        bar.update()
                        if lv["errors"]:
                            report(f"{mode} repeat {rep} x{c}: {lv['errors']} errors, e.g. "
                                   f"{lv['error_samples'][:1]}")
                    runs.append({"repeat": rep, "mode": mode, "position": order.index(mode),
                                 "kv_cache_tokens": r.get("kv_cache_tokens"),
                                 "ready_s": r.get("ready_s"), "replica": info, "levels": levels})
                if checkpoint:
                    checkpoint({"workload": w.public(), "repeats": repeats, "runs": runs,
                                "partial": True, **aggregate(runs, w)})
    except KeyboardInterrupt:
        stopped_early = f"interrupted after {len(runs)} of {repeats * len(MODES)} replica runs"
    finally:
        bar.close()
    return {"workload": w.public(), "repeats": repeats, "runs": runs,
            "stopped_early": stopped_early, **aggregate(runs, w)}


def _sum_counts(counts: list[dict[str, int] | None]) -> dict[str, int] | None:
    total: dict[int, int] = {}
    for c in counts:
        for k, v in (c or {}).items():
            total[int(k)] = total.get(int(k), 0) + v
    return {str(k): total[k] for k in sorted(total)} or None


def aggregate(runs: list[dict[str, Any]], w: Workload) -> dict[str, Any]:
    """Per concurrency: throughput, TTFT and prefix-cache hit rate per mode across repeats,
    one-page/stock ratios paired within each repeat; the page mode each mode's replicas said
    they run (r9k_plugin_info)."""
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
                      "ttft_p90_s": spread([lv["ttft_s"]["p90"] for lv in lvs
                                            if lv["ttft_s"].get("p90") is not None]),
                      "prefix_cache_hit_rate": spread(
                          [lv["prefix_cache"]["hit_rate"] for lv in lvs
                           if (lv.get("prefix_cache") or {}).get("hit_rate") is not None]),
                      "requests_ok": sum(lv.get("ok", 0) for lv in lvs),
                      "cached_tokens_per_request": _sum_counts(
                          [lv.get("cached_tokens_per_request") for lv in lvs]),
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
    page_modes = {m: sorted({str((run.get("replica") or {}).get("page_mode"))
                             for run in runs if run["mode"] == m}) for m in MODES}
    cache_modes = sorted({str((run.get("replica") or {}).get("cache_mode")) for run in runs})
    return {"by_concurrency": table, "errors": errors, "page_modes_seen": page_modes,
            "cache_modes_seen": cache_modes,
            "page_mode_mismatch": any(seen not in (m, "None") for m in MODES
                                      for seen in page_modes[m])}


def capacity_block(model_dir: Path, *, num_spec: int, kv_bytes: int, max_model_len: int,
                   concurrencies: list[int], max_num_seqs: int, platform: str = "cpu",
                   state_dtype: str | None = "float32",
                   prefix_caching: bool = False) -> dict[str, Any]:
    """Planner numbers (r9k.capacity): tokens per mode and the share running requests pin.
    `prefix_caching` is what the compared servers run (on: vLLM's align accounting)."""
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
    return {"prefix_caching": prefix_caching,
            "planner_tokens": {"stock": p.stock.tokens, "onepage": p.onepage.tokens},
            "planner_ratio": p.ratio, "num_blocks": {"stock": p.stock.num_blocks,
                                                     "onepage": p.onepage.num_blocks},
            "pinned_fraction_by_concurrency": pinned, "plan": p.public()}


def _median_range(s: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    if not s.get("n"):
        return "-"
    med, lo, hi = (scale * s[k] for k in ("median", "min", "max"))
    return f"{med:{fmt}} ({lo:{fmt}}..{hi:{fmt}})" if s["n"] > 1 else f"{med:{fmt}}"


def shared_prefix_markdown(result: dict[str, Any]) -> list[str]:
    """The shared-prefix table: medians over repeats (min..max), hit rate from the replicas'
    counters, ratios paired within repeats."""
    w = result["workload"]
    setup = result.get("setup") or {}
    pc = setup.get("prefix_caching")
    lines = [f"Workload: shared prefix: {w['prefix_groups']} prefixes of {w['prefix_tokens']} "
             f"tokens, each request = a prefix + {w['prompt_tokens']} unique tokens, "
             f"{w['output_tokens']} output tokens (greedy, ignore_eos), >= "
             f"{w['requests_per_level']} requests per level, order shuffled, new prefixes per "
             f"level; prefix caching {'on' if pc else 'off' if pc is not None else 'as served'}"
             f"; {result['repeats']} repeats, order alternated; errors: {result['errors']}; "
             f"page modes seen (r9k_plugin_info): stock "
             f"{result.get('page_modes_seen', {}).get('stock')}, one-page "
             f"{result.get('page_modes_seen', {}).get('onepage')}; mamba cache modes seen "
             f"{result.get('cache_modes_seen')}.", "",
             "Medians over repeats (min..max); ratios one-page/stock paired within a repeat.", "",
             "| concurrency | mode | requests ok | prefix-cache hit rate | output tok/s "
             "| TTFT p50 | TTFT p90 |", "|---:|---|---:|---:|---:|---:|---:|"]
    for row in result["by_concurrency"]:
        for m, label in (("stock", "stock"), ("onepage", "one-page")):
            x = row[m]
            lines.append(f"| {row['concurrency']} | {label} | {x.get('requests_ok', '-')} | "
                         f"{_median_range(x.get('prefix_cache_hit_rate', {}), '.1%')} | "
                         f"{_median_range(x['output_tokens_per_s'], '.1f')} | "
                         f"{_median_range(x['ttft_p50_s'], '.0f', 1000)} ms | "
                         f"{_median_range(x.get('ttft_p90_s', {}), '.0f', 1000)} ms |")
        lines.append(f"| {row['concurrency']} | **ratio** | | | "
                     f"{_median_range(row['throughput_ratio_onepage_over_stock'], '.3f')} | "
                     f"{_median_range(row['ttft_ratio_onepage_over_stock'], '.3f')} | |")
    hits = [(row["concurrency"], label, row[m].get("cached_tokens_per_request"))
            for row in result["by_concurrency"]
            for m, label in (("stock", "stock"), ("onepage", "one-page"))]
    if any(h for _, _, h in hits):
        lines += ["", "Prefix-cache hit per request (cached prompt tokens: requests, all repeats, "
                  "from each response's usage):", ""]
        lines += [f"- concurrency {c}, {label}: " + ", ".join(f"{k}: {v}" for k, v in h.items())
                  for c, label, h in hits if h]
    return lines


def markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    lines = [f"# Stock vs one-page: {result.get('title', '')}".rstrip(": "), ""]
    if w.get("prefix_tokens"):
        lines += shared_prefix_markdown(result)
        return _capacity_markdown(result, lines)
    lines += [f"Workload: prompt {w['prompt_tokens']} tokens, {w['output_tokens']} output tokens "
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
    return _capacity_markdown(result, lines)


def _capacity_markdown(result: dict[str, Any], lines: list[str]) -> str:
    capb = result.get("capacity")
    if capb:
        kv = result.get("kv_cache_tokens_logged", {})
        mode = "prefix caching on (align)" if capb.get("prefix_caching") else "prefix caching off"
        lines += ["", f"| KV capacity ({mode}) | stock | one-page | ratio |", "|---|---:|---:|---:|",
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
