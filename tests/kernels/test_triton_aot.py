"""The fused one-page kernel and vLLM's stock GDN kernel compile ahead of time for the R9700
(ROCm, gfx1201, wave32) with Triton's offline compiler: no GPU needed. This is the evidence that
the production target builds; it also checks that both kernels get the same compile options
(a differing `enable_fp_fusion` would break bit-identity)."""
import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from lab.fused_variants import DEP_ORDERED, measured  # noqa: E402
from lab.kernel_static import fused_compiled, shipped_compiled, stock_compiled  # noqa: E402
from r9k.kernels.onepage import GdnHeads  # noqa: E402

R9700 = GPUTarget("hip", "gfx1201", 32)
# 27B at TP2: 8 key heads, 24 value heads, head dims 128; k = 7 -> S = 8
QWEN35_27B_TP2 = GdnHeads(num_k_heads=8, num_v_heads=24, head_k_dim=128, head_v_dim=128)
S = 8


@pytest.mark.parametrize("state_ty,variant",
                         [("fp32", measured(prefetch=0)), ("bf16", measured(prefetch=0)),
                          # as shipped (own flag pairs): the package's kernel
                          ("fp32", None), ("bf16", None),
                          # the count-in protocols, and measured variants (gdn_kernel.py):
                          # they must build for the R9700 too
                          ("fp32", measured(**DEP_ORDERED)), ("bf16", measured()),
                          ("bf16", measured(late=True, rows_end=True)),
                          ("bf16", measured(prefetch=2, late=True, rec_in_verify=True))])
def test_fused_and_stock_build_for_gfx1201_wave32(state_ty, variant):
    # both with the options their launchers pass (enable_fp_fusion left to Triton's default)
    fused = (shipped_compiled(QWEN35_27B_TP2, state_ty, S, R9700) if variant is None
             else fused_compiled(QWEN35_27B_TP2, state_ty, S, variant, R9700))
    stock = stock_compiled(QWEN35_27B_TP2, state_ty, S, R9700)
    for ck in (fused, stock):
        assert ck.metadata.target.arch == "gfx1201" and ck.metadata.warp_size == 32
        assert ck.metadata.num_warps == 4
        assert len(ck.asm["hsaco"]) > 0 and "amdgcn" in ck.asm["amdgcn"]
    assert fused.metadata.enable_fp_fusion == stock.metadata.enable_fp_fusion
    assert fused.metadata.num_stages == stock.metadata.num_stages
    assert fused.metadata.shared <= 64 * 1024  # fits RDNA4's LDS


# Flash-Next at TP2 per rank, k = 3: where the kernel's occupancy was measured
_FLASH_NEXT_TP2 = dict(num_k_heads=8, num_v_heads=16, head_k_dim=128, head_v_dim=128)


def test_programs_per_sm_follows_the_register_file():
    from lab.kernel_static import programs_per_sm

    # 65,536 registers per SM in 256-register warp steps, 4 warps per program
    assert [programs_per_sm(r) for r in (64, 72, 80, 96, 113, 128, 255)] == [8, 7, 6, 5, 4, 4, 2]


@pytest.mark.parametrize("state_ty", ["bf16", "fp32"])
def test_waves_per_eu_cap_reaches_stock_occupancy_on_gfx1201(state_ty):
    """On the R9700 the shipped fused kernel holds fewer waves per SIMD than stock (more live
    registers); the capped variant gdn_kernel.py measures holds as many, without spilling."""
    from lab.kernel_static import hip_facts

    heads = GdnHeads(**_FLASH_NEXT_TP2)
    stock = hip_facts(stock_compiled(heads, state_ty, 4, R9700))
    capped = hip_facts(fused_compiled(heads, state_ty, 4,
                                      measured(prefetch=0, late=True, waves_per_eu=16), R9700))
    assert stock["waves_per_simd"] and capped["waves_per_simd"]
    assert capped["waves_per_simd"] >= stock["waves_per_simd"], (capped, stock)
    assert capped["vgpr_spills"] == 0, capped


