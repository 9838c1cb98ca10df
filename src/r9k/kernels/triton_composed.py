"""One-page recurrence composed from vLLM's stock Triton spec kernel: the GPU fallback and the
reference the fused kernel is tested against.

`fused_sigmoid_gating_delta_rule_update` loads the initial state from column `num_accepted - 1`
of a 2-D index row, stores the state after token t into column t and skips indices <= 0, so
- replay n rows: row `[0]*(n-1) + [page]`, num_accepted = n: starts from `page`, stores once
  into `page` after the last row;
- verify T rows: row `[0]*T + [page]`, num_accepted = T + 1: starts from `page`, stores nothing.
Both are the stock kernel's own arithmetic (same tiling, same op order), hence bit-identical.
State layout: vLLM's GPU view `[slots, HV, V, K]`.
"""
from __future__ import annotations

import torch

from r9k.kernels._stock_loader import stock_spec_update
from r9k.kernels.onepage import GdnInputs


def _pow2(width: int) -> int:
    # the row width is a constexpr of the stock kernel: round it up to bound recompilations
    # (columns past the ones read and stored are never touched)
    return 1 << max(width - 1, 0).bit_length()


def index_rows(pages: torch.Tensor, column: torch.Tensor, width: int) -> torch.Tensor:
    """[N, width] int32 rows of zeros with pages[i] at column[i] (built on the device)."""
    cols = torch.arange(width, device=pages.device)[None, :]
    return torch.where(cols == column[:, None].long(), pages[:, None].to(torch.int32),
                       torch.zeros((), dtype=torch.int32, device=pages.device)).contiguous()


class StockTritonComposed:
    """GdnBackend built from two calls of vLLM's stock Triton kernel per step."""

    def __init__(self, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        self.A_log = A_log
        self.dt_bias = dt_bias
        self._update = stock_spec_update()

    def _run(self, state, idx, num_accepted, q, k, v, a, b, cu):
        out, _ = self._update(
            A_log=self.A_log, a=a.contiguous(), b=b.contiguous(), dt_bias=self.dt_bias,
            q=q.unsqueeze(0).contiguous(), k=k.unsqueeze(0).contiguous(),
            v=v.unsqueeze(0).contiguous(), initial_state=state, inplace_final_state=True,
            cu_seqlens=cu.to(torch.int32).contiguous(), ssm_state_indices=idx,
            num_accepted_tokens=num_accepted.to(torch.int32).contiguous(),
            use_qk_l2norm_in_kernel=True)
        return out.squeeze(0)

    def replay(self, state_pool, pages, k, v, a, b, cu_seqlens) -> None:
        if pages.numel() == 0:
            return
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        width = max(int(lens.max()), 1)
        idx = index_rows(pages, lens - 1, _pow2(width))
        # q only feeds outputs, which replay discards: k stands in for it
        self._run(state_pool, idx, lens, k, k, v, a, b, cu_seqlens)

    def verify(self, state_pool, pages, x: GdnInputs, cu_seqlens) -> torch.Tensor:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        width = (int(lens.max()) if lens.numel() else 0) + 1
        idx = index_rows(pages, lens, _pow2(width))
        return self._run(state_pool, idx, lens + 1, x.q, x.k, x.v, x.a, x.b, cu_seqlens)

    def per_slot_step(self, state_pool, slot_rows, num_accepted, x: GdnInputs, cu_seqlens):
        """Stock: exactly the call vLLM's `_forward_core` makes on the spec rows."""
        return self._run(state_pool, slot_rows.to(torch.int32).contiguous(), num_accepted,
                         x.q, x.k, x.v, x.a, x.b, cu_seqlens)
