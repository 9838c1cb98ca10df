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

While a level runs, the replica's scheduler gauges (running, waiting, KV usage, preemptions) are
sampled from its /metrics, so a pool-bound run shows the engine queueing against the planner's
prediction of how many requests the pool holds. The load comes from this package's client, or
(`client="vllm"`, unique prompts) from vLLM's own `vllm bench serve` library.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from r9k.core import capacity as cap
from r9k.bench.client import RequestResult, drive, new_session
from r9k.bench.soak import prompt_of_length
from r9k.bench.stats import spread, summarize
from r9k.core.http_client import HttpUnreachable, http_get
from r9k.core.vllm_metrics import parse_vllm_metrics

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
    client: str = "r9k"              # load generator: "r9k" (bench.client) or "vllm" (bench serve)
    sample_interval_s: float = 0.5   # /metrics sampling while a level runs

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
    """What the replica says about itself on /metrics (r9k.core.vllm_metrics): the plugin's page
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


@dataclass
class PoolSample:
    t_s: float                       # since the level started
    running: float | None            # vllm:num_requests_running
    waiting: float | None            # vllm:num_requests_waiting
    kv_usage: float | None           # vllm:kv_cache_usage_perc (0..1)
    preemptions: float | None        # vllm:num_preemptions_total (counter)


def pool_sample(metrics_text: str | None, t_s: float) -> PoolSample | None:
    """The scheduler gauges on one /metrics page; None when there is no page or it is not
    Prometheus text."""
    if metrics_text is None:
        return None
    try:
        m = parse_vllm_metrics(metrics_text)
    except ValueError:
        return None
    return PoolSample(t_s, m.running, m.waiting, m.kv_usage_ratio, m.preemptions)


def pool_summary(samples: list[PoolSample], interval_s: float) -> dict[str, Any]:
    """Peaks over a level, preemptions as the counter's rise from the first sample to the last
    (None when either lacks it or it went backwards: the replica restarted), and the series."""
    def peak(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None
    first = samples[0].preemptions if samples else None
    last = samples[-1].preemptions if samples else None
    preempted = last - first if first is not None and last is not None and last >= first else None
    return {"interval_s": interval_s, "samples": len(samples),
            "peak_running": peak([s.running for s in samples]),
            "peak_waiting": peak([s.waiting for s in samples]),
            "peak_kv_usage": peak([s.kv_usage for s in samples]),
            "preemptions": None if preempted is None else int(preempted),
            "series": {k: [getattr(s, k) for s in samples]
                       for k in ("t_s", "running", "waiting", "kv_usage")}}


class PoolSampler:
    """Samples a replica's scheduler gauges while a level runs: once on entry, every
    `interval_s` from a thread (so it runs beside any load generator, ours or vLLM's), once on
    exit, so the preemption count covers the whole level."""

    def __init__(self, read_text: Callable[[], str | None], interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read_text, self.interval_s, self.clock = read_text, interval_s, clock
        self.samples: list[PoolSample] = []
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        s = pool_sample(self.read_text(), round(self.clock() - self._t0, 3))
        if s is not None:
            self.samples.append(s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "PoolSampler":
        self._t0 = self.clock()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="pool-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def summary(self) -> dict[str, Any]:
        return pool_summary(self.samples, self.interval_s)


def vllm_bench_argv(base: str, model: str, tokenizer: str, w: Workload, concurrency: int,
                    n: int, seed: int, progress: bool) -> list[str]:
    """`vllm bench serve` options for this workload: fixed-length random prompts (range ratio 0),
    fixed output with ignore_eos, greedy, all requests at once behind a semaphore of
    `concurrency` (a closed loop), streamed completions; TTFT percentiles 50/90/99."""
    argv = ["--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(w.prompt_tokens), "--random-output-len",
            str(w.output_tokens), "--random-range-ratio", "0", "--num-prompts", str(n),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", "50,90,99"]
    return argv if progress else [*argv, "--disable-tqdm"]


def level_from_vllm_bench(res: dict[str, Any], concurrency: int, n: int) -> dict[str, Any]:
    """A level in this module's shape from `vllm bench serve`'s result: its output throughput
    (output tokens / duration, as ours), TTFT percentiles, TPOT median as decode rate."""
    ms = 1e-3
    errors = [e for e in res.get("errors") or [] if e]
    tpot = res.get("median_tpot_ms")
    ok = int(res["completed"])
    return {"concurrency": concurrency, "requests": n, "ok": ok,
            "errors": int(res.get("failed") or 0), "stopped_early": None,
            "error_samples": [{"message": e[:300]} for e in errors[:5]],
            "wall_s": round(res["duration"], 3), "output_tokens": int(res["total_output_tokens"]),
            "output_tokens_per_s": res["output_throughput"],
            "prompt_tokens": int(res["total_input_tokens"]),
            "prefix_cache": {"queries": None, "hits": None, "hit_rate": None},
            "cached_tokens_per_request": None,
            "ttft_s": {"n": ok, "mean": res["mean_ttft_ms"] * ms,
                       **{f"p{p}": res[f"p{p}_ttft_ms"] * ms for p in (50, 90, 99)}},
            "decode_tokens_per_s_per_request": {"n": ok, "p50": 1000 / tpot} if tpot else {"n": 0},
            "client": "vllm bench serve",
            "vllm_bench": {k: res.get(k) for k in (
                "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "max_concurrent_requests", "spec_decode_acceptance_rate",
                "spec_decode_acceptance_length")}}


@functools.cache
def _vllm_bench_lib() -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser, main


def run_vllm_bench(argv: list[str]) -> dict[str, Any]:
    """vLLM's benchmark client as a library call (its prints go to stderr)."""
    parser, main = _vllm_bench_lib()
    with contextlib.redirect_stdout(sys.stderr):
        return main(parser.parse_args(argv))


def run_level(base: str, model: str, w: Workload, concurrency: int, seed: int,
              tokenizer: str | None = None, progress: bool = False,
              vllm_bench: Callable[[list[str]], dict[str, Any]] = run_vllm_bench,
              energy: "Energy | None" = None) -> dict[str, Any]:
    if w.client == "vllm":
        n = w.requests_at(concurrency)
        argv = vllm_bench_argv(base, model, tokenizer or model, w, concurrency, n, seed, progress)
        if vllm_bench is run_vllm_bench:
            _vllm_bench_lib()  # the first import takes ~15 s: not inside the sampled level
        with PoolSampler(lambda: read_metrics_text(base), w.sample_interval_s) as sampler, \
                energy_window(energy) as window:
            lv = level_from_vllm_bench(vllm_bench(argv), concurrency, n)
        return {**lv, "pool": sampler.summary(),
                "energy": energy_block(window, energy, lv.get("output_tokens"))}
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
    with PoolSampler(lambda: read_metrics_text(base), w.sample_interval_s) as sampler, \
            energy_window(energy) as window:
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
            "decode_tokens_per_s_per_request": summarize(decode, (50,)),
            "pool": sampler.summary(),
            "energy": energy_block(window, energy, out_tokens)}


