"""Qwen3.5 dense and MoE, text-only and multimodal (imports qwen3_vl: needs torchvision)."""
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration)

from r9k.models.sizing import onepage_state_dtypes, onepage_state_shapes


class _OnePageSizing:
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return onepage_state_shapes(super().get_mamba_state_shape_from_config(vllm_config),
                                    vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return onepage_state_dtypes(super().get_mamba_state_dtype_from_config(vllm_config),
                                    vllm_config)


class OnePageQwen3_5ForCausalLM(_OnePageSizing, Qwen3_5ForCausalLM):
    pass


class OnePageQwen3_5MoeForCausalLM(_OnePageSizing, Qwen3_5MoeForCausalLM):
    pass


class OnePageQwen3_5ForConditionalGeneration(_OnePageSizing, Qwen3_5ForConditionalGeneration):
    pass


class OnePageQwen3_5MoeForConditionalGeneration(_OnePageSizing,
                                                Qwen3_5MoeForConditionalGeneration):
    pass
