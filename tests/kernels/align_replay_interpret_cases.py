"""Run under TRITON_INTERPRET=1 (by test_align_replay_interpret.py): prefix caching's one-page
copies on the GPU path's kernels (`r9k.kernels.triton_align`) on CPU tensors at tiny shapes.
Prints one line per case and 'ok <n> cases'; any mismatch raises."""
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

from r9k.kernels.onepage import GdnHeads  # noqa: E402
from lab.simulate import ALIGN_EVENTS, recycled_flags, run_align_simulation  # noqa: E402
from r9k.kernels.triton_align import ReplayLayer, ReplayPlan, onepage_replay_into  # noqa: E402
from lab.triton_sim import FusedStepChecked, ReplayIntoChecked, composed_backend  # noqa: E402
from r9k.core.page_layout import RECORD_SLOTS  # noqa: E402

TINY = GdnHeads(num_k_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64)


def simulation_cases() -> int:
    """Stock's slot copies vs the Triton replay (one layer) over random align events."""
    for dtype, k in ((torch.float32, 3), (torch.bfloat16, 7)):
        copies = ReplayIntoChecked()
        counts, replayed = run_align_simulation(
            composed_backend, TINY, dtype, num_seqs=3, num_spec=k, steps=5, seed=k,
            onepage_step=FusedStepChecked(), replay_into_fn=copies)
        assert all(counts[e] > 0 for e in ALIGN_EVENTS if e != "none"), counts
        assert copies.copies > 0 and max(replayed) > 1, (copies.copies, replayed)
        print(f"simulation {dtype} k={k}: {counts} copies {copies.copies}", flush=True)
    return 2


def _layer(g, heads, slots, S, dtype, group):
    h = heads
    state = (torch.randn((slots, h.num_v_heads, h.head_v_dim, h.head_k_dim), generator=g)
             * 0.1).to(dtype)
    record = torch.randn((slots, RECORD_SLOTS, S, h.record_row_width), generator=g).to(
        torch.bfloat16)
    flag = recycled_flags(g, slots, S, h)
    A_log = torch.rand(h.num_v_heads, generator=g) * 2
    dt_bias = torch.randn(h.num_v_heads, generator=g).to(torch.bfloat16)
    return ReplayLayer(A_log, dt_bias, state, record, flag, h.num_k_heads, group)


def plan_case() -> int:
    """Four layers in two groups, one `ReplayPlan` launch set against `onepage_replay_into` per
    layer on copies: every page equal. Pairs: copies into fresh pages, in place (src == dst),
    and null pairs (both pages 0, as `align_pairs` writes them) that must change nothing."""
    g = torch.Generator().manual_seed(11)
    S, slots, n = 4, 12, 4
    layers = [_layer(g, TINY, slots, S, dt, grp) for grp, dt in
              ((0, torch.float32), (0, torch.float32), (1, torch.bfloat16), (1, torch.bfloat16))]
    src = torch.tensor([[1, 2, 0, 3], [4, 5, 0, 6]], dtype=torch.int32)
    dst = torch.tensor([[7, 2, 0, 8], [9, 5, 0, 10]], dtype=torch.int32)
    rows = torch.tensor([1, 3, 0, 4], dtype=torch.int32)
    ref = [layer._replace(ssm_state=layer.ssm_state.clone(), record=layer.record.clone(),
                          flag=layer.flag.clone()) for layer in layers]
    before = [layer.ssm_state.clone() for layer in layers]
    ReplayPlan(layers).replay(src, dst, rows)
    for layer in ref:
        onepage_replay_into(A_log=layer.A_log, dt_bias=layer.dt_bias, ssm_state=layer.ssm_state,
                            record=layer.record, flag=layer.flag, src_pages=src[layer.group],
                            dst_pages=dst[layer.group], num_rows=rows,
                            num_k_heads=layer.num_k_heads)
    for i, (a, b) in enumerate(zip(layers, ref)):
        for name in ("ssm_state", "record", "flag"):
            assert torch.equal(getattr(a, name), getattr(b, name)), f"layer {i} {name}"
        d = dst[a.group].long()
        assert int(a.flag[d[d > 0]].abs().sum()) == 0, f"layer {i}: destination flags"
        changed = (a.ssm_state != before[i]).flatten(1).any(1)
        assert bool(changed[d[d > 0]].all()), f"layer {i}: a destination kept its checkpoint"
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[d] = False
        assert not bool(changed[untouched].any()), f"layer {i}: a page outside the pairs moved"
    print("plan case: 4 layers in 2 groups equal per-layer replays", flush=True)
    try:  # pages must be whole contiguous words
        ReplayPlan([layers[0]._replace(ssm_state=layers[0].ssm_state.transpose(2, 3))])
    except ValueError as exc:
        assert "contiguous" in str(exc), exc
    else:
        raise AssertionError("a non-contiguous page was accepted")
    try:
        ReplayPlan(layers).replay(src[:1], dst[:1], rows)
    except ValueError as exc:
        assert "[2, 4]" in str(exc), exc
    else:
        raise AssertionError("pages for one group were accepted for two")
    return 1


if __name__ == "__main__":
    n = plan_case() + simulation_cases()
    print(f"ok {n} cases")
