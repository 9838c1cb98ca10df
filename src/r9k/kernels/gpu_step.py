"""The one-page GDN spec-decode step the plugin's GPU path (CUDA and ROCm) calls per layer.

`onepage_spec_step` replaces vLLM's `fused_sigmoid_gating_delta_rule_update(...,
ssm_state_indices=spec_state_indices_tensor, num_accepted_tokens=...)` call on the spec rows:
- impl="fused" (default): one Triton launch (`triton_fused`), no host synchronization; the
  accepted counts stay on the device.
- impl="composed": the pure state machine (`onepage.onepage_verify_step`) over two calls of
  vLLM's stock Triton kernel (`triton_composed`): the fallback and the reference. It synchronizes
  with the host (it sizes index rows from the counts), so it is not CUDA-graph safe.
Both are bit-identical to stock per-slot decoding (tests/gpu). Imports neither vLLM, click,
pydantic nor Ray (the stock kernel is found lazily, only for impl="composed").
"""
from __future__ import annotations

import torch

from r9k.kernels.onepage import NULL_PAGE, GdnHeads, GdnInputs

IMPLS = ("fused", "composed")


def onepage_spec_step(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      ssm_state: torch.Tensor, record: torch.Tensor, flag: torch.Tensor,
                      state_indices: torch.Tensor, num_accepted: torch.Tensor,
                      cu_seqlens: torch.Tensor, row_map: torch.Tensor | None = None,
                      impl: str = "fused", out: torch.Tensor | None = None) -> torch.Tensor:
    """One verify step for N spec sequences on one-page pages; returns outputs [T, HV, V].

    q, k [T, HK, K]; v [T, HV, V]; a, b [T, HV]: post-conv rows (model dtype). ssm_state: vLLM's
    [slots, HV, V, K] view (fp32 or bf16); record [slots, 2, S, W] and flag [slots, words]
    int32 (`capacity.flag_words`): the page's record views. state_indices [N] int32 page ids
    (0 = null page, skipped);
    num_accepted [N] int32 (vLLM's counts, on the device); cu_seqlens [N + 1] int32. With a
    row_map, sequence i's rows are row_map[cu[i]:cu[i+1]] of q..b and the other output rows are 0.
    Rows of null pages come out 0 (fused) or unspecified (composed, as stock leaves them).
    out: a contiguous [T, HV, V] tensor of v's dtype to write the outputs into (fused: written
    by the kernel; composed: copied).
    """
    if impl == "fused":
        from r9k.kernels.triton_fused import onepage_fused_step

        return onepage_fused_step(
            q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state,
            record=record, flag=flag, state_indices=state_indices, num_accepted=num_accepted,
            cu_seqlens=cu_seqlens, row_map=row_map, out=out)
    if impl == "composed":
        from r9k.kernels.onepage import onepage_verify_step
        from r9k.kernels.triton_composed import StockTritonComposed

        heads = GdnHeads(num_k_heads=k.shape[1], num_v_heads=v.shape[1], head_k_dim=k.shape[2],
                         head_v_dim=v.shape[2])
        res = onepage_verify_step(
            StockTritonComposed(A_log, dt_bias), heads, ssm_state, record, flag, state_indices,
            num_accepted, GdnInputs(q=q, k=k, v=v, a=a, b=b), cu_seqlens, row_map)
        return res if out is None else out.copy_(res)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def clear_flags(flag: torch.Tensor, state_indices: torch.Tensor) -> None:
    """Prefill and stock paths: forget the pages' records (every flag word to 0, as
    `onepage.clear_records` does: a fresh page holds garbage in every field).

    No host synchronization (safe under CUDA graphs): null pages are redirected to the null
    page's own flag, which is written with its current value.
    """
    idx = state_indices.reshape(-1).long()
    live = idx > NULL_PAGE
    idx = torch.where(live, idx, torch.zeros_like(idx))
    cur = flag[idx]
    flag[idx] = torch.where(live[:, None], torch.zeros_like(cur), cur)
