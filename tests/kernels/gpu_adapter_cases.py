"""Run under TRITON_INTERPRET=1 (fresh process): the plugin's GPU-path adapter (r9k.gdn_gpu)
routes vLLM's spec-path calls into the one-page step exactly as a direct call would."""
import types

import torch
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as stock_gdn

from r9k.gdn_gpu import _routed_spec_calls
from r9k.kernels.gpu_step import onepage_spec_step
from r9k.kernels.onepage import FLAG_COUNT, GdnHeads

torch.manual_seed(0)
HK, HV, K, V, S, N, P = 2, 4, 16, 32, 4, 3, 6
W = HK * K + HV * V + 2 * HV
heads = GdnHeads(HK, HV, K, V)


def pools():
    g = torch.Generator().manual_seed(7)  # the same pages every call
    ssm = torch.randn(P, HV, V, K, generator=g) * 0.1
    record = torch.randn(P, 2, S, W, generator=g).bfloat16()
    flag = torch.zeros(P, 4, dtype=torch.int32)
    flag[[1, 2, 3], FLAG_COUNT] = torch.tensor([3, 2, 4], dtype=torch.int32)
    flag[[1, 2, 3], 1] = torch.tensor([0, 1, 0], dtype=torch.int32)
    return ssm, record, flag


A_log, dt_bias = torch.rand(HV), torch.randn(HV).bfloat16()
lens = torch.tensor([4, 1, 3])
cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
T = int(cu[-1])
q, k = torch.randn(T, HK, K).bfloat16(), torch.randn(T, HK, K).bfloat16()
v, a, b = torch.randn(T, HV, V).bfloat16(), torch.randn(T, HV).bfloat16(), torch.randn(T, HV).bfloat16()
pages = torch.tensor([1, 2, 3], dtype=torch.int32)
na = torch.tensor([2, 1, 4], dtype=torch.int32)

ssm0, rec0, flag0 = pools()
want = onepage_spec_step(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm0,
                         record=rec0, flag=flag0, state_indices=pages, num_accepted=na,
                         cu_seqlens=cu)

ssm1, rec1, flag1 = pools()
layer = types.SimpleNamespace(kv_cache=(None, ssm1, rec1, flag1), num_candidates=S,
                              onepage_heads=heads, A_log=A_log, dt_bias=dt_bias)
with _routed_spec_calls(layer):
    # the call exactly as vLLM's _forward_core makes it for the spec rows
    got, state = stock_gdn.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q.unsqueeze(0), k=k.unsqueeze(0),
        v=v.unsqueeze(0), initial_state=ssm1, inplace_final_state=True, cu_seqlens=cu,
        ssm_state_indices=pages[:, None], num_accepted_tokens=na, use_qk_l2norm_in_kernel=True)
assert state is None and got.shape == (1, T, HV, V)
assert torch.equal(got.squeeze(0), want)
assert torch.equal(ssm1, ssm0) and torch.equal(rec1, rec0) and torch.equal(flag1, flag0)
print("spec call routed")

# the conv update gets S from the configuration, not from the one-column index width
seen = {}
orig = stock_gdn.causal_conv1d_update
stock_gdn.causal_conv1d_update = lambda *a_, **kw: seen.update(kw)
try:
    with _routed_spec_calls(layer):
        stock_gdn.causal_conv1d_update(None, num_accepted_tokens=na, max_query_len=1)
        stock_gdn.causal_conv1d_update(None, max_query_len=1)
        assert seen["max_query_len"] == 1  # non-spec decode untouched
        stock_gdn.causal_conv1d_update(None, num_accepted_tokens=na, max_query_len=1)
        assert seen["max_query_len"] == S
finally:
    stock_gdn.causal_conv1d_update = orig
assert stock_gdn.causal_conv1d_update is orig and \
    stock_gdn.fused_sigmoid_gating_delta_rule_update.__name__ != "recurrence"
print("conv routed")

# a non-spec decode on a live page: one replayed row, then the stock call, and the flag cleared
ssm2, rec2, flag2 = pools()
ssm3, rec3, flag3 = pools()
calls = []
orig_rec = stock_gdn.fused_sigmoid_gating_delta_rule_update
stock_gdn.fused_sigmoid_gating_delta_rule_update = lambda **kw: calls.append(kw) or ("o", "s")
try:
    layer2 = types.SimpleNamespace(kv_cache=(None, ssm2, rec2, flag2), num_candidates=S,
                                   onepage_heads=heads, A_log=A_log, dt_bias=dt_bias)
    with _routed_spec_calls(layer2):
        out = stock_gdn.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a[:2], b=b[:2], dt_bias=dt_bias, q=q[None, :2], k=k[None, :2],
            v=v[None, :2], initial_state=ssm2, inplace_final_state=True,
            cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32),
            ssm_state_indices=torch.tensor([1, 2], dtype=torch.int32),
            use_qk_l2norm_in_kernel=True)
finally:
    stock_gdn.fused_sigmoid_gating_delta_rule_update = orig_rec
assert out == ("o", "s") and len(calls) == 1 and "num_accepted_tokens" not in calls[0]
assert int(flag2[1, FLAG_COUNT]) == 0 and int(flag2[2, FLAG_COUNT]) == 0
assert int(flag2[3, FLAG_COUNT]) == 4  # untouched page keeps its record
# pages 1 and 2 got exactly one replayed row: the same as a one-row replay step
onepage_spec_step(q=q[:0], k=k[:0], v=v[:0], a=a[:0], b=b[:0], A_log=A_log, dt_bias=dt_bias,
                  ssm_state=ssm3, record=rec3, flag=flag3,
                  state_indices=torch.tensor([1, 2], dtype=torch.int32),
                  num_accepted=torch.ones(2, dtype=torch.int32),
                  cu_seqlens=torch.zeros(3, dtype=torch.int32))
assert torch.equal(ssm2, ssm3)
assert not torch.equal(ssm2[1], pools()[0][1])
print("non-spec decode routed")
print("ok")
