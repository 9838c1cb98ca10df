"""On a GPU (H200 in CI, any CUDA or ROCm card): the fused one-page kernel, the composed
stock-kernel path and vLLM's stock per-slot kernel, bit for bit (torch.equal), over multi-step
simulations with random acceptance. Every step checks fused == composed (outputs, checkpoints,
records, flags) and one-page == stock per-slot (outputs, and each checkpoint against the slot
stock reads next).

Shapes per TP rank: Qwen3.5-27B at TP2 (8 key heads, 24 value heads, 128/128) and "Flash-Next"
at TP4, taken as Qwen3-Next-80B-A3B's GDN geometry (16/32 heads -> 4/8 per rank, 128/128):
Qwen4Exp's own GDN head counts are not public here, so this is a stand-in.

Tests marked `research` run the research kernel's measured variants (`lab.fused_variants`,
168 of them in one function); `pytest tests/gpu -m "not research"` runs what ships.
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

from r9k.core.page_layout import FLAG_COUNT, FLAG_WORDS, RECORD_SLOTS  # noqa: E402
from r9k.kernels.onepage import GdnHeads  # noqa: E402
from lab.simulate import SimConfig, assert_replay_coverage, run_simulation  # noqa: E402
from lab.fused_variants import DEP_ORDERED, OWN_PAIRS, checked, measured  # noqa: E402

QWEN35_27B_TP2 = GdnHeads(num_k_heads=8, num_v_heads=24, head_k_dim=128, head_v_dim=128)
FLASH_NEXT_TP4 = GdnHeads(num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128)
SHAPES = {"27b-tp2": QWEN35_27B_TP2, "flash-next-tp4": FLASH_NEXT_TP4}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sim(heads, variant=None, **kw):
    """`variant`: kernel knobs (a `measured` dict); none: the kernel as shipped for the dtype."""
    from lab.triton_sim import FusedStepChecked, composed_backend

    chk = checked(**variant) if variant else FusedStepChecked()
    cfg = SimConfig(heads, device="cuda", **kw)
    st = run_simulation(cfg, composed_backend, onepage_step=chk)
    assert chk.steps == cfg.steps * cfg.layers
    live = cfg.num_seqs - cfg.null_pages
    # only the step after prefill replays nothing; later steps replay the bonus row at least
    assert st.replay_hist[0] == cfg.layers * live, dict(st.replay_hist)
    assert st.checkpoint_checks == (1 + cfg.steps) * cfg.layers * live  # after prefill + steps
    assert st.compared_rows > 0
    return st


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state", list(DTYPES))
@pytest.mark.parametrize("num_spec", [3, 7])
@pytest.mark.parametrize("num_seqs", [1, 4, 16, 64, 256])
def test_fused_composed_stock_bit_identical(shape, state, num_spec, num_seqs):
    st = _sim(SHAPES[shape], num_seqs=num_seqs, num_spec=num_spec, steps=5,
              state_dtype=DTYPES[state], seed=num_seqs * 10 + num_spec)
    if num_seqs >= 16:  # enough sequence-steps for bonus-only, partial and full acceptance
        assert_replay_coverage(st, num_candidates=1 + num_spec)


@pytest.mark.research
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state", list(DTYPES))
@pytest.mark.parametrize("num_seqs", [1, 64, 256])
def test_no_prefetch_variant_bit_identical(shape, state, num_seqs):
    _sim(SHAPES[shape], variant=measured(prefetch=0), num_seqs=num_seqs, num_spec=7, steps=5,
         state_dtype=DTYPES[state], seed=num_seqs + 1)


# kernel variants lab/scripts/gdn_kernel.py measures (its VARIANTS), each protocol
# piece alone: a variant may ship only with these passing on the GPU. (`pipe`, one row's
# normalization computed a row ahead, was removed: not bit-identical on sm_90 in fp32,
# lab/results/gdn_kernel_h200_flashnext_variants_k3.md)
MEASURED_VARIANTS = {
    # the shipped protocol (own flag pairs), its pieces, and the count-in protocols that
    # shipped before it, on both state dtypes
    "own_pairs": measured(**OWN_PAIRS),
    "own_plain": measured(own=True),
    "own_spec": measured(own=True, spec=True),
    "own_rows_end": measured(own=True, rows_end=True),
    "fenced": measured(),
    "dep_ordered": measured(**DEP_ORDERED),
    "late": measured(late=True),
    "p2_late_riv": measured(prefetch=2, late=True, rec_in_verify=True),
    "p0_late_r80": measured(prefetch=0, late=True, maxnreg=80),
    "spec": measured(spec=True),
    "late_spec": measured(late=True, spec=True),
    "rows_end": measured(rows_end=True),
    "late_rows_end": measured(late=True, rows_end=True),
    "late_spec_dep": measured(late=True, spec=True, dep=True),
}


@pytest.mark.research
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state", list(DTYPES))
@pytest.mark.parametrize("variant", list(MEASURED_VARIANTS))
@pytest.mark.parametrize("num_seqs", [1, 16, 256])
def test_measured_variants_bit_identical(shape, state, variant, num_seqs):
    st = _sim(SHAPES[shape], variant=MEASURED_VARIANTS[variant], num_seqs=num_seqs,
              num_spec=3, steps=5, state_dtype=DTYPES[state], seed=num_seqs + 3)
    if num_seqs >= 16:
        assert_replay_coverage(st, num_candidates=4)


# iterations of a dependent multiply-add (about 4 cycles each, so tens of microseconds): the
# skewed program starts after the rest of the page's programs have finished
SKEW_SPIN = 20000


@pytest.mark.research
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state", list(DTYPES))
@pytest.mark.parametrize("protocol", ["own_pairs", "fenced", "dep_ordered"])
def test_protocols_hold_when_a_program_starts_late(shape, state, protocol):
    """Each page's last program spins before it reads the flag: every other program of the
    page has finished first. The count-in protocols must still flip only after its read, and
    under own pairs no other program's flip is its business: bit-identical steps."""
    st = _sim(SHAPES[shape], variant={**MEASURED_VARIANTS[protocol], "skew_spin": SKEW_SPIN},
              num_seqs=16, num_spec=3, steps=4, state_dtype=DTYPES[state], seed=21)
    assert_replay_coverage(st, num_candidates=4)


