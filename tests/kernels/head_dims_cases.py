"""Run under TRITON_INTERPRET=1 (by test_head_dims_agree.py): the fused one-page kernel's launch
over a grid of GDN head dims, each two verify steps through `onepage_spec_step` against the
composed path (vLLM's stock Triton kernel, per-slot): outputs, pages, records and flags equal.
Prints one JSON line per (K, V): served (bit-identical) or refused (the launcher's message)."""
import json
import os
import sys

import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

from r9k.kernels.gpu_step import clear_flags, onepage_spec_step  # noqa: E402
from r9k.kernels.onepage import GdnHeads  # noqa: E402
from triton_interpret_cases import random_rows  # noqa: E402  (this directory: the same rows)


def case(K: int, V: int) -> int:
    g = torch.Generator().manual_seed(K * 1000 + V)
    HK, HV, S, n = 1, 2, 3, 2
    W = HK * K + HV * V + 2 * HV
    A_log, dt_bias = torch.rand(HV, generator=g), torch.randn(HV, generator=g).bfloat16()
    pools = {}
    for impl in ("fused", "composed"):
        g2 = torch.Generator().manual_seed(8)
        pools[impl] = [(torch.randn(n + 1, HV, V, K, generator=g2) * 0.1).float(),
                       torch.randn(n + 1, 2, S, W, generator=g2).bfloat16(),
                       torch.zeros(n + 1, GdnHeads(HK, HV, K, V).flag_words, dtype=torch.int32)]
        clear_flags(pools[impl][2], torch.tensor([1, 2, 0], dtype=torch.int32))
    pages = torch.tensor([2, 1], dtype=torch.int32)
    acc = torch.ones(n, dtype=torch.int32)
    rows_compared = 0
    for step in range(2):
        lens = torch.randint(1, S + 1, (n,), generator=g)
        cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
        T = int(cu[-1])
        rows = random_rows(g, T, HK, HV, K, V)
        outs = {impl: onepage_spec_step(**rows, A_log=A_log, dt_bias=dt_bias, ssm_state=st,
                                        record=rec, flag=fl, state_indices=pages,
                                        num_accepted=acc, cu_seqlens=cu, impl=impl)
                for impl, (st, rec, fl) in pools.items()}
        assert torch.equal(outs["fused"], outs["composed"]), f"{K}x{V} step {step} outputs"
        for name, a_, b_ in zip(("state", "record", "flag"), pools["fused"], pools["composed"]):
            assert torch.equal(a_, b_), f"{K}x{V} step {step} {name}"
        rows_compared += T
        acc = torch.stack([torch.randint(1, int(t) + 1, (1,), generator=g)[0]
                           for t in lens]).to(torch.int32)
    return rows_compared


for pair in sys.argv[1:]:
    K, V = (int(x) for x in pair.split("x"))
    try:
        rows = case(K, V)
        print(json.dumps({"K": K, "V": V, "served": True, "rows": rows}), flush=True)
    except ValueError as exc:  # the launcher refused the heads (a bit mismatch asserts instead)
        print(json.dumps({"K": K, "V": V, "served": False, "error": str(exc)}), flush=True)
