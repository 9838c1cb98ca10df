"""The shipped fused kernel (`r9k.kernels.triton_fused`) compiles to the same PTX (sm_90) and
AMDGCN (gfx1201) as the research kernel it was cut from at the shipped settings
(`lab.fused_variants`), and the comparison sees a one-barrier difference. Offline
compiles, no GPU; the full grid: `lab/scripts/kernel_compare.py`
(lab/results/kernel_compare_shipped.json)."""
import pytest

pytest.importorskip("triton")


def _compare_module():
    from lab.scripts import kernel_compare

    return kernel_compare


@pytest.mark.parametrize("target", ["ptx-sm90", "amdgcn-gfx1201"])
@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_shipped_kernel_is_the_research_kernel_at_the_shipped_settings(target, state):
    kc = _compare_module()
    for row_map in (False, True):
        row = kc.compare(kc.SHAPES["flash-next-tp4"], state, 4, target, row_map)
        assert row["equal"], row
        assert row["lines"] > 1000, row  # code, not an emptied-out listing


def test_the_comparison_sees_one_barrier():
    from lab.kernel_static import fused_compiled, shipped_compiled

    kc = _compare_module()
    target, kind = kc.TARGETS["ptx-sm90"]
    heads = kc.SHAPES["flash-next-tp4"]
    shipped = shipped_compiled(heads, "fp32", 4, target)
    probe = fused_compiled(heads, "fp32", 4, dict(own_barrier=False), target)
    a = kc.normalized(shipped.asm[kind], shipped.metadata.name)
    b = kc.normalized(probe.asm[kind], probe.metadata.name)
    assert a != b
    assert sum("bar.sync" in x for x in a) == sum("bar.sync" in x for x in b) + 1
