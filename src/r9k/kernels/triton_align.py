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

Pairs with a page <= 0 (vLLM's null block; "no copy") touch nothing: the page copies and flag
clears skip them (copies skip src == dst too) and the fused kernel skips page 0. Everything
runs on the device from device tensors: no host sync, shapes fixed by N, so it can be captured
in a CUDA graph. Pairs must not write a page another pair reads.

`ReplayPlan` does it for many layers at once, in a number of launches that does not grow with
the pairs: one word-copy launch over a device table of every layer's pages, the fused kernel per
layer, one flag-clear launch (the align hook calls it every step, most steps with no pair to
copy: the launches, not the work, are the cost).

`align_pairs` is the decision half: from the launch arguments of vLLM's two align copy kernels
(`precopy_mamba_align_fused_kernel`, `postprocess_mamba_fused_kernel`) it computes, on the
device and with the originals' own integer arithmetic, each batch row's (source page, destination
page, rows to replay) per mamba group, which `r9k.plugin.onepage_align` feeds to `ReplayPlan.replay`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from r9k.kernels.launch_cache import CACHES
from r9k.kernels.triton_fused import onepage_fused_step

_COPY_BLOCK = 1024
_COPY_TILES = 16  # programs per (pair, tensor): a page is up to a few MB; most steps copy none


@triton.jit(do_not_specialize=["num_pairs"])
def _page_words_kernel(src_pages_ptr, dst_pages_ptr, table_ptr, num_pairs, CLEAR: tl.constexpr,
                       BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Table entry e (one per-page tensor of one layer), pair i of its group: page src -> page
    dst as raw words (CLEAR False, pairs with both pages > 0 and src != dst), or page dst to
    zero words (CLEAR True, pairs with both pages > 0). Other pairs read and write nothing."""
    i = tl.program_id(0)
    e = tl.program_id(1)
    tile = tl.program_id(2)
    base = tl.load(table_ptr + e * 4).to(tl.pointer_type(tl.int32))
    stride = tl.load(table_ptr + e * 4 + 1)
    words = tl.load(table_ptr + e * 4 + 2)
    group = tl.load(table_ptr + e * 4 + 3)
    src = tl.load(src_pages_ptr + group * num_pairs + i).to(tl.int64)
    dst = tl.load(dst_pages_ptr + group * num_pairs + i).to(tl.int64)
    skip = (src <= 0) | (dst <= 0)
    if not CLEAR:
        skip = skip | (src == dst)
    if skip:
        return
    for start in range(tile * BLOCK, words, TILES * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < words
        if CLEAR:
            tl.store(base + dst * stride + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=mask)
        else:
            x = tl.load(base + src * stride + offs, mask=mask)
            tl.store(base + dst * stride + offs, x, mask=mask)


def _word_entry(t: torch.Tensor, group: int) -> tuple[int, int, int, int]:
    """A per-page tensor [slots, ...] as a table entry, in 32-bit words."""
    size = t.element_size()
    if not t[0].is_contiguous():
        raise ValueError(f"one-page replay: a page of shape {tuple(t.shape[1:])} must be "
                         f"contiguous (strides {t.stride()})")
    addr, stride_b, page_b = t.data_ptr(), t.stride(0) * size, t[0].numel() * size
    if addr % 4 or stride_b % 4 or page_b % 4:
        raise ValueError(f"one-page replay: pages must be whole 32-bit words (address {addr}, "
                         f"page stride {stride_b} B, page {page_b} B)")
    return addr, stride_b // 4, page_b // 4, group


class ReplayLayer(NamedTuple):
    """One one-page GDN layer's SSM state, as the replay needs it. ssm_state [slots, HV, V, K]
    (vLLM's GPU view), record [slots, 2, S, W], flag [slots, words]; `group`: the row of the
    [groups, pairs] page arrays its pairs are in."""
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    ssm_state: torch.Tensor
    record: torch.Tensor
    flag: torch.Tensor
    num_k_heads: int
    group: int = 0


class ReplayPlan:
    """`onepage_replay_into` for many layers with a fixed number of launches besides one per
    layer: one copy launch for every layer's pages (checkpoint, record, flag), the fused
    kernel per layer, one flag-clear launch. Built once per set of layers (device tables of
    the pages' addresses), then `replay` is device work only: no host sync, shapes fixed by the
    pair count, so it can be captured in a CUDA graph."""

    def __init__(self, layers: list[ReplayLayer]) -> None:
        if not layers:
            raise ValueError("one-page replay: no layers")
        self.layers = list(layers)
        self.num_groups = 1 + max(layer.group for layer in self.layers)
        dev = self.layers[0].ssm_state.device
        copies = [_word_entry(t, layer.group) for layer in self.layers
                  for t in (layer.ssm_state, layer.record, layer.flag)]
        clears = [_word_entry(layer.flag, layer.group) for layer in self.layers]
        self._copy_table = torch.tensor(copies, dtype=torch.int64, device=dev)
        self._clear_table = torch.tensor(clears, dtype=torch.int64, device=dev)
        self._copy_words = max(c[2] for c in copies)
        self._clear_words = max(c[2] for c in clears)
        self._empty: dict[tuple, tuple] = {}

    def _inputs(self, layer: ReplayLayer, n: int) -> tuple:
        """Zero-row q/k/v/a/b and zero cu_seqlens for n pairs, made once per (shape, n)."""
        HV, V, K = layer.ssm_state.shape[1:]
        key = (layer.num_k_heads, HV, V, K, layer.record.dtype, n)
        if key not in self._empty:
            dt, dev = layer.record.dtype, layer.ssm_state.device
            qk = torch.empty((0, layer.num_k_heads, K), dtype=dt, device=dev)
            self._empty[key] = (qk, torch.empty((0, HV, V), dtype=dt, device=dev),
                                torch.empty((0, HV), dtype=dt, device=dev),
                                torch.zeros(n + 1, dtype=torch.int32, device=dev))
        return self._empty[key]

    def replay(self, src_pages: torch.Tensor, dst_pages: torch.Tensor, num_rows: torch.Tensor,
               use_qk_l2norm_in_kernel: bool = True) -> None:
        """src_pages, dst_pages [groups, n] int32 (contiguous), num_rows [n] int32, on the
        device. A pair must have both pages > 0 or both 0 (`align_pairs` writes them so)."""
        n = num_rows.numel()
        if tuple(src_pages.shape) != (self.num_groups, n) or src_pages.shape != dst_pages.shape:
            raise ValueError(f"one-page replay: pages must be [{self.num_groups}, {n}], got "
                             f"{tuple(src_pages.shape)} and {tuple(dst_pages.shape)}")
        if n == 0:
            return
        self._words(self._copy_table, self._copy_words, src_pages, dst_pages, clear=False)
        for layer in self.layers:
            qk, v, ab, cu = self._inputs(layer, n)
            onepage_fused_step(
                q=qk, k=qk, v=v, a=ab, b=ab, A_log=layer.A_log, dt_bias=layer.dt_bias,
                ssm_state=layer.ssm_state, record=layer.record, flag=layer.flag,
                state_indices=dst_pages[layer.group], num_accepted=num_rows, cu_seqlens=cu,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        self._words(self._clear_table, self._clear_words, src_pages, dst_pages, clear=True)

    @staticmethod
    def _words(table, max_words, src_pages, dst_pages, *, clear: bool) -> None:
        n = src_pages.shape[1]
        tiles = min(_COPY_TILES, triton.cdiv(max_words, _COPY_BLOCK))
        _page_words_kernel[(n, table.shape[0], tiles)](
            src_pages, dst_pages, table, n, CLEAR=clear, BLOCK=_COPY_BLOCK, TILES=tiles)


def onepage_replay_into(*, A_log, dt_bias, ssm_state, record, flag, src_pages, dst_pages,
                        num_rows, num_k_heads: int, use_qk_l2norm_in_kernel: bool = True) -> None:
    """N (src, dst, rows) pairs as int32 device tensors [N], any pages (a pair with a page
    <= 0 is no copy). ssm_state [slots, HV, V, K] (vLLM's GPU view), record [slots, 2, S, W],
    flag [slots, words]. One layer; the align hook replays all its layers with a `ReplayPlan`."""
    n = src_pages.numel()
    if dst_pages.numel() != n or num_rows.numel() != n:
        raise ValueError(f"src_pages, dst_pages and num_rows must have one entry per pair; got "
                         f"{n}, {dst_pages.numel()}, {num_rows.numel()}")
    if n == 0:
        return
    valid = (src_pages > 0) & (dst_pages > 0)
    src = torch.where(valid, src_pages, 0).to(torch.int32).reshape(1, n)
    dst = torch.where(valid, dst_pages, 0).to(torch.int32).reshape(1, n)
    _single_plan(ReplayLayer(A_log, dt_bias, ssm_state, record, flag, num_k_heads)).replay(
        src, dst, num_rows.to(torch.int32).contiguous(), use_qk_l2norm_in_kernel)


def _single_plan(layer: ReplayLayer) -> ReplayPlan:
    """One layer's plan, kept by its tensors: a plan builds device tables (a host-to-device
    copy), which a CUDA graph capture must not do, so a call captured after an eager one
    reuses the eager one's."""
    key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
                for t in (layer.A_log, layer.dt_bias, layer.ssm_state, layer.record, layer.flag))
    key += (layer.num_k_heads,)
    plans = CACHES.single_plans
    if key not in plans:
        if len(plans) >= 64:
            plans.clear()
        plans[key] = ReplayPlan([layer])
    return plans[key]


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
    0 rows; a pair with a null page (<= 0) gets both pages 0. The boundary case keeps the in-place one (same block, bias 0) that stock skips as
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
        pair = copy & (src_page > 0) & (dst_page > 0)  # a null page: no copy in this group
        tl.store(src_pages_ptr + g * num_reqs + batch_idx, tl.where(pair, src_page, 0))
        tl.store(dst_pages_ptr + g * num_reqs + batch_idx, tl.where(pair, dst_page, 0))


def align_pairs(*, boundary: bool, num_reqs: int, num_groups: int, block_table_ptrs,
                block_table_stride_req: int, mamba_state_idx, src_col=None, token_bias=None,
                num_accepted_tokens=None, num_scheduled_tokens=None, num_computed_tokens=None,
                num_draft_tokens=None, idx_mapping=None, block_size: int | None = None,
                precomputed_new_computed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src pages [G, n], dst pages [G, n], rows [n]) int32 on the device, n = num_reqs: the
    pre-copy's (`boundary=False`) or the boundary copy's decision per batch row, from the
    arguments vLLM launches its kernel with (`ReplayPlan.replay`'s inputs: both pages > 0 or
    both 0). Rows to replay = accepted-token bias + 1."""
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
