"""Difference: the module vLLM's model registry takes each architecture's stock class from.
The one-page model classes (`r9k.plugin.models`) subclass exactly that class, so registering them
keeps whatever implementation the release picks, and only adds the page sizing.

0.34 moved Qwen3.5 to `vllm.models.qwen3_5`, which picks a new NVIDIA implementation on CUDA
and re-exports the old one elsewhere; subclassing the old module there would swap NVIDIA's
model back out. Qwen3-Next and Qwen4Exp did not move."""
from __future__ import annotations

MODULES_032 = {
    "qwen3_next": "vllm.model_executor.models.qwen3_next",
    "qwen3_5": "vllm.model_executor.models.qwen3_5",
    "qwen4_exp": "vllm.models.qwen4_exp",
}
MODULES_034 = dict(MODULES_032, qwen3_5="vllm.models.qwen3_5")
