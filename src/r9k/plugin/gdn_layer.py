"""The one-page GDN layer: vLLM's QwenGatedDeltaNetAttention with one state page per request.

Registered with `register_oot`, so Qwen3-Next, Qwen3.5 and Qwen4Exp build it wherever they
build the stock layer. A layer decides once, at construction, whether its engine gets one-page
pages (`r9k.plugin.policy`); when not, it is the stock layer, unchanged.

What one-page changes in the layer:
- the page: stock conv window + SSM state, plus the record and flag words (shapes from the
  capacity module), and `num_speculative_blocks = 0` in its KV spec;
- the metadata builder: one-column state indices (no silent broadcast into k+1 columns),
  metadata shared across groups on V2 as vLLM's own builder does;
- every decode path: the spec verify step replays/verifies/records; prefills clear the flag;
  draft-less decodes and non-spec decodes replay a live record first; NVIDIA's compiled MTP
  kernel, the packed non-spec decode and ROCm's AITER path are switched off for the layer.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention)
from vllm.platforms import current_platform
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend, GDNAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import MambaSpec

from r9k.compat import decode_switches, forward_method, oot_registry
from r9k.core.page_layout import PAGE_FLAG, PAGE_RECORD
from r9k.kernels.onepage import GdnHeads
from r9k.plugin.models.sizing import record_dtypes, record_shapes
from r9k.plugin import runtime
from r9k.plugin.policy import onepage_enabled

logger = logging.getLogger("vllm.r9k")


class OnePageGDNMetadataBuilder(GDNAttentionMetadataBuilder):
    """The stock builder with one-column persistent state-index buffers.

    Stays a subclass: the model runner passes accepted counts only to instances of
    GDNAttentionMetadataBuilder. With one page the block table has one column, and the stock
    [max_bs, k+1] buffer would silently broadcast [n, 1] into every column.
    """

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from r9k import compat
        from r9k.compat import metadata_sharing

        metadata_sharing.one_column_spec_indices(self, device)
        # without sharing every one-page group rebuilt the whole metadata each step
        if compat.current().shares_gdn_metadata(vllm_config, device):
            metadata_sharing.share(self)
            if runtime.current().once("metadata-shared"):
                logger.info("r9k one-page GDN metadata: built once per step and shared by the "
                            "one-page groups (update_block_table)")
        runtime.current().track_group(layer_names)  # prefix caching's copies find layers by group


class OnePageGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "GDN_ATTN"

    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return OnePageGDNMetadataBuilder


class OnePageGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    def __init__(self, config, vllm_config, prefix: str = "", gqa_interleaved_layout=False,
                 reduce_results: bool = True, **release_kwargs) -> None:
        from r9k import compat

        adapter = compat.current()
        unknown = sorted(set(release_kwargs) - set(adapter.layer_kwargs))
        if unknown:  # as vLLM's own constructor would: a keyword this release does not take
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments "
                            f"{unknown} (vLLM {adapter.series} takes {adapter.layer_kwargs})")
        self.onepage = onepage_enabled(vllm_config)
        self._vllm_config = vllm_config
        super().__init__(config, vllm_config, prefix, gqa_interleaved_layout, reduce_results,
                         **release_kwargs)
        if not self.onepage:
            return
        adapter.no_prefill_checkpoints(self)
        self.num_candidates = 1 + self.num_spec  # S, from the configuration, never an index width
        self.onepage_heads = GdnHeads(self.num_k_heads // self.tp_size,
                                      self.num_v_heads // self.tp_size,
                                      self.head_k_dim, self.head_v_dim)
        # Decode paths that would bypass the record: off for one-page layers. Where vLLM chose
        # NVIDIA's fused MTP decode ("cuda"), one-page's own step runs instead
        # (r9k_plugin_info's gdn_spec_decode says so).
        decode_switches.turn_off(self)
        runtime.current().track_layer(self)  # prefix caching's copies replay its record
        if current_platform.is_cpu():
            from r9k.plugin import gdn_cpu

            gdn_cpu.register_op()  # at construction: torch.compile must not trace a registration
            self._onepage_forward_cpu = gdn_cpu.onepage_forward_cpu
            forward_method.choose(self, self.forward_cpu_onepage)
        elif current_platform.is_cuda_alike():
            from r9k.plugin import gdn_gpu

            # forward_hip would take AITER's GDN kernels; forward_cuda reaches _forward_core
            forward_method.choose(self, forward_method.gpu_forward(self))
            self.routed_forward_core = gdn_gpu.bind_routed_forward_core(self)
        else:
            raise RuntimeError(f"r9k one-page GDN has no path for platform "
                               f"{current_platform.device_name}; set R9K_GDN_STATE=stock")

    # --- the page ---------------------------------------------------------------------------
    # get_state_shape/get_state_dtype keep vLLM's meaning (conv, SSM): its GDN layer unpacks
    # two of each (the fused-decode check at construction, the prefill warm-up). The page's
    # states, record and flag added, are what the spec sizes and bind_kv_cache views.
    def page_state_shapes(self) -> tuple:
        return tuple(self.get_state_shape()) + record_shapes(self._vllm_config)

    def page_state_dtypes(self) -> tuple:
        return tuple(self.get_state_dtype()) + record_dtypes(self._vllm_config)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if not self.onepage:
            return super().bind_kv_cache(kv_cache)
        self.kv_cache = page_state_views(kv_cache, self.page_state_shapes(),
                                         self.page_state_dtypes())

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if not self.onepage or not isinstance(spec, MambaSpec):
            return spec
        # every other field as stock built it; the page gains the record, the extra
        # per-candidate pages go
        return dataclasses.replace(spec, shapes=self.page_state_shapes(),
                                   dtypes=self.page_state_dtypes(), num_speculative_blocks=0)

    def get_attn_backend(self):
        return OnePageGDNAttentionBackend if self.onepage else super().get_attn_backend()

    @property
    def onepage_record(self) -> torch.Tensor:
        """The page's record view [slots, 2, S, W] (bound by vLLM with the state tensors)."""
        return self.kv_cache[PAGE_RECORD]

    @property
    def onepage_flag(self) -> torch.Tensor:
        """The page's flag words [slots, head + a pair per kernel program]."""
        return self.kv_cache[PAGE_FLAG]

    # --- decode paths -------------------------------------------------------------------------
    def forward_cpu_onepage(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._onepage_forward_cpu(self, hidden_states)

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if not self.onepage:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        from r9k.plugin.gdn_gpu import onepage_forward_core

        return onepage_forward_core(self, mixed_qkv, b, a, core_attn_out)


def page_state_views(pages: torch.Tensor, shapes, dtypes) -> tuple[torch.Tensor, ...]:
    """Per-state views of a raw [blocks, 1, 1, bytes] int8 page tensor, states packed in order,
    as vLLM's MambaBase.bind_kv_cache slices them."""
    raw = pages.squeeze(dim=(1, 2))
    views, offset = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(raw[:, offset:offset + nbytes].view(dtype).view(-1, *shape))
        offset += nbytes
    return tuple(views)


def register_layer() -> None:
    done = runtime.current().registered
    if "layer" in done:
        return
    name = QwenGatedDeltaNetAttention.__name__
    taken = oot_registry.replaced_by(name)
    if taken is not None:  # another plugin took it: do not fight over the layer
        logger.warning("r9k: %s is already replaced by %s; keeping stock GDN pages", name,
                       taken.__qualname__)
        return
    QwenGatedDeltaNetAttention.register_oot(OnePageGatedDeltaNetAttention)
    done.add("layer")
