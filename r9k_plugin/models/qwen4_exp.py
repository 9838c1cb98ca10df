"""Qwen4Exp ("Flash-Next"): its platform-specific classes size GDN pages through
get_gdn_mamba_state_{shape,dtype}_from_config, read by get_mamba_specs_from_config."""
from vllm.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

from r9k.models.sizing import onepage_state_dtypes, onepage_state_shapes


class _OnePageGdnSizing:
    @classmethod
    def get_gdn_mamba_state_shape_from_config(cls, vllm_config):
        return onepage_state_shapes(super().get_gdn_mamba_state_shape_from_config(vllm_config),
                                    vllm_config)

    @classmethod
    def get_gdn_mamba_state_dtype_from_config(cls, vllm_config):
        return onepage_state_dtypes(super().get_gdn_mamba_state_dtype_from_config(vllm_config),
                                    vllm_config)


class OnePageQwen4ExpForCausalLM(_OnePageGdnSizing, Qwen4ExpForCausalLM):
    pass


class OnePageQwen4ExpForConditionalGeneration(_OnePageGdnSizing,
                                              Qwen4ExpForConditionalGeneration):
    pass
