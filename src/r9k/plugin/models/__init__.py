"""Model classes that size the pool's GDN pages for one-page (record + flag words appended).

The platform's hybrid block-size alignment sizes pages from the *model class*
(`get_mamba_state_shape_from_config` / `_dtype_` or `get_mamba_specs_from_config`), so each
affected architecture gets a subclass registered lazily as a "module:Class" string: importing
the plugin imports none of them (Qwen3.5's module needs torchvision, absent on CPU machines).
"""
from __future__ import annotations

ARCHITECTURES: dict[str, str] = {
    "Qwen3NextForCausalLM": "r9k.plugin.models.qwen3_next:OnePageQwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "r9k.plugin.models.qwen3_5:OnePageQwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "r9k.plugin.models.qwen3_5:OnePageQwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration": "r9k.plugin.models.qwen3_5:OnePageQwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration":
        "r9k.plugin.models.qwen3_5:OnePageQwen3_5MoeForConditionalGeneration",
    "Qwen4ExpForCausalLM": "r9k.plugin.models.qwen4_exp:OnePageQwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration":
        "r9k.plugin.models.qwen4_exp:OnePageQwen4ExpForConditionalGeneration",
}


def register_models() -> None:
    from vllm import ModelRegistry

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
