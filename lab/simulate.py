"""Multi-step speculative decoding simulations: per-slot (stock) vs one-page, side by side.

Shared by the CPU unit tests, the GPU tests on the H200 and the kernel benchmark. Every step
draws random candidate counts (1 = a draft-less decode) and random acceptance. Which replay
lengths actually occurred (0 after prefill, 1 bonus only, partial, full) is measured from the
replay itself (`SimStats.replay_hist`); `assert_replay_coverage` checks a run exercised them all.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from r9k.core.page_layout import FLAG_COUNT, FLAG_DTYPE, FLAG_SLOT, FLAG_WORDS, RECORD_SLOTS
from r9k.kernels.onepage import (
    NULL_PAGE, GdnHeads, GdnInputs, clear_records, onepage_verify_step,
    replay_accepted_rows, replay_into, set_live)


@dataclass
class SimConfig:
    heads: GdnHeads
    num_seqs: int
    num_spec: int                      # k: S = 1 + k candidate rows at most
    steps: int = 6
    state_dtype: torch.dtype = torch.float32
    input_dtype: torch.dtype = torch.bfloat16
    layers: int = 1
    gate: str = "silu"                 # output gate after the core: silu | sigmoid
    row_map: bool = False              # interleave spec rows with other rows (mixed batch)
    null_pages: int = 0                # padded sequences pointing at the null page
    lockstep_copies: bool = False      # all sequences identical (copies in one batch)
    full_candidates: bool = False      # every sequence verifies S rows (vLLM's decode batch)
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lockstep_copies and (self.row_map or self.null_pages):
            raise ValueError("lockstep_copies runs without a row map or null pages")


@dataclass
class SimStats:
    steps: int = 0
    compared_rows: int = 0
    checkpoint_checks: int = 0  # per layer and live sequence, after prefill and every step
    # rows replay_accepted_rows replayed, per layer, live sequence and step (the step after
    # prefill included), measured on the pools the one-page step left behind
    replay_hist: Counter = field(default_factory=Counter)
    # the same replays as (rows replayed, live rows the record held) pairs
    replay_of_record: Counter = field(default_factory=Counter)


def assert_replay_coverage(stats: SimStats, num_candidates: int) -> None:
    """The run replayed after zero acceptance (the bonus row of a record with drafts), partial
    acceptance (2 .. c-1 of c rows) and full acceptance of S = num_candidates rows."""
    pairs = stats.replay_of_record
    seen = dict(sorted(pairs.items()))
    assert any(r == 1 < c for r, c in pairs), f"no zero acceptance (bonus row only): {seen}"
    assert any(1 < r < c for r, c in pairs), f"no partial acceptance: {seen}"
    assert pairs[(num_candidates, num_candidates)] > 0, \
        f"no full acceptance of {num_candidates} rows: {seen}"


def recycled_flags(g: torch.Generator, num_pages: int, num_candidates: int,
                   heads: GdnHeads) -> torch.Tensor:
    """Flag words of recycled pages: a live-looking random head (count 1..S, slot 0 or 1) that
    prefill or a copy must clear, repeated into every program's pair. Draws the same numbers
    from `g` whatever the pair count, so a seed keeps its run when the page layout changes."""
    head = torch.randint(1, num_candidates + 1, (num_pages, FLAG_WORDS), generator=g,
                         dtype=getattr(torch, FLAG_DTYPE))
    head[:, FLAG_SLOT] %= RECORD_SLOTS
    flags = torch.zeros((num_pages, heads.flag_words), dtype=head.dtype)
    flags[:, :FLAG_WORDS] = head
    set_live(flags, head[:, FLAG_COUNT], head[:, FLAG_SLOT])
    return flags


def _gated_norm(o: torch.Tensor, z: torch.Tensor, gate: str) -> torch.Tensor:
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + 1e-6)
    act = F.silu(z.float()) if gate == "silu" else torch.sigmoid(z.float())
    return (of * act).to(o.dtype)


def assert_bit_identical(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        diff = (a.float() - b.float()).abs()
        raise AssertionError(f"{what}: not bit-identical (max abs diff {diff.max().item():.3e}, "
                             f"{int((diff > 0).sum())} of {diff.numel()} elements differ)")


def run_simulation(cfg: SimConfig, make_backend: Callable[[torch.Tensor, torch.Tensor], object],
                   per_slot: Callable | None = None,
                   onepage_step: Callable | None = None) -> SimStats:
    """Run cfg.steps verify steps through per-slot and one-page pools, asserting bit-identity of
    outputs after every step and of the checkpoint against the slot stock would read next.

    make_backend(A_log, dt_bias) -> a GdnBackend; per_slot(backend, pool, rows, n_acc, x, cu)
    runs the stock step (defaults to backend.per_slot_step); onepage_step takes
    onepage_verify_step's arguments and runs the one-page step (defaults to it, e.g. a fused
    GPU kernel instead).
    """
    g = torch.Generator().manual_seed(cfg.seed)
    h, dev = cfg.heads, cfg.device
    n, S = cfg.num_seqs, 1 + cfg.num_spec
    stats = SimStats()

    def rand(*shape, dtype=cfg.input_dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    layers = []
    for _ in range(cfg.layers):
        A_log = (torch.rand(h.num_v_heads, generator=g) * 2).to(dev)
        # as vLLM builds them: A_log fp32, dt_bias in the model dtype
        dt_bias = torch.randn(h.num_v_heads, generator=g).to(cfg.input_dtype).to(dev)
        backend = make_backend(A_log, dt_bias)
        state_shape = (h.num_v_heads, h.head_k_dim, h.head_v_dim)
        # per-slot: page 0 null, request i owns slots 1 + i*S .. ; one-page: request i owns page 1+i
        slot_pool = torch.zeros((1 + n * S, *state_shape), dtype=cfg.state_dtype, device=dev)
        page_pool = torch.zeros((1 + n, *state_shape), dtype=cfg.state_dtype, device=dev)
        # recycled pages: garbage records with a live-looking flag that prefill must clear
        record_pool = rand(1 + n, RECORD_SLOTS, S, h.record_row_width)
        flag_pool = recycled_flags(g, 1 + n, S, h).to(dev)
        layers.append(dict(backend=backend, slot_pool=slot_pool, page_pool=page_pool,
                           record_pool=record_pool, flag_pool=flag_pool))

    is_null = torch.zeros(n, dtype=torch.bool)
    if cfg.null_pages:
        is_null[torch.randperm(n, generator=g)[: cfg.null_pages]] = True
    pages = torch.where(is_null, NULL_PAGE, torch.arange(1, n + 1)).to(torch.int32).to(dev)
    slot_rows = torch.stack([torch.arange(S) + 1 + i * S for i in range(n)]).to(torch.int32)
    slot_rows[is_null] = NULL_PAGE
    slot_rows = slot_rows.to(dev)

    # "prefill": the same initial state written where each design keeps it
    for L in layers:
        init = rand(n, h.num_v_heads, h.head_k_dim, h.head_v_dim, dtype=torch.float32, scale=0.1)
        if cfg.lockstep_copies:
            init[:] = init[0]
        init = init.to(cfg.state_dtype)
        for i in range(n):
            if not is_null[i]:
                L["slot_pool"][int(slot_rows[i, 0])] = init[i]
                L["page_pool"][int(pages[i])] = init[i]
        clear_records(L["flag_pool"], pages)
        L["null_flag"] = L["flag_pool"][NULL_PAGE].clone()
        L["null_record"] = L["record_pool"][NULL_PAGE].clone()

    def check_replayed_checkpoints(when: str, num_accepted: torch.Tensor) -> None:
        """Replay on copies of the pools: the checkpoint must equal the slot stock reads next."""
        for L in layers:
            pp, rp, fp = L["page_pool"].clone(), L["record_pool"].clone(), L["flag_pool"].clone()
            live_rows = fp[pages.long(), FLAG_COUNT]
            replayed = replay_accepted_rows(L["backend"], h, pp, rp, fp, pages,
                                            num_accepted.to(dev))
            for i in range(n):
                if is_null[i]:
                    continue
                slot = int(slot_rows[i, int(num_accepted[i]) - 1])
                assert_bit_identical(pp[int(pages[i])], L["slot_pool"][slot],
                                     f"{when}: checkpoint of seq {i}")
                stats.checkpoint_checks += 1
            live_seqs = ~is_null.to(dev)
            for r, c in zip(replayed[live_seqs].tolist(), live_rows[live_seqs].tolist()):
                stats.replay_hist[int(r)] += 1
                stats.replay_of_record[(int(r), int(c))] += 1
            assert_bit_identical(L["flag_pool"][NULL_PAGE], L["null_flag"],
                                 f"{when}: null page flag")
            assert_bit_identical(L["record_pool"][NULL_PAGE], L["null_record"],
                                 f"{when}: null page record")

    num_accepted = torch.ones(n, dtype=torch.int32)        # vLLM's value right after prefill
    check_replayed_checkpoints("after prefill", num_accepted)
    for step in range(cfg.steps):
        lens = torch.randint(1, S + 1, (n,), generator=g)
        if cfg.full_candidates:
            lens[:] = S
        if cfg.lockstep_copies:
            lens[:] = lens[0]
        cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
        total = int(cu[-1])
        extra = int(torch.randint(0, 5, (1,), generator=g)) if cfg.row_map else 0
        row_map = torch.randperm(total + extra, generator=g)[:total].to(dev) if cfg.row_map else None
        for L in layers:
            rows = total + extra
            x = GdnInputs(q=rand(rows, h.num_k_heads, h.head_k_dim),
                          k=rand(rows, h.num_k_heads, h.head_k_dim),
                          v=rand(rows, h.num_v_heads, h.head_v_dim),
                          a=rand(rows, h.num_v_heads), b=rand(rows, h.num_v_heads))
            z = rand(rows, h.num_v_heads, h.head_v_dim)
            if cfg.lockstep_copies:  # every sequence gets the first sequence's rows
                x = x.rows(torch.arange(int(lens[0])).repeat(n).to(dev))
                z = z[: int(lens[0])].repeat(n, 1, 1)
            xs = x.rows(row_map) if row_map is not None else x
            b = L["backend"]
            step_fn = per_slot or (lambda be, *a: be.per_slot_step(*a))
            ref = step_fn(b, L["slot_pool"], slot_rows, num_accepted.to(dev), xs, cu.to(dev))
            step_onepage = onepage_step or onepage_verify_step
            out = step_onepage(b, h, L["page_pool"], L["record_pool"], L["flag_pool"],
                               pages, num_accepted.to(dev), x, cu.to(dev), row_map)
            outs = out.index_select(0, row_map) if row_map is not None else out
            zs = z.index_select(0, row_map) if row_map is not None else z
            live = torch.repeat_interleave(~is_null, lens).to(dev)
            assert_bit_identical(outs[live], ref[live], f"step {step} outputs")
            assert_bit_identical(_gated_norm(outs[live], zs[live], cfg.gate),
                          _gated_norm(ref[live], zs[live], cfg.gate), f"step {step} gated outputs")
            if cfg.lockstep_copies and live.all():
                first = outs[: int(lens[0])]
                for i in range(1, n):
                    assert_bit_identical(outs[int(cu[i]):int(cu[i + 1])], first,
                                         f"step {step} copy {i}")
            stats.compared_rows += int(live.sum())
        # acceptance for the next step: 1..len (1 = only the bonus token)
        nxt = torch.stack([torch.randint(1, int(t) + 1, (1,), generator=g)[0] for t in lens])
        if cfg.lockstep_copies:
            nxt[:] = nxt[0]
        num_accepted = nxt.to(torch.int32)
        check_replayed_checkpoints(f"step {step}", num_accepted)
        stats.steps += 1
    return stats


# --- prefix caching's copies (mamba_cache_mode "align") -------------------------------------------

ALIGN_EVENTS = ("none", "boundary", "boundary_in_place", "move", "hit")


def run_align_simulation(make_backend, heads: GdnHeads, state_dtype: torch.dtype, num_seqs: int = 6,
                         num_spec: int = 3, steps: int = 10, seed: int = 0,
                         device: str = "cpu", onepage_step: Callable | None = None,
                         replay_into_fn: Callable | None = None
                         ) -> tuple[dict[str, int], list[int]]:
    """Stock's slot copies vs `replay_into` side by side over `steps` verify steps with random
    acceptance; per request and step a random event: none, boundary copy into an earlier block
    (which gets cached), boundary copy in place (the running page ends at the boundary, then
    moves on), pre-copy (the running page moved), prefix hit (a new request resumes from a
    cached block). Asserts outputs, every copied checkpoint (against stock's bytes) and cleared
    flags; returns the event counts and the rows each copy replayed. `onepage_step` (default
    onepage_verify_step) and `replay_into_fn` (default replay_into) take those functions'
    arguments: a fused GPU kernel instead, for example."""
    step_fn = onepage_step or onepage_verify_step
    replay_into_ = replay_into_fn or replay_into
    g = torch.Generator().manual_seed(seed)
    h, n, S, dev = heads, num_seqs, 1 + num_spec, device
    counts = {e: 0 for e in ALIGN_EVENTS}
    replayed_rows = []

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    A_log = (torch.rand(h.num_v_heads, generator=g) * 2).to(dev)
    dt_bias = torch.randn(h.num_v_heads, generator=g).to(torch.bfloat16).to(dev)
    be = make_backend(A_log, dt_bias)
    shape = (h.num_v_heads, h.head_k_dim, h.head_v_dim)
    pages_needed = 1 + n * S + 2 * n * steps + n
    stock = torch.zeros((pages_needed, *shape), dtype=state_dtype, device=dev)
    one = torch.zeros((pages_needed, *shape), dtype=state_dtype, device=dev)
    record = rand(pages_needed, RECORD_SLOTS, S, h.record_row_width)
    # recycled pages: live-looking garbage flags that every copy must clear at its destination
    flag = recycled_flags(g, pages_needed, S, h).to(dev)
    free = iter(range(1 + n * S, pages_needed))

    slot_rows = torch.stack([torch.arange(S) + 1 + i * S for i in range(n)]).to(torch.int32).to(dev)
    pages = torch.tensor([next(free) for _ in range(n)], dtype=torch.int32, device=dev)
    dev_kw = dict(device=dev)
    init = rand(n, *shape, dtype=torch.float32, scale=0.1).to(state_dtype)
    stock[slot_rows[:, 0].long()] = init
    one[pages.long()] = init
    clear_records(flag, pages)  # prefill
    cached: list[tuple[int, int]] = []  # (stock page, one-page page) of cached blocks
    num_accepted = torch.ones(n, dtype=torch.int32, device=dev)

    def check(stock_page: int, one_page: int, what: str) -> None:
        assert_bit_identical(one[one_page], stock[stock_page], what)
        assert int(flag[one_page].abs().sum()) == 0, f"{what}: flag not cleared {flag[one_page]}"

    for step in range(steps):
        lens = torch.randint(1, S + 1, (n,), generator=g)
        cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32).to(dev)
        rows = int(cu[-1])
        x = GdnInputs(q=rand(rows, h.num_k_heads, h.head_k_dim),
                      k=rand(rows, h.num_k_heads, h.head_k_dim),
                      v=rand(rows, h.num_v_heads, h.head_v_dim),
                      a=rand(rows, h.num_v_heads), b=rand(rows, h.num_v_heads))
        ref = be.per_slot_step(stock, slot_rows, num_accepted, x, cu)
        out = step_fn(be, h, one, record, flag, pages, num_accepted, x, cu)
        assert_bit_identical(out, ref, f"step {step} outputs")
        new_acc = torch.stack([torch.randint(1, int(t) + 1, (1,), generator=g)[0] for t in lens])
        for i in range(n):
            acc = int(new_acc[i])
            event = ALIGN_EVENTS[int(torch.randint(len(ALIGN_EVENTS), (1,), generator=g))]
            if event == "hit" and not cached:
                event = "none"
            counts[event] += 1
            src = pages[i:i + 1]
            if event == "boundary":  # accepted tokens crossed an earlier block's end
                bias = int(torch.randint(acc, (1,), generator=g))
                d_stock, d_one = next(free), next(free)
                stock[d_stock] = stock[int(slot_rows[i, bias])]
                replayed_rows += replay_into_(be, h, one, record, flag, src,
                                             torch.tensor([d_one], **dev_kw), torch.tensor([bias + 1], **dev_kw)).tolist()
                check(d_stock, d_one, f"step {step} seq {i}: boundary copy (bias {bias})")
                cached.append((d_stock, d_one))
                num_accepted[i] = acc
            elif event == "boundary_in_place":  # the running page ends at the boundary
                run = int(slot_rows[i, 0])
                stock[run] = stock[int(slot_rows[i, acc - 1])]
                replayed_rows += replay_into_(be, h, one, record, flag, src, src,
                                             torch.tensor([acc], **dev_kw)).tolist()
                check(run, int(pages[i]), f"step {step} seq {i}: boundary copy in place")
                cached.append((run, int(pages[i])))
                slot_rows[i, 0] = next(free)  # the cached block stays; running moves on
                stock[int(slot_rows[i, 0])] = stock[run]
                new = next(free)
                replayed_rows += replay_into_(be, h, one, record, flag, src, torch.tensor([new], **dev_kw),
                                             torch.tensor([1], **dev_kw)).tolist()
                pages[i] = new
                check(int(slot_rows[i, 0]), new, f"step {step} seq {i}: pre-copy from a cached block")
                num_accepted[i] = 1
            elif event == "move":  # pre-copy: the running page moved on
                new_stock, new_one = next(free), next(free)
                stock[new_stock] = stock[int(slot_rows[i, acc - 1])]
                replayed_rows += replay_into_(be, h, one, record, flag, src,
                                             torch.tensor([new_one], **dev_kw), torch.tensor([acc], **dev_kw)).tolist()
                check(new_stock, new_one, f"step {step} seq {i}: pre-copy")
                slot_rows[i, 0], pages[i] = new_stock, new_one
                num_accepted[i] = 1
            elif event == "hit":  # a new request resumes from a cached block
                c_stock, c_one = cached[int(torch.randint(len(cached), (1,), generator=g))]
                new_stock, new_one = next(free), next(free)
                stock[new_stock] = stock[c_stock]
                replayed_rows += replay_into_(be, h, one, record, flag, torch.tensor([c_one], **dev_kw),
                                             torch.tensor([new_one], **dev_kw), torch.tensor([acc], **dev_kw)).tolist()
                check(new_stock, new_one, f"step {step} seq {i}: prefix hit")
                slot_rows[i, 0], pages[i] = new_stock, new_one
                num_accepted[i] = 1
            else:
                num_accepted[i] = acc
    # the cached blocks still hold what stock cached (nothing wrote them since)
    for c_stock, c_one in cached:
        check(c_stock, c_one, "cached block at the end")
    return counts, replayed_rows
