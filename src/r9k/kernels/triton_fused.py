"""The fused one-page GDN verify step as shipped: one Triton kernel per (sequence, value head,
V block).

Per program, with the state tile [BV, K] in registers:
1. copy this step's candidate rows (post-conv k | v | a | b) into the page's other record slot;
2. replay the first min(num_accepted, live_count) rows of the live slot onto the checkpoint,
   store it once (rounded to the state dtype) and continue from the rounded value, exactly as
   stock re-reads a stored slot;
3. run the candidate rows from there, storing their outputs and no state.
Each program reads the live count and slot from its own pair of the page's flag words and,
after a barrier (every warp has used them), writes the new ones there; program (0, 0) also
writes the head words, which host-side code reads. No program waits on another, no atomics:
correct under any order the GPU dispatches programs in. Row t + 1's inputs load while row t
computes.

Two constexprs choose what ships per state dtype (`shipped_protocol`): bf16 / fp16 state loads
the state and both record slots' first rows beside the flag read (`SPEC`) and stores the record
tiles after the verify loop (`ROWS_END`); fp32 state, whose larger state loads and stores
dominate, runs 1-4% faster without. The measured variants, the earlier count-in protocols and
their history are in `lab.fused_variants` (results: lab/results/gdn_kernel_h200_*); at
the shipped settings that kernel compiles to this one's PTX (sm_90) and AMDGCN (gfx1201):
`lab/scripts/kernel_compare.py`.

Bit-identity with vLLM's stock kernel (`fused_sigmoid_gating_delta_rule_update_kernel`) rests on
keeping its tiling (BV = min(32, V), BK = K, 4 warps, 3 stages), its per-token op order (copied
line by line below; A_log and dt_bias are loaded once, the same values) and its compile options
(none passed, as the stock launcher passes none). q, k and v rows are read at their own stride
(`stride_*_row`; each row's heads packed): vLLM's are column slices of the conv output, read in
place where stock copies them first (the same values). Replay rows skip q and the output, which never
feed the state. Portable Triton only: it builds for CUDA and for ROCm RDNA4 (gfx1201, wave32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from r9k.core.page_layout import (
    FLAG_COUNT, FLAG_DTYPE, FLAG_PAIR_WORDS, FLAG_SLOT, FLAG_WORDS, KERNEL_V_BLOCK_MAX,
    RECORD_SLOTS, flag_words, head_dims_reason, kernel_programs_per_page, record_row_elements)
from r9k.kernels.launch_cache import CACHES

# the stock launcher's tiling and launch parameters; changing any of them changes the last bits
STOCK_BV_MAX = KERNEL_V_BLOCK_MAX  # the capacity module sizes the flag pairs from it
STOCK_NUM_WARPS = 4
STOCK_NUM_STAGES = 3

_F_COUNT = tl.constexpr(FLAG_COUNT)
_F_SLOT = tl.constexpr(FLAG_SLOT)
_F_HEAD = tl.constexpr(FLAG_WORDS)
_F_PAIR = tl.constexpr(FLAG_PAIR_WORDS)


@triton.jit
def _step_rows(row_map, bos, n_rows, SP: tl.constexpr, HAS_ROW_MAP: tl.constexpr):
    """This step's first `n_rows` candidate rows as a tile: offsets, mask and row indices."""
    o_s = tl.arange(0, SP)
    mask_s = o_s < n_rows
    if HAS_ROW_MAP:
        rows = tl.load(row_map + bos + o_s, mask=mask_s, other=0).to(tl.int64)
    else:
        rows = bos + o_s
    return o_s, mask_s, rows


