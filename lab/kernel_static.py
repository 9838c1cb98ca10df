"""Offline compiles of the GDN kernels (no GPU): vLLM's stock spec kernel and the fused one-page
kernel's variants, with the facts that decide speed at small N: registers, spills, programs per
SM (CUDA) or waves per SIMD (ROCm), and the SASS opcode mix. Used by
lab/scripts/gdn_kernel_static.py and tests/kernels/test_triton_aot.py.

Launches are compiled as the JIT specializes them for 16-byte aligned tensors. CUDA numbers
depend on the Triton (ptxas) version: compare kernels compiled by one version.
"""
from __future__ import annotations

import collections
import math
import re
import subprocess
import tempfile
from pathlib import Path

# H200 (sm_90): the register file and limits of NVIDIA's occupancy calculator
SM90 = dict(sms=132, regs_per_sm=65536, reg_step_thread=8, reg_step_warp=256, max_warps=64,
            max_blocks=32)
NUM_WARPS = 4
FP_OPS = ("FFMA", "FMUL", "FADD", "MUFU")
SHOWN_OPS = FP_OPS + ("SHFL", "BAR", "LDG", "STG", "LDL", "STL", "ATOMG", "RED")


def _ptr_attrs(sig: dict, extra_div: tuple = ()) -> dict:
    """The JIT's specialization of a launch with 16-byte aligned tensors (and the int args
    listed, which are multiples of 16 at these shapes)."""
    names = list(sig)
    div = [n for n in names if sig[n].startswith("*")] + [n for n in extra_div if n in sig]
    return {(names.index(n),): [["tt.divisibility", 16]] for n in div}


def _compile(fn, sig: dict, constexprs: dict, options: dict, target, extra_div=()):
    import triton
    from triton.compiler import ASTSource

    for name in constexprs:
        sig[name] = "constexpr"
    # indices are the kernel's parameter positions, whatever order the dicts were built in
    sig = {n: sig[n] for n in fn.arg_names if n in sig}
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=_ptr_attrs(sig, extra_div))
    return triton.compile(src, target=target, options=options)


# int args the JIT sees as multiples of 16 at these shapes (record pages; q, k, v rows)
FUSED_DIV = ("stride_record_page", "stride_q_row", "stride_k_row", "stride_v_row")
_STATE_DTYPE = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def _fused_signature(kern, state: str, constexprs: dict) -> dict:
    ptr = {"A_log": "*fp32", "h": f"*{state}", "flag": "*i32", "cu_seqlens": "*i32",
           "state_indices": "*i32", "num_accepted": "*i32", "row_map": "*i32"}
    scal = {"beta": "fp32", "threshold": "fp32", "scale": "fp32", "N": "i32",
            "stride_record_page": "i64", "stride_flag_page": "i32", "stride_q_row": "i32",
            "stride_k_row": "i32", "stride_v_row": "i32"}
    return {n: ptr.get(n) or scal.get(n) or "*bf16" for n in kern.arg_names
            if n not in constexprs}


def shipped_compiled(heads, state: str, S: int, target, has_row_map: bool = False):
    """The package's fused kernel (`r9k.kernels.triton_fused`), as its launcher configures it."""
    from r9k.kernels.triton_fused import kernel_config, onepage_gdn_step_kernel as kern

    H, HV, K, V = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim
    constexprs, options = kernel_config(H=H, HV=HV, K=K, V=V, S=S, state_dtype=_STATE_DTYPE[state],
                                        state_page_stride=HV * V * K, has_row_map=has_row_map)
    return _compile(kern, _fused_signature(kern, state, constexprs), constexprs, options, target,
                    extra_div=FUSED_DIV)


def fused_compiled(heads, state: str, S: int, variant: dict, target, has_row_map: bool = False):
    """The research kernel (`lab.fused_variants`) with a measured variant's knobs; `{}`:
    its knobs at the shipped settings."""
    from lab.fused_variants import kernel_config, onepage_gdn_step_kernel as kern

    H, HV, K, V = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim
    constexprs, options = kernel_config(H=H, HV=HV, K=K, V=V, S=S, state_dtype=_STATE_DTYPE[state],
                                        state_page_stride=HV * V * K, has_row_map=has_row_map,
                                        hip=target.backend == "hip", warp_size=target.warp_size,
                                        **variant)
    return _compile(kern, _fused_signature(kern, state, constexprs), constexprs, options, target,
                    extra_div=FUSED_DIV)


def stock_compiled(heads, state: str, S: int, target):
    from triton.runtime.jit import JITFunction

    from r9k.kernels._stock_loader import stock_spec_kernel
    from r9k.kernels.triton_fused import STOCK_BV_MAX

    kern = stock_spec_kernel()
    while not isinstance(kern, JITFunction):  # under @triton.heuristics
        kern = kern.fn
    H, HV, K, V = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim
    constexprs = {"B": 1, "H": H, "HV": HV, "K": K, "V": V, "BK": K, "BV": min(V, STOCK_BV_MAX),
                  "stride_init_state_token": HV * V * K, "stride_final_state_token": HV * V * K,
                  "stride_indices_seq": S, "stride_indices_tok": 1, "USE_INITIAL_STATE": True,
                  "INPLACE_FINAL_STATE": True, "USE_QK_L2NORM_IN_KERNEL": True,
                  "IS_VARLEN": True, "IS_CONTINUOUS_BATCHING": True, "IS_SPEC_DECODING": True,
                  "IS_KDA": False}
    ptr = {"A_log": "*fp32", "h0": f"*{state}", "ht": f"*{state}", "cu_seqlens": "*i32",
           "ssm_state_indices": "*i32", "num_accepted_tokens": "*i32"}
    scal = {"beta": "fp32", "threshold": "fp32", "scale": "fp32", "N": "i64", "T": "i64"}
    sig = {n: ptr.get(n) or scal.get(n) or "*bf16" for n in kern.arg_names
           if n not in constexprs}
    return _compile(kern, sig, constexprs, {"num_warps": NUM_WARPS, "num_stages": 3}, target)


def programs_per_sm(regs: int, num_warps: int = NUM_WARPS, sm: dict = SM90) -> int:
    per_thread = math.ceil(regs / sm["reg_step_thread"]) * sm["reg_step_thread"]
    per_warp = math.ceil(per_thread * 32 / sm["reg_step_warp"]) * sm["reg_step_warp"]
    warps = sm["regs_per_sm"] // per_warp
    return min(warps // num_warps, sm["max_warps"] // num_warps, sm["max_blocks"])


def _triton_bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cuda_facts(ck) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([_triton_bin("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_triton_bin("nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if not m:
        raise RuntimeError(f"cuobjdump printed no register count: {usage[:300]!r}")
    ops = collections.Counter()
    for line in sass.splitlines():
        op = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", line)
        if op:
            ops[op.group(1)] += 1
    regs = int(m.group(1))
    return {"regs": regs, "spill_stack_bytes": int(m.group(2)),
            "programs_per_sm": programs_per_sm(regs), "sass_instructions": sum(ops.values()),
            "sass_ops": {k: ops[k] for k in SHOWN_OPS}}


def hip_facts(ck) -> dict:
    text = ck.asm["amdgcn"]

    def num(pat):
        m = re.search(pat, text)
        return int(m.group(1)) if m else None

    return {"vgprs": num(r"\.vgpr_count:\s+(\d+)"), "sgprs": num(r"\.sgpr_count:\s+(\d+)"),
            "vgpr_spills": num(r"\.vgpr_spill_count:\s+(\d+)"),
            "waves_per_simd": num(r"; Occupancy: (\d+)")}


