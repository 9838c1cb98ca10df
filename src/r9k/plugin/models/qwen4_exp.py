"""Qwen4Exp ("Flash-Next"): platform-specific classes (imports qwen2_vl: needs torchvision)."""
from importlib import import_module

from r9k import compat
from r9k.plugin.models.sizing import OnePageGdnSizing

_stock = import_module(compat.current().model_modules["qwen4_exp"])
Qwen4ExpForCausalLM = _stock.Qwen4ExpForCausalLM
Qwen4ExpForConditionalGeneration = _stock.Qwen4ExpForConditionalGeneration


class OnePageQwen4ExpForCausalLM(OnePageGdnSizing, Qwen4ExpForCausalLM):
    pass


class OnePageQwen4ExpForConditionalGeneration(OnePageGdnSizing,
                                              Qwen4ExpForConditionalGeneration):
    """vLLM's class sizes pages through `Qwen4ExpForCausalLM.<method>` by name, which would skip
    the one-page sizing (stock pages in the pool, one-page pages in the layers): route the
    three sizing entry points through the one-page CausalLM class instead."""

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config):
        return OnePageQwen4ExpForCausalLM.get_mamba_specs_from_config(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return OnePageQwen4ExpForCausalLM.get_mamba_state_shape_from_config(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return OnePageQwen4ExpForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
