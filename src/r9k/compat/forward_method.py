"""Touch point: the forward a GDN layer runs, `CustomOp._forward_method`.

Changes: sets the one-page layer's private `_forward_method` after vLLM's constructor: the
one-page CPU forward on CPUs, `forward_cuda` on CUDA and ROCm (so ROCm skips `forward_hip`'s
AITER GDN kernels, which bypass the record).
Why no extension route: `CustomOp` picks the forward per platform once, in its constructor;
`register_oot` replaces the class, not that choice.
Contract: test_forward_runs_the_method_the_layer_sets_after_vllms_constructor.
"""
from __future__ import annotations

ATTRIBUTE = "_forward_method"
GPU_FORWARD = "forward_cuda"  # the release's method one-page runs on CUDA and ROCm


def choose(layer, method) -> None:
    """`layer.forward(...)` runs `method` from now on (call after vLLM's constructor)."""
    setattr(layer, ATTRIBUTE, method)


def gpu_forward(layer):
    return getattr(layer, GPU_FORWARD)
