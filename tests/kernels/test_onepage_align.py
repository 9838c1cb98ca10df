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

from r9k.core.page_layout import FLAG_COUNT, FLAG_DTYPE, RECORD_SLOTS
from r9k.kernels.onepage import GdnHeads, TorchReference, replay_into, set_live
from lab.simulate import ALIGN_EVENTS, run_align_simulation

HEADS = GdnHeads(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)


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


BACKENDS = [pytest.param(torch_backend, id="torch")]
if _cpu_op_available():
    BACKENDS.append(pytest.param(vllm_cpu_backend, id="vllm-cpu-op"))


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_spec", [3, 7])
def test_align_copies_match_stock(make_backend, state_dtype, num_spec):
    counts, replayed = run_align_simulation(make_backend, HEADS, state_dtype, num_spec=num_spec,
                                            seed=num_spec)
    assert all(counts[e] > 0 for e in ALIGN_EVENTS), counts
    # copies replayed no rows (cached source), one row (bonus only) and several
    assert {0, 1} <= set(replayed) and max(replayed) > 1, sorted(set(replayed))


def test_replay_into_skips_null_pages_and_reports_rows():
    g = torch.Generator().manual_seed(1)
    S = 4
    pool = torch.randn(5, HEADS.num_v_heads, HEADS.head_k_dim, HEADS.head_v_dim, generator=g)
    record = torch.randn(5, RECORD_SLOTS, S, HEADS.record_row_width, generator=g).bfloat16()
    flag = torch.zeros(5, HEADS.flag_words, dtype=getattr(torch, FLAG_DTYPE))
    live = flag[:4]  # pages 1-3 and the null page, which must not be touched, whatever it holds
    set_live(live, torch.full((4,), S), torch.zeros(4))
    before_null, before_flag0 = pool[0].clone(), flag[0].clone()
    be = TorchReference(torch.rand(HEADS.num_v_heads, generator=g),
                        torch.randn(HEADS.num_v_heads, generator=g))
    rows = replay_into(be, HEADS, pool, record, flag, torch.tensor([1, 0, 2]),
                       torch.tensor([4, 3, 0]), torch.tensor([2, 3, 3]))
    assert rows.tolist() == [2, 0, 0]
    assert torch.equal(pool[0], before_null) and torch.equal(flag[0], before_flag0)
    assert flag[4].abs().sum() == 0 and flag[3, FLAG_COUNT] == S  # 3 was only a null pair's dst
    assert flag[1, FLAG_COUNT] == S  # the source keeps its record
