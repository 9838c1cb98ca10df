"""The fused one-page GDN kernel's research version: every variant measured on the way to the
shipped kernel (`r9k.kernels.triton_fused`), as constexpr knobs, with their launcher and
history. Benchmarks (`lab.gdn_kernel`), the offline compiles (`lab.kernel_static`)
and the variant tests use it; at the shipped settings (`kernel_config(...)` with no knobs) it
compiles to the shipped kernel's PTX and AMDGCN (`lab/scripts/kernel_compare.py`).

Per program, with the state tile [BV, K] in registers:
1. copy this step's candidate rows (post-conv k | v | a | b) into the page's other record slot,
   as tiles off the token chain; the program flips its own (count, slot) pair of the page's
   flag words (the shipped protocol), so no program reads a flag another one rewrites;
2. replay the first min(num_accepted, live_count) rows of the live slot onto the checkpoint,
   store it once (rounded to the state dtype) and continue from the rounded value, exactly as
   stock re-reads a stored slot;
3. run the candidate rows from there, storing their outputs and no state.
No program waits on another, so the kernel is correct under any order the GPU dispatches
programs in. With `prefetch` (the default) row t + 1's inputs are loaded while row t computes;
A_log and dt_bias are loaded once per program.

The shipped protocol, for every state dtype (`shipped_protocol`: `OWN_PLAIN` for fp32 state,
`OWN_PAIRS` = own + spec + rows_end for bf16 / fp16): each program reads the live count and slot
from its own pair of flag words and, after a barrier (every warp has used them), writes the new
ones there; program (0, 0) also writes the head words, which host-side code reads. The pairs of
a page stay equal because every program of a page runs every step. No atomics, no count-in: the
count-in was most of the bf16 gap to stock at 16 sequences (gdn_kernel_h200_flashnext_count_k3.md;
own pairs: lab/results/gdn_kernel_h200_flashnext_own_r5_k3.md).

Two count-in protocols on the head words shipped before (measured variants now; H200 table:
lab/results/gdn_kernel_h200_flashnext_final_k3.md); they write their pairs too:
- fenced: the record tiles are stored, then one acq_rel add behind a barrier; its
  answer is checked at once and the last program flips the flag.
- dependency-ordered (`DEP_ORDERED` = late + spec + dep + rows_end): the
  state and first rows load beside the flag read; the first lane of every warp counts in with a
  relaxed add predicated on its own flag reads (it cannot issue before they returned: no fence);
  the last lane (seen after the verify loop) flips the flag with plain stores, which issue after
  its add returned, after every other add, each issued after its own reads; the record tiles
  are stored last (the next step is another launch, so the flip needs no order against them).

Measured variants are knobs on the fenced kernel (`measured(...)`; lab/scripts/gdn_kernel.py):
- `late`: count in before the state and row loads with a release add and look at the answer
  after the verify loop, so no program stalls on the atomic's round trip; the page's last to
  count in flips the flag at its end (an acquire on the reset orders the flip after the counts).
  Still wait-free.
- `rec_in_verify`: the record rows are stored from the verify loop's loads (no tile loads).
- `prefetch=2`: the first candidate row is loaded after the replay (fewer live registers).
- `spec`: the state, both record slots' first rows and the first candidate row are loaded
  beside the flag read instead of after it (the live slot picks a row), so the replay waits one
  memory round trip less.
- `rows_end`: the record tiles are loaded early and stored after the verify loop, so no store
  stalls the program waiting for its tile (the flag's flip needs no order against them: the
  next step is another launch).
- `dep`: the dependency-ordered count-in (needs `late` and `spec`); `flag_volatile` reads the
  flag with ld.volatile (slower at N = 16; not shipped).
- probes (wrong values or order, timing only): `record_parts` (the record's rows or its flag
  alone), `replay_prep=False` (replayed rows skip normalization and gates), `count_probe` (1:
  one add per program, 2: no add). The `skew_spin` test knob makes each page's last program
  start late (tests/gpu).
- `maxnreg` (CUDA) / `waves_per_eu` (ROCm): a register cap, so an SM or SIMD holds as many
  programs as it holds of stock (lab/results/gdn_kernel_static_flashnext_k3.md); arithmetic
  unchanged, and 1.2-1.5x slower at N <= 16 on the H200.
Removed after measurement: a leader-waits protocol (it relies on in-order dispatch and once hung
the H200), `pipe` (normalization a row ahead: not bit-identical on sm_90) and narrower value
tiles (slower, not bit-identical on sm_90).

Bit-identity with vLLM's stock kernel (`fused_sigmoid_gating_delta_rule_update_kernel`) rests on
keeping its tiling (BV = min(32, V), BK = K, 4 warps, 3 stages), its per-token op order (copied
line by line below; A_log and dt_bias are loaded once, the same values) and its compile options
(none passed, as the stock launcher passes none). Replay rows skip q and the output, which never
feed the state. Portable Triton only (no vendor intrinsics): it builds for CUDA and for ROCm
RDNA4 (gfx1201, wave32).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from r9k.kernels.triton_fused import (  # the shipped kernel's tiling and layout checks
    STOCK_BV_MAX, STOCK_NUM_STAGES, STOCK_NUM_WARPS, _check_layout, _first_candidate_row,
    _step_rows, rows_in_place)
from r9k.core.page_layout import (
    FLAG_COUNT, FLAG_DONE, FLAG_PAIR_WORDS, FLAG_SLOT, FLAG_WORDS, head_dims_reason)
# flag word columns, as constexprs the kernel may read
_F_COUNT = tl.constexpr(FLAG_COUNT)
_F_SLOT = tl.constexpr(FLAG_SLOT)
_F_DONE = tl.constexpr(FLAG_DONE)
_F_HEAD = tl.constexpr(FLAG_WORDS)
_F_PAIR = tl.constexpr(FLAG_PAIR_WORDS)


@triton.jit(do_not_specialize=["N"])
def onepage_gdn_step_kernel(
    A_log,
    a,
    b,
    dt_bias,
    beta,
    threshold,
    q,
    k,
    v,
    o,
    h,
    record,
    flag,
    cu_seqlens,
    state_indices,
    num_accepted,
    row_map,
    scale,
    N,
    stride_record_page,
    stride_flag_page,
    stride_q_row,
    stride_k_row,
    stride_v_row,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    stride_state_page: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
    HAS_ROW_MAP: tl.constexpr,
    DO_REPLAY: tl.constexpr,
    DO_VERIFY: tl.constexpr,
    DO_RECORD: tl.constexpr,
    PREFETCH: tl.constexpr,
    LATE: tl.constexpr = False,
    REC_IN_VERIFY: tl.constexpr = False,
    THREADS: tl.constexpr = 128,
    WARP: tl.constexpr = 32,
    SPEC: tl.constexpr = False,
    REC_ROWS: tl.constexpr = True,
    REC_FLAG: tl.constexpr = True,
    ROWS_END: tl.constexpr = False,
    DEP: tl.constexpr = False,
    FLAG_VOLATILE: tl.constexpr = False,
    REPLAY_PREP: tl.constexpr = True,
    COUNT_PROBE: tl.constexpr = 0,
    SKEW_SPIN: tl.constexpr = 0,
    OWN: tl.constexpr = False,
    OWN_BARRIER: tl.constexpr = True,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    W: tl.constexpr = H * K + HV * V + 2 * HV
    NV: tl.constexpr = (V + BV - 1) // BV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]

    page = tl.load(state_indices + i_n).to(tl.int64)
    if page <= 0:
        # null page (padding): nothing to replay or record; deterministic zero outputs
        for i_t in range(0, T):
            if HAS_ROW_MAP:
                row = tl.load(row_map + bos + i_t).to(tl.int64)
            else:
                row = bos + i_t
            p_o = o + (row * HV + i_hv) * V + o_v
            tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=mask_v)
        return

    p_flag = flag + page * stride_flag_page
    if SKEW_SPIN > 0:
        # test knob (tests/gpu): the page's last program spins before it reads the flag, so
        # it starts long after the others have finished; a flip that does not wait for every
        # program's read is then seen. The flag address depends on the spin (never taken)
        if (i_v == NV - 1) & (i_hv == HV - 1):
            x_spin = tl.load(A_log + i_hv).to(tl.float32)
            for _ in range(SKEW_SPIN):
                x_spin = x_spin * 0.999 + 0.001
            p_flag += (x_spin == 12345.5).to(tl.int64)
    # this program's own (count, slot) pair: OWN reads and flips it, every protocol writes it
    p_pair = p_flag + _F_HEAD + _F_PAIR * (i_hv * NV + i_v)
    if SPEC:
        # SPEC: everything whose address does not depend on the flag is issued beside the
        # flag read (and before the count-in's fence): the state, both record slots' first
        # rows (the live slot picks one below; the other may be being written this step and
        # is discarded) and the first candidate row
        c_negA = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        c_dtb = tl.load(dt_bias + i_hv).to(tl.float32)
        p_h = h + page * stride_state_page + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
        b_h = tl.zeros([BV, BK], dtype=tl.float32)
        b_h += tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
        p_r0 = record + page * stride_record_page
        s0_k = tl.load(p_r0 + i_h * K + o_k, mask=mask_k, other=0)
        s1_k = tl.load(p_r0 + S * W + i_h * K + o_k, mask=mask_k, other=0)
        s0_v = tl.load(p_r0 + H * K + i_hv * V + o_v, mask=mask_v, other=0)
        s1_v = tl.load(p_r0 + S * W + H * K + i_hv * V + o_v, mask=mask_v, other=0)
        s0_a = tl.load(p_r0 + H * K + HV * V + i_hv)
        s1_a = tl.load(p_r0 + S * W + H * K + HV * V + i_hv)
        s0_b = tl.load(p_r0 + H * K + HV * V + HV + i_hv)
        s1_b = tl.load(p_r0 + S * W + H * K + HV * V + HV + i_hv)
        if PREFETCH == 1:
            if HAS_ROW_MAP:
                n_row = tl.load(row_map + bos, mask=T > 0, other=0).to(tl.int64)
            else:
                n_row = bos
            n_q = tl.load(q + n_row * stride_q_row + i_h * K + o_k, mask=mask_k & (o_k * 0 < T),
                          other=0)
            n_k = tl.load(k + n_row * stride_k_row + i_h * K + o_k, mask=mask_k & (o_k * 0 < T),
                          other=0)
            n_v = tl.load(v + n_row * stride_v_row + i_hv * V + o_v, mask=mask_v & (o_v * 0 < T),
                          other=0)
            n_a = tl.load(a + n_row * HV + i_hv, mask=T > 0, other=0)
            n_b = tl.load(b + n_row * HV + i_hv, mask=T > 0, other=0)
    # DEP's order rests on these registers holding the values read before the count-in; a
    # compiler does not re-issue a global load. With `flag_volatile` (ld.volatile) the H200
    # timed bf16 N = 16 at 1.15 / 1.27 of stock, against 1.06 / 1.10 without (another run)
    if OWN:
        live_count = tl.load(p_pair + _F_COUNT)
        raw_slot = tl.load(p_pair + _F_SLOT)
    else:
        live_count = tl.load(p_flag + _F_COUNT, volatile=FLAG_VOLATILE)
        raw_slot = tl.load(p_flag + _F_SLOT, volatile=FLAG_VOLATILE)
    live_slot = raw_slot & 1
    n_replay = tl.minimum(tl.load(num_accepted + i_n).to(tl.int32), live_count)
    n_replay = tl.minimum(tl.maximum(n_replay, 0), S)
    new_slot = 1 - live_slot
    n_rows = tl.minimum(T, S)
    if DO_RECORD and REC_FLAG and LATE:
        # the count's answer is looked at after the verify loop. One element per thread
        # (THREADS = warps x warp size, element i in thread i), not a scalar: Triton broadcasts
        # a scalar (or replicated) atomic's answer to every thread through shared memory
        # behind a barrier, which would stall the program here
        o_t = tl.arange(0, THREADS)
        if DEP:
            # DEP: no fence and no barrier. Every warp reads the flag itself; its first lane
            # counts in, predicated on that warp's flag values (a test no flag value written
            # here fails), so the add cannot issue before the warp's reads returned. The
            # page's last lane to count in flips the flag only after its own add returned.
            # The order is carried by dependencies, not by release / acquire
            one = (((o_t % WARP) == 0) & (o_t * 0 + T > 0)
                   & (o_t * 0 + live_count != -2147483648) & (o_t * 0 + raw_slot != -2147483648))
            # COUNT_PROBE (timing probes, lab/results/gdn_kernel_h200_flashnext_count_k3.md):
            # 1 = one add per program (wrong order for the other warps), 2 = no add at all
            if COUNT_PROBE == 1:
                one = one & (o_t == 0)
            if COUNT_PROBE == 2:
                one = one & (o_t == 0) & (o_t * 0 + i_v + i_hv == 0)
                done = o_t * 0 + NV * HV * (THREADS // WARP) - 1
            else:
                # ptxas aggregates this add across the warp and hands the answer out by a
                # shuffle at once; a lane-varying address avoids that but timed the same on
                # the H200 (gdn_kernel_h200_flashnext_count_k3.md), so the proven code stays
                done = tl.atomic_add(p_flag + _F_DONE + o_t * 0, o_t * 0 + 1, mask=one,
                                     sem="relaxed")
            if COUNT_PROBE == 1:
                done = done * (THREADS // WARP)
        else:
            # count in before the state and row loads: the release waits for the flag reads
            # only; thread 0 counts for the program
            one = (o_t == 0) & (o_t * 0 + T > 0)  # full-width: the interpreter wants tensor masks
            tl.debug_barrier()
            done = tl.atomic_add(p_flag + _F_DONE + o_t * 0, o_t * 0 + 1, mask=one,
                                 sem="release")

    if not SPEC:
        c_negA = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        c_dtb = tl.load(dt_bias + i_hv).to(tl.float32)
        p_h = h + page * stride_state_page + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
        b_h = tl.zeros([BV, BK], dtype=tl.float32)
        b_h += tl.load(p_h, mask=mask_h, other=0).to(tl.float32)

    p_rec = record + page * stride_record_page + live_slot.to(tl.int64) * (S * W)
    p_rk = p_rec + i_h * K + o_k
    p_rv = p_rec + H * K + i_hv * V + o_v
    p_ra = p_rec + H * K + HV * V + i_hv
    p_rb = p_ra + HV
    # this step's record rows go to the other slot
    p_w = record + page * stride_record_page + new_slot.to(tl.int64) * (S * W)
    w_k = (i_v == 0) & (i_hv % (HV // H) == 0)
    if PREFETCH > 0 and SPEC:
        # the live slot's first row (unused when nothing is replayed)
        r_k = tl.where(o_k * 0 + live_slot == 1, s1_k, s0_k)
        r_v = tl.where(o_v * 0 + live_slot == 1, s1_v, s0_v)
        r_a = tl.where(live_slot == 1, s1_a, s0_a)
        r_b = tl.where(live_slot == 1, s1_b, s0_b)
    if PREFETCH > 0 and not SPEC:
        # first replay row in flight before anything waits; row t + 1 is loaded while row t
        # computes (same values, same arithmetic). Vector masks are built full-width: the
        # interpreter rejects vector & scalar masks.
        r_k = tl.load(p_rk, mask=mask_k & (o_k * 0 < n_replay), other=0)
        r_v = tl.load(p_rv, mask=mask_v & (o_v * 0 < n_replay), other=0)
        r_a = tl.load(p_ra, mask=n_replay > 0, other=0)
        r_b = tl.load(p_rb, mask=n_replay > 0, other=0)
    if PREFETCH == 1 and not SPEC:
        # PREFETCH 1: the first candidate row too (it stays in registers through the replay)
        n_row, n_q, n_k, n_v, n_a, n_b = _first_candidate_row(
            q, k, v, a, b, row_map, bos, T, i_h, i_hv, o_k, o_v, mask_k, mask_v, stride_q_row,
            stride_k_row, stride_v_row, H, HV, K, V, HAS_ROW_MAP)

    if DO_RECORD and REC_ROWS and ROWS_END:
        # ROWS_END: the tiles are loaded here and stored after the verify loop, so no store
        # waits on its load in the program's in-order stream. Branch-free (masks only): the
        # tiles must live past this point
        o_s, mask_s, rows = _step_rows(row_map, bos, n_rows, SP, HAS_ROW_MAP)
        m_sv = mask_s[:, None] & mask_v[None, :]
        m_sa = mask_s[:, None] & ((o_s * 0 + i_v) == 0)[:, None]
        m_sk = m_sa & ((o_s * 0 + i_hv % (HV // H)) == 0)[:, None] & mask_k[None, :]
        t_v = tl.load(v + rows[:, None] * stride_v_row + i_hv * V + o_v[None, :], mask=m_sv, other=0)
        t_a = tl.load(a + rows[:, None] * HV + i_hv, mask=m_sa, other=0)
        t_b = tl.load(b + rows[:, None] * HV + i_hv, mask=m_sa, other=0)
        t_k = tl.load(k + rows[:, None] * stride_k_row + i_h * K + o_k[None, :], mask=m_sk, other=0)
    if DO_RECORD and REC_ROWS and not REC_IN_VERIFY and not ROWS_END:
        # this step's rows into the other slot, as tiles off the token chain
        if T > 0:
            o_s, mask_s, rows = _step_rows(row_map, bos, n_rows, SP, HAS_ROW_MAP)
            p_w0 = p_w + o_s[:, None] * W
            t_v = tl.load(v + rows[:, None] * stride_v_row + i_hv * V + o_v[None, :],
                          mask=mask_s[:, None] & mask_v[None, :], other=0)
            tl.store(p_w0 + H * K + i_hv * V + o_v[None, :], t_v.to(record.dtype.element_ty),
                     mask=mask_s[:, None] & mask_v[None, :])
            if i_v == 0:
                p_w1 = p_w0 + H * K + HV * V + i_hv
                t_a = tl.load(a + rows[:, None] * HV + i_hv, mask=mask_s[:, None], other=0)
                t_b = tl.load(b + rows[:, None] * HV + i_hv, mask=mask_s[:, None], other=0)
                tl.store(p_w1, t_a.to(record.dtype.element_ty), mask=mask_s[:, None])
                tl.store(p_w1 + HV, t_b.to(record.dtype.element_ty), mask=mask_s[:, None])
                if i_hv % (HV // H) == 0:
                    t_k = tl.load(k + rows[:, None] * stride_k_row + i_h * K + o_k[None, :],
                                  mask=mask_s[:, None] & mask_k[None, :], other=0)
                    tl.store(p_w0 + i_h * K + o_k[None, :], t_k.to(record.dtype.element_ty),
                             mask=mask_s[:, None] & mask_k[None, :])
    if DO_RECORD and REC_FLAG and not LATE and not OWN:
        if T > 0:
            # every warp has used the flag (record addresses) before the count goes up
            tl.debug_barrier()
            done = tl.atomic_add(p_flag + _F_DONE, 1)
            if done == NV * HV - 1:
                tl.store(p_flag + _F_COUNT, n_rows.to(tl.int32))
                tl.store(p_flag + _F_SLOT, new_slot)
                tl.store(p_flag + _F_DONE, 0)

    # 1. replay: the stock per-token state update, without q and the output
    if DO_REPLAY:
        for i_t in range(0, n_replay):
            if PREFETCH > 0:
                b_k = r_k.to(tl.float32)
                b_v = r_v.to(tl.float32)
                b_b = r_b.to(tl.float32)
                x = r_a.to(tl.float32) + c_dtb
                more = i_t + 1 < n_replay
                r_k = tl.load(p_rk + W, mask=mask_k & (o_k * 0 + i_t + 1 < n_replay), other=0)
                r_v = tl.load(p_rv + W, mask=mask_v & (o_v * 0 + i_t + 1 < n_replay), other=0)
                r_a = tl.load(p_ra + W, mask=more, other=0)
                r_b = tl.load(p_rb + W, mask=more, other=0)
            else:
                b_k = tl.load(p_rk, mask=mask_k, other=0).to(tl.float32)
                b_v = tl.load(p_rv, mask=mask_v, other=0).to(tl.float32)
                b_b = tl.load(p_rb).to(tl.float32)
                x = tl.load(p_ra).to(tl.float32) + c_dtb
            if REPLAY_PREP:
                softplus_x = tl.where(
                    beta * x <= threshold, (1 / beta) * tl.log(1 + tl.exp(beta * x)), x
                )
                b_g = c_negA * softplus_x

                b_beta = tl.sigmoid(b_b.to(tl.float32))

                if USE_QK_L2NORM_IN_KERNEL:
                    b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
                b_h *= tl.exp(b_g)
            else:
                # probe: the rows' normalization and gates as if stored ready (wrong values)
                b_beta = b_b
                b_h *= x
            b_v -= tl.sum(b_h * b_k[None, :], 1)
            b_v *= b_beta
            b_h += b_v[:, None] * b_k[None, :]

            p_rk += W
            p_rv += W
            p_ra += W
            p_rb += W
    if PREFETCH == 2:
        # PREFETCH 2: the first candidate row is loaded after the replay, beside its store
        n_row, n_q, n_k, n_v, n_a, n_b = _first_candidate_row(
            q, k, v, a, b, row_map, bos, T, i_h, i_hv, o_k, o_v, mask_k, mask_v, stride_q_row,
            stride_k_row, stride_v_row, H, HV, K, V, HAS_ROW_MAP)
    if DO_REPLAY:
        if n_replay > 0:
            tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)
        # continue from the stored (rounded) checkpoint, as stock re-reads a stored slot
        b_h = b_h.to(p_h.dtype.element_ty).to(tl.float32)

    # 2. verify: the stock per-token body, outputs only
    if DO_VERIFY:
        for i_t in range(0, T):
            if PREFETCH > 0:
                row = n_row
                c_q = n_q
                c_k = n_k
                c_v = n_v
                c_a = n_a
                c_b = n_b
                more = i_t + 1 < T
                if HAS_ROW_MAP:
                    n_row = tl.load(row_map + bos + i_t + 1, mask=more, other=0).to(tl.int64)
                else:
                    n_row = bos + i_t + 1
                n_q = tl.load(q + n_row * stride_q_row + i_h * K + o_k,
                              mask=mask_k & (o_k * 0 + i_t + 1 < T), other=0)
                n_k = tl.load(k + n_row * stride_k_row + i_h * K + o_k,
                              mask=mask_k & (o_k * 0 + i_t + 1 < T), other=0)
                n_v = tl.load(v + n_row * stride_v_row + i_hv * V + o_v,
                              mask=mask_v & (o_v * 0 + i_t + 1 < T), other=0)
                n_a = tl.load(a + n_row * HV + i_hv, mask=more, other=0)
                n_b = tl.load(b + n_row * HV + i_hv, mask=more, other=0)
            else:
                if HAS_ROW_MAP:
                    row = tl.load(row_map + bos + i_t).to(tl.int64)
                else:
                    row = bos + i_t
                c_q = tl.load(q + row * stride_q_row + i_h * K + o_k, mask=mask_k, other=0)
                c_k = tl.load(k + row * stride_k_row + i_h * K + o_k, mask=mask_k, other=0)
                c_v = tl.load(v + row * stride_v_row + i_hv * V + o_v, mask=mask_v, other=0)
                c_b = tl.load(b + row * HV + i_hv)
                c_a = tl.load(a + row * HV + i_hv)
            if DO_RECORD and REC_ROWS and REC_IN_VERIFY:
                # this candidate's row, as loaded, into the other slot (rows past S dropped)
                p_wt = p_w + i_t * W
                tl.store(p_wt + H * K + i_hv * V + o_v, c_v.to(record.dtype.element_ty),
                         mask=mask_v & (o_v * 0 + i_t < S))
                if i_v == 0:
                    tl.store(p_wt + H * K + HV * V + i_hv, c_a.to(record.dtype.element_ty),
                             mask=i_t < S)
                    tl.store(p_wt + H * K + HV * V + HV + i_hv,
                             c_b.to(record.dtype.element_ty), mask=i_t < S)
                if w_k:
                    tl.store(p_wt + i_h * K + o_k, c_k.to(record.dtype.element_ty),
                             mask=mask_k & (o_k * 0 + i_t < S))
            b_q = c_q.to(tl.float32)
            b_k = c_k.to(tl.float32)
            b_v = c_v.to(tl.float32)
            b_b = c_b.to(tl.float32)
            x = c_a.to(tl.float32) + c_dtb
            p_o = o + (row * HV + i_hv) * V + o_v
            softplus_x = tl.where(
                beta * x <= threshold, (1 / beta) * tl.log(1 + tl.exp(beta * x)), x
            )
            b_g = c_negA * softplus_x

            b_beta = tl.sigmoid(b_b.to(tl.float32))

            if USE_QK_L2NORM_IN_KERNEL:
                b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q) + 1e-6))
                b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
            b_q = b_q * scale
            b_h *= tl.exp(b_g)
            b_v -= tl.sum(b_h * b_k[None, :], 1)
            b_v *= b_beta
            b_h += b_v[:, None] * b_k[None, :]
            b_o = tl.sum(b_h * b_q[None, :], 1)
            tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)

    if DO_RECORD and REC_ROWS and ROWS_END:
        p_w0 = p_w + o_s[:, None] * W
        tl.store(p_w0 + H * K + i_hv * V + o_v[None, :], t_v.to(record.dtype.element_ty),
                 mask=m_sv)
        p_w1 = p_w0 + H * K + HV * V + i_hv
        tl.store(p_w1, t_a.to(record.dtype.element_ty), mask=m_sa)
        tl.store(p_w1 + HV, t_b.to(record.dtype.element_ty), mask=m_sa)
        tl.store(p_w0 + i_h * K + o_k[None, :], t_k.to(record.dtype.element_ty), mask=m_sk)

    if DO_RECORD and REC_FLAG and LATE:
        # the page's last to count in: every other program has read the flag. Only the
        # counting lanes hold an answer
        if DEP:
            last = one & (done == NV * HV * (THREADS // WARP) - 1)
            tl.store(p_flag + _F_DONE + o_t * 0, o_t * 0, mask=last)
        else:
            # the acquire (on the reset) orders the flip after the other programs' counts
            last = one & (done == NV * HV - 1)
            tl.atomic_xchg(p_flag + _F_DONE + o_t * 0, o_t * 0, mask=last, sem="acquire")
        tl.store(p_flag + _F_COUNT + o_t * 0, o_t * 0 + n_rows.to(tl.int32), mask=last)
        tl.store(p_flag + _F_SLOT + o_t * 0, o_t * 0 + new_slot, mask=last)

    if DO_RECORD and REC_FLAG:
        if T > 0:
            if OWN:
                # every warp has used its pair reads (replay count, record addresses): then
                # the pair flips. No other program reads it, so nothing else is waited for.
                # OWN_BARRIER=False: a timing probe (the order then rests on the loops' own
                # reduction barriers)
                if OWN_BARRIER:
                    tl.debug_barrier()
                if (i_v == 0) & (i_hv == 0):
                    # the head too, for host-side readers (no program reads it under OWN)
                    tl.store(p_flag + _F_COUNT, n_rows.to(tl.int32))
                    tl.store(p_flag + _F_SLOT, new_slot)
            tl.store(p_pair + _F_COUNT, n_rows.to(tl.int32))
            tl.store(p_pair + _F_SLOT, new_slot)


# The record protocol and load order shipped per state dtype: the fastest bit-identical variant
# on the H200 for each (lab/results/gdn_kernel_h200_flashnext_own_k3.md). Both flip their own
# flag pairs; bf16 / fp16 state also loads the state and first rows beside the flag read and
# stores the record tiles last (`spec`, `rows_end`), which fp32 state, whose larger state loads
# and stores dominate, runs 1-4% faster without
FENCED = dict(late=False, spec=False, dep=False, rows_end=False, own=False)
DEP_ORDERED = dict(late=True, spec=True, dep=True, rows_end=True, own=False)
OWN_PLAIN = dict(late=False, spec=False, dep=False, rows_end=False, own=True)
OWN_PAIRS = dict(late=False, spec=True, dep=False, rows_end=True, own=True)


def shipped_protocol(state_dtype: str) -> dict:
    """The protocol knobs `kernel_config` uses for a state dtype ("float32", "bfloat16", ...)."""
    return dict(OWN_PLAIN if state_dtype == "float32" else OWN_PAIRS)


def measured(**knobs) -> dict:
    """A measured variant: knobs on top of the fenced kernel, the base every variant in
    lab/results/ was measured against, whatever the state dtype ships."""
    return {**FENCED, **knobs}


def kernel_config(*, H, HV, K, V, S, state_page_stride, state_dtype,
                  use_qk_l2norm_in_kernel=True, has_row_map=False,
                  stages=("replay", "verify", "record"), prefetch=True, late=None,
                  rec_in_verify=False, spec=None, maxnreg=None, waves_per_eu=None,
                  rows_end=None, dep=None, flag_volatile=False, record_parts=("rows", "flag"),
                  hip=False, warp_size=32, replay_prep=True, count_probe=0, skew_spin=0,
                  own=None, own_barrier=True):
    """The kernel's constexprs and compile options for one launch shape and variant: one place
    for the launcher and the offline compile (lab/scripts/gdn_kernel_static.py). Protocol
    knobs left None (`late`, `spec`, `dep`, `rows_end`, `own`) come from
    `shipped_protocol(state_dtype)`;
    `stages`, `prefetch` (0, 1, 2), `rec_in_verify`, `maxnreg` (CUDA), `waves_per_eu`
    (ROCm), `flag_volatile`, `record_parts`, `replay_prep` and `count_probe` (probes) select
    measured variants (see `measured`); `skew_spin` is a test knob. `warp_size`: the device's
    (32, or 64 on CDNA)."""
    ship = shipped_protocol(state_dtype)
    late = ship["late"] if late is None else late
    spec = ship["spec"] if spec is None else spec
    dep = ship["dep"] if dep is None else dep
    rows_end = ship["rows_end"] if rows_end is None else rows_end
    own = ship["own"] if own is None else own
    bad_heads = head_dims_reason(K, V)  # the policy's rule: it keeps stock pages for these
    if bad_heads:
        raise ValueError(bad_heads)
    BK = K
    BV = min(triton.next_power_of_2(V), STOCK_BV_MAX)
    unknown = set(stages) - {"replay", "verify", "record"}
    if unknown:
        raise ValueError(f"stages must be among replay, verify, record; got {sorted(unknown)}")
    if "record" in stages and "verify" not in stages and rec_in_verify:
        raise ValueError("the record rows are written by the verify loop: keep 'verify'")
    if int(prefetch) not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2, got {prefetch!r}")
    if rows_end and rec_in_verify:
        raise ValueError("rows_end stores the record tiles; rec_in_verify stores no tiles")
    if dep and not (late and spec):
        raise ValueError("dep counts in without a fence: it needs late and spec (every load "
                         "that does not need the flag issued before the count-in)")
    if own and (late or dep):
        raise ValueError("own reads and flips the program's own flag pair: there is no count-in "
                         "to make late or dependency-ordered")
    if spec and int(prefetch) == 0:
        raise ValueError("spec loads the first replay row ahead: it needs prefetch 1 or 2")
    constexprs = dict(
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, S=S, SP=triton.next_power_of_2(S),
        stride_state_page=state_page_stride, USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        HAS_ROW_MAP=has_row_map, DO_REPLAY="replay" in stages, DO_VERIFY="verify" in stages,
        DO_RECORD="record" in stages, PREFETCH=int(prefetch), LATE=bool(late),
        REC_IN_VERIFY=bool(rec_in_verify), SPEC=bool(spec),
        ROWS_END=bool(rows_end), DEP=bool(dep), OWN=bool(own), OWN_BARRIER=bool(own_barrier),
        FLAG_VOLATILE=bool(flag_volatile),
        # probes only (a record without its rows or its flag is not a record): where the
        # record's cost goes
        REC_ROWS="rows" in record_parts, REC_FLAG="flag" in record_parts,
        REPLAY_PREP=bool(replay_prep), COUNT_PROBE=int(count_probe),
        SKEW_SPIN=int(skew_spin),  # a test knob (tests/gpu), not a variant
        # one element per thread: DEP counts one lane per warp, whatever the warp size (32 on
        # CUDA and RDNA, 64 on CDNA)
        THREADS=STOCK_NUM_WARPS * int(warp_size), WARP=int(warp_size))
    options = dict(num_warps=STOCK_NUM_WARPS, num_stages=STOCK_NUM_STAGES)
    # register caps change how values are kept, not the arithmetic: ptxas's on CUDA, the AMDGPU
    # backend's occupancy target on ROCm; each is ignored on the other vendor
    if maxnreg and not hip:
        options["maxnreg"] = int(maxnreg)
    if waves_per_eu and hip:
        options["waves_per_eu"] = int(waves_per_eu)
    return constexprs, options


def _warp_size(device) -> int:
    """32 on CUDA and RDNA, 64 on CDNA (gfx9): what Triton compiles for on that device."""
    if device.type != "cuda":
        return 32  # the interpreter (CPU tensors)
    return _device_warp_size(device.index if device.index is not None
                             else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_warp_size(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    size = getattr(props, "warp_size", None)
    if size is None:
        size = 64 if str(getattr(props, "gcnArchName", "")).startswith("gfx9") else 32
    return int(size)


_configs: dict[tuple, tuple[int, dict, dict]] = {}


def _launch_config(H, HV, K, V, ssm_state, record, flag, use_qk_l2norm_in_kernel,
                   has_row_map, variant) -> tuple[int, dict, dict]:
    """(S, constexprs, options) of a launch, checked and computed once per layout: the checks
    and the config are host work every layer pays per step without CUDA graphs (eager and
    piecewise steps), and they depend only on what the key holds."""
    key = (H, HV, K, V, tuple(ssm_state.shape[1:]), ssm_state.stride(), ssm_state.dtype,
           tuple(record.shape[1:]), record.stride(), tuple(flag.shape[1:]), flag.stride(),
           flag.dtype, ssm_state.device, bool(use_qk_l2norm_in_kernel), has_row_map,
           tuple(sorted((n, tuple(x) if isinstance(x, list) else x)
                        for n, x in variant.items())))
    hit = _configs.get(key)
    if hit is None:
        S = _check_layout(ssm_state, record, flag, H, HV, K, V)
        constexprs, options = kernel_config(
            H=H, HV=HV, K=K, V=V, S=S, state_page_stride=ssm_state.stride(0),
            state_dtype=str(ssm_state.dtype).removeprefix("torch."),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, has_row_map=has_row_map,
            hip=torch.version.hip is not None, warp_size=_warp_size(ssm_state.device),
            **variant)
        hit = _configs[key] = (S, constexprs, options)
    return hit


def onepage_fused_step(*, q, k, v, a, b, A_log, dt_bias, ssm_state, record, flag,
                       state_indices, num_accepted, cu_seqlens, row_map=None,
                       use_qk_l2norm_in_kernel=True, out=None, **variant) -> torch.Tensor:
    """Launch the fused kernel; returns outputs [T, HV, V] in v's dtype (rows outside a row map
    and rows of null pages are zero). `variant` (see `kernel_config`) is for measurements."""
    T_all, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    N = state_indices.numel()
    S, constexprs, options = _launch_config(
        H, HV, K, V, ssm_state, record, flag, use_qk_l2norm_in_kernel, row_map is not None,
        variant)
    if out is None:
        alloc = torch.zeros if row_map is not None else torch.empty
        out = alloc((T_all, HV, V), dtype=v.dtype, device=v.device)
    if N == 0:
        return out
    grid = (triton.cdiv(V, constexprs["BV"]), N * HV)
    q, k, v = rows_in_place(q), rows_in_place(k), rows_in_place(v)
    onepage_gdn_step_kernel[grid](
        A_log, a.contiguous(), b.contiguous(), dt_bias, 1.0, 20.0,
        q, k, v, out, ssm_state, record, flag,
        cu_seqlens, state_indices, num_accepted, row_map if row_map is not None else cu_seqlens,
        K ** -0.5, N, record.stride(0), flag.stride(0), q.stride(0), k.stride(0), v.stride(0),
        **constexprs, **options)
    return out


def checked(**variant):
    """A `FusedStepChecked` (lab.triton_sim) running this kernel with `variant`'s
    knobs: the simulations' cross-check of a measured variant."""
    import functools

    from lab.triton_sim import FusedStepChecked

    return FusedStepChecked(functools.partial(onepage_fused_step, **variant))
