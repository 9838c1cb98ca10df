"""The one-page GDN state machine, pure and engine-free (tensors in, tensors out).

Stock vLLM keeps 1 + k state slots per request under speculative decoding: verify stores the
state after every candidate, and the next step resumes from slot `num_accepted - 1`. One-page
keeps one page per request holding

- the checkpoint: the state after the last accepted token (the stock SSM state tensor),
- a record: for each of the S = 1 + k candidates of the previous step, the post-conv k and v rows
  and the a and b gate inputs, in two slots (a step reads one and writes the other),
- flag words: [live row count, live slot, done counter (measured GPU protocols), spare], then
  a (count, slot) pair per fused GPU kernel program, kept equal to the first two words.

A verify step per request: replay the first `num_accepted` rows of the live record onto the
checkpoint (store once, rounded to the state dtype as stock stores slots), run the new candidates
from the checkpoint producing outputs without storing states, write their rows into the other
slot and flip the flag. Prefill and stock paths clear the flag, so a recycled page never replays
a stale record. Page 0 is vLLM's null block: never replayed nor recorded.

The recurrence itself comes from a backend (`GdnBackend`): the plain-torch reference here, vLLM's
CPU ops (`cpu.py`) or Triton (`triton_composed.py`, `triton_fused.py`), so the same state machine
runs the same arithmetic as stock on each platform.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from r9k.core.page_layout import (
    FLAG_COUNT, FLAG_PAIR_WORDS, FLAG_SLOT, FLAG_WORDS, flag_words, record_row_elements)

NULL_PAGE = 0  # vLLM's null block (CUDA-graph padding): never replayed nor recorded


@dataclass(frozen=True)
class GdnHeads:
    """Per-rank head geometry of one GDN layer."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def record_row_width(self) -> int:
        return record_row_elements(self.num_k_heads, self.num_v_heads, self.head_k_dim,
                                   self.head_v_dim)

    @property
    def flag_words(self) -> int:
        return flag_words(self.num_v_heads, self.head_v_dim)


def set_live(flags: torch.Tensor, count: torch.Tensor, slot: torch.Tensor) -> None:
    """Make `count` rows of `slot` live in flag rows [n, words] (in place): the head's two words
    and every kernel program's pair, which the fused GPU kernel reads instead of the head."""
    count = count.to(flags.dtype)
    slot = slot.to(flags.dtype)
    flags[:, FLAG_COUNT] = count
    flags[:, FLAG_SLOT] = slot
    flags[:, FLAG_WORDS + FLAG_COUNT::FLAG_PAIR_WORDS] = count[:, None]
    flags[:, FLAG_WORDS + FLAG_SLOT::FLAG_PAIR_WORDS] = slot[:, None]


@dataclass
class GdnInputs:
    """A batch's candidate rows, post-conv: q, k [T, HK, K]; v [T, HV, V]; a, b [T, HV]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    def rows(self, idx: torch.Tensor) -> "GdnInputs":
        return GdnInputs(*(t.index_select(0, idx) for t in (self.q, self.k, self.v, self.a, self.b)))


class GdnBackend(Protocol):
    """The two recurrence primitives the state machine needs; both run per sequence
    (rows cu_seqlens[i]:cu_seqlens[i+1]) from the state stored in page `pages[i]`."""

    def replay(self, state_pool: torch.Tensor, pages: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               cu_seqlens: torch.Tensor) -> None:
        """Run the rows from each page's state and store the final state there once."""

    def verify(self, state_pool: torch.Tensor, pages: torch.Tensor, x: GdnInputs,
               cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Run the rows from each page's state; return outputs [T, HV, V]; store nothing."""


# --- record packing -----------------------------------------------------------------------------

def pack_record_rows(x: GdnInputs) -> torch.Tensor:
    """[T, record_row_width] rows: k | v | a | b, in the inputs' dtype (bit-exact storage)."""
    t = x.k.shape[0]
    return torch.cat([x.k.reshape(t, -1), x.v.reshape(t, -1), x.a.reshape(t, -1),
                      x.b.reshape(t, -1)], dim=1)


def unpack_record_rows(rows: torch.Tensor, heads: GdnHeads):
    kd = heads.num_k_heads * heads.head_k_dim
    vd = heads.num_v_heads * heads.head_v_dim
    hv = heads.num_v_heads
    k, v, a, b = rows.split([kd, vd, hv, hv], dim=1)
    t = rows.shape[0]
    return (k.reshape(t, heads.num_k_heads, heads.head_k_dim),
            v.reshape(t, hv, heads.head_v_dim), a, b)


# --- the state machine ----------------------------------------------------------------------------

def clear_records(flag_pool: torch.Tensor, pages: torch.Tensor) -> None:
    """Prefill and stock paths: the page's state is the truth now; forget any record."""
    live = pages[pages != NULL_PAGE].long()
    if live.numel():
        # the whole word: a freshly allocated page holds garbage in every field
        flag_pool[live] = 0


def replay_accepted_rows(backend: GdnBackend, heads: GdnHeads, state_pool: torch.Tensor,
                         record_pool: torch.Tensor, flag_pool: torch.Tensor,
                         pages: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Bring each page's checkpoint up to the last accepted token; returns rows replayed [N].

    `num_accepted` is vLLM's count (1 right after prefill *and* when only the bonus token was
    accepted): the flag tells the two apart, a prefill leaves no live record.
    """
    pages_l = pages.long()
    n_replay = _rows_to_replay(flag_pool, pages_l, num_accepted)
    todo = (n_replay > 0).nonzero().flatten()
    if todo.numel() == 0:
        return n_replay
    sel_pages = pages_l[todo]
    k, v, a, b, cu = _live_rows(record_pool, flag_pool, sel_pages, n_replay[todo].long(), heads)
    backend.replay(state_pool, sel_pages.to(torch.int32), k, v, a, b, cu)
    return n_replay


def _rows_to_replay(flag_pool: torch.Tensor, pages_l: torch.Tensor,
                    wanted: torch.Tensor) -> torch.Tensor:
    """min(wanted, live row count) per page; 0 for the null page and for pages without a record."""
    live_count = flag_pool[pages_l, FLAG_COUNT]
    n = torch.minimum(wanted.to(live_count.dtype), live_count).clamp_min(0)
    return torch.where(pages_l == NULL_PAGE, torch.zeros_like(n), n)


def _live_rows(record_pool, flag_pool, pages_l, counts, heads):
    """The first `count` rows of each page's live slot, page after page: k, v, a, b, cu_seqlens."""
    dev = pages_l.device
    slots = flag_pool[pages_l, FLAG_SLOT].long()
    row_seq = torch.repeat_interleave(torch.arange(pages_l.numel(), device=dev), counts)
    row_pos = torch.arange(int(counts.sum()), device=dev) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts)
    rows = record_pool[pages_l[row_seq], slots[row_seq], row_pos]
    k, v, a, b = unpack_record_rows(rows, heads)
    return k, v, a, b, F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)


