from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from r9k.models.sizing import OnePageSizing


class OnePageQwen3NextForCausalLM(OnePageSizing, Qwen3NextForCausalLM):
    pass
