from importlib import import_module

from r9k import compat
from r9k.plugin.models.sizing import OnePageSizing

Qwen3NextForCausalLM = import_module(
    compat.current().model_modules["qwen3_next"]).Qwen3NextForCausalLM


class OnePageQwen3NextForCausalLM(OnePageSizing, Qwen3NextForCausalLM):
    pass
