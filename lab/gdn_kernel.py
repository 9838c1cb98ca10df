"""GDN spec-decode kernel benchmark: stock per-slot vs one-page fused vs one-page composed, on the
same inputs, side by side in one run.

Per configuration (sequences N, state dtype, k, head shape), every sequence verifies S = 1 + k
candidates and last step accepted `--accepted` tokens (stock resumes from slot accepted - 1 and
stores S states; one-page replays `accepted` record rows, stores one state, verifies S rows).
Kernels are timed inside CUDA graphs (as vLLM runs decode), so launch overhead is excluded; the
composed path is also timed eagerly through the step API (it synchronizes with the host).
Variants of the fused kernel that drop a stage show where its time goes.

    python -m lab.scripts.gdn_kernel                # 27B-TP2 grid, k = 7, fp32 and bf16
    python -m lab.scripts.gdn_kernel --out lab/results/gdn_kernel_h200.json

Writes JSON (times in microseconds, ratios to stock, modelled bytes moved, achieved bandwidth
against the measured device copy bandwidth) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from r9k.core.capacity import RECORD_SLOTS
from r9k.kernels.gpu_step import clear_flags
from r9k.kernels.onepage import GdnHeads, set_live
from r9k.kernels.triton_composed import StockTritonComposed, index_rows
from lab import fused_variants
from lab.fused_variants import DEP_ORDERED, OWN_PAIRS, measured
from r9k.kernels.launch_cache import CACHES
from r9k.kernels.triton_fused import onepage_fused_step


def _fused_step(variant: dict | None = None, **kw):
    """The shipped kernel (no variant), or the research kernel with a measured variant."""
    if variant is None:
        return onepage_fused_step(**kw)
    return fused_variants.onepage_fused_step(**kw, **variant)


def onepage_fused_step_kernel():
    from r9k.kernels.triton_fused import onepage_gdn_step_kernel

    return onepage_gdn_step_kernel


def _stock_kernel():
    from r9k.kernels._stock_loader import stock_spec_kernel

    return stock_spec_kernel()

SHAPES = {
    "27b-tp2": GdnHeads(num_k_heads=8, num_v_heads=24, head_k_dim=128, head_v_dim=128),
    # Flash-Next (Qwen4Exp) per rank, from the planner's flash-next preset (transformers'
    # Qwen4ExpTextConfig defaults: 16 key / 32 value heads, dims 128)
    "flash-next-tp2": GdnHeads(num_k_heads=8, num_v_heads=16, head_k_dim=128, head_v_dim=128),
    "flash-next-tp4": GdnHeads(num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# research-kernel variants (`lab.fused_variants` knobs) that --variants can time:
# knobs on the fenced kernel (`measured`), whatever the state dtype ships
VARIANTS = {
    # the count-in protocols that shipped before the own pairs ("fused"), on any state dtype
    "fenced": measured(),
    "dep_ordered": measured(**DEP_ORDERED),
    # the own-pair protocol as shipped for bf16 (`OWN_PAIRS`) and for fp32 (`OWN_PLAIN`), each
    # on any state dtype, and with one of the bf16 one's two load-order knobs
    "own_pairs": measured(**OWN_PAIRS),
    "own_plain": measured(own=True),
    "own_spec": measured(own=True, spec=True),
    "own_rows_end": measured(own=True, rows_end=True),
    # probe: the shipped protocol with replay rows skipping normalization and gates
    "own_no_prep": measured(**OWN_PAIRS, replay_prep=False),
    # probe: the own pairs' barrier before the flip left out
    "own_no_barrier": measured(**OWN_PAIRS, own_barrier=False),
    # the dependency-ordered one with ld.volatile flag reads (measured, not shipped)
    "dep_volatile_flag": measured(**DEP_ORDERED, flag_volatile=True),
    # probes: no record at all (the floor)
    "no_record": measured(stages=("replay", "verify")),
    # probes: the record's rows without its flag protocol, and the protocol without rows
    "rows_only": measured(record_parts=("rows",)),
    "flag_only": measured(record_parts=("flag",)),
    "late_rows_only": measured(late=True, record_parts=("rows",)),
    "late_flag_only": measured(late=True, record_parts=("flag",)),
    "verify_only": measured(stages=("verify",)),
    # probes: replay rows without their normalization and gates (as if the record held them)
    "dep_no_prep": measured(**DEP_ORDERED, replay_prep=False),
    "no_record_no_prep": measured(stages=("replay", "verify"), replay_prep=False),
    "replay_only": measured(stages=("replay",)),
    "no_prefetch": measured(prefetch=0),
    # register caps: maxnreg applies on CUDA, waves_per_eu on ROCm (the other is ignored)
    "fused_r80": measured(maxnreg=80),
    "fused_w16": measured(waves_per_eu=16),
    "p0_late_w16": measured(prefetch=0, late=True, waves_per_eu=16),
    "late": measured(late=True),
    "late_r80": measured(late=True, maxnreg=80),
    "late_riv": measured(late=True, rec_in_verify=True),
    "p0_late": measured(prefetch=0, late=True),
    "p0_late_r80": measured(prefetch=0, late=True, maxnreg=80),
    "p0_late_r72": measured(prefetch=0, late=True, maxnreg=72),
    # 8 programs per SM: TP2 N = 16 (1,024 programs) in one wave on 132 SMs, stock needs two
    "p0_late_r64": measured(prefetch=0, late=True, maxnreg=64),
    "p2_late_riv": measured(prefetch=2, late=True, rec_in_verify=True),
    "p2_late_riv_r80": measured(prefetch=2, late=True, rec_in_verify=True, maxnreg=80),
    # loads beside the flag read: the replay waits one round trip less
    "spec": measured(spec=True),
    "p2_spec": measured(prefetch=2, spec=True),
    "late_spec": measured(late=True, spec=True),
    "p2_late_spec": measured(prefetch=2, late=True, spec=True),
    "late_riv_spec": measured(late=True, rec_in_verify=True, spec=True),
    # record tiles stored after the verify loop
    "rows_end": measured(rows_end=True),
    "late_rows_end": measured(late=True, rows_end=True),
    "late_spec_rows_end": measured(late=True, spec=True, rows_end=True),
    "p0_late_rows_end": measured(prefetch=0, late=True, rows_end=True),
    # the count-in ordered by dependencies instead of a release fence / acquire flip
    "late_spec_dep": measured(late=True, spec=True, dep=True),
    "late_spec_dep_rows_end": measured(late=True, spec=True, dep=True, rows_end=True),
    "p2_late_spec_dep": measured(prefetch=2, late=True, spec=True, dep=True),
    "late_spec_dep_riv": measured(late=True, spec=True, dep=True, rec_in_verify=True),
    # probes: the count-in's contention (one add per program; no add at all)
    "dep_count_w0": measured(**DEP_ORDERED, count_probe=1),
    "dep_count_none": measured(**DEP_ORDERED, count_probe=2),
    "dep_rows_only": measured(**DEP_ORDERED, record_parts=("rows",)),
    "dep_flag_only": measured(**DEP_ORDERED, record_parts=("flag",)),
}


def copy_bandwidth_bytes_per_s(dev: str, nbytes: int = 2 << 30, reps: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)


def time_graph_us(fn, launches: int = 20, reps: int = 15) -> float:
    """Median per-launch time of `fn` captured `launches` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(samples)


