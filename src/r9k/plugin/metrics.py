"""The plugin's page decision on the replica's own /metrics: `r9k_plugin_info{...} 1`.

vLLM serves /metrics from the API server process, while the pages are sized in the engine core
(another process). The decision is a pure function of the engine config (`r9k.plugin.policy.page_mode`),
so this stat-logger plugin (entry point `vllm.stat_logger_plugins` -> `r9k`), which vLLM builds in
the API server process with that config, computes it there and exports it as an info gauge, the
way vLLM exports `vllm:cache_config_info`.
"""
from __future__ import annotations

from prometheus_client import REGISTRY, Gauge
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from r9k.plugin.policy import page_mode
from r9k.core.vllm_metrics import PLUGIN_INFO_DOC, PLUGIN_INFO_METRIC


class PageModeInfoLogger(AggregateStatLoggerBase):
    """Exports the page decision once at construction; records nothing per step."""

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None) -> None:
        self.info = page_mode(vllm_config)
        labels = self.info.labels()
        _unregister(PLUGIN_INFO_METRIC)  # a second engine in one process (tests) re-exports
        gauge = Gauge(PLUGIN_INFO_METRIC, PLUGIN_INFO_DOC, labelnames=list(labels),
                      multiprocess_mode="mostrecent")
        gauge.labels(**labels).set(1)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        pass

    def log_engine_initialized(self) -> None:
        pass


def _unregister(name: str) -> None:
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) == name:
            REGISTRY.unregister(collector)
