"""One reader of a vLLM replica's /metrics text: vLLM's own series and the plugin's
`r9k_plugin_info` (exported by `r9k.plugin.metrics`). Used by the fleet's health and page proof,
the exporter and the tests, so they all read a replica the same way.

Pure: imports prometheus_client's parser only (no vLLM).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PLUGIN_INFO_METRIC = "r9k_plugin_info"
PLUGIN_INFO_DOC = ("r9k plugin page decision (value 1): page_mode onepage|stock, reason, cache_mode, "
                   "record_layout, vllm_version, num_spec, pool groups and GDN pages per request, "
                   "gdn_spec_decode (what runs the GDN spec-decode step)")
# The labels `r9k.plugin.policy.PageMode.labels()` writes; readers may rely on these.
PLUGIN_INFO_LABELS = ("page_mode", "reason", "cache_mode", "record_layout", "vllm_version",
                      "num_spec", "num_gdn_groups", "num_attention_groups", "gdn_pages_per_request",
                      "num_ple_groups", "ple_pages_per_request", "gdn_spec_decode")
STATE_DTYPES = ("float32", "bfloat16")
PAGE_MODES = ("stock", "onepage")


@dataclass
class VllmMetrics:
    """What the stack takes from one replica's /metrics; None where the replica did not say."""

    model_name: str | None = None
    running: float | None = None            # vllm:num_requests_running (sum over engines)
    waiting: float | None = None            # vllm:num_requests_waiting
    generation_tokens: float | None = None  # vllm:generation_tokens_total
    kv_usage_ratio: float | None = None     # vllm:kv_cache_usage_perc (the fullest engine)
    preemptions: float | None = None        # vllm:num_preemptions_total
    prefix_cache_queries: float | None = None  # vllm:prefix_cache_queries_total (tokens looked up)
    prefix_cache_hits: float | None = None     # vllm:prefix_cache_hits_total (tokens found)
    num_blocks: int | None = None           # vllm:cache_config_info num_gpu_blocks
    block_size: int | None = None           # vllm:cache_config_info block_size (tokens)
    ssm_state_dtype: str | None = None      # mamba_ssm_cache_dtype when set explicitly
    cache_mode: str | None = None           # mamba_cache_mode (none | align | all)
    plugin: dict[str, str] | None = None    # r9k_plugin_info labels; None: no plugin series
    invalid: list[str] = field(default_factory=list)  # series dropped: NaN, infinite, a sum past float

    @property
    def page_mode(self) -> str | None:
        mode = (self.plugin or {}).get("page_mode")
        return mode if mode in PAGE_MODES else None


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels.get(key, ""))
    except ValueError:
        return None  # vLLM writes 'None' before the engine has sized its pool


# vLLM's series summed over engines -> the field that holds the sum
_SUMMED = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:generation_tokens_total": "generation_tokens",
           "vllm:num_preemptions_total": "preemptions",
           "vllm:prefix_cache_queries_total": "prefix_cache_queries",
           "vllm:prefix_cache_hits_total": "prefix_cache_hits"}


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Sums over engines for request and token counts, the fullest engine for KV usage. A value
    that is not finite says nothing: a NaN or infinite sample, or a sum of finite ones past the
    largest float, leaves its field unknown and is named in ``invalid``.

    Raises ValueError on text that is not the Prometheus exposition format."""
    out = VllmMetrics()
    sums: dict[str, float] = {}
    overflowed: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if not math.isfinite(value):
                out.invalid.append(name)
                continue
            if out.model_name is None and labels.get("model_name"):
                out.model_name = labels["model_name"]
            if name in _SUMMED:
                total = sums.get(name, 0.0) + value
                if not math.isfinite(total) and name not in overflowed:
                    overflowed.add(name)
                    out.invalid.append(name)
                sums[name] = total
            elif name == "vllm:kv_cache_usage_perc":
                out.kv_usage_ratio = value if out.kv_usage_ratio is None else max(out.kv_usage_ratio, value)
            elif name == "vllm:cache_config_info" and out.num_blocks is None:
                out.num_blocks = _int_label(labels, "num_gpu_blocks")
                out.block_size = _int_label(labels, "block_size")
                dtype = labels.get("mamba_ssm_cache_dtype")
                out.ssm_state_dtype = dtype if dtype in STATE_DTYPES else None
                out.cache_mode = labels.get("mamba_cache_mode")
            elif name == PLUGIN_INFO_METRIC and out.plugin is None:
                out.plugin = dict(labels)
    for name, total in sums.items():
        if name not in overflowed:
            setattr(out, _SUMMED[name], total)
    return out
