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

Pairs with a page <= 0 (vLLM's null block; "no copy") touch nothing: the page copy skips them
(and src == dst), the fused kernel skips page 0, and page 0's flag is rewritten with its own
value. Everything runs on the device from device tensors: no host sync, shapes fixed by N, so
it can be captured in a CUDA graph. Pairs must not write a page another pair reads.

`align_pairs` is the decision half: from the launch arguments of vLLM's two align copy kernels
(`precopy_mamba_align_fused_kernel`, `postprocess_mamba_fused_kernel`) it computes, on the
device and with the originals' own integer arithmetic, each batch row's (source page, destination
page, rows to replay) per mamba group, which `r9k.onepage_align` feeds to `onepage_replay_into`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from r9k.kernels.triton_fused import onepage_fused_step

_COPY_BLOCK = 1024
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_pages_kernel(src_pages_ptr, dst_pages_ptr, base_ptr, page_stride, page_elems,
                       BLOCK: tl.constexpr):
    """Page src -> page dst of one per-page tensor, for every pair with both pages > 0 and
    src != dst; other pairs read and write nothing."""
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_pages_ptr + i).to(tl.int64)
    dst = tl.load(dst_pages_ptr + i).to(tl.int64)
    if (src <= 0) | (dst <= 0) | (src == dst):
        return
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_elems
    x = tl.load(base_ptr + src * page_stride + offs, mask=mask)
    tl.store(base_ptr + dst * page_stride + offs, x, mask=mask)


def copy_pages(src_pages: torch.Tensor, dst_pages: torch.Tensor, *tensors: torch.Tensor) -> None:
    """For each per-page tensor [slots, ...] (page rows contiguous, any page stride, as vLLM's
    padded page views are): page src -> page dst of every valid pair, as raw bits."""
    n = src_pages.numel()
    if n == 0:
        return
    for t in tensors:
        if not t[0].is_contiguous():
            raise ValueError(f"copy_pages: a page of shape {tuple(t.shape[1:])} must be "
                             f"contiguous (strides {t.stride()})")
        bits = t.view(_INT_OF_SIZE[t.element_size()])  # bit copies, whatever the dtype
        page_elems = t[0].numel()
        grid = (n, triton.cdiv(page_elems, _COPY_BLOCK))
        _copy_pages_kernel[grid](src_pages, dst_pages, bits, bits.stride(0), page_elems,
                                 BLOCK=_COPY_BLOCK)


