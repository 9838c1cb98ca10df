"""GPU path (CUDA and ROCm) of the one-page GDN layer.

vLLM's `_forward_core` stays the code that runs: convs, prefill chunks and output merging are
stock. It calls two functions by their module-global names; a one-page layer runs that same code
object bound, once at construction, to a copy of the module's globals in which those two names
are the layer's routed calls (`bind_routed_forward_core`). vLLM's module is never modified, so
stock layers and other threads are unaffected and no lock is needed:
- `causal_conv1d_update(..., num_accepted_tokens=...)` gets `max_query_len = S` from the
  configuration (stock derives it from the state-index width, which is 1 with one page);
- `fused_sigmoid_gating_delta_rule_update(..., num_accepted_tokens=...)` (the spec verify) runs
  the one-page step (`r9k.kernels.gpu_step`), and the non-spec decode call replays a live record's
  first row first (stock resumes from block-table column 0).
Prefill pages get their flag cleared before the stock prefill writes their checkpoint.

In place (`R9K_GDN_INPLACE`, default on, fused step only): the spec rows' q, k, v reach the
fused kernel as column views of the conv output (vLLM's `rearrange_mixed_qkv` packs them with
four copy kernels, the kernel reads rows at any stride), and on spec-only steps the kernel
writes its outputs into `core_attn_out`, so stock's copy of them is a self-copy torch skips.
Same values read, same values written: per GDN layer and step, five small kernels fewer.

Proven at kernel and step level on an H200 (tests/gpu) and run in vLLM 0.32.0's CUDA engine there
(lab/scripts/gpu_engine.py; lab/results/gpu_engine_h200_*.md).
"""
from __future__ import annotations

import functools

import torch
from vllm.forward_context import get_forward_context

from r9k.compat import forward_core, rearrange
from r9k.kernels.gpu_step import clear_flags, onepage_spec_step
from r9k.plugin.policy import gdn_inplace, gdn_step_mode


def bind_routed_forward_core(layer):
    """vLLM's `_forward_core` as a method of `layer`, with its spec-path calls routed.

    The same code object and closure, run against a copy of its module's globals where the
    conv update and the recurrence are the layer's routed calls (`r9k.compat.forward_core`).
    Built once per layer.
    """
    impl = gdn_step_mode()
    routed = forward_core.routed(layer, {
        forward_core.CONV_UPDATE: lambda stock: functools.partial(routed_conv_update, layer, stock),
        forward_core.RECURRENCE: lambda stock: functools.partial(routed_recurrence, layer, impl,
                                                                 stock)})
    layer.onepage_inplace = gdn_inplace() and impl == "fused"  # read (and checked) either way
    layer.onepage_spec_rows = None  # the spec conv's output, while _forward_core runs
    layer.onepage_spec_out = None  # core_attn_out's rows on spec-only steps
    if layer.onepage_inplace:
        rearrange.replace(layer, rearrange_in_place)
    return routed


def onepage_forward_core(layer, mixed_qkv, b, a, core_attn_out):
    ctx = get_forward_context()
    md = ctx.attn_metadata.get(layer.prefix) if isinstance(ctx.attn_metadata, dict) else None
    if md is not None and md.num_prefills > 0:
        pages = md.prefill_state_indices
        if pages is None:
            pages = md.non_spec_state_indices_tensor
        clear_flags(layer.onepage_flag, pages)
    if (layer.onepage_inplace and md is not None and md.spec_sequence_masks is not None
            and md.num_prefills == 0 and md.num_decodes == 0):
        # spec rows only: stock then copies the verify's outputs to these rows
        layer.onepage_spec_out = core_attn_out[:md.num_actual_tokens]
    try:
        return layer.routed_forward_core(mixed_qkv, b, a, core_attn_out)
    finally:
        layer.onepage_spec_rows = layer.onepage_spec_out = None


