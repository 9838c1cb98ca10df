"""The fused one-page kernel and vLLM's stock GDN kernel compile ahead of time for the R9700
(ROCm, gfx1201, wave32) with Triton's offline compiler: no GPU needed. This is the evidence that
the production target builds; it also checks that both kernels get the same compile options
(a differing `enable_fp_fusion` would break bit-identity)."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

R9700 = GPUTarget("hip", "gfx1201", 32)
# 27B at TP2: 8 key heads, 24 value heads, head dims 128; k = 7 -> S = 8
H, HV, K, V, S = 8, 24, 128, 128, 8
BV = 32


def _compile(fn, signature, constexprs, target=R9700):
    from triton.compiler import make_backend

    backend = make_backend(target)
    # the launch options both launchers pass; enable_fp_fusion left to Triton's default for both
    options = backend.parse_options({"num_warps": 4, "num_stages": 3})
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options=options.__dict__)


def _fused_args(state_ty, prefetch=False):
    from r9k.kernels.triton_fused import onepage_gdn_step_kernel as kern

    ptr = {"A_log": "*fp32", "a": "*bf16", "b": "*bf16", "dt_bias": "*bf16", "q": "*bf16",
           "k": "*bf16", "v": "*bf16", "o": "*bf16", "h": f"*{state_ty}", "record": "*bf16",
           "flag": "*i32", "cu_seqlens": "*i32", "state_indices": "*i32",
           "num_accepted": "*i32", "row_map": "*i32"}
    scal = {"beta": "fp32", "threshold": "fp32", "scale": "fp32", "N": "i32",
            "stride_record_page": "i64", "stride_flag_page": "i32"}
    const = {"H": H, "HV": HV, "K": K, "V": V, "BK": K, "BV": BV, "S": S, "SP": S,
             "stride_state_page": HV * V * K, "USE_QK_L2NORM_IN_KERNEL": True,
             "HAS_ROW_MAP": False, "DO_REPLAY": True, "DO_VERIFY": True, "DO_RECORD": True, "PREFETCH": prefetch}
    sig = {n: ptr.get(n) or scal.get(n) or "constexpr" for n in kern.arg_names}
    return kern, sig, const


def _stock_args(state_ty):
    from r9k.kernels._stock_loader import stock_spec_kernel

    kern = stock_spec_kernel().fn  # under @triton.heuristics
    ptr = {"A_log": "*fp32", "a": "*bf16", "b": "*bf16", "dt_bias": "*bf16", "q": "*bf16",
           "k": "*bf16", "v": "*bf16", "o": "*bf16", "h0": f"*{state_ty}",
           "ht": f"*{state_ty}", "cu_seqlens": "*i32", "ssm_state_indices": "*i32",
           "num_accepted_tokens": "*i32"}
    scal = {"beta": "fp32", "threshold": "fp32", "scale": "fp32", "N": "i64", "T": "i64"}
    const = {"B": 1, "H": H, "HV": HV, "K": K, "V": V, "BK": K, "BV": BV,
             "stride_init_state_token": HV * V * K, "stride_final_state_token": HV * V * K,
             "stride_indices_seq": S, "stride_indices_tok": 1, "USE_INITIAL_STATE": True,
             "INPLACE_FINAL_STATE": True, "USE_QK_L2NORM_IN_KERNEL": True, "IS_VARLEN": True,
             "IS_CONTINUOUS_BATCHING": True, "IS_SPEC_DECODING": True, "IS_KDA": False}
    sig = {n: ptr.get(n) or scal.get(n) or "constexpr" for n in kern.arg_names}
    return kern, sig, const


@pytest.mark.parametrize("state_ty,prefetch",
                         [("fp32", False), ("bf16", False), ("fp32", True)])
def test_fused_and_stock_build_for_gfx1201_wave32(state_ty, prefetch):
    fused = _compile(*_fused_args(state_ty, prefetch))
    stock = _compile(*_stock_args(state_ty))
    for ck in (fused, stock):
        assert ck.metadata.target.arch == "gfx1201" and ck.metadata.warp_size == 32
        assert ck.metadata.num_warps == 4
        assert len(ck.asm["hsaco"]) > 0 and "amdgcn" in ck.asm["amdgcn"]
    assert fused.metadata.enable_fp_fusion == stock.metadata.enable_fp_fusion
    assert fused.metadata.num_stages == stock.metadata.num_stages
    assert fused.metadata.shared <= 64 * 1024  # fits RDNA4's LDS
