"""Run under TRITON_INTERPRET=1 (by test_triton_interpret.py): the fused one-page kernel and the
composed stock-kernel path on CPU tensors at tiny shapes, against stock per-slot decoding.
Prints one line per case and 'ok <n> cases'; any mismatch raises."""
import os
import sys

import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

from r9k.kernels.gpu_step import clear_flags, onepage_spec_step  # noqa: E402
from r9k.kernels.onepage import GdnHeads  # noqa: E402
from lab.simulate import SimConfig, run_simulation  # noqa: E402
from lab.fused_variants import DEP_ORDERED, checked, measured  # noqa: E402
from lab.triton_sim import FusedStepChecked, composed_backend  # noqa: E402

# 1 key head, 2 value heads (GQA 2), K = V = 64: two V blocks per head, so several programs of
# one page count in (the interpreter runs them one after another: this checks the counting,
# not the ordering under a race, which the GPU tests exercise); small enough for the
# interpreter
TINY = GdnHeads(num_k_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64)

CASES = [
    dict(num_seqs=2, num_spec=3, steps=4, state_dtype=torch.float32, seed=1),
    dict(num_seqs=2, num_spec=3, steps=4, state_dtype=torch.bfloat16, seed=2),
    dict(num_seqs=3, num_spec=7, steps=4, row_map=True, null_pages=1, seed=3),
    dict(num_seqs=3, num_spec=7, steps=2, state_dtype=torch.bfloat16, row_map=True,
         null_pages=1, layers=2, seed=4),
    dict(num_seqs=2, num_spec=3, steps=3, lockstep_copies=True, seed=5),
]
# the fused kernel's measured variants (gdn_kernel.py: prefetch modes, the late count-in, record
# rows from the verify loop, loads beside the flag read, record tiles stored last, the fenced
# protocol on bf16) on one case: kept bit-identical too
VARIANT_CASE = dict(num_seqs=3, num_spec=7, steps=4, state_dtype=torch.bfloat16, row_map=True,
                    null_pages=1, seed=6)
VARIANTS = [measured(prefetch=0), measured(late=True),
            measured(prefetch=2, late=True, rec_in_verify=True),
            measured(late=True, spec=True),
            measured(prefetch=2, spec=True), measured(late=True, rows_end=True),
            measured(),  # the fenced protocol
            measured(**DEP_ORDERED),  # the dependency-ordered one
            measured(own=True), measured(own=True, spec=True, prefetch=2)]  # own pairs
# the count-in protocols on fp32 state
CROSS = [(CASES[0], measured(**DEP_ORDERED)), (CASES[0], measured())]


def sim_cases() -> int:
    cases = ([(c, {}) for c in CASES] + [(VARIANT_CASE, v) for v in VARIANTS] + CROSS)
    for case, variant in cases:
        chk = checked(**variant) if variant else FusedStepChecked()
        st = run_simulation(SimConfig(TINY, **case), composed_backend, onepage_step=chk)
        assert chk.steps == st.steps * case.get("layers", 1)
        assert st.replay_hist[0] > 0 and sum(v for r, v in st.replay_hist.items() if r > 0) > 0
        print(f"sim {case} {variant}: rows {st.compared_rows} "
              f"replay {dict(st.replay_hist)}", flush=True)
    return len(cases)


def api_case() -> int:
    """onepage_spec_step, fused vs composed, K != V, [slots, HV, V, K] pool, null page, a
    zero-length step; fp32 and bf16 state."""
    for state_dtype in (torch.float32, torch.bfloat16):
        _api_case(state_dtype)
    return 2


def random_rows(g, T: int, HK: int, HV: int, K: int, V: int) -> dict:
    """T post-conv verify rows (q, k, v, a, b) in bf16, as the layer hands them to the step."""
    return dict(q=torch.randn(T, HK, K, generator=g).bfloat16(),
                k=torch.randn(T, HK, K, generator=g).bfloat16(),
                v=torch.randn(T, HV, V, generator=g).bfloat16(),
                a=torch.randn(T, HV, generator=g).bfloat16(),
                b=torch.randn(T, HV, generator=g).bfloat16())


def packed_rows(rows: dict) -> dict:
    """The same rows as vLLM hands them over: q, k and v column slices of one packed conv
    output [T, q | k | v | z] (Qwen3.5's conv runs on a column slice of [q | k | v | z], so a
    row's stride is wider than q | k | v; each row's heads contiguous)."""
    from r9k.kernels.triton_fused import rows_in_place

    qkv = [rows[n] for n in ("q", "k", "v")]
    z = torch.full((qkv[0].shape[0], 3 * qkv[2].shape[2]), float("nan"), dtype=qkv[0].dtype)
    mixed = torch.cat([x.flatten(1) for x in qkv] + [z], dim=1)
    views, col = {}, 0
    for name, x in zip(("q", "k", "v"), qkv):
        width = x.shape[1] * x.shape[2]
        views[name] = mixed[:, col:col + width].unflatten(1, x.shape[1:])
        col += width
        assert torch.equal(views[name], x) and not views[name].is_contiguous()
        assert rows_in_place(views[name]) is views[name]  # read in place, not copied
    return {**rows, **views}


