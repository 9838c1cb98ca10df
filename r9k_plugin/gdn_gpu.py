"""GPU path (CUDA and ROCm) of the one-page GDN layer.

vLLM's `_forward_core` stays the code that runs: convs, prefill chunks and output merging are
stock. While it runs for a one-page layer, its two spec-path calls are routed:
- `causal_conv1d_update(..., num_accepted_tokens=...)` gets `max_query_len = S` from the
  configuration (stock derives it from the state-index width, which is 1 with one page);
- `fused_sigmoid_gating_delta_rule_update(..., num_accepted_tokens=...)` (the spec verify) runs
  the one-page step (`r9k.kernels.gpu_step`), and the non-spec decode call replays a live record's
  first row first (stock resumes from block-table column 0).
Prefill pages get their flag cleared before the stock prefill writes their checkpoint.

Proven at kernel and step level on an H200 (tests/gpu); no vLLM GPU engine runs here.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as stock_gdn

from r9k.kernels.gpu_step import IMPLS, clear_flags, onepage_spec_step

STEP_IMPL_ENV = "R9K_GDN_STEP"  # fused (default) | composed (stock kernel calls, reference)
_lock = threading.Lock()


def step_impl() -> str:
    impl = os.environ.get(STEP_IMPL_ENV, "fused").strip().lower()
    if impl not in IMPLS:
        raise ValueError(f"{STEP_IMPL_ENV}={impl!r}: expected one of {', '.join(IMPLS)}")
    return impl


def onepage_forward_core(layer, stock_forward_core, mixed_qkv, b, a, core_attn_out):
    ctx = get_forward_context()
    md = ctx.attn_metadata.get(layer.prefix) if isinstance(ctx.attn_metadata, dict) else None
    if md is not None and md.num_prefills > 0:
        pages = md.prefill_state_indices
        if pages is None:
            pages = md.non_spec_state_indices_tensor
        clear_flags(layer.kv_cache[3], pages)
    with _routed_spec_calls(layer):
        return stock_forward_core(mixed_qkv, b, a, core_attn_out)


@contextlib.contextmanager
def _routed_spec_calls(layer):
    orig_conv = stock_gdn.causal_conv1d_update
    orig_rec = stock_gdn.fused_sigmoid_gating_delta_rule_update
    impl = step_impl()

    def conv_update(*args, **kwargs):
        if kwargs.get("num_accepted_tokens") is not None:
            kwargs["max_query_len"] = layer.num_candidates  # S, never an index width
        return orig_conv(*args, **kwargs)

    def recurrence(*, q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens,
                   ssm_state_indices, num_accepted_tokens=None, **kwargs):
        record, flag = layer.kv_cache[2], layer.kv_cache[3]
        if num_accepted_tokens is None:  # non-spec decode: stock reads column 0
            _replay_first_row(layer, impl, initial_state, ssm_state_indices)
            clear_flags(flag, ssm_state_indices)
            return orig_rec(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                            initial_state=initial_state, cu_seqlens=cu_seqlens,
                            ssm_state_indices=ssm_state_indices, **kwargs)
        n = cu_seqlens.numel() - 1
        out = onepage_spec_step(
            q=q.squeeze(0), k=k.squeeze(0), v=v.squeeze(0), a=a, b=b, A_log=A_log,
            dt_bias=dt_bias, ssm_state=initial_state, record=record, flag=flag,
            state_indices=ssm_state_indices.reshape(-1)[:n].to(torch.int32),
            num_accepted=num_accepted_tokens[:n].to(torch.int32),
            cu_seqlens=cu_seqlens.to(torch.int32), impl=impl)
        return out.unsqueeze(0), None

    with _lock:
        stock_gdn.causal_conv1d_update = conv_update
        stock_gdn.fused_sigmoid_gating_delta_rule_update = recurrence
        try:
            yield
        finally:
            stock_gdn.causal_conv1d_update = orig_conv
            stock_gdn.fused_sigmoid_gating_delta_rule_update = orig_rec


def _replay_first_row(layer, impl, ssm_state, pages) -> None:
    """Bring live records' first row onto the checkpoint (a zero-length verify step)."""
    pages = pages.reshape(-1).to(torch.int32)
    n = pages.numel()
    dev = ssm_state.device
    heads = layer.onepage_heads
    empty_k = torch.empty((0, heads.num_k_heads, heads.head_k_dim), dtype=layer.kv_cache[2].dtype,
                          device=dev)
    empty_v = torch.empty((0, heads.num_v_heads, heads.head_v_dim), dtype=empty_k.dtype, device=dev)
    empty_g = torch.empty((0, heads.num_v_heads), dtype=empty_k.dtype, device=dev)
    onepage_spec_step(q=empty_k, k=empty_k, v=empty_v, a=empty_g, b=empty_g, A_log=layer.A_log,
                      dt_bias=layer.dt_bias, ssm_state=ssm_state, record=layer.kv_cache[2],
                      flag=layer.kv_cache[3], state_indices=pages,
                      num_accepted=torch.ones(n, dtype=torch.int32, device=dev),
                      cu_seqlens=torch.zeros(n + 1, dtype=torch.int32, device=dev), impl=impl)
