"""When a GDN layer gets a one-page page, and why not otherwise: one decision, used by the model
classes (which size the pool's pages) and the layer (which owns the page), so they never
disagree about the page size."""
from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm.r9k")

GDN_STATE_ENV = "R9K_GDN_STATE"
GDN_STATE_MODES = ("onepage", "stock")
SUPPORTED_VLLM_SERIES = "0.32."
# Architectures whose page sizing r9k.models registers (see r9k.models.ARCHITECTURES).
ONEPAGE_ARCHITECTURES = frozenset({
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration",
})
# The one-page kernels tile the value dim by 32 (the stock Triton kernel's BV) and keep the
# whole key dim in one block.
VALUE_TILE = 32
MAX_HEAD_K_DIM = 256

_said: set[str] = set()


def gdn_state_mode() -> str:
    """The requested page mode; raises ValueError naming the allowed values on a bad setting."""
    raw = os.environ.get(GDN_STATE_ENV, "onepage")
    value = raw.strip().lower()
    if value not in GDN_STATE_MODES:
        raise ValueError(f"{GDN_STATE_ENV}={raw!r} is not a GDN state mode; expected one of "
                         f"{', '.join(GDN_STATE_MODES)}")
    return value


def vllm_version_reason() -> str | None:
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM_SERIES):
        return (f"vLLM {vllm.__version__} is not {SUPPORTED_VLLM_SERIES}x, the series whose "
                "internals the plugin subclasses")
    return None


def unservable_shape_reason(hf_text_config: Any, tp_size: int) -> str | None:
    dk = int(hf_text_config.linear_key_head_dim)
    dv = int(hf_text_config.linear_value_head_dim)
    if dv % VALUE_TILE:
        return (f"GDN value head dim {dv} is not a multiple of {VALUE_TILE} "
                "(the one-page kernels tile V like the stock kernel)")
    if dk > MAX_HEAD_K_DIM:
        return f"GDN key head dim {dk} exceeds {MAX_HEAD_K_DIM} (one key block per head)"
    hk, hv = int(hf_text_config.linear_num_key_heads), int(hf_text_config.linear_num_value_heads)
    if hk % tp_size or hv % tp_size:
        return f"GDN heads {hk}/{hv} do not split over TP {tp_size}"
    return None


def onepage_reason(vllm_config: Any) -> str | None:
    """None when one-page pages apply to this engine's GDN layers, else why not (one line)."""
    if gdn_state_mode() == "stock":
        return f"{GDN_STATE_ENV}=stock"
    reason = vllm_version_reason()
    if reason:
        return reason
    spec = vllm_config.speculative_config
    if spec is None or not spec.num_speculative_tokens:
        return "speculative decoding is off (one page is all stock keeps then)"
    mode = vllm_config.cache_config.mamba_cache_mode
    if mode != "none":
        return (f"prefix caching is on (mamba_cache_mode={mode!r}), which copies per-slot "
                "states; pass --no-enable-prefix-caching for one-page pages")
    arch = vllm_config.model_config.architecture
    if arch not in ONEPAGE_ARCHITECTURES:
        return f"architecture {arch} has no one-page page sizing registered"
    return unservable_shape_reason(vllm_config.model_config.hf_text_config,
                                   vllm_config.parallel_config.tensor_parallel_size)


def onepage_enabled(vllm_config: Any) -> bool:
    """The decision, with one log line per engine process saying which pages and why."""
    reason = onepage_reason(vllm_config)
    key = reason or "onepage"
    if key not in _said:
        _said.add(key)
        if reason is None:
            k = vllm_config.speculative_config.num_speculative_tokens
            logger.info("r9k: one-page GDN state pages (1 page per request instead of 1 + %d)", k)
        else:
            logger.warning("r9k: stock GDN state pages: %s", reason)
    return reason is None