@pytest.mark.research
@pytest.mark.parametrize("state", list(DTYPES))
def test_skew_exposes_a_flip_that_does_not_wait(state):
    """The test above has teeth: with the count-in removed (one program flips the flag at its
    end, a timing probe) the late program reads the flipped flag and replays the wrong slot."""
    broken = measured(**DEP_ORDERED, count_probe=2, skew_spin=SKEW_SPIN)
    with pytest.raises(AssertionError, match="fused step"):
        _sim(FLASH_NEXT_TP4, variant=broken, num_seqs=16, num_spec=3, steps=4,
             state_dtype=DTYPES[state], seed=21)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state", list(DTYPES))
@pytest.mark.parametrize("variant", ["shipped", "no_prefetch"])
def test_row_map_null_pages_layers(shape, state, variant):
    knobs = None if variant == "shipped" else measured(prefetch=0)
    st = _sim(SHAPES[shape], variant=knobs, num_seqs=37, num_spec=7, steps=6,
              state_dtype=DTYPES[state], row_map=True, null_pages=5, layers=2, seed=11)
    assert_replay_coverage(st, num_candidates=1 + 7)


@pytest.mark.parametrize("state", list(DTYPES))
def test_lockstep_copies_agree(state):
    _sim(QWEN35_27B_TP2, num_seqs=8, num_spec=7, steps=5, state_dtype=DTYPES[state],
         lockstep_copies=True, seed=12)


