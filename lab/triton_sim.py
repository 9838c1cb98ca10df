"""Triton hooks for `simulate.run_simulation`: stock per-slot vs one-page composed vs fused.

Shared by the GPU tests (H200), the CPU interpreter tests (TRITON_INTERPRET=1) and the kernel
benchmark. The simulation's backend is the composed one (its `per_slot_step` is vLLM's stock
call); `fused_step_checked` runs the fused kernel on the simulation's pools and the composed
step on copies, and asserts after every step that outputs, checkpoints, records and flags are
torch.equal, so each step checks fused == composed == stock.
"""
from __future__ import annotations

from typing import Callable

import torch

from r9k.kernels.onepage import NULL_PAGE, GdnHeads, GdnInputs, onepage_verify_step
from lab.simulate import assert_bit_identical
from r9k.kernels.triton_composed import StockTritonComposed
from r9k.kernels.triton_fused import onepage_fused_step


def composed_backend(A_log: torch.Tensor, dt_bias: torch.Tensor) -> StockTritonComposed:
    return StockTritonComposed(A_log, dt_bias)


class FusedStepChecked:
    """An `onepage_step` for run_simulation: fused kernel, cross-checked against composed."""

    def __init__(self, fused_step: Callable = onepage_fused_step) -> None:
        """`fused_step`: the shipped kernel's launcher, or a research variant's
        (`lab.fused_variants.checked`)."""
        self.steps = 0
        self.fused_step = fused_step

    def __call__(self, backend: StockTritonComposed, heads: GdnHeads, state_pool, record_pool,
                 flag_pool, pages, num_accepted, x: GdnInputs, cu_seqlens, row_map=None):
        pool_c, record_c, flag_c = state_pool.clone(), record_pool.clone(), flag_pool.clone()
        out_c = onepage_verify_step(backend, heads, pool_c, record_c, flag_c, pages,
                                    num_accepted, x, cu_seqlens, row_map)
        out = self.fused_step(
            q=x.q, k=x.k, v=x.v, a=x.a, b=x.b, A_log=backend.A_log, dt_bias=backend.dt_bias,
            ssm_state=state_pool, record=record_pool, flag=flag_pool, state_indices=pages,
            num_accepted=num_accepted, cu_seqlens=cu_seqlens, row_map=row_map)
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        live_rows = torch.repeat_interleave(pages.long() != NULL_PAGE, lens)
        rows = row_map.long()[live_rows] if row_map is not None else live_rows.nonzero().flatten()
        step = f"fused step {self.steps}"
        assert_bit_identical(out.index_select(0, rows), out_c.index_select(0, rows),
                             f"{step} outputs")
        if row_map is not None:  # rows outside the map stay zero
            outside = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
            outside[row_map.long()] = False
            assert_bit_identical(out[outside], torch.zeros_like(out[outside]),
                                 f"{step} unmapped rows")
        null_rows = (row_map.long()[~live_rows] if row_map is not None
                     else (~live_rows).nonzero().flatten())
        assert_bit_identical(out.index_select(0, null_rows),
                             torch.zeros_like(out.index_select(0, null_rows)),
                             f"{step} null-page rows")
        assert_bit_identical(state_pool, pool_c, f"{step} checkpoints")
        assert_bit_identical(record_pool, record_c, f"{step} records")
        assert_bit_identical(flag_pool, flag_c, f"{step} flags")
        self.steps += 1
        return out


class ReplayIntoChecked:
    """A `replay_into_fn` for run_align_simulation: the Triton align-copy kernel on the
    simulation's pools, `replay_into` over the composed backend on copies, torch.equal after
    every copy (checkpoints, records, flags)."""

    def __init__(self) -> None:
        self.copies = 0

    def __call__(self, backend: StockTritonComposed, heads: GdnHeads, state_pool, record_pool,
                 flag_pool, src_pages, dst_pages, num_rows):
        from r9k.kernels.onepage import replay_into
        from r9k.kernels.triton_align import onepage_replay_into

        pool_c, record_c, flag_c = state_pool.clone(), record_pool.clone(), flag_pool.clone()
        rows = replay_into(backend, heads, pool_c, record_c, flag_c, src_pages, dst_pages,
                           num_rows)
        onepage_replay_into(A_log=backend.A_log, dt_bias=backend.dt_bias, ssm_state=state_pool,
                            record=record_pool, flag=flag_pool,
                            src_pages=src_pages.to(torch.int32), dst_pages=dst_pages.to(torch.int32),
                            num_rows=num_rows.to(torch.int32), num_k_heads=heads.num_k_heads)
        what = f"align copy {self.copies}"
        assert_bit_identical(state_pool, pool_c, f"{what} checkpoints")
        # a destination's record is dead (its flag is cleared): the kernel path copies src's
        # there, replay_into leaves it; every other page's record must be untouched
        live = torch.ones(record_pool.shape[0], dtype=torch.bool, device=record_pool.device)
        moved = (src_pages > 0) & (dst_pages > 0) & (src_pages != dst_pages)
        live[dst_pages[moved].long()] = False
        assert_bit_identical(record_pool[live], record_c[live], f"{what} records")
        assert_bit_identical(flag_pool, flag_c, f"{what} flags")
        self.copies += 1
        return rows
