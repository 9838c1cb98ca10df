"""Prefix caching's state copies (mamba_cache_mode "align") on one-page pages, bit for bit
against stock's per-slot copies, on CPU.

Stock keeps 1 + k slot pages per request; its align copies move raw bytes: the pre-copy (the
running page moved: slot `num_accepted - 1` -> the new page, accepted count reset to 1), the
boundary copy (slot `bias` -> a block that gets cached; in place into the running page when the
boundary ends that page, count reset to 1) and a prefix hit (a cached block -> a new request's
running page). One-page has one page per request and `replay_into` advances the source's
checkpoint by the record's rows instead. Each step below runs stock and one-page side by side:
outputs equal, every copied page's checkpoint equal to stock's bytes, its flag cleared, and the
steps after a copy (which read the copied pages) equal too.
"""
import pytest
import torch
import torch.nn.functional as F

from r9k.capacity import FLAG_COUNT, FLAG_DTYPE, FLAG_SLOT, FLAG_WORDS, RECORD_SLOTS
from r9k.kernels.onepage import (
    NULL_PAGE, GdnHeads, GdnInputs, TorchReference, clear_records, onepage_verify_step,
    replay_into)
from r9k.kernels.simulate import assert_bit_identical

HEADS = GdnHeads(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
EVENTS = ("none", "boundary", "boundary_in_place", "move", "hit")


def _cpu_op_available() -> bool:
    try:
        import vllm._custom_ops  # noqa: F401
    except Exception:
        return False
    return hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_spec_cpu")


def torch_backend(A_log, dt_bias):
    return TorchReference(A_log, dt_bias)


def vllm_cpu_backend(A_log, dt_bias):
    from r9k.kernels.cpu import VllmCpuOps

    return VllmCpuOps(A_log, dt_bias)


def run_align_sim(make_backend, state_dtype, num_seqs=6, num_spec=3, steps=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, n, S = HEADS, num_seqs, 1 + num_spec
    counts = {e: 0 for e in EVENTS}
    replayed_rows = []

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    A_log = torch.rand(h.num_v_heads, generator=g) * 2
    dt_bias = torch.randn(h.num_v_heads, generator=g).to(torch.bfloat16)
    be = make_backend(A_log, dt_bias)
    shape = (h.num_v_heads, h.head_k_dim, h.head_v_dim)
    pages_needed = 1 + n * S + 2 * n * steps + n
    stock = torch.zeros((pages_needed, *shape), dtype=state_dtype)
    one = torch.zeros((pages_needed, *shape), dtype=state_dtype)
    record = rand(pages_needed, RECORD_SLOTS, S, h.record_row_width)
    # recycled pages: live-looking garbage flags that every copy must clear at its destination
    flag = torch.randint(1, S + 1, (pages_needed, FLAG_WORDS), generator=g,
                         dtype=getattr(torch, FLAG_DTYPE))
    flag[:, FLAG_SLOT] %= RECORD_SLOTS
    free = iter(range(1 + n * S, pages_needed))

    slot_rows = torch.stack([torch.arange(S) + 1 + i * S for i in range(n)]).to(torch.int32)
    pages = torch.tensor([int(free.__next__()) for _ in range(n)], dtype=torch.int32)
    init = rand(n, *shape, dtype=torch.float32, scale=0.1).to(state_dtype)
    stock[slot_rows[:, 0].long()] = init
    one[pages.long()] = init
    clear_records(flag, pages)  # prefill
    cached: list[tuple[int, int]] = []  # (stock page, one-page page) of cached blocks
    num_accepted = torch.ones(n, dtype=torch.int32)

    def check(stock_page: int, one_page: int, what: str) -> None:
        assert_bit_identical(one[one_page], stock[stock_page], what)
        assert int(flag[one_page].abs().sum()) == 0, f"{what}: flag not cleared {flag[one_page]}"

    for step in range(steps):
        lens = torch.randint(1, S + 1, (n,), generator=g)
        cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
        rows = int(cu[-1])
        x = GdnInputs(q=rand(rows, h.num_k_heads, h.head_k_dim),
                      k=rand(rows, h.num_k_heads, h.head_k_dim),
                      v=rand(rows, h.num_v_heads, h.head_v_dim),
                      a=rand(rows, h.num_v_heads), b=rand(rows, h.num_v_heads))
        ref = be.per_slot_step(stock, slot_rows, num_accepted, x, cu)
        out = onepage_verify_step(be, h, one, record, flag, pages, num_accepted, x, cu)
        assert_bit_identical(out, ref, f"step {step} outputs")
        new_acc = torch.stack([torch.randint(1, int(t) + 1, (1,), generator=g)[0] for t in lens])
        for i in range(n):
            acc = int(new_acc[i])
            event = EVENTS[int(torch.randint(len(EVENTS), (1,), generator=g))]
            if event == "hit" and not cached:
                event = "none"
            counts[event] += 1
            src = pages[i:i + 1]
            if event == "boundary":  # accepted tokens crossed an earlier block's end
                bias = int(torch.randint(acc, (1,), generator=g))
                d_stock, d_one = next(free), next(free)
                stock[d_stock] = stock[int(slot_rows[i, bias])]
                replayed_rows += replay_into(be, h, one, record, flag, src,
                                             torch.tensor([d_one]), torch.tensor([bias + 1])).tolist()
                check(d_stock, d_one, f"step {step} seq {i}: boundary copy (bias {bias})")
                cached.append((d_stock, d_one))
                num_accepted[i] = acc
            elif event == "boundary_in_place":  # the running page ends at the boundary
                run = int(slot_rows[i, 0])
                stock[run] = stock[int(slot_rows[i, acc - 1])]
                replayed_rows += replay_into(be, h, one, record, flag, src, src,
                                             torch.tensor([acc])).tolist()
                check(run, int(pages[i]), f"step {step} seq {i}: boundary copy in place")
                cached.append((run, int(pages[i])))
                slot_rows[i, 0] = next(free)  # the cached block stays; running moves on
                stock[int(slot_rows[i, 0])] = stock[run]
                new = next(free)
                replayed_rows += replay_into(be, h, one, record, flag, src, torch.tensor([new]),
                                             torch.tensor([1])).tolist()
                pages[i] = new
                check(int(slot_rows[i, 0]), new, f"step {step} seq {i}: pre-copy from a cached block")
                num_accepted[i] = 1
            elif event == "move":  # pre-copy: the running page moved on
                new_stock, new_one = next(free), next(free)
                stock[new_stock] = stock[int(slot_rows[i, acc - 1])]
                replayed_rows += replay_into(be, h, one, record, flag, src,
                                             torch.tensor([new_one]), torch.tensor([acc])).tolist()
                check(new_stock, new_one, f"step {step} seq {i}: pre-copy")
                slot_rows[i, 0], pages[i] = new_stock, new_one
                num_accepted[i] = 1
            elif event == "hit":  # a new request resumes from a cached block
                c_stock, c_one = cached[int(torch.randint(len(cached), (1,), generator=g))]
                new_stock, new_one = next(free), next(free)
                stock[new_stock] = stock[c_stock]
                replayed_rows += replay_into(be, h, one, record, flag, torch.tensor([c_one]),
                                             torch.tensor([new_one]), torch.tensor([acc])).tolist()
                check(new_stock, new_one, f"step {step} seq {i}: prefix hit")
                slot_rows[i, 0], pages[i] = new_stock, new_one
                num_accepted[i] = 1
            else:
                num_accepted[i] = acc
    # the cached blocks still hold what stock cached (nothing wrote them since)
    for c_stock, c_one in cached:
        check(c_stock, c_one, "cached block at the end")
    return counts, replayed_rows


BACKENDS = [pytest.param(torch_backend, id="torch")]
if _cpu_op_available():
    BACKENDS.append(pytest.param(vllm_cpu_backend, id="vllm-cpu-op"))


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_spec", [3, 7])
def test_align_copies_match_stock(make_backend, state_dtype, num_spec):
    counts, replayed = run_align_sim(make_backend, state_dtype, num_spec=num_spec,
                                     seed=num_spec)
    assert all(counts[e] > 0 for e in EVENTS), counts
    # copies replayed no rows (cached source), one row (bonus only) and several
    assert {0, 1} <= set(replayed) and max(replayed) > 1, sorted(set(replayed))


def test_replay_into_skips_null_pages_and_reports_rows():
    g = torch.Generator().manual_seed(1)
    S = 4
    pool = torch.randn(5, HEADS.num_v_heads, HEADS.head_k_dim, HEADS.head_v_dim, generator=g)
    record = torch.randn(5, RECORD_SLOTS, S, HEADS.record_row_width, generator=g).bfloat16()
    flag = torch.zeros(5, FLAG_WORDS, dtype=getattr(torch, FLAG_DTYPE))
    flag[[1, 2, 3], FLAG_COUNT] = S
    flag[0, FLAG_COUNT] = S  # the null page must not be touched, whatever it holds
    before_null, before_flag0 = pool[0].clone(), flag[0].clone()
    be = TorchReference(torch.rand(HEADS.num_v_heads, generator=g),
                        torch.randn(HEADS.num_v_heads, generator=g))
    rows = replay_into(be, HEADS, pool, record, flag, torch.tensor([1, 0, 2]),
                       torch.tensor([4, 3, 0]), torch.tensor([2, 3, 3]))
    assert rows.tolist() == [2, 0, 0]
    assert torch.equal(pool[0], before_null) and torch.equal(flag[0], before_flag0)
    assert flag[4].abs().sum() == 0 and flag[3, FLAG_COUNT] == S  # 3 was only a null pair's dst
    assert flag[1, FLAG_COUNT] == S  # the source keeps its record
