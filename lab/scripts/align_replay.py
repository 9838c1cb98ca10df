"""Host cost per step of prefix caching's one-page copies, with and without a replay plan, on a GPU.

vLLM calls its two align copy kernels every step outside its CUDA graphs; with one-page pages
the plugin replays each one-page layer there. This times one call's replay over L layers in G
groups (the perf model: 24 GDN layers in 3 groups), N requests, side by side in one run:
- `before`: the per-layer path without a replay plan: pair filtering, three page-copy
  launches, the fused kernel with its layout checks and config, a flag gather / where /
  scatter (reproduced here);
- `plan_eager`: `ReplayPlan.replay` (one word-copy launch, the fused kernel per layer, one
  flag-clear launch), launched from Python;
- `plan_graph`: the same captured once in a CUDA graph and replayed (what `r9k.plugin.align_graphs`
  does for a launch that repeats).
With no pair to copy (most steps) and with every request copying. The pages each path leaves
are compared with torch.equal. Times: microseconds per call, eager calls back to back with one
synchronization at the end, median over repeats.

    python -m lab.scripts.align_replay --out lab/results/align_replay_h200.json
"""
from __future__ import annotations

from lab import command_line

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from lab.gdn_kernel import time_host_us
from r9k.kernels.onepage import GdnHeads
from lab.simulate import recycled_flags
from r9k.kernels.triton_align import ReplayLayer, ReplayPlan
from r9k.kernels.launch_cache import CACHES
from r9k.kernels.triton_fused import onepage_fused_step
from r9k.core.page_layout import RECORD_SLOTS

HEADS = GdnHeads(num_k_heads=8, num_v_heads=24, head_k_dim=128, head_v_dim=128)  # 27B TP2


@triton.jit
def _before_copy_kernel(src_pages_ptr, dst_pages_ptr, base_ptr, page_stride, page_elems,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_pages_ptr + i).to(tl.int64)
    dst = tl.load(dst_pages_ptr + i).to(tl.int64)
    if (src <= 0) | (dst <= 0) | (src == dst):
        return
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_elems
    x = tl.load(base_ptr + src * page_stride + offs, mask=mask)
    tl.store(base_ptr + dst * page_stride + offs, x, mask=mask)


def before_replay_into(layer: ReplayLayer, src_pages, dst_pages, num_rows) -> None:
    """The per-layer `onepage_replay_into` (no replay plan) for one layer, launch for launch."""
    n = src_pages.numel()
    valid = (src_pages > 0) & (dst_pages > 0)
    src = torch.where(valid, src_pages, 0).to(torch.int32)
    dst = torch.where(valid, dst_pages, 0).to(torch.int32)
    for t in (layer.ssm_state, layer.record, layer.flag):
        bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            t.element_size()])
        elems = t[0].numel()
        _before_copy_kernel[(n, triton.cdiv(elems, 1024))](src, dst, bits, bits.stride(0), elems,
                                                           BLOCK=1024)
    HV, V, K = layer.ssm_state.shape[1:]
    dev, dt = layer.ssm_state.device, layer.record.dtype
    none = torch.empty((0, layer.num_k_heads, K), dtype=dt, device=dev)
    CACHES.configs.clear()  # the per-layer path checks the layout and builds the config on every call
    onepage_fused_step(
        q=none, k=none, v=torch.empty((0, HV, V), dtype=dt, device=dev),
        a=torch.empty((0, HV), dtype=dt, device=dev), b=torch.empty((0, HV), dtype=dt, device=dev),
        A_log=layer.A_log, dt_bias=layer.dt_bias, ssm_state=layer.ssm_state,
        record=layer.record, flag=layer.flag, state_indices=dst,
        num_accepted=num_rows.to(torch.int32), cu_seqlens=torch.zeros(n + 1, dtype=torch.int32,
                                                                      device=dev))
    dst_l = dst.long()
    flag = layer.flag
    flag[dst_l] = torch.where(valid[:, None], torch.zeros_like(flag[dst_l]), flag[dst_l])