@dataclass
class Energy:
    """The cards whose draw a level costs (the replicas' cards on this host) and the meter."""

    meter: Any                      # r9k.ops.energy.EnergyMeter, started
    cards: list[str] | None         # PCI addresses; None: every card the meter sees


@contextlib.contextmanager
def energy_window(energy: Energy | None):
    if energy is None:
        yield None
        return
    from r9k.ops.energy import EnergyWindow

    with EnergyWindow(energy.meter, energy.cards) as window:
        yield window


def energy_block(window, energy: Energy | None, output_tokens: float | None) -> dict[str, Any]:
    """A level's energy: joules, seconds, mean watts, joules per output token; or
    {"measured": False, "why": ...}, never a 0 that was not measured."""
    if energy is None:
        return {"measured": False, "why": "no card power to read here (no amdgpu card with "
                "power1_average, power1_input or energy1_input)"}
    if window is None or not window.measured:
        return {"measured": False, "why": f"no power readings from {energy.cards or 'the cards'}"}
    return {"measured": True, "cards": energy.cards, "joules": window.joules,
            "seconds": window.seconds, "watts": window.watts, "gap_seconds": window.gap_seconds,
            "joules_per_output_token": (window.joules / output_tokens if output_tokens else None)}


Replica = Callable[[str, int], ContextManager[dict[str, Any]]]
"""(mode, repeat) -> context giving {"url", "model", "tokenizer"?, "kv_cache_tokens"?,
"ready_s"?}."""


