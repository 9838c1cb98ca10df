"""Touch point: the GDN layer's per-layer decode switches.

Changes: on a one-page layer, sets `gdn_decode_kernel` to a value no vLLM path is keyed on
(vLLM takes NVIDIA's fused MTP decode for "cuda"), `enable_fused_gdn_spec_decode` and
`enable_packed_recurrent_decode` to False; the stock choice is kept as
`stock_gdn_decode_kernel` for `r9k_plugin_info`.
Why no extension route: vLLM chooses decode paths per layer from the environment in the
layer's constructor; one-page layers must not take paths that bypass the record, while other
layers keep theirs.
Contract: test_the_decode_switches_the_layer_turns_off_are_the_releases.
"""
from __future__ import annotations

ONEPAGE_KERNEL = "r9k-onepage"
# attribute: the value a one-page layer takes
SWITCHES = {
    "gdn_decode_kernel": ONEPAGE_KERNEL,
    "enable_fused_gdn_spec_decode": False,
    "enable_packed_recurrent_decode": False,
}


def turn_off(layer) -> None:
    """After vLLM's constructor: the layer takes none of the record-bypassing decodes."""
    layer.stock_gdn_decode_kernel = layer.gdn_decode_kernel
    for name, value in SWITCHES.items():
        setattr(layer, name, value)
