"""Touch point: a GDN layer's `rearrange_mixed_qkv`, replaced per layer.

Changes: binds a replacement over the layer's own bound method (`layer.rearrange_mixed_qkv =
partial(replacement, layer, stock)`), so the in-place spec step reads q, k, v as column views
of the spec conv's output; every other call goes to stock's.
Why no extension route: `_forward_core` calls `self.rearrange_mixed_qkv` between the conv and
the recurrence and offers no hook there.
Contract: test_the_spec_rows_the_in_place_step_reads_are_the_spec_conv_output.
"""
from __future__ import annotations

import functools

METHOD = "rearrange_mixed_qkv"


def replace(layer, replacement) -> None:
    """`layer.rearrange_mixed_qkv(x)` runs `replacement(layer, stock_bound_method, x)`."""
    setattr(layer, METHOD, functools.partial(replacement, layer, getattr(layer, METHOD)))