def test_step_api_sync_free_and_graph_capturable():
    """The fused step launches without host synchronization: it captures into a CUDA graph,
    and replays of the graph continue the sequence exactly as eager steps do."""
    from r9k.kernels.gpu_step import clear_flags, onepage_spec_step

    dev, g = "cuda", torch.Generator().manual_seed(3)
    HK, HV, K, V, S, n = 4, 8, 128, 128, 4, 6
    W = GdnHeads(HK, HV, K, V).record_row_width
    A_log = torch.rand(HV, generator=g).to(dev)
    dt_bias = torch.randn(HV, generator=g).bfloat16().to(dev)
    T = n * S
    rows = {name: (torch.randn(*shape, generator=g) * 0.5).bfloat16().to(dev) for name, shape in
            dict(q=(T, HK, K), k=(T, HK, K), v=(T, HV, V), a=(T, HV), b=(T, HV)).items()}
    cu = (torch.arange(n + 1) * S).to(torch.int32).to(dev)
    pages = torch.tensor([1, 2, 0, 3, 4, 5], dtype=torch.int32, device=dev)
    acc = torch.tensor([1, 2, 3, 4, 2, 1], dtype=torch.int32, device=dev)

    def fresh():
        st = (torch.randn(n + 1, HV, V, K, generator=g) * 0.1).to(dev)
        rec = torch.randn(n + 1, RECORD_SLOTS, S, W, generator=g).bfloat16().to(dev)
        fl = torch.randint(0, 2, (n + 1, GdnHeads(HK, HV, K, V).flag_words), generator=g,
                           dtype=torch.int32).to(dev)
        clear_flags(fl, pages)
        return st, rec, fl

    base = fresh()
    eager = tuple(t.clone() for t in base)
    graphed = tuple(t.clone() for t in base)

    def step(pool):
        return onepage_spec_step(**rows, A_log=A_log, dt_bias=dt_bias, ssm_state=pool[0],
                                 record=pool[1], flag=pool[2], state_indices=pages,
                                 num_accepted=acc, cu_seqlens=cu)

    scratch = tuple(t.clone() for t in base)
    step(scratch)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = step(graphed)
    graphed[0].copy_(base[0]), graphed[1].copy_(base[1]), graphed[2].copy_(base[2])
    for i in range(3):
        out_e = step(eager)
        graph.replay()
        assert torch.equal(out_e, out_g), f"step {i} outputs"
        for a_, b_ in zip(eager, graphed):
            assert torch.equal(a_, b_), f"step {i} pools"
    assert int(eager[2][1, FLAG_COUNT]) == S
    # every program's pair (8 value heads x 4 blocks of 32) says what the head says
    assert eager[2][1, FLAG_WORDS:].tolist() == eager[2][1, :2].tolist() * (HV * V // 32)


@pytest.mark.parametrize("state", list(DTYPES))
def test_zero_length_step_replays_like_composed(state):
    """The plugin's non-spec decode path: a step with no candidate rows replays the live record
    (num_accepted rows) onto the checkpoint and leaves record and flag alone."""
    from r9k.kernels.gpu_step import clear_flags, onepage_spec_step

    h, dev, g = QWEN35_27B_TP2, "cuda", torch.Generator().manual_seed(5)
    HK, HV, K, V, S, n = h.num_k_heads, h.num_v_heads, h.head_k_dim, h.head_v_dim, 8, 5
    A_log = torch.rand(HV, generator=g).to(dev)
    dt_bias = torch.randn(HV, generator=g).bfloat16().to(dev)
    rows = {name: (torch.randn(*shape, generator=g) * 0.5).bfloat16().to(dev) for name, shape in
            dict(q=(n * S, HK, K), k=(n * S, HK, K), v=(n * S, HV, V), a=(n * S, HV),
                 b=(n * S, HV)).items()}
    pages = torch.tensor([1, 0, 2, 3, 4], dtype=torch.int32, device=dev)
    st = (torch.randn(n + 1, HV, V, K, generator=g) * 0.1).to(DTYPES[state]).to(dev)
    rec = torch.randn(n + 1, RECORD_SLOTS, S, h.record_row_width, generator=g).bfloat16().to(dev)
    fl = torch.zeros(n + 1, h.flag_words, dtype=torch.int32, device=dev)
    clear_flags(fl, pages)
    pools = {impl: (st.clone(), rec.clone(), fl.clone()) for impl in ("fused", "composed")}
    cu = (torch.arange(n + 1) * S).to(torch.int32).to(dev)
    for impl, (p_st, p_rec, p_fl) in pools.items():
        onepage_spec_step(**rows, A_log=A_log, dt_bias=dt_bias, ssm_state=p_st, record=p_rec,
                          flag=p_fl, state_indices=pages,
                          num_accepted=torch.ones(n, dtype=torch.int32, device=dev),
                          cu_seqlens=cu, impl=impl)
    before = pools["fused"][0].clone()
    acc = torch.tensor([3, 1, 8, 1, 5], dtype=torch.int32, device=dev)
    for impl, (p_st, p_rec, p_fl) in pools.items():
        onepage_spec_step(**{k_: t[:0] for k_, t in rows.items()}, A_log=A_log, dt_bias=dt_bias,
                          ssm_state=p_st, record=p_rec, flag=p_fl, state_indices=pages,
                          num_accepted=acc, cu_seqlens=torch.zeros_like(cu), impl=impl)
    for name, x, y in zip(("state", "record", "flag"), pools["fused"], pools["composed"]):
        assert torch.equal(x, y), name
    assert not torch.equal(pools["fused"][0][1], before[1])
    assert torch.equal(pools["fused"][0][0], before[0])


def test_compile_options_identical_to_stock():
    """enable_fp_fusion and the launch options of the compiled fused and stock kernels agree."""
    from r9k.kernels._stock_loader import stock_spec_kernel
    from r9k.kernels.triton_fused import onepage_gdn_step_kernel

    _sim(FLASH_NEXT_TP4, num_seqs=2, num_spec=3, steps=2, seed=1)

    def compiled(kernel):
        from triton.runtime.jit import JITFunction

        while not isinstance(kernel, JITFunction):  # unwrap @triton.heuristics
            kernel = kernel.fn
        found = []
        for entry in kernel.device_caches.values():  # (kernel_cache, ...) per device
            found.extend(entry[0].values())
        return found

    fused, stock = compiled(onepage_gdn_step_kernel), compiled(stock_spec_kernel())
    assert fused and stock
    opts = {(k.metadata.enable_fp_fusion, k.metadata.num_warps, k.metadata.num_stages)
            for k in fused + stock}
    assert len(opts) == 1, opts