def onepage_replay_into(*, A_log, dt_bias, ssm_state, record, flag, src_pages, dst_pages,
                        num_rows, num_k_heads: int, use_qk_l2norm_in_kernel: bool = True) -> None:
    """N (src, dst, rows) pairs as int32 device tensors [N]. ssm_state [slots, HV, V, K]
    (vLLM's GPU view), record [slots, 2, S, W], flag [slots, words]."""
    n = src_pages.numel()
    if dst_pages.numel() != n or num_rows.numel() != n:
        raise ValueError(f"src_pages, dst_pages and num_rows must have one entry per pair; got "
                         f"{n}, {dst_pages.numel()}, {num_rows.numel()}")
    if n == 0:
        return
    valid = (src_pages > 0) & (dst_pages > 0)
    src = torch.where(valid, src_pages, 0).to(torch.int32)
    dst = torch.where(valid, dst_pages, 0).to(torch.int32)
    copy_pages(src, dst, ssm_state, record, flag)
    HV, V, K = ssm_state.shape[1], ssm_state.shape[2], ssm_state.shape[3]
    dev = ssm_state.device
    none = torch.empty((0, num_k_heads, K), dtype=record.dtype, device=dev)
    onepage_fused_step(
        q=none, k=none, v=torch.empty((0, HV, V), dtype=record.dtype, device=dev),
        a=torch.empty((0, HV), dtype=record.dtype, device=dev),
        b=torch.empty((0, HV), dtype=record.dtype, device=dev), A_log=A_log, dt_bias=dt_bias,
        ssm_state=ssm_state, record=record, flag=flag, state_indices=dst,
        num_accepted=num_rows.to(torch.int32),
        cu_seqlens=torch.zeros(n + 1, dtype=torch.int32, device=dev),
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    dst_l = dst.long()
    flag[dst_l] = torch.where(valid[:, None], torch.zeros_like(flag[dst_l]), flag[dst_l])


@triton.jit(do_not_specialize=["num_reqs"])
def _align_pairs_kernel(
    mamba_state_idx_ptr, src_col_ptr, token_bias_ptr,
    num_accepted_tokens_ptr, num_scheduled_tokens_ptr, num_computed_tokens_ptr,
    num_draft_tokens_ptr, block_table_ptrs_ptr, block_table_stride_req, idx_mapping_ptr,
    src_pages_ptr, dst_pages_ptr, rows_ptr, num_reqs,
    NUM_GROUPS: tl.constexpr, BOUNDARY: tl.constexpr, block_size: tl.constexpr,
    HAS_IDX_MAPPING: tl.constexpr, PRECOMPUTED_NEW_COMPUTED: tl.constexpr,
):
    """One batch row: the decision lines of vLLM's kernel (copied in their order and types),
    then the block-table lookups of both pages per group. Rows with no copy get pages 0 and
    0 rows. The boundary case keeps the in-place one (same block, bias 0) that stock skips as
    a no-op: one-page materializes the running page's checkpoint there (it gets cached)."""
    batch_idx = tl.program_id(0)
    if HAS_IDX_MAPPING:
        req_idx = tl.load(idx_mapping_ptr + batch_idx)
    else:
        req_idx = batch_idx
    valid = req_idx >= 0
    req_idx = tl.maximum(req_idx, 0)
    if BOUNDARY:
        num_accepted = tl.load(num_accepted_tokens_ptr + req_idx)
        src_col = tl.load(mamba_state_idx_ptr + req_idx)
        if PRECOMPUTED_NEW_COMPUTED:
            new_num_computed = tl.load(num_computed_tokens_ptr + req_idx)
            num_tokens_running_state = new_num_computed - num_accepted + 1
        else:
            num_scheduled = tl.load(num_scheduled_tokens_ptr + req_idx)
            num_computed = tl.load(num_computed_tokens_ptr + req_idx)
            num_draft = tl.load(num_draft_tokens_ptr + req_idx)
            num_tokens_running_state = num_computed + num_scheduled - num_draft
            new_num_computed = num_tokens_running_state + num_accepted - 1
        aligned_new_computed = (new_num_computed // block_size) * block_size
        copy = valid & (aligned_new_computed >= num_tokens_running_state)
        bias = aligned_new_computed - num_tokens_running_state
        dst_col = aligned_new_computed // block_size - 1
    else:
        src_col = tl.load(src_col_ptr + req_idx)
        dst_col = tl.load(mamba_state_idx_ptr + req_idx)
        copy = valid & (src_col >= 0) & (src_col != dst_col)
        bias = tl.load(token_bias_ptr + req_idx)
    tl.store(rows_ptr + batch_idx, tl.where(copy, bias + 1, 0).to(tl.int32))
    for g in tl.static_range(NUM_GROUPS):
        table = tl.load(block_table_ptrs_ptr + g).to(tl.pointer_type(tl.int32))
        row = table + req_idx.to(tl.int64) * block_table_stride_req
        src_page = tl.load(row + src_col, mask=copy, other=0)
        dst_page = tl.load(row + dst_col, mask=copy, other=0)
        tl.store(src_pages_ptr + g * num_reqs + batch_idx, tl.where(copy, src_page, 0))
        tl.store(dst_pages_ptr + g * num_reqs + batch_idx, tl.where(copy, dst_page, 0))


def align_pairs(*, boundary: bool, num_reqs: int, num_groups: int, block_table_ptrs,
                block_table_stride_req: int, mamba_state_idx, src_col=None, token_bias=None,
                num_accepted_tokens=None, num_scheduled_tokens=None, num_computed_tokens=None,
                num_draft_tokens=None, idx_mapping=None, block_size: int | None = None,
                precomputed_new_computed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src pages [G, n], dst pages [G, n], rows [n]) int32 on the device, n = num_reqs: the
    pre-copy's (`boundary=False`) or the boundary copy's decision per batch row, from the
    arguments vLLM launches its kernel with. Rows to replay = accepted-token bias + 1."""
    dev = mamba_state_idx.device
    src = torch.zeros((num_groups, num_reqs), dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    rows = torch.zeros(num_reqs, dtype=torch.int32, device=dev)
    if num_reqs == 0:
        return src, dst, rows
    if boundary and block_size is None:
        raise ValueError("align_pairs: the boundary copy needs block_size")
    dummy = mamba_state_idx  # pointers of arguments the chosen branch never reads
    _align_pairs_kernel[(num_reqs,)](
        mamba_state_idx, dummy if src_col is None else src_col,
        dummy if token_bias is None else token_bias,
        dummy if num_accepted_tokens is None else num_accepted_tokens,
        dummy if num_scheduled_tokens is None else num_scheduled_tokens,
        dummy if num_computed_tokens is None else num_computed_tokens,
        dummy if num_draft_tokens is None else num_draft_tokens,
        block_table_ptrs, block_table_stride_req, dummy if idx_mapping is None else idx_mapping,
        src, dst, rows, num_reqs,
        NUM_GROUPS=num_groups, BOUNDARY=boundary, block_size=block_size or 1,
        HAS_IDX_MAPPING=idx_mapping is not None,
        PRECOMPUTED_NEW_COMPUTED=precomputed_new_computed)
    return src, dst, rows