def make_layers(g, num_layers: int, num_groups: int, slots: int, S: int, state_dtype, dev):
    h = HEADS
    layers = []
    for i in range(num_layers):
        state = (torch.randn((slots, h.num_v_heads, h.head_v_dim, h.head_k_dim), generator=g)
                 * 0.1).to(state_dtype).to(dev)
        record = torch.randn((slots, RECORD_SLOTS, S, h.record_row_width), generator=g).to(
            torch.bfloat16).to(dev)
        flag = recycled_flags(g, slots, S, h).to(dev)
        layers.append(ReplayLayer(torch.rand(h.num_v_heads, generator=g).mul(2).to(dev),
                                  torch.randn(h.num_v_heads, generator=g).to(torch.bfloat16).to(dev),
                                  state, record, flag, h.num_k_heads, i % num_groups))
    return layers


def clone_layers(layers):
    return [la._replace(ssm_state=la.ssm_state.clone(), record=la.record.clone(),
                        flag=la.flag.clone()) for la in layers]


def bench(n: int, copying: bool, num_layers: int, num_groups: int, state_dtype, repeats: int,
          calls: int, dev: str) -> dict:
    g = torch.Generator().manual_seed(n)
    S, slots = 4, 1 + 2 * n * num_groups
    layers = make_layers(g, num_layers, num_groups, slots, S, state_dtype, dev)
    if copying:  # request i of group j: page 1 + j*n + i -> page 1 + (G + j)*n + i
        base = torch.arange(n, dtype=torch.int32)[None, :] + 1 + n * torch.arange(
            num_groups, dtype=torch.int32)[:, None]
        src, dst = base.to(dev), (base + n * num_groups).to(dev)
        rows = (torch.arange(n, dtype=torch.int32) % S + 1).to(dev)
    else:
        src = torch.zeros((num_groups, n), dtype=torch.int32, device=dev)
        dst, rows = src.clone(), torch.zeros(n, dtype=torch.int32, device=dev)
    # bits: each path once on fresh copies
    ref, plan_layers = clone_layers(layers), clone_layers(layers)
    for la in ref:
        before_replay_into(la, src[la.group], dst[la.group], rows)
    ReplayPlan(plan_layers).replay(src, dst, rows)
    torch.cuda.synchronize()
    equal = all(torch.equal(getattr(a, f), getattr(b, f)) for a, b in zip(ref, plan_layers)
                for f in ("ssm_state", "record", "flag"))
    plan = ReplayPlan(layers)

    def before():
        for la in layers:
            before_replay_into(la, src[la.group], dst[la.group], rows)

    def plan_eager():
        plan.replay(src, dst, rows)

    plan_eager()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_eager()
    fns = {"before": before, "plan_eager": plan_eager, "plan_graph": graph.replay}
    samples = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved: side by side
        for k, f in fns.items():
            samples[k].append(time_host_us(f, calls))
    t = {k: statistics.median(v) for k, v in samples.items()}
    return {"num_reqs": n, "copying": copying, "num_layers": num_layers,
            "num_groups": num_groups, "state_dtype": str(state_dtype).removeprefix("torch."),
            "bits_equal_before_vs_plan": equal,
            "time_us": {k: round(v, 1) for k, v in t.items()},
            "samples_us": {k: [round(x, 1) for x in v] for k, v in samples.items()},
            "ratio_to_before": {k: round(v / t["before"], 3) for k, v in t.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1,4,16")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for dt in args.dtypes.split(","):
        for n in (int(x) for x in args.seqs.split(",")):
            for copying in (False, True):
                r = bench(n, copying, args.layers, args.groups, dtypes[dt], args.repeats,
                          args.calls, "cuda")
                rows.append(r)
                print(f"{dt} N={n:3d} {'copy' if copying else 'none'}: "
                      + ", ".join(f"{k} {v:8.1f} us" for k, v in r["time_us"].items())
                      + f"  bits equal {r['bits_equal_before_vs_plan']}", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "command": command_line("python")}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all(r["bits_equal_before_vs_plan"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
