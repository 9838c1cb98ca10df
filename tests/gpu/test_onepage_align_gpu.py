"""On a GPU: prefix caching's state copies on one-page pages against stock's slot copies, bit for
bit. Stock: vLLM's stock Triton kernel verifies per slot, then the copy moves slot `n - 1`'s
bytes. One-page: the fused verify kernel, then the Triton align-copy kernel
(`r9k.kernels.triton_align`), each cross-checked against the composed path on copies of the
pools. Multi-step runs with random acceptance and random pre-copies, boundary copies (into an
earlier block and in place) and prefix hits; a boundary at every candidate position; null pages;
a CUDA-graph capture of the copy kernel."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

from r9k.core.page_layout import FLAG_COUNT, RECORD_SLOTS  # noqa: E402
from r9k.kernels.onepage import GdnHeads, GdnInputs, onepage_verify_step  # noqa: E402
from lab.simulate import (  # noqa: E402
    ALIGN_EVENTS, assert_bit_identical, recycled_flags, run_align_simulation)

SHAPES = {"27b-tp2": GdnHeads(8, 24, 128, 128), "flash-next-tp4": GdnHeads(4, 8, 128, 128),
          "small": GdnHeads(2, 4, 64, 64)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state", list(DTYPES))
@pytest.mark.parametrize("num_spec", [3, 7])
def test_align_copies_match_stock_on_gpu(shape, state, num_spec):
    from lab.triton_sim import FusedStepChecked, ReplayIntoChecked, composed_backend

    copies = ReplayIntoChecked()
    counts, replayed = run_align_simulation(
        composed_backend, SHAPES[shape], DTYPES[state], num_seqs=8, num_spec=num_spec, steps=8,
        seed=num_spec, device="cuda", onepage_step=FusedStepChecked(), replay_into_fn=copies)
    assert all(counts[e] > 0 for e in ALIGN_EVENTS), counts
    assert {0, 1} <= set(replayed) and max(replayed) > 1, sorted(set(replayed))
    assert copies.copies == sum(counts[e] for e in ALIGN_EVENTS if e != "none") + \
        counts["boundary_in_place"]  # in place: the boundary copy, then the move


def _one_verified_step(heads, state_dtype, n, S, seed):
    """Stock slot pools and one-page pools after one verify step of S rows per sequence."""
    from lab.triton_sim import composed_backend

    g = torch.Generator().manual_seed(seed)
    dev = "cuda"
    h = heads
    rand = lambda *s, dtype=torch.bfloat16, scale=1.0: (  # noqa: E731
        torch.randn(*s, generator=g) * scale).to(dtype).to(dev)
    be = composed_backend((torch.rand(h.num_v_heads, generator=g) * 2).to(dev),
                          torch.randn(h.num_v_heads, generator=g).to(torch.bfloat16).to(dev))
    shape = (h.num_v_heads, h.head_v_dim, h.head_k_dim)
    slots = torch.zeros((1 + n * S, *shape), dtype=state_dtype, device=dev)
    pages = torch.zeros((1 + 2 * n, *shape), dtype=state_dtype, device=dev)
    record = rand(1 + 2 * n, RECORD_SLOTS, S, h.record_row_width)
    flag = recycled_flags(g, 1 + 2 * n, S, h).to(dev)
    slot_rows = (torch.arange(S)[None, :] + 1 + torch.arange(n)[:, None] * S).to(torch.int32).to(dev)
    own = torch.arange(1, n + 1, dtype=torch.int32, device=dev)
    init = rand(n, *shape, dtype=torch.float32, scale=0.1).to(state_dtype)
    slots[slot_rows[:, 0].long()] = init
    pages[own.long()] = init
    flag[own.long()] = 0
    cu = (torch.arange(n + 1) * S).to(torch.int32).to(dev)
    x = GdnInputs(q=rand(n * S, h.num_k_heads, h.head_k_dim), k=rand(n * S, h.num_k_heads, h.head_k_dim),
                  v=rand(n * S, h.num_v_heads, h.head_v_dim), a=rand(n * S, h.num_v_heads),
                  b=rand(n * S, h.num_v_heads))
    ones = torch.ones(n, dtype=torch.int32, device=dev)
    ref = be.per_slot_step(slots, slot_rows, ones, x, cu)
    out = onepage_verify_step(be, h, pages, record, flag, own, ones, x, cu)
    assert_bit_identical(out, ref, "verify outputs")
    return be, slots, slot_rows, pages, record, flag, own


@pytest.mark.parametrize("state", list(DTYPES))
@pytest.mark.parametrize("in_place", [False, True])
def test_boundary_at_every_candidate_position(state, in_place):
    """Sequence i's boundary after candidate row i (S = 8, k = 7): n = i + 1 rows, into a fresh
    page or in place; plus null pairs (src or dst 0) that must change nothing."""
    from r9k.kernels.triton_align import onepage_replay_into

    heads, S = SHAPES["27b-tp2"], 8
    be, slots, slot_rows, pages, record, flag, own = _one_verified_step(heads, DTYPES[state],
                                                                        S, S, seed=7)
    n_rows = torch.arange(1, S + 1, dtype=torch.int32, device="cuda")
    dst = own if in_place else own + S
    null_src = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    null_dst = torch.tensor([S + 1, 0], dtype=torch.int32, device="cuda")
    before = pages.clone(), flag.clone()
    onepage_replay_into(A_log=be.A_log, dt_bias=be.dt_bias, ssm_state=pages, record=record,
                        flag=flag, src_pages=torch.cat([own, null_src]),
                        dst_pages=torch.cat([dst, null_dst]),
                        num_rows=torch.cat([n_rows, n_rows[:2]]), num_k_heads=heads.num_k_heads)
    for i in range(S):
        assert_bit_identical(pages[int(dst[i])], slots[int(slot_rows[i, i])],
                             f"boundary after row {i} ({'in place' if in_place else 'copy'})")
        assert int(flag[int(dst[i])].abs().sum()) == 0, flag[int(dst[i])]
    if not in_place:  # sources keep checkpoint and record
        assert_bit_identical(pages[own.long()], before[0][own.long()], "sources untouched")
        assert bool((flag[own.long(), FLAG_COUNT] == S).all())
    assert_bit_identical(pages[0], before[0][0], "null page state")
    assert_bit_identical(flag[0], before[1][0], "null page flag")


def test_align_copy_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed with new pairs written into the static inputs: the same bytes as
    an eager launch (no host sync inside, fixed grid)."""
    from r9k.kernels.triton_align import onepage_replay_into

    heads, S = SHAPES["small"], 4
    be, slots, slot_rows, pages, record, flag, own = _one_verified_step(heads, torch.float32,
                                                                        S, S, seed=3)
    src = torch.zeros(S, dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    rows = torch.zeros_like(src)
    kw = dict(A_log=be.A_log, dt_bias=be.dt_bias, ssm_state=pages, record=record, flag=flag,
              src_pages=src, dst_pages=dst, num_rows=rows, num_k_heads=heads.num_k_heads)
    onepage_replay_into(**kw)  # compile outside the capture (all pairs null: a no-op)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        onepage_replay_into(**kw)
    eager_pages, eager_flag = pages.clone(), flag.clone()
    want_rows = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device="cuda")
    onepage_replay_into(**{**kw, "ssm_state": eager_pages, "flag": eager_flag, "src_pages": own,
                           "dst_pages": own + S, "num_rows": want_rows})
    src.copy_(own)
    dst.copy_(own + S)
    rows.copy_(want_rows)
    graph.replay()
    torch.cuda.synchronize()
    assert_bit_identical(pages, eager_pages, "graph replay checkpoints")
    assert_bit_identical(flag, eager_flag, "graph replay flags")
    for i in range(S):
        assert_bit_identical(pages[S + 1 + i], slots[int(slot_rows[i, i])], f"graph copy {i}")