def time_host_us(fn, calls: int = 200) -> float:
    """Eager calls back to back, one synchronization at the end: per-call time when the host
    (Python launch path) and not the GPU sets the pace."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def compiled_regs(kernel) -> list:
    """(registers, spills) of every compiled instance of a Triton kernel, with its constexprs."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):  # unwrap @triton.heuristics
        kernel = kernel.fn
    found = []
    for entry in kernel.device_caches.values():
        for key, ck in entry[0].items():
            found.append({"key": str(key)[-400:], "n_regs": getattr(ck, "n_regs", None),
                          "n_spills": getattr(ck, "n_spills", None)})
    return found


def time_eager_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def bench_config(heads: GdnHeads, n: int, state_dtype: torch.dtype, num_spec: int,
                 accepted: int, dev: str, eager_composed: bool, repeats: int = 5,
                 variants: tuple = (), composed: bool = True) -> dict:
    g = torch.Generator().manual_seed(n)
    HK, HV, K, V = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim
    S, W = 1 + num_spec, heads.record_row_width
    T = n * S

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    rows = dict(q=rnd(T, HK, K), k=rnd(T, HK, K), v=rnd(T, HV, V), a=rnd(T, HV), b=rnd(T, HV))
    A_log = torch.rand(HV, generator=g).to(dev)
    dt_bias = rnd(HV)
    cu = (torch.arange(n + 1) * S).to(torch.int32).to(dev)
    init = rnd(n, HV, V, K, scale=0.1, dtype=state_dtype)

    # stock: request i owns slots 1 + i*S ..; resumes from slot accepted-1, stores S states
    slot_pool = torch.zeros(1 + n * S, HV, V, K, dtype=state_dtype, device=dev)
    slot_rows = (1 + torch.arange(n)[:, None] * S + torch.arange(S)[None, :]).to(torch.int32)
    slot_rows = slot_rows.to(dev)
    slot_pool[slot_rows[:, accepted - 1].long()] = init
    acc = torch.full((n,), accepted, dtype=torch.int32, device=dev)
    stock = StockTritonComposed(A_log, dt_bias)

    def run_stock():
        stock._run(slot_pool, slot_rows, acc, rows["q"], rows["k"], rows["v"], rows["a"],
                   rows["b"], cu)

    # one-page: request i owns page 1 + i; a live record of S rows, `accepted` of them replayed
    pages = torch.arange(1, n + 1, dtype=torch.int32, device=dev)

    def onepage_pools():
        pool = torch.zeros(1 + n, HV, V, K, dtype=state_dtype, device=dev)
        pool[1:] = init
        record = rnd(1 + n, RECORD_SLOTS, S, W)
        flag = torch.zeros(1 + n, heads.flag_words, dtype=torch.int32,
                           device=dev)
        clear_flags(flag, pages)
        set_live(flag[1:], torch.full((n,), S), torch.zeros(n))
        return pool, record, flag

    fused_pools = onepage_pools()

    def run_fused(variant=None):
        pool, record, flag = fused_pools
        _fused_step(variant, **rows, A_log=A_log, dt_bias=dt_bias, ssm_state=pool, record=record,
                    flag=flag, state_indices=pages, num_accepted=acc, cu_seqlens=cu)

    # composed kernels only: the two stock launches one-page makes (indices prebuilt)
    comp_pool = onepage_pools()[0]
    rep_rows = fused_pools[1][1:, 0, :accepted].reshape(n * accepted, W)
    kd, vd = HK * K, HV * V
    rk = rep_rows[:, :kd].reshape(-1, HK, K).contiguous()
    rv = rep_rows[:, kd:kd + vd].reshape(-1, HV, V).contiguous()
    ra = rep_rows[:, kd + vd:kd + vd + HV].contiguous()
    rb = rep_rows[:, kd + vd + HV:].contiguous()
    rep_cu = (torch.arange(n + 1) * accepted).to(torch.int32).to(dev)
    rep_idx = index_rows(pages, torch.full_like(pages, accepted - 1), accepted)
    ver_idx = index_rows(pages, torch.full_like(pages, S), S + 1)
    ver_acc = torch.full((n,), S + 1, dtype=torch.int32, device=dev)

    def run_composed_kernels():
        stock._run(comp_pool, rep_idx, acc, rk, rk, rv, ra, rb, rep_cu)
        stock._run(comp_pool, ver_idx, ver_acc, rows["q"], rows["k"], rows["v"], rows["a"],
                   rows["b"], cu)

    res = {"num_seqs": n, "state_dtype": str(state_dtype).replace("torch.", ""),
           "num_spec": num_spec, "accepted": accepted}
    fns = {"stock": run_stock, "fused": run_fused}
    for name in variants:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        fns[name] = (lambda kw=VARIANTS[name]: run_fused(kw))
    # each variant that records must leave exactly the shipped kernel's bits (one step on
    # fresh pools); stage-dropping variants are timing probes only
    bits = {}
    ref = None
    base = onepage_pools()
    probes = ("stages", "record_parts", "replay_prep", "count_probe", "own_barrier")
    for name in ["fused"] + [v_ for v_ in variants if not set(probes) & set(VARIANTS[v_])]:
        pool, record, flag = (x_.clone() for x_ in base)
        out = _fused_step(VARIANTS.get(name), **rows, A_log=A_log, dt_bias=dt_bias,
                          ssm_state=pool, record=record, flag=flag, state_indices=pages,
                          num_accepted=acc, cu_seqlens=cu)
        got = (out, pool, record, flag)
        if ref is None:
            ref = got
        else:
            bits[name] = all(torch.equal(x_, y_) for x_, y_ in zip(got, ref))
    res["bit_identical_to_fused"] = bits
    if composed:
        fns["composed_kernels"] = run_composed_kernels
    # repeats interleave the variants (side by side); each sample is a median over graph
    # replays, the reported time the median over repeats
    samples = {k_: [] for k_ in fns}
    for _ in range(repeats):
        for k_, f in fns.items():
            samples[k_].append(time_graph_us(f))
    t = {k_: statistics.median(v_) for k_, v_ in samples.items()}
    res["samples_us"] = {k_: [round(x, 2) for x in v_] for k_, v_ in samples.items()}
    # the fused/stock ratio per repeat (one repeat's two numbers were measured back to back)
    res["fused_ratio_per_repeat"] = [round(f_ / s_, 3) for f_, s_ in
                                     zip(samples["fused"], samples["stock"])]
    t["stock_eager_host"] = time_host_us(run_stock)
    t["fused_eager_host"] = time_host_us(run_fused)
    # without the memoized config: the layout checks and kernel config recomputed on every call
    t["fused_eager_host_unmemoized"] = time_host_us(lambda: (CACHES.configs.clear(), run_fused()))
    res["time_us"] = {k_: round(v_, 2) for k_, v_ in t.items()}
    res["ratio_to_stock"] = {k_: round(v_ / t["stock"], 3) for k_, v_ in t.items()}

    es = torch.finfo(state_dtype).bits // 8
    state = n * HV * V * K * es
    inputs = T * (2 * HK * K + HV * V + 2 * HV) * 2
    outputs = T * HV * V * 2
    rec_row = W * 2
    bytes_moved = {
        "stock": state * (1 + S) + inputs + outputs,
        "fused": 2 * state + n * accepted * rec_row + inputs + outputs + T * rec_row,
        "fused_no_prefetch": 2 * state + n * accepted * rec_row + inputs + outputs + T * rec_row,
        "composed_kernels": 3 * state + n * accepted * (rec_row + HK * K * 2) + inputs + outputs,
    }
    bytes_moved = {k_: v_ for k_, v_ in bytes_moved.items() if k_ in t}
    res["bytes_moved"] = bytes_moved
    res["achieved_bytes_per_s"] = {k_: bytes_moved[k_] / (t[k_] * 1e-6) for k_ in bytes_moved}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1,4,16,64,256")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--shapes", default="27b-tp2")
    ap.add_argument("--num-spec", type=int, default=7)
    ap.add_argument("--accepted", type=int, default=4, help="tokens accepted last step (replayed)")
    ap.add_argument("--no-eager-composed", action="store_true")
    ap.add_argument("--no-composed", action="store_true", help="skip the composed kernels")
    ap.add_argument("--repeats", type=int, default=5, help="side-by-side repeats (median)")
    ap.add_argument("--variants", default="", help="fused variants to time besides 'fused' "
                    f"(comma list of {', '.join(VARIANTS)})")
    ap.add_argument("--out", default="lab/results/gdn_kernel.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA or ROCm GPU", file=sys.stderr)
        return 2
    if not 1 <= args.accepted <= args.num_spec + 1:
        print(f"--accepted must be in 1..{args.num_spec + 1}", file=sys.stderr)
        return 2
    import triton

    dev = "cuda"
    copy_bw = copy_bandwidth_bytes_per_s(dev)
    results = []
    for shape in args.shapes.split(","):
        for dname in args.dtypes.split(","):
            for n in map(int, args.seqs.split(",")):
                r = bench_config(SHAPES[shape], n, DTYPES[dname], args.num_spec, args.accepted,
                                 dev, not args.no_eager_composed, args.repeats,
                                 tuple(x for x in args.variants.split(",") if x),
                                 not args.no_composed)
                r["shape"] = shape
                r["bw_fraction_of_copy"] = {k: round(v / copy_bw, 3)
                                            for k, v in r["achieved_bytes_per_s"].items()}
                results.append(r)
                torch.cuda.empty_cache()
    doc = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "method": (f"per-launch time: median of {args.repeats} side-by-side repeats (variants "
                   "interleaved), each the median of 15 replays of a CUDA graph of 20 launches; "
                   "*_eager_host: eager calls back to back, one sync at the end"),
        "compiled": {"fused": compiled_regs(onepage_fused_step_kernel()),
                     "stock": compiled_regs(_stock_kernel())},
        "command": "python -m lab.scripts.gdn_kernel " + " ".join(argv or sys.argv[1:]),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    cols = [c for c in ["stock", "fused", *VARIANTS, "composed_kernels",
                        "stock_eager_host", "fused_eager_host", "composed_step_eager"]
            if any(c in r["time_us"] for r in results)]
    print(f"{doc['device']}  copy bandwidth {copy_bw / 1e12:.2f} TB/s  k={args.num_spec} "
          f"accepted={args.accepted}  (us; ratio to stock in brackets)")
    print(f"{'shape':15} {'state':8} {'N':>4} " + " ".join(f"{c:>20}" for c in cols))
    for r in results:
        cells = []
        for c in cols:
            if c in r["time_us"]:
                cells.append(f"{r['time_us'][c]:>8.2f} [{r['ratio_to_stock'][c]:5.3f}]")
            else:
                cells.append("-")
        print(f"{r['shape']:15} {r['state_dtype']:8} {r['num_seqs']:>4} "
              + " ".join(f"{c:>20}" for c in cells))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