def external_replica(urls: dict[str, str], model: str, tokenizer: str | None = None) -> Replica:
    """Replicas someone else started (a GPU host, the fleet): measured as they are (their prefix
    caching is whatever they were started with)."""
    @contextlib.contextmanager
    def open_(mode: str, repeat: int) -> Iterator[dict[str, Any]]:
        yield {"url": urls[mode], "model": model, "tokenizer": tokenizer}
    return open_


def run_compare(replica: Replica, w: Workload, *, repeats: int, progress: bool = True,
                report: Callable[[str], None] = print,
                checkpoint: Callable[[dict[str, Any]], None] | None = None,
                energy: Energy | None = None) -> dict[str, Any]:
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
                        lv = run_level(r["url"], r["model"], w, c, seed=c,
                                       tokenizer=r.get("tokenizer"), energy=energy)
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


def _jpt(lv: dict[str, Any]) -> float | None:
    e = lv.get("energy") or {}
    return e.get("joules_per_output_token") if e.get("measured") else None


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
                           if lv["decode_tokens_per_s_per_request"].get("p50") is not None]),
                      "joules_per_output_token": spread(
                          [_jpt(lv) for lv in lvs if _jpt(lv) is not None]),
                      "watts": spread([lv["energy"]["watts"] for lv in lvs
                                       if (lv.get("energy") or {}).get("measured")]),
                      **{key: spread([lv["pool"][key] for lv in lvs
                                      if (lv.get("pool") or {}).get(key) is not None])
                         for key in ("peak_running", "peak_waiting", "peak_kv_usage",
                                     "preemptions")}}
        paired = sorted(set(per_mode["stock"]) & set(per_mode["onepage"]))
        row["throughput_ratio_onepage_over_stock"] = spread(
            [per_mode["onepage"][r]["output_tokens_per_s"] / per_mode["stock"][r]["output_tokens_per_s"]
             for r in paired if per_mode["stock"][r]["output_tokens_per_s"]])
        row["joules_per_token_ratio_onepage_over_stock"] = spread(
            [_jpt(per_mode["onepage"][r]) / _jpt(per_mode["stock"][r]) for r in paired
             if _jpt(per_mode["stock"][r]) and _jpt(per_mode["onepage"][r]) is not None])
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
                   concurrencies: list[int], max_num_seqs: int | str, platform: str = "cpu",
                   state_dtype: str | None = "float32",
                   prefix_caching: bool = False) -> dict[str, Any]:
    """Planner numbers (r9k.core.capacity): tokens per mode and the share running requests pin.
    `prefix_caching` is what the compared servers run (on: vLLM's align accounting);
    `max_num_seqs` "planner" gives each mode its own whole requests (`admission_caps`)."""
    shape = cap.HybridModelShape.from_path(model_dir)

    def plan(running: int) -> cap.CapacityPlan:
        return cap.plan(shape, tp=1, num_spec=num_spec, kv_bytes_per_rank=kv_bytes,
                        max_model_len=max_model_len, platform=platform, state_dtype=state_dtype,
                        running=running, prefix_caching=prefix_caching)

    p = plan(0)
    pools = {"stock": p.stock, "onepage": p.onepage}
    seqs = ({m: pool.whole_requests for m, pool in pools.items()} if max_num_seqs == "planner"
            else max_num_seqs)
    capb = {"max_num_seqs": seqs}
    pinned = {}
    for running in sorted(set(concurrencies) | set(admission_caps(capb).values())):
        runs = {m: min(running, mode_seqs(capb, m)) for m in MODES}
        pinned[running] = {"running": runs["stock"] if len(set(runs.values())) == 1 else runs,
                           **{m: getattr(plan(runs[m]), m).pinned_fraction for m in MODES}}
    top = max(admission_caps(capb).values())
    return {"prefix_caching": prefix_caching,
            "planner_tokens": {"stock": p.stock.tokens, "onepage": p.onepage.tokens},
            "planner_ratio": p.ratio, "num_blocks": {"stock": p.stock.num_blocks,
                                                     "onepage": p.onepage.num_blocks},
            "max_concurrency": {m: pool.max_concurrency for m, pool in pools.items()},
            "requests_fit": {m: pool.whole_requests for m, pool in pools.items()},
            "max_num_seqs": seqs,
            "pinned_fraction_by_concurrency": pinned, "plan": plan(top).public()}


