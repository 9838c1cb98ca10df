"""Difference: when vLLM builds GDN metadata once per step and re-gathers only the other
kv-cache groups' state indices (`GDNAttentionMetadataBuilder.supports_update_block_table`).

vLLM grants it only to its own class (`type(self) is GDNAttentionMetadataBuilder`); the
one-page builder adds no per-group metadata and takes the same terms (`r9k.plugin.gdn_layer`)."""
from __future__ import annotations


def v032(vllm_config, device) -> bool:
    """0.32 and 0.33 (`gdn_attn.py:134` / `:185`): the V2 model runner on a CUDA-alike
    device."""
    return bool(vllm_config.use_v2_model_runner) and device.type == "cuda"


def v034(vllm_config, device) -> bool:
    """0.34 (`gdn_attn.py:202`): V2 is the only runner; CUDA-alike or XPU."""
    del vllm_config
    return device.type in ("cuda", "xpu")