@triton.jit
def _first_candidate_row(q, k, v, a, b, row_map, bos, T, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                         stride_q_row, stride_k_row, stride_v_row,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         HAS_ROW_MAP: tl.constexpr):
    """The first candidate row's index and q, k, v, a, b (zeros when the step has no rows):
    loaded ahead, so it is in flight while the replay runs."""
    if HAS_ROW_MAP:
        n_row = tl.load(row_map + bos, mask=T > 0, other=0).to(tl.int64)
    else:
        n_row = bos
    n_q = tl.load(q + n_row * stride_q_row + i_h * K + o_k, mask=mask_k & (o_k * 0 < T), other=0)
    n_k = tl.load(k + n_row * stride_k_row + i_h * K + o_k, mask=mask_k & (o_k * 0 < T), other=0)
    n_v = tl.load(v + n_row * stride_v_row + i_hv * V + o_v, mask=mask_v & (o_v * 0 < T),
                  other=0)
    n_a = tl.load(a + n_row * HV + i_hv, mask=T > 0, other=0)
    n_b = tl.load(b + n_row * HV + i_hv, mask=T > 0, other=0)
    return n_row, n_q, n_k, n_v, n_a, n_b


@triton.jit(do_not_specialize=["N"])
def onepage_gdn_step_kernel(
    A_log, a, b, dt_bias, beta, threshold, q, k, v, o, h, record, flag, cu_seqlens,
    state_indices, num_accepted, row_map, scale, N, stride_record_page, stride_flag_page,
    stride_q_row, stride_k_row, stride_v_row,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, stride_state_page: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr, HAS_ROW_MAP: tl.constexpr,
    SPEC: tl.constexpr, ROWS_END: tl.constexpr,
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
    # this program's own (count, slot) pair: read here, flipped at the end
    p_pair = p_flag + _F_HEAD + _F_PAIR * (i_hv * NV + i_v)
    if SPEC:
        # everything whose address does not depend on the flag is issued beside the flag
        # read: the state, both record slots' first rows (the live slot picks one below) and
        # the first candidate row
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
        n_row, n_q, n_k, n_v, n_a, n_b = _first_candidate_row(
            q, k, v, a, b, row_map, bos, T, i_h, i_hv, o_k, o_v, mask_k, mask_v, stride_q_row,
            stride_k_row, stride_v_row, H, HV, K, V, HAS_ROW_MAP)
    live_count = tl.load(p_pair + _F_COUNT)
    raw_slot = tl.load(p_pair + _F_SLOT)
    live_slot = raw_slot & 1
    n_replay = tl.minimum(tl.load(num_accepted + i_n).to(tl.int32), live_count)
    n_replay = tl.minimum(tl.maximum(n_replay, 0), S)
    new_slot = 1 - live_slot
    n_rows = tl.minimum(T, S)

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
    if SPEC:
        # the live slot's first row (unused when nothing is replayed)
        r_k = tl.where(o_k * 0 + live_slot == 1, s1_k, s0_k)
        r_v = tl.where(o_v * 0 + live_slot == 1, s1_v, s0_v)
        r_a = tl.where(live_slot == 1, s1_a, s0_a)
        r_b = tl.where(live_slot == 1, s1_b, s0_b)
    else:
        # the first replay row and the first candidate row in flight before anything waits;
        # row t + 1 is loaded while row t computes (same values, same arithmetic). Vector
        # masks are built full-width: the interpreter rejects vector & scalar masks.
        r_k = tl.load(p_rk, mask=mask_k & (o_k * 0 < n_replay), other=0)
        r_v = tl.load(p_rv, mask=mask_v & (o_v * 0 < n_replay), other=0)
        r_a = tl.load(p_ra, mask=n_replay > 0, other=0)
        r_b = tl.load(p_rb, mask=n_replay > 0, other=0)
        n_row, n_q, n_k, n_v, n_a, n_b = _first_candidate_row(
            q, k, v, a, b, row_map, bos, T, i_h, i_hv, o_k, o_v, mask_k, mask_v, stride_q_row,
            stride_k_row, stride_v_row, H, HV, K, V, HAS_ROW_MAP)

    if ROWS_END:
        # the tiles are loaded here and stored after the verify loop, so no store waits on its
        # load in the program's in-order stream. Branch-free (masks only): the tiles must live
        # past this point
        o_s, mask_s, rows = _step_rows(row_map, bos, n_rows, SP, HAS_ROW_MAP)
        m_sv = mask_s[:, None] & mask_v[None, :]
        m_sa = mask_s[:, None] & ((o_s * 0 + i_v) == 0)[:, None]
        m_sk = m_sa & ((o_s * 0 + i_hv % (HV // H)) == 0)[:, None] & mask_k[None, :]
        t_v = tl.load(v + rows[:, None] * stride_v_row + i_hv * V + o_v[None, :], mask=m_sv,
                      other=0)
        t_a = tl.load(a + rows[:, None] * HV + i_hv, mask=m_sa, other=0)
        t_b = tl.load(b + rows[:, None] * HV + i_hv, mask=m_sa, other=0)
        t_k = tl.load(k + rows[:, None] * stride_k_row + i_h * K + o_k[None, :], mask=m_sk,
                      other=0)
    else:
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

    # 1. replay: the stock per-token state update, without q and the output
    for i_t in range(0, n_replay):
        b_k = r_k.to(tl.float32)
        b_v = r_v.to(tl.float32)
        b_b = r_b.to(tl.float32)
        x = r_a.to(tl.float32) + c_dtb
        more = i_t + 1 < n_replay
        r_k = tl.load(p_rk + W, mask=mask_k & (o_k * 0 + i_t + 1 < n_replay), other=0)
        r_v = tl.load(p_rv + W, mask=mask_v & (o_v * 0 + i_t + 1 < n_replay), other=0)
        r_a = tl.load(p_ra + W, mask=more, other=0)
        r_b = tl.load(p_rb + W, mask=more, other=0)
        softplus_x = tl.where(
            beta * x <= threshold, (1 / beta) * tl.log(1 + tl.exp(beta * x)), x
        )
        b_g = c_negA * softplus_x

        b_beta = tl.sigmoid(b_b.to(tl.float32))

        if USE_QK_L2NORM_IN_KERNEL:
            b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
        b_h *= tl.exp(b_g)
        b_v -= tl.sum(b_h * b_k[None, :], 1)
        b_v *= b_beta
        b_h += b_v[:, None] * b_k[None, :]

        p_rk += W
        p_rv += W
        p_ra += W
        p_rb += W
    if n_replay > 0:
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)
    # continue from the stored (rounded) checkpoint, as stock re-reads a stored slot
    b_h = b_h.to(p_h.dtype.element_ty).to(tl.float32)

    # 2. verify: the stock per-token body, outputs only
    for i_t in range(0, T):
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

    if ROWS_END:
        p_w0 = p_w + o_s[:, None] * W
        tl.store(p_w0 + H * K + i_hv * V + o_v[None, :], t_v.to(record.dtype.element_ty),
                 mask=m_sv)
        p_w1 = p_w0 + H * K + HV * V + i_hv
        tl.store(p_w1, t_a.to(record.dtype.element_ty), mask=m_sa)
        tl.store(p_w1 + HV, t_b.to(record.dtype.element_ty), mask=m_sa)
        tl.store(p_w0 + i_h * K + o_k[None, :], t_k.to(record.dtype.element_ty), mask=m_sk)

    if T > 0:
        # every warp has used its pair reads (replay count, record addresses): then the pair
        # flips. No other program reads it, so nothing else is waited for
        tl.debug_barrier()
        if (i_v == 0) & (i_hv == 0):
            # the head too, for host-side readers (no program reads it)
            tl.store(p_flag + _F_COUNT, n_rows.to(tl.int32))
            tl.store(p_flag + _F_SLOT, new_slot)
        tl.store(p_pair + _F_COUNT, n_rows.to(tl.int32))
        tl.store(p_pair + _F_SLOT, new_slot)


def _check_layout(ssm_state, record, flag, heads_k, heads_v, K, V) -> int:
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (heads_v, V, K):
        raise ValueError(f"ssm_state must be [slots, HV={heads_v}, V={V}, K={K}], "
                         f"got {tuple(ssm_state.shape)}")
    if ssm_state[0].stride() != (V * K, K, 1):
        raise ValueError("ssm_state pages must be contiguous inside ([HV, V, K] row-major)")
    width = record_row_elements(heads_k, heads_v, K, V)
    if record.dim() != 4 or record.shape[1] != RECORD_SLOTS or record.shape[3] != width:
        raise ValueError(f"record must be [slots, {RECORD_SLOTS}, S, W={width}], "
                         f"got {tuple(record.shape)}")
    if record[0].stride() != (record.shape[2] * width, width, 1):
        raise ValueError(f"record pages must be contiguous inside ([{RECORD_SLOTS}, S, W] "
                         "row-major)")
    flag_dtype = getattr(torch, FLAG_DTYPE)
    words = flag_words(heads_v, V)
    if (flag.dim() != 2 or flag.shape[1] != words or flag.dtype != flag_dtype
            or flag.stride(1) != 1):
        raise ValueError(f"flag must be {FLAG_DTYPE} [slots, {words}] (a head of {FLAG_WORDS} "
                         f"words and a pair per program: {kernel_programs_per_page(heads_v, V)} "
                         f"programs), got {flag.dtype} {tuple(flag.shape)}")
    return int(record.shape[2])


def shipped_protocol(state_dtype: str) -> dict:
    """The load-order knobs shipped for a state dtype ("float32", "bfloat16", ...): the fastest
    bit-identical variant on the H200 for each (lab/results/gdn_kernel_h200_flashnext_own_k3.md)."""
    wide = state_dtype == "float32"
    return dict(spec=not wide, rows_end=not wide)


def kernel_config(*, H, HV, K, V, S, state_page_stride, state_dtype,
                  use_qk_l2norm_in_kernel=True, has_row_map=False) -> tuple[dict, dict]:
    """The kernel's constexprs and compile options for one launch shape: one place for the
    launcher and the offline compiles (`lab.kernel_static`)."""
    bad_heads = head_dims_reason(K, V)  # the policy's rule: it keeps stock pages for these
    if bad_heads:
        raise ValueError(bad_heads)
    ship = shipped_protocol(state_dtype)
    constexprs = dict(
        H=H, HV=HV, K=K, V=V, BK=K, BV=min(triton.next_power_of_2(V), STOCK_BV_MAX), S=S,
        SP=triton.next_power_of_2(S), stride_state_page=state_page_stride,
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel, HAS_ROW_MAP=has_row_map,
        SPEC=ship["spec"], ROWS_END=ship["rows_end"])
    return constexprs, dict(num_warps=STOCK_NUM_WARPS, num_stages=STOCK_NUM_STAGES)


def _launch_config(H, HV, K, V, ssm_state, record, flag, use_qk_l2norm_in_kernel,
                   has_row_map) -> tuple[int, dict, dict]:
    """(S, constexprs, options) of a launch, checked and computed once per layout: the checks
    and the config are host work every layer pays per step without CUDA graphs (eager and
    piecewise steps), and they depend only on what the key holds."""
    key = (H, HV, K, V, tuple(ssm_state.shape[1:]), ssm_state.stride(), ssm_state.dtype,
           tuple(record.shape[1:]), record.stride(), tuple(flag.shape[1:]), flag.stride(),
           flag.dtype, ssm_state.device, bool(use_qk_l2norm_in_kernel), has_row_map)
    hit = CACHES.configs.get(key)
    if hit is None:
        S = _check_layout(ssm_state, record, flag, H, HV, K, V)
        constexprs, options = kernel_config(
            H=H, HV=HV, K=K, V=V, S=S, state_page_stride=ssm_state.stride(0),
            state_dtype=str(ssm_state.dtype).removeprefix("torch."),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, has_row_map=has_row_map)
        hit = CACHES.configs[key] = (S, constexprs, options)
    return hit


def onepage_fused_step(*, q, k, v, a, b, A_log, dt_bias, ssm_state, record, flag,
                       state_indices, num_accepted, cu_seqlens, row_map=None,
                       use_qk_l2norm_in_kernel=True, out=None) -> torch.Tensor:
    """Launch the fused kernel; returns outputs [T, HV, V] in v's dtype (rows outside a row map
    and rows of null pages are zero)."""
    T_all, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    N = state_indices.numel()
    S, constexprs, options = _launch_config(H, HV, K, V, ssm_state, record, flag,
                                            use_qk_l2norm_in_kernel, row_map is not None)
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


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] as the kernel reads it: rows at any stride (vLLM's q, k, v are column
    slices of the conv output), each row's heads packed. Anything else is copied."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()
