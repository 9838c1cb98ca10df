"""Qwen4Exp ("Flash-Next"): platform-specific classes (imports qwen2_vl: needs torchvision)."""
from vllm.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

from r9k.models.sizing import OnePageGdnSizing


class OnePageQwen4ExpForCausalLM(OnePageGdnSizing, Qwen4ExpForCausalLM):
    pass


class OnePageQwen4ExpForConditionalGeneration(OnePageGdnSizing,
                                              Qwen4ExpForConditionalGeneration):
    pass