def test_maxnreg_cap_keeps_the_arithmetic_on_sm90():
    """A ptxas register cap changes registers and moves, not arithmetic: the capped kernel's
    floating-point opcode counts equal the uncapped one's (evidence for bit-identity; the H200
    tests are the proof) and it fits the cap."""
    from lab.kernel_static import FP_OPS, cuda_facts

    h200 = GPUTarget("cuda", 90, 32)
    heads = GdnHeads(**_FLASH_NEXT_TP2)
    free = cuda_facts(fused_compiled(heads, "bf16", 4, measured(prefetch=0, late=True), h200))
    capped = cuda_facts(fused_compiled(heads, "bf16", 4,
                                       measured(prefetch=0, late=True, maxnreg=80), h200))
    assert capped["regs"] <= 80 < free["regs"], (capped["regs"], free["regs"])
    assert capped["programs_per_sm"] > free["programs_per_sm"]
    assert {k: capped["sass_ops"][k] for k in FP_OPS} == {k: free["sass_ops"][k] for k in FP_OPS}


def test_late_count_in_does_not_wait_for_its_answer_on_sm90():
    """The late count-in exists so that no program stalls on the atomic's round trip. Triton
    broadcasts a scalar atomic's answer through shared memory behind a barrier (every thread
    waits for it right there); the late count-in is one element per thread and must not be."""
    heads = GdnHeads(**_FLASH_NEXT_TP2)
    sm90 = GPUTarget("cuda", 90, 32)
    ptx = fused_compiled(heads, "bf16", 4, measured(late=True), sm90).asm["ptx"]
    lines = ptx.splitlines()
    at = [i for i, line in enumerate(lines) if "atom.global.gpu.release.add" in line]
    assert len(at) == 1, at
    # from the count-in to the verify loop's first load: no barrier
    after = lines[at[0] + 1:]
    nxt = next(i for i, line in enumerate(after) if "ld.global" in line)
    assert not any("bar.sync" in line for line in after[:nxt]), "\n".join(after[:nxt])
    # the fenced protocol's count-in does wait (a barrier right after it), which is why
    fenced = fused_compiled(heads, "bf16", 4, measured(), sm90).asm["ptx"]
    lines = fenced.splitlines()
    i = next(i for i, line in enumerate(lines) if "atom.global" in line)
    assert any("bar.sync" in line for line in lines[i + 1:i + 8])


_PTX_REG = re.compile(r"%[a-z]+\d+")


def _ptx_defs(ptx: str) -> dict:
    """register -> the PTX instructions that write it (Triton's inline-asm loads included)."""
    defs = {}
    for line in ptx.splitlines():
        ins = line.split("//")[0].strip().rstrip(";")
        if not ins or ins.startswith((".", "}", "{")) or ins.endswith(":"):
            continue
        body = re.sub(r"^@!?%p\d+\s+", "", ins)
        parts = body.split(None, 1)
        if len(parts) < 2 or parts[0].startswith(("st.", "atom.", "red.", "bar.", "bra")):
            continue
        dest = parts[1].split("}", 1)[0] if parts[1].lstrip().startswith("{") else \
            parts[1].split(",", 1)[0]
        for reg in _PTX_REG.findall(dest):
            defs.setdefault(reg, []).append(ins)
    return defs


def _flag_compares_feeding(ptx: str, pred: str) -> list:
    """The `setp ..., -2147483648` compares in the backward slice of `pred` whose compared
    register is written by a global load (the dependency-ordered count-in's flag tests)."""
    defs, seen, todo, found = _ptx_defs(ptx), set(), [pred], []
    while todo:
        reg = todo.pop()
        if reg in seen:
            continue
        seen.add(reg)
        for ins in defs.get(reg, []):
            srcs = _PTX_REG.findall(ins)
            if ins.startswith("setp") and ins.endswith("-2147483648"):
                if any("ld.global" in d for d in defs.get(srcs[-1], [])):
                    found.append(ins)
            todo += srcs
    return found