def routed_conv_update(layer, stock_conv_update, *args, **kwargs):
    if kwargs.get("num_accepted_tokens") is None:
        return stock_conv_update(*args, **kwargs)
    kwargs["max_query_len"] = layer.num_candidates  # S, never an index width
    rows = stock_conv_update(*args, **kwargs)
    if layer.onepage_inplace:
        layer.onepage_spec_rows = rows  # rearranged next: as views, for the fused step only
    return rows


def rearrange_in_place(layer, stock_rearrange, mixed_qkv):
    """vLLM's `rearrange_mixed_qkv` for the spec rows as column views (shapes as stock's:
    [1, T, heads, dim]); any other rows (non-spec decode, for vLLM's kernel) go to stock's."""
    if mixed_qkv is None or mixed_qkv is not layer.onepage_spec_rows:
        return stock_rearrange(mixed_qkv)
    layer.onepage_spec_rows = None
    heads = layer.onepage_heads
    q_dim = heads.num_k_heads * heads.head_k_dim
    q, k, v = torch.split(mixed_qkv, [q_dim, q_dim, heads.num_v_heads * heads.head_v_dim], -1)
    return (q.unflatten(-1, (heads.num_k_heads, heads.head_k_dim)).unsqueeze(0),
            k.unflatten(-1, (heads.num_k_heads, heads.head_k_dim)).unsqueeze(0),
            v.unflatten(-1, (heads.num_v_heads, heads.head_v_dim)).unsqueeze(0))


def routed_recurrence(layer, impl, stock_recurrence, *, q, k, v, a, b, A_log, dt_bias,
                      initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens=None,
                      **kwargs):
    if num_accepted_tokens is None:  # non-spec decode: stock reads column 0
        _replay_first_row(layer, impl, initial_state, ssm_state_indices)
        clear_flags(layer.onepage_flag, ssm_state_indices)
        return stock_recurrence(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                                initial_state=initial_state, cu_seqlens=cu_seqlens,
                                ssm_state_indices=ssm_state_indices, **kwargs)
    n = cu_seqlens.numel() - 1
    q = q.squeeze(0)
    out = layer.onepage_spec_out
    if out is not None and (out.shape != (q.shape[0],) + tuple(v.shape[-2:])
                            or out.dtype != v.dtype or not out.is_contiguous()):
        out = None
    out = onepage_spec_step(
        q=q, k=k.squeeze(0), v=v.squeeze(0), a=a, b=b, A_log=A_log,
        dt_bias=dt_bias, ssm_state=initial_state, record=layer.onepage_record,
        flag=layer.onepage_flag, state_indices=ssm_state_indices.reshape(-1)[:n].to(torch.int32),
        num_accepted=num_accepted_tokens[:n].to(torch.int32),
        cu_seqlens=cu_seqlens.to(torch.int32), impl=impl, out=out)
    return out.unsqueeze(0), None


def _replay_first_row(layer, impl, ssm_state, pages) -> None:
    """Bring live records' first row onto the checkpoint (a zero-length verify step)."""
    pages = pages.reshape(-1).to(torch.int32)
    n = pages.numel()
    dev = ssm_state.device
    heads = layer.onepage_heads
    record = layer.onepage_record
    empty_k = torch.empty((0, heads.num_k_heads, heads.head_k_dim), dtype=record.dtype,
                          device=dev)
    empty_v = torch.empty((0, heads.num_v_heads, heads.head_v_dim), dtype=record.dtype,
                          device=dev)
    empty_g = torch.empty((0, heads.num_v_heads), dtype=record.dtype, device=dev)
    onepage_spec_step(q=empty_k, k=empty_k, v=empty_v, a=empty_g, b=empty_g, A_log=layer.A_log,
                      dt_bias=layer.dt_bias, ssm_state=ssm_state, record=record,
                      flag=layer.onepage_flag, state_indices=pages,
                      num_accepted=torch.ones(n, dtype=torch.int32, device=dev),
                      cu_seqlens=torch.zeros(n + 1, dtype=torch.int32, device=dev), impl=impl)
