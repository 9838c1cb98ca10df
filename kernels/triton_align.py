"""Prefix caching's state copies on one-page pages, on the GPU.

Stock (mamba_cache_mode "align") copies the state after candidate row `n - 1` of the last verify
(its slot column) into another page: the pre-copy when a running page moves, the boundary copy
into a block that then gets cached (in place when the running page ends at the boundary). A
one-page page has no slot columns; `onepage_replay_into` gives the destination the same bytes:

    dst.checkpoint = src.checkpoint advanced by the first min(n, live count) rows of src's record
    dst.flag = 0   (a copied or cached page holds a checkpoint, no live record)

How: copy src's page (checkpoint, record, flag) into dst, run the fused verify kernel
(`triton_fused.onepage_gdn_step_kernel`, the production binary) at dst with zero candidate rows
and `num_accepted = n` (it replays min(n, live count) rows and stores once, rounded to the state
dtype; with no rows it records nothing and leaves the flag alone), then clear dst's flag. The
replay is that kernel's, proven bit-identical to stock; a separate replay-only kernel was not:
on the H200 it differed from stock in the last bit of ~500 of 66M state elements (fp32, 27B-TP2
heads), presumably because Triton picks the reduction layout from the whole kernel.

Pairs with a page <= 0 (vLLM's null block; "no copy") are redirected to page 0 -> 0, which
copies page 0 onto itself, is skipped by the kernel, and keeps page 0's flag. Everything runs on
the device from device tensors: no host sync, shapes fixed by N, so it can be captured in a CUDA
graph. src == dst replays in place. Pairs must not write a page another pair reads.
"""
from __future__ import annotations

import torch

from r9k.kernels.triton_fused import onepage_fused_step


def onepage_replay_into(*, A_log, dt_bias, ssm_state, record, flag, src_pages, dst_pages,
                        num_rows, num_k_heads: int, use_qk_l2norm_in_kernel: bool = True) -> None:
    """N (src, dst, rows) pairs as int32 device tensors [N]. ssm_state [slots, HV, V, K]
    (vLLM's GPU view), record [slots, 2, S, W], flag [slots, FLAG_WORDS]."""
    n = src_pages.numel()
    if dst_pages.numel() != n or num_rows.numel() != n:
        raise ValueError(f"src_pages, dst_pages and num_rows must have one entry per pair; got "
                         f"{n}, {dst_pages.numel()}, {num_rows.numel()}")
    if n == 0:
        return
    valid = (src_pages > 0) & (dst_pages > 0)
    src = torch.where(valid, src_pages, 0).long()
    dst = torch.where(valid, dst_pages, 0).long()
    ssm_state[dst] = ssm_state[src]
    record[dst] = record[src]
    flag[dst] = flag[src]
    HV, V, K = ssm_state.shape[1], ssm_state.shape[2], ssm_state.shape[3]
    dev = ssm_state.device
    none = torch.empty((0, num_k_heads, K), dtype=record.dtype, device=dev)
    onepage_fused_step(
        q=none, k=none, v=torch.empty((0, HV, V), dtype=record.dtype, device=dev),
        a=torch.empty((0, HV), dtype=record.dtype, device=dev),
        b=torch.empty((0, HV), dtype=record.dtype, device=dev), A_log=A_log, dt_bias=dt_bias,
        ssm_state=ssm_state, record=record, flag=flag, state_indices=dst.to(torch.int32),
        num_accepted=num_rows.to(torch.int32),
        cu_seqlens=torch.zeros(n + 1, dtype=torch.int32, device=dev),
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    flag[dst] = torch.where(valid[:, None], torch.zeros_like(flag[dst]), flag[dst])