@pytest.mark.parametrize("state_ty", ["bf16", "fp32"])
def test_shipped_protocol_has_no_atomic_on_sm90(state_ty):
    """Both state dtypes ship the own-pair protocol: no atomic, no fence; a barrier before
    the pair's stores (every warp has used its pair reads)."""
    heads = GdnHeads(**_FLASH_NEXT_TP2)
    ptx = shipped_compiled(heads, state_ty, 4, GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert not re.search(r"\batom\.|\bred\.global|\bfence\.|membar", ptx)
    # the reductions have barriers of their own: the flip's is the one the probe leaves out
    unfenced = fused_compiled(heads, state_ty, 4, dict(own_barrier=False),
                              GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ptx.count("bar.sync") == unfenced.count("bar.sync") + 1
    measured_ptx = fused_compiled(heads, state_ty, 4, measured(**DEP_ORDERED),
                                  GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert re.search(r"\batom\.global", measured_ptx)  # the pattern finds an atomic


@pytest.mark.parametrize("state_ty,protocol", [("bf16", "dep"), ("fp32", "fenced")])
def test_count_in_protocols_on_sm90(state_ty, protocol):
    """The count-in protocols that shipped before the own pairs (measured variants now). The
    dependency-ordered count-in: a relaxed add whose predicate is computed from the warp's own
    flag loads (two compares of loaded values: the add cannot issue before those loads
    returned), no fence, no barrier beside it and no acquire flip. The fenced one: an acq_rel
    add right behind a barrier."""
    heads = GdnHeads(**_FLASH_NEXT_TP2)
    variant = measured(**DEP_ORDERED) if protocol == "dep" else measured()
    ptx = fused_compiled(heads, state_ty, 4, variant, GPUTarget("cuda", 90, 32)).asm["ptx"]
    atoms = re.findall(r"^\s*(?:@(%p\d+)\s+)?atom\.global\.([\w.]+)", ptx, re.M)
    assert not re.search(r"\bfence\.|membar", ptx)
    lines = ptx.splitlines()
    at = next(i for i, line in enumerate(lines) if "atom.global" in line)
    if protocol == "dep":
        assert [op for _, op in atoms] == ["gpu.relaxed.add.u32"], atoms
        pred = atoms[0][0]
        assert pred, "the count-in must be predicated"
        flag_tests = _flag_compares_feeding(ptx, pred)
        assert len(flag_tests) == 2, flag_tests  # COUNT and SLOT, as loaded
        assert not any("bar.sync" in line for line in lines[max(0, at - 12):at + 8])
    else:
        assert [op for _, op in atoms] == ["gpu.acq_rel.add.u32"], atoms
        assert any("bar.sync" in line for line in lines[max(0, at - 12):at])


def test_dep_count_target_follows_the_warp_size():
    """One counting lane per warp: 4 per program on wave32 and on wave64 alike (CDNA), so every
    warp that reads the flag orders its own reads before a count."""
    from lab.fused_variants import kernel_config

    for warp in (32, 64):
        c, _ = kernel_config(H=8, HV=16, K=128, V=128, S=4, state_page_stride=16 * 128 * 128,
                             state_dtype="bfloat16", hip=True, warp_size=warp,
                             **measured(**DEP_ORDERED))
        assert c["DEP"] and c["WARP"] == warp and c["THREADS"] // c["WARP"] == 4


@pytest.mark.parametrize("V,HV", [(128, 8), (128, 24), (64, 2), (48, 3), (16, 4), (256, 1)])
def test_flag_pairs_cover_the_kernel_grid(V, HV):
    """The capacity module sizes one flag pair per program of the launch grid (value heads x
    value blocks): the layout check accepts exactly that width and names it when it is wrong."""
    import torch

    from r9k.core.page_layout import FLAG_WORDS, flag_words, kernel_programs_per_page
    from r9k.kernels.triton_fused import _check_layout, kernel_config

    c, _ = kernel_config(H=1, HV=HV, K=32, V=V, S=4, state_page_stride=HV * V * 32,
                         state_dtype="bfloat16")
    grid_programs = HV * triton.cdiv(V, c["BV"])
    assert kernel_programs_per_page(HV, V) == grid_programs
    assert flag_words(HV, V) == FLAG_WORDS + 2 * grid_programs
    heads = GdnHeads(num_k_heads=1, num_v_heads=HV, head_k_dim=32, head_v_dim=V)
    state = torch.zeros(3, HV, V, 32)
    record = torch.zeros(3, 2, 4, heads.record_row_width)
    assert _check_layout(state, record, torch.zeros(3, heads.flag_words, dtype=torch.int32),
                         1, HV, 32, V) == 4
    want = rf"\[slots, {heads.flag_words}\].*{grid_programs} programs"
    with pytest.raises(ValueError, match=want):
        _check_layout(state, record, torch.zeros(3, FLAG_WORDS, dtype=torch.int32), 1, HV, 32, V)
