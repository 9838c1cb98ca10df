"""Qwen3.5 dense and MoE, text-only and multimodal (imports qwen3_vl: needs torchvision)."""
from importlib import import_module

from r9k import compat
from r9k.plugin.models.sizing import OnePageSizing

# the module vLLM's registry takes Qwen3.5 from in this release (0.34: platform-selected)
_stock = import_module(compat.current().model_modules["qwen3_5"])
Qwen3_5ForCausalLM = _stock.Qwen3_5ForCausalLM
Qwen3_5MoeForCausalLM = _stock.Qwen3_5MoeForCausalLM
Qwen3_5ForConditionalGeneration = _stock.Qwen3_5ForConditionalGeneration
Qwen3_5MoeForConditionalGeneration = _stock.Qwen3_5MoeForConditionalGeneration


class OnePageQwen3_5ForCausalLM(OnePageSizing, Qwen3_5ForCausalLM):
    pass


class OnePageQwen3_5MoeForCausalLM(OnePageSizing, Qwen3_5MoeForCausalLM):
    pass


class OnePageQwen3_5ForConditionalGeneration(OnePageSizing, Qwen3_5ForConditionalGeneration):
    pass


class OnePageQwen3_5MoeForConditionalGeneration(OnePageSizing,
                                                Qwen3_5MoeForConditionalGeneration):
    pass
