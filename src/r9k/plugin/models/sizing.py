"""The shared page-sizing code path for every one-page model class."""
from __future__ import annotations

from typing import Any

import torch

from r9k.core.capacity import HybridModelShape, gdn_page_layout
from r9k.core.page_layout import onepage_extra_dtypes
from r9k.plugin.policy import onepage_enabled


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_from_vllm(vllm_config: Any) -> HybridModelShape:
    hf = vllm_config.model_config.hf_text_config
    return HybridModelShape(
        name=vllm_config.model_config.architecture, num_gdn_layers=0, num_attention_layers=0,
        num_attention_heads=1, num_key_value_heads=1, head_dim=1,
        linear_num_key_heads=hf.linear_num_key_heads,
        linear_num_value_heads=hf.linear_num_value_heads,
        linear_key_head_dim=hf.linear_key_head_dim,
        linear_value_head_dim=hf.linear_value_head_dim,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
        dtype=_dtype_name(vllm_config.model_config.dtype),
    )


def record_shapes(vllm_config: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(record shape [2, S, W], flag shape [flag words]) from the capacity module's layout."""
    spec = vllm_config.speculative_config
    layout = gdn_page_layout(_shape_from_vllm(vllm_config),
                             vllm_config.parallel_config.tensor_parallel_size,
                             spec.num_speculative_tokens, onepage=True)
    return layout.record_shape, (layout.flag_words,)


def record_dtypes(vllm_config: Any) -> tuple[torch.dtype, torch.dtype]:
    """(record dtype, flag dtype) from the capacity module, as torch dtypes."""
    names = onepage_extra_dtypes(_dtype_name(vllm_config.model_config.dtype))
    return tuple(getattr(torch, name) for name in names)


def onepage_state_shapes(stock_shapes: tuple, vllm_config: Any) -> tuple:
    if not onepage_enabled(vllm_config):
        return stock_shapes
    return tuple(stock_shapes) + record_shapes(vllm_config)


def onepage_state_dtypes(stock_dtypes: tuple, vllm_config: Any) -> tuple:
    if not onepage_enabled(vllm_config):
        return stock_dtypes
    return tuple(stock_dtypes) + record_dtypes(vllm_config)


class _StockName:
    """A one-page model class answers to its vLLM class's name: vLLM picks behaviour by
    `type(model).__name__` (its MTP proposer maps the image token only for the multimodal
    classes it names, e.g. Qwen3_5ForConditionalGeneration; under another name the drafter's
    load failed). `__qualname__` stays the plugin's, so the class still pickles by reference."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        stock = next((b for b in cls.__mro__[1:] if b.__module__.startswith("vllm.")), None)
        if stock is not None:   # the mixins themselves have none
            cls.__name__ = stock.__name__


class OnePageSizing(_StockName):
    """Mixin for model classes that size GDN pages through get_mamba_state_{shape,dtype}."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return onepage_state_shapes(super().get_mamba_state_shape_from_config(vllm_config),
                                    vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return onepage_state_dtypes(super().get_mamba_state_dtype_from_config(vllm_config),
                                    vllm_config)


class OnePageGdnSizing(_StockName):
    """Mixin for Qwen4Exp, whose get_mamba_specs_from_config reads the GDN layout from
    get_gdn_mamba_state_{shape,dtype}_from_config (its PLE layer keeps its own spec)."""

    @classmethod
    def get_gdn_mamba_state_shape_from_config(cls, vllm_config):
        return onepage_state_shapes(super().get_gdn_mamba_state_shape_from_config(vllm_config),
                                    vllm_config)

    @classmethod
    def get_gdn_mamba_state_dtype_from_config(cls, vllm_config):
        return onepage_state_dtypes(super().get_gdn_mamba_state_dtype_from_config(vllm_config),
                                    vllm_config)