def mode_seqs(capb: dict[str, Any], mode: str) -> int:
    """The mode's max_num_seqs: one count for both, or each mode's own (planner admission)."""
    seqs = capb["max_num_seqs"]
    return seqs[mode] if isinstance(seqs, dict) else seqs


def admission_caps(capb: dict[str, Any]) -> dict[str, int]:
    return {m: mode_seqs(capb, m) for m in MODES}


def expected_running(capb: dict[str, Any], mode: str, concurrency: int) -> int:
    """What the planner says the engine runs with `concurrency` clients: the clients, capped
    by max_num_seqs and by the whole requests the pool holds."""
    return min(concurrency, mode_seqs(capb, mode), capb["requests_fit"][mode])


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
        lines += shared_prefix_markdown(result) + energy_markdown(result)
        return _capacity_markdown(result, lines)
    client = ("vLLM's `vllm bench serve` (random dataset, fixed lengths, --max-concurrency)"
              if w.get("client") == "vllm" else "r9k bench client (closed loop)")
    lines += [f"Workload: prompt {w['prompt_tokens']} tokens, {w['output_tokens']} output tokens "
              f"(greedy, ignore_eos), >= {w['requests_per_level']} requests per level; "
              f"{result['repeats']} repeats, order alternated; errors: {result['errors']}; "
              f"load: {client}.", "",
              "Means over repeats; ratios paired within a repeat, mean (min..max) and median.", "",
              "| concurrency | stock tok/s | one-page tok/s | ratio one-page/stock (min..max) "
              "| TTFT p50 stock | TTFT p50 one-page | ratio median | TTFT p50 ratio median |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["by_concurrency"]:
        s, o = row["stock"], row["onepage"]
        r = row["throughput_ratio_onepage_over_stock"]
        if not r.get("n") or not s["ttft_p50_s"].get("n") or not o["ttft_p50_s"].get("n"):
            continue
        lines.append(
            f"| {row['concurrency']} | {s['output_tokens_per_s']['mean']:.1f} | "
            f"{o['output_tokens_per_s']['mean']:.1f} | {r['mean']:.3f} ({r['min']:.3f}..{r['max']:.3f}) | "
            f"{1000 * s['ttft_p50_s']['mean']:.0f} ms | {1000 * o['ttft_p50_s']['mean']:.0f} ms | "
            f"{r['median']:.3f} | {_median_range(row['ttft_ratio_onepage_over_stock'], '.3f')} |")
    lines += energy_markdown(result)
    cross = crossover(result["by_concurrency"])
    if cross:
        lines += ["", f"Crossover: the median ratio rises through 1 for good between "
                  f"concurrency {cross['below']} and {cross['above']} "
                  f"(~{cross['concurrency']:.1f}, interpolated on log2 concurrency)."]
    elif len(result["by_concurrency"]) > 1:
        lines += ["", "Crossover: none; the median ratio does not rise through 1 to stay "
                  "above it over these levels."]
    return _capacity_markdown(result, lines)


def energy_markdown(result: dict[str, Any]) -> list[str]:
    """Joules per output token per level, stock vs one-page, or why it was not measured."""
    rows = [row for row in result["by_concurrency"]
            if any(row[m].get("joules_per_output_token", {}).get("n") for m in MODES)]
    if not rows:
        why = next((lv["energy"].get("why") for run in result.get("runs", [])
                    for lv in run["levels"] if lv.get("energy")), None)
        return ["", f"Joules per output token: not measured ({why or 'no energy readings'})."]
    lines = ["", "Energy over each level (the cards' power integrated, r9k.ops.energy): mean "
             "draw and joules per output token, mean over repeats; ratio paired within a repeat.",
             "", "| concurrency | stock W | one-page W | stock J/token | one-page J/token "
             "| ratio one-page/stock (min..max) |", "|---:|---:|---:|---:|---:|---:|"]

    def mean(x: dict[str, Any], fmt: str) -> str:
        return format(x["mean"], fmt) if x.get("n") else "-"
    for row in rows:
        s, o = row["stock"], row["onepage"]
        r = row["joules_per_token_ratio_onepage_over_stock"]
        ratio = f"{r['mean']:.3f} ({r['min']:.3f}..{r['max']:.3f})" if r.get("n") else "-"
        lines.append(f"| {row['concurrency']} | {mean(s['watts'], '.1f')} | {mean(o['watts'], '.1f')} "
                     f"| {mean(s['joules_per_output_token'], '.4f')} "
                     f"| {mean(o['joules_per_output_token'], '.4f')} | {ratio} |")
    return lines


def pool_markdown(result: dict[str, Any]) -> list[str]:
    """Observed scheduler peaks (/metrics samples) beside the planner's prediction, per level."""
    rows = [row for row in result["by_concurrency"]
            if any(row[m].get("peak_running", {}).get("n") for m in MODES)]
    if not rows:
        return []
    capb = result.get("capacity")
    interval = (result["workload"].get("sample_interval_s") or 0.5)
    caps = ""
    if capb:
        planner = isinstance(capb["max_num_seqs"], dict)
        caps = (f" (stock {mode_seqs(capb, 'stock')}, one-page {mode_seqs(capb, 'onepage')}"
                + (": each mode's whole requests, planner admission" if planner else "") + ")")
    lines = ["", f"Scheduler over each level (the replica's /metrics every {interval:g} s): "
             "peak running and waiting requests, peak KV usage, preemptions over the level; "
             "median over repeats (min..max). Planner: whole requests of max_model_len the "
             "pool holds ((num_blocks - 1) // blocks per request; vLLM logs num_blocks / blocks "
             f"per request), capped by the clients and max_num_seqs{caps}.", "",
             "| concurrency | mode | planner running | observed peak running | peak waiting "
             "| peak KV usage | preemptions |", "|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        for m, label in (("stock", "stock"), ("onepage", "one-page")):
            x = row[m]
            planned = "-" if not capb else (
                f"{expected_running(capb, m, row['concurrency'])} "
                f"(pool {capb['max_concurrency'][m]:.2f}x)")
            lines.append(f"| {row['concurrency']} | {label} | {planned} | "
                         f"{_median_range(x.get('peak_running', {}), '.0f')} | "
                         f"{_median_range(x.get('peak_waiting', {}), '.0f')} | "
                         f"{_median_range(x.get('peak_kv_usage', {}), '.0%')} | "
                         f"{_median_range(x.get('preemptions', {}), '.0f')} |")
    return lines


def _capacity_markdown(result: dict[str, Any], lines: list[str]) -> str:
    lines = lines + pool_markdown(result)
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
        shown = set()
        for c, p in capb["pinned_fraction_by_concurrency"].items():
            runs = p["running"]
            runs = f"{runs['stock']} / {runs['onepage']}" if isinstance(runs, dict) else runs
            if runs in shown:  # clients beyond both caps run what the caps allow: one row
                continue
            shown.add(runs)
            lines.append(f"| pool pinned by {runs} running | {p['stock']:.1%} | "
                         f"{p['onepage']:.1%} | |")
    return "\n".join(lines) + "\n"


def crossover(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the median one-page/stock throughput ratio rises through 1 for good (the last upward
    crossing; at light load the ratio may wander around 1): the pair of levels around it and the
    crossing, interpolated on log2 concurrency (the plot's axis); None when it never crosses
    upward (below 1 at the top, or never below 1)."""
    pts = [(r["concurrency"], r["throughput_ratio_onepage_over_stock"]["median"]) for r in rows
           if r["throughput_ratio_onepage_over_stock"].get("n")]
    for (c0, r0), (c1, r1) in reversed(list(zip(pts, pts[1:]))):
        if r1 < 1:
            return None
        if r0 < 1:
            x0, x1 = math.log2(c0), math.log2(c1)
            at = 2 ** (x0 + (1 - r0) * (x1 - x0) / (r1 - r0))
            return {"below": c0, "above": c1, "concurrency": at}
    return None


def _pool_series_run(result: dict[str, Any], mode: str) -> tuple[int, dict[str, Any]] | None:
    """The highest level of the first run of `mode` that has a sampled series."""
    for run in result.get("runs") or []:
        if run["mode"] != mode:
            continue
        levels = [lv for lv in run["levels"] if (lv.get("pool") or {}).get("samples")]
        if levels:
            lv = max(levels, key=lambda lv: lv["concurrency"])
            return lv["concurrency"], lv["pool"]
    return None


def plot(result: dict[str, Any], path: Path) -> bool:
    """Throughput per mode and the ratio against concurrency (the upward crossover of 1 marked
    when there is one); with sampled levels, running and waiting requests over time at the
    highest level, one replica run per mode, beside the planner's running requests."""
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
    series = {m: _pool_series_run(result, m) for m in MODES}
    with_pool = all(series.values())
    fig, axes = plt.subplots(1, 3 if with_pool else 2, figsize=(15 if with_pool else 10, 4))
    a1, a2 = axes[0], axes[1]
    for m, label in (("stock", "stock pages"), ("onepage", "one-page")):
        mean = [r[m]["output_tokens_per_s"]["mean"] for r in rows]
        lo = [r[m]["output_tokens_per_s"]["mean"] - r[m]["output_tokens_per_s"]["min"] for r in rows]
        hi = [r[m]["output_tokens_per_s"]["max"] - r[m]["output_tokens_per_s"]["mean"] for r in rows]
        a1.errorbar(cs, mean, yerr=[lo, hi], marker="o", capsize=3, label=label)
    a1.set_xlabel("concurrency")
    a1.set_ylabel("output tokens/s")
    a1.set_xscale("log", base=2)
    a1.set_title("output throughput (mean, min..max over repeats)")
    ratio = [r["throughput_ratio_onepage_over_stock"] for r in rows]
    a2.errorbar(cs, [x["median"] for x in ratio],
                yerr=[[x["median"] - x["min"] for x in ratio],
                      [x["max"] - x["median"] for x in ratio]],
                marker="o", capsize=3, color="C2")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("concurrency")
    a2.set_title("throughput ratio one-page / stock (median, min..max)")
    cross = crossover(rows)
    if cross:
        for ax in (a1, a2):
            ax.axvline(cross["concurrency"], color="C3", ls="--", lw=1,
                       label=f"crossover ~{cross['concurrency']:.1f}")
    capb = result.get("capacity")
    if capb and len(cs) > 1:
        for i, (m, label) in enumerate((("stock", "stock"), ("onepage", "one-page"))):
            fit = min(capb["requests_fit"][m], mode_seqs(capb, m))
            if cs[0] <= fit < cs[-1]:  # the pool (or max_num_seqs) caps running requests here
                for ax in (a1, a2):
                    ax.axvline(fit, color=f"C{i}", ls=":", lw=1,
                               label=f"{label} runs at most {fit} (planner)")
    a1.legend(fontsize=7)
    if a2.get_legend_handles_labels()[0]:
        a2.legend(loc="upper left", fontsize=7)
    if with_pool:
        a3 = axes[2]
        for i, (m, label) in enumerate((("stock", "stock"), ("onepage", "one-page"))):
            c, pool = series[m]
            ts = pool["series"]["t_s"]
            a3.step(ts, pool["series"]["running"], where="post", color=f"C{i}",
                    label=f"{label} running (x{c})")
            a3.step(ts, pool["series"]["waiting"], where="post", color=f"C{i}", ls=":",
                    label=f"{label} waiting")
            if capb:
                a3.axhline(expected_running(capb, m, c), color=f"C{i}", lw=0.8, ls="--",
                           label=f"{label} planner running")
        a3.set_xlabel("seconds into the level")
        a3.set_ylabel("requests")
        a3.set_title("engine scheduler (/metrics), first repeat")
        a3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def energy_for(host_root: str, cards: list[str] | None, sample_hz: float = 5.0) -> Energy | None:
    """A started meter over ``cards`` (every amdgpu card under ``host_root``: None) when one of
    them has a power or energy file; None (not measured) otherwise. Unknown cards: ValueError."""
    from r9k.ops import sysfs
    from r9k.ops.energy import EnergyMeter, source_of

    found = {c.bdf: c for c in sysfs.discover_cards(host_root, enrich=False)}
    unknown = [b for b in cards or [] if b not in found]
    if unknown:
        raise ValueError(f"--energy-cards: {', '.join(unknown)} not found under {host_root} "
                         f"(cards here: {', '.join(found) or 'none'})")
    chosen = [found[b] for b in (cards or list(found))]
    if not any(c.hwmon_dir is not None and source_of(c.hwmon_dir) for c in chosen):
        return None
    return Energy(EnergyMeter(host_root, sample_hz=sample_hz).start(), [c.bdf for c in chosen])