def _api_case(state_dtype) -> None:
    g = torch.Generator().manual_seed(7)
    HK, HV, K, V, S, n = 1, 2, 32, 64, 3, 3  # S = 3: not a power of two
    W = HK * K + HV * V + 2 * HV
    A_log, dt_bias = torch.rand(HV, generator=g), torch.randn(HV, generator=g).bfloat16()
    pools = {}
    for impl in ("fused", "composed"):
        g2 = torch.Generator().manual_seed(8)
        pools[impl] = ((torch.randn(n + 1, HV, V, K, generator=g2) * 0.1).to(state_dtype),
                       torch.randn(n + 1, 2, S, W, generator=g2).bfloat16(),
                       torch.randint(0, 2, (n + 1, GdnHeads(HK, HV, K, V).flag_words),
                                     generator=g2, dtype=torch.int32))
        clear_flags(pools[impl][2], torch.tensor([1, 2, 3, 0], dtype=torch.int32))
    pages = torch.tensor([2, 0, 3], dtype=torch.int32)
    acc = torch.ones(n, dtype=torch.int32)
    for step in range(4):
        lens = torch.randint(1, S + 1, (n,), generator=g)
        cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
        T = int(cu[-1])
        rows = random_rows(g, T, HK, HV, K, V)
        outs = {}
        for impl, (st, rec, fl) in pools.items():
            # the fused kernel reads vLLM's packed layout in place on even steps
            given = packed_rows(rows) if impl == "fused" and step % 2 == 0 else rows
            outs[impl] = onepage_spec_step(**given, A_log=A_log, dt_bias=dt_bias, ssm_state=st,
                                           record=rec, flag=fl, state_indices=pages,
                                           num_accepted=acc, cu_seqlens=cu, impl=impl)
        live = torch.repeat_interleave(pages != 0, lens)
        assert torch.equal(outs["fused"][live], outs["composed"][live]), f"api step {step}"
        assert not outs["fused"][~live].any()
        for name, a_, b_ in zip(("state", "record", "flag"), pools["fused"], pools["composed"]):
            if not torch.equal(a_, b_):
                print(name, (a_ != b_).nonzero()[:10], a_[a_ != b_][:10], b_[a_ != b_][:10])
            assert torch.equal(a_, b_), f"api step {step} {name}"
        acc = torch.stack([torch.randint(1, int(t) + 1, (1,), generator=g)[0] for t in lens])
        acc = acc.to(torch.int32)
        if step == 1:  # a zero-length step replays only (the plugin's non-spec decode path)
            empty = {name: t[:0] for name, t in rows.items()}
            before = pools["fused"][0].clone()
            for impl, (st, rec, fl) in pools.items():
                onepage_spec_step(**empty, A_log=A_log, dt_bias=dt_bias, ssm_state=st,
                                  record=rec, flag=fl, state_indices=pages, num_accepted=acc,
                                  cu_seqlens=torch.zeros(n + 1, dtype=torch.int32), impl=impl)
            for name, a_, b_ in zip(("state", "record", "flag"), pools["fused"],
                                    pools["composed"]):
                assert torch.equal(a_, b_), f"api zero-length step {name}"
            assert not torch.equal(pools["fused"][0][2], before[2])  # page 2 replayed
            assert torch.equal(pools["fused"][0][0], before[0])  # the null page never
            for _, _, fl in pools.values():
                clear_flags(fl, pages)
    assert int(pools["fused"][2][2, 0]) > 0  # a live record was kept
    print(f"api case {state_dtype}: K != V, S = 3, null page, zero-length step, 4 steps, "
          "packed q | k | v rows read in place",
          flush=True)


def skew_case() -> int:
    """The GPU tests' skew knob (tests/gpu/test_onepage_gpu.py): each page's last program spins
    before it reads the flag. Here programs run one after another, so the last one always reads
    after the rest: the shipped own-pair protocol and the count-in ones pass with the knob on,
    and a flip that does not wait (the no-count-in probe) is caught, as the GPU test expects
    of a real race."""
    case = dict(num_seqs=2, num_spec=3, steps=3, state_dtype=torch.bfloat16, seed=7)
    for variant in (dict(skew_spin=3), measured(skew_spin=3),
                    measured(**DEP_ORDERED, skew_spin=3)):
        run_simulation(SimConfig(TINY, **case), composed_backend,
                       onepage_step=checked(**variant))
    try:
        run_simulation(SimConfig(TINY, **case), composed_backend,
                       onepage_step=checked(**measured(**DEP_ORDERED, count_probe=2,
                                                                skew_spin=3)))
    except AssertionError as e:
        assert "fused step" in str(e), e
    else:
        raise AssertionError("a flip that does not wait for the late program went unseen")
    print("skew case: the three protocols hold, the no-count-in probe is caught", flush=True)
    return 1


def bench_case() -> int:
    """lab.gdn_kernel's configuration runner (it needs a GPU to time): its variants
    reach the kernel and each recording variant is checked against the shipped kernel's bits,
    so a device run is not spent finding a broken benchmark. Timers stubbed: nothing is timed."""
    from lab import gdn_kernel

    gdn_kernel.time_graph_us = lambda fn, **kw: (fn(), 1.0)[1]
    gdn_kernel.time_host_us = lambda fn, **kw: (fn(), 1.0)[1]
    variants = ("no_record", "fenced", "dep_ordered", "own_plain", "late", "p2_late_riv",
                "p0_late_r64")
    r = gdn_kernel.bench_config(TINY, 2, torch.bfloat16, 3, 2, "cpu", False, repeats=1,
                                variants=variants, composed=False)
    assert r["bit_identical_to_fused"] == {v: True for v in variants if v != "no_record"}, r
    assert set(variants) | {"stock", "fused"} <= set(r["time_us"]), r["time_us"]
    print("bench case: gdn_kernel.bench_config, 7 variants, bits equal", flush=True)
    return 1


if __name__ == "__main__":
    n = ((sim_cases() if 'api' not in sys.argv else 0) + api_case() + skew_case()
         + bench_case())
    print(f"ok {n} cases")
    sys.exit(0)
