"""Qwen3.5 dense and MoE, text-only and multimodal (imports qwen3_vl: needs torchvision)."""
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration)

from r9k.models.sizing import OnePageSizing


class OnePageQwen3_5ForCausalLM(OnePageSizing, Qwen3_5ForCausalLM):
    pass


class OnePageQwen3_5MoeForCausalLM(OnePageSizing, Qwen3_5MoeForCausalLM):
    pass


class OnePageQwen3_5ForConditionalGeneration(OnePageSizing, Qwen3_5ForConditionalGeneration):
    pass


class OnePageQwen3_5MoeForConditionalGeneration(OnePageSizing,
                                                Qwen3_5MoeForConditionalGeneration):
    pass