def replay_into(backend: GdnBackend, heads: GdnHeads, state_pool: torch.Tensor,
                record_pool: torch.Tensor, flag_pool: torch.Tensor, src_pages: torch.Tensor,
                dst_pages: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
    """Prefix caching's state copies (align mode) on one-page pages; returns rows replayed [N].

    Stock copies the state after candidate row `num_rows - 1` of the last verify (its slot
    column `src + num_rows - 1`) into page `dst`: before the forward when a request's running
    page moves (pre-copy) and after sampling when accepted tokens reach a block end (boundary
    copy; the block is then cached). One-page has no such slot: it advances src's checkpoint by
    the first `num_rows` rows of src's live record (none if src holds no live record: its
    checkpoint is that state already) and stores the result once into dst, then clears dst's
    flag, so a copied or cached page holds a checkpoint and no live record. src == dst works in
    place; src keeps its record otherwise. Pairs touching the null page are skipped.
    """
    src_l, dst_l = src_pages.long(), dst_pages.long()
    keep = (src_l != NULL_PAGE) & (dst_l != NULL_PAGE)
    src_l, dst_l = src_l[keep], dst_l[keep]
    n_replay = _rows_to_replay(flag_pool, src_l, num_rows[keep])
    todo = (n_replay > 0).nonzero().flatten()
    rows = (_live_rows(record_pool, flag_pool, src_l[todo], n_replay[todo].long(), heads)
            if todo.numel() else None)  # read before dst's flag (maybe src's own) is cleared
    moved = src_l != dst_l
    if bool(moved.any()):
        state_pool[dst_l[moved]] = state_pool[src_l[moved]]
    if rows is not None:
        k, v, a, b, cu = rows
        backend.replay(state_pool, dst_l[todo].to(torch.int32), k, v, a, b, cu)
    if dst_l.numel():
        flag_pool[dst_l] = 0
    out = torch.zeros_like(keep, dtype=n_replay.dtype)
    out[keep] = n_replay
    return out


def write_record(record_pool: torch.Tensor, flag_pool: torch.Tensor, pages: torch.Tensor,
                 x: GdnInputs, cu_seqlens: torch.Tensor) -> None:
    """Store this step's candidate rows in each page's other slot and make it live."""
    pages_l = pages.long()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    keep = (pages_l != NULL_PAGE) & (lens > 0)
    if not bool(keep.any()):
        return
    new_slot = 1 - flag_pool[pages_l, FLAG_SLOT].long()
    dev = pages_l.device
    seq_of_row = torch.repeat_interleave(torch.arange(pages_l.numel(), device=dev), lens)
    pos_of_row = torch.arange(seq_of_row.numel(), device=dev) - torch.repeat_interleave(
        cu_seqlens[:-1].long(), lens)
    row_keep = keep[seq_of_row]
    packed = pack_record_rows(x).to(record_pool.dtype)
    record_pool[pages_l[seq_of_row][row_keep], new_slot[seq_of_row][row_keep],
                pos_of_row[row_keep]] = packed[row_keep]
    kp = pages_l[keep]
    flags = flag_pool[kp]
    set_live(flags, lens[keep], new_slot[keep])
    flag_pool[kp] = flags


def onepage_verify_step(backend: GdnBackend, heads: GdnHeads, state_pool: torch.Tensor,
                        record_pool: torch.Tensor, flag_pool: torch.Tensor, pages: torch.Tensor,
                        num_accepted: torch.Tensor, x: GdnInputs, cu_seqlens: torch.Tensor,
                        row_map: torch.Tensor | None = None) -> torch.Tensor:
    """One speculative verify step for N sequences on one-page pages.

    x holds the batch's rows; sequence i's candidates are rows row_map[cu[i]:cu[i+1]] (or
    cu[i]:cu[i+1] without a row map: a mixed batch's spec rows are interleaved with others).
    Returns the outputs of those rows, in the same order as `x` (rows outside the map are 0).
    """
    xs = x.rows(row_map) if row_map is not None else x
    fused_step = getattr(backend, "verify_step", None)
    if fused_step is not None:  # the same three steps in fewer ops (vLLM's CPU op)
        out = fused_step(heads, state_pool, record_pool, flag_pool, pages, num_accepted, xs,
                         cu_seqlens)
    else:
        replay_accepted_rows(backend, heads, state_pool, record_pool, flag_pool, pages,
                             num_accepted)
        out = backend.verify(state_pool, pages, xs, cu_seqlens)
        write_record(record_pool, flag_pool, pages, xs, cu_seqlens)
    if row_map is None:
        return out
    full = out.new_zeros((x.v.shape[0],) + tuple(out.shape[1:]))
    full.index_copy_(0, row_map.long(), out)
    return full


# --- the plain-torch reference recurrence ---------------------------------------------------------

@dataclass
class TorchReference:
    """fused_sigmoid_gating_delta_rule_update's per-token arithmetic in plain torch (fp32).

    State layout per page: [HV, K, V]. Used as the CPU reference in unit tests; the engine
    path uses vLLM's own ops instead (`r9k.kernels.cpu`).
    """

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    use_qk_l2norm: bool = True

    def _run(self, h: torch.Tensor, q, k, v, a, b):
        """h: [HV, K, V] fp32; rows [T, ...] -> (outputs [T, HV, V] fp32, states list)."""
        hv = v.shape[1]
        groups = hv // k.shape[1]
        scale = k.shape[-1] ** -0.5
        outs, states = [], []
        for t in range(k.shape[0]):
            kt = k[t].float().repeat_interleave(groups, 0)
            qt = q[t].float().repeat_interleave(groups, 0)
            if self.use_qk_l2norm:
                kt = kt * torch.rsqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
                qt = qt * torch.rsqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
            qt = qt * scale
            g = -torch.exp(self.A_log.float()) * F.softplus(a[t].float() + self.dt_bias.float())
            beta = torch.sigmoid(b[t].float())
            h = h * torch.exp(g)[:, None, None]
            v_new = (v[t].float() - (h * kt[:, :, None]).sum(1)) * beta[:, None]
            h = h + kt[:, :, None] * v_new[:, None, :]
            outs.append((h * qt[:, :, None]).sum(1))
            states.append(h)
        out = torch.stack(outs) if outs else h.new_zeros((0, hv, h.shape[-1]))
        return out, states

    def replay(self, state_pool, pages, k, v, a, b, cu_seqlens):
        for i, page in enumerate(pages.tolist()):
            s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            if page == NULL_PAGE or e == s:
                continue
            _, states = self._run(state_pool[page].float(), k[s:e], k[s:e], v[s:e], a[s:e], b[s:e])
            state_pool[page] = states[-1].to(state_pool.dtype)

    def verify(self, state_pool, pages, x: GdnInputs, cu_seqlens):
        out = torch.zeros(x.v.shape, dtype=torch.float32)
        for i, page in enumerate(pages.tolist()):
            s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            h0 = state_pool[page].float() if page != NULL_PAGE else state_pool.new_zeros(
                state_pool.shape[1:], dtype=torch.float32)
            out[s:e], _ = self._run(h0, x.q[s:e], x.k[s:e], x.v[s:e], x.a[s:e], x.b[s:e])
        return out.to(x.v.dtype)

    def per_slot_step(self, state_pool, slot_rows: torch.Tensor, num_accepted: torch.Tensor,
                      x: GdnInputs, cu_seqlens) -> torch.Tensor:
        """Stock semantics: resume from slot num_accepted-1, store after token t in slot t."""
        out = torch.zeros(x.v.shape, dtype=torch.float32)
        for i in range(slot_rows.shape[0]):
            s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            row = slot_rows[i].tolist()
            base = row[int(num_accepted[i]) - 1]
            h0 = state_pool[base].float() if base > NULL_PAGE else state_pool.new_zeros(
                state_pool.shape[1:], dtype=torch.float32)
            out[s:e], states = self._run(h0, x.q[s:e], x.k[s:e], x.v[s:e], x.a[s:e], x.b[s:e])
            for t, st in enumerate(states):
                if row[t] > NULL_PAGE:
                    state_pool[row[t]] = st.to(state_pool.dtype)
        return out.to(x.v.dtype)
