"""Run under one vLLM release (its staged sources first on PYTHONPATH, or the installed 0.32):
the one-page CPU layer's spec conv (`r9k.plugin.gdn_cpu._conv_update`, with the release's
`r9k.compat` adapter) against the release's own `_spec_forward` conv, step after step on the
same pages, and which of them takes the native AMX/ARM conv. Prints one JSON line.

The release's GDN op is replaced by one that hands back its q (the conv output, as the fake
layer splits it): the recurrence is not what differs between releases, and 0.33/0.34's compiled
ops are not here."""
from __future__ import annotations

import json
import types

import torch

import vllm
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as stock

from r9k import compat
from r9k.plugin import gdn_cpu

WIDTH = 4


def _layer(dim, dtype, gen):
    weight = torch.randn(dim, 1, WIDTH, generator=gen).to(dtype)
    return types.SimpleNamespace(
        conv1d=types.SimpleNamespace(weight=weight, bias=torch.randn(dim, generator=gen).to(dtype)),
        activation="silu", A_log=None, dt_bias=None,
        rearrange_mixed_qkv=lambda x: (x.unsqueeze(0),) * 3)


def _metadata(pages, qsl, num_accepted, k):
    n = pages.numel()
    rows = torch.zeros(n, k + 1, dtype=torch.int32)
    rows[:, 0] = pages
    return types.SimpleNamespace(num_spec_decodes=n, spec_state_indices_tensor=rows,
                                 spec_query_start_loc=qsl, num_accepted_tokens=num_accepted)


def _steps(gen, n, k, steps, uniform, left_aligned):
    """Per step: rows per sequence (1..k+1, full and short) and accepted counts: 1 to the last
    step's rows (0.33+'s left-aligned window takes more accepted than new rows), or to the
    smaller of the last and this step's rows (0.32's roll cannot)."""
    last = torch.ones(n, dtype=torch.int32)
    for _ in range(steps):
        if uniform:
            q = torch.full((n,), int(torch.randint(1, k + 2, (1,), generator=gen)), dtype=torch.int32)
        else:
            q = torch.randint(1, k + 2, (n,), generator=gen, dtype=torch.int32)
        top = last if left_aligned else torch.minimum(last, q)
        acc = torch.stack([torch.randint(1, int(t) + 1, (1,), generator=gen)[0]
                           for t in top]).to(torch.int32)
        yield q, acc
        last = q


def _run_r9k(version, layer, x, buf, pages, qsl, acc):
    compat.select(version)
    return gdn_cpu._conv_update(layer, x, buf, pages, qsl, acc, WIDTH)


def main() -> None:
    version = vllm.__version__
    other = "0.33.0" if compat.series(version) == "0.32" else "0.32.0"
    stock.ops = types.SimpleNamespace(
        fused_sigmoid_gating_delta_rule_update_spec_cpu=lambda **kw: kw["q"].clone())
    left_aligned = compat.series(version) != "0.32"
    out = {"version": version, "cases": 0, "steps": 0, "equal": 0, "short_rows": 0,
           "accepted_over_rows": 0, "batched": 0, "other_release_differs": 0, "native": []}
    calls = {"batched": 0}
    batched = gdn_cpu._conv_update_batched

    def counting(*a, **kw):
        calls["batched"] += 1
        return batched(*a, **kw)

    gdn_cpu._conv_update_batched = counting
    amx = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: False  # the torch conv (the native one is vLLM's)
    for seed, (n, k, dtype, uniform) in enumerate(
            [(n, k, dt, u) for n in (1, 3) for k in (1, 3, 7)
             for dt in (torch.float32, torch.bfloat16) for u in (True, False)]):
        gen = torch.Generator().manual_seed(seed)
        dim, slots = 24, 6
        layer = _layer(dim, dtype, gen)
        state_len = WIDTH - 1 + k
        init = torch.randn(slots, dim, state_len, generator=gen).to(dtype)
        bufs = {"stock": init.clone(), "r9k": init.clone(), "other": init.clone()}
        pages = torch.randperm(slots - 1, generator=gen)[:n].to(torch.int32) + 1
        out["cases"] += 1
        for q, acc in _steps(gen, n, k, 6, uniform, left_aligned):
            qsl = torch.zeros(n + 1, dtype=torch.int32)
            qsl[1:] = torch.cumsum(q, 0)
            x = torch.randn(int(qsl[-1]), dim, generator=gen).to(dtype)
            md = _metadata(pages, qsl, acc, k)
            y_stock = stock._spec_forward(layer, md, x, None, None, bufs["stock"], None, WIDTH,
                                          state_len)
            y = _run_r9k(version, layer, x, bufs["r9k"], pages, qsl, acc)
            over = bool((acc > q).any())  # 0.32's roll cannot run these
            if not over:
                _run_r9k(other, layer, x, bufs["other"], pages, qsl, acc)
            out["steps"] += 1
            out["short_rows"] += int((q < k + 1).sum())
            out["accepted_over_rows"] += int(over)
            out["equal"] += int(torch.equal(y, y_stock) and torch.equal(bufs["r9k"], bufs["stock"]))
            out["other_release_differs"] += int(not over and not torch.equal(bufs["other"],
                                                                              bufs["stock"]))
            bufs["other"].copy_(bufs["stock"])  # each step from the same pages
    out["batched"] = calls["batched"]

    # the native conv's gate: both run it or neither (recorded, not run: no AMX here)
    taken = []
    stock._causal_conv1d_update_cpu = lambda **kw: (taken.append(1), torch.zeros_like(kw["x"]))[1]
    torch.cpu._is_amx_tile_supported = lambda: True
    out["amx_here"] = bool(amx())
    gen = torch.Generator().manual_seed(99)
    for k in (1, 3):
        state_len = WIDTH - 1 + k
        layer = _layer(8, torch.float32, gen)
        for q_i in range(1, k + 2):
            n = 2
            pages = torch.tensor([1, 2], dtype=torch.int32)
            qsl = torch.arange(n + 1, dtype=torch.int32) * q_i
            acc = torch.ones(n, dtype=torch.int32)
            x = torch.randn(n * q_i, 8, generator=gen)
            buf = torch.randn(4, 8, state_len, generator=gen)
            taken.clear()
            stock._spec_forward(layer, _metadata(pages, qsl, acc, k), x, None, None, buf.clone(),
                                None, WIDTH, state_len)
            stock_native = bool(taken)
            taken.clear()
            _run_r9k(version, layer, x, buf.clone(), pages, qsl, acc)
            out["native"].append([k, q_i, stock_native, bool(taken)])
    ops = __import__(compat.for_version(version).cpu.ops_module, fromlist=["_"])
    out["ops_module"] = ops.__name__
    out["ops_module_has_op"] = hasattr(ops, "fused_sigmoid_gating_delta_rule_update_spec_cpu")
    print("R9K-CONV " + json.dumps(out))


if __name__ == "__main__":
    main()
