from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from r9k.models.sizing import onepage_state_dtypes, onepage_state_shapes


class OnePageQwen3NextForCausalLM(Qwen3NextForCausalLM):
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return onepage_state_shapes(super().get_mamba_state_shape_from_config(vllm_config),
                                    vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return onepage_state_dtypes(super().get_mamba_state_dtype_from_config(vllm_config),
                                    vllm_config)
