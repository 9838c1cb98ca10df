"""The exporter: one registry of collect-on-scrape collectors, served over HTTP.

``build_collector(...)`` gives the composite collector (the card sources `gpu`, `ops_power`,
`ops_state`, optionally the MES event logs, replicas, scrape errors last so a scrape's own failures show in that scrape); ``serve(...)`` serves
it over HTTP(S) (:mod:`~r9k.monitoring.web_config`).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Iterator, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from r9k.monitoring import web_config
from r9k.monitoring.cards import CARD_COLLECTORS
from r9k.monitoring.energy import EnergyCollector
from r9k.monitoring.mes_log import MesLogCollector
from r9k.monitoring.replicas import DEFAULT_BUDGET_S, DEFAULT_TIMEOUT_S, ReplicaCollector, ReplicaDescription
from r9k.monitoring.scrape_errors import ScrapeErrors
from r9k.ops.config import DEFAULT_CONFIG_PATH
from r9k.ops.energy import EnergyMeter
from r9k.ops.state import DEFAULT_STATE_DIR

logger = logging.getLogger(__name__)


class _Collector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


class R9kCollector:
    def __init__(self, parts: dict[str, _Collector], errors: ScrapeErrors) -> None:
        self.parts = parts
        self.errors = errors

    def collect(self) -> Iterator[Metric]:
        """node_exporter's way: each collector's metrics, its duration and whether it succeeded;
        one that raises is left out of this scrape and marked 0, the others are served."""
        duration = GaugeMetricFamily("r9k_exporter_collect_seconds", "Time spent collecting, by collector.",
                                     labels=["collector"])
        success = GaugeMetricFamily("r9k_exporter_collect_success",
                                    "1 when the collector ran to the end this scrape, else 0.",
                                    labels=["collector"])
        for name, part in self.parts.items():
            started = time.monotonic()
            try:
                metrics = list(part.collect())
            except Exception:  # noqa: BLE001  (isolated: the scrape goes on without it)
                logger.exception("collector %s failed; its metrics are left out of this scrape", name)
                metrics, ok = [], 0.0
            else:
                ok = 1.0
            yield from metrics
            duration.add_metric([name], time.monotonic() - started)
            success.add_metric([name], ok)
        yield duration
        yield success
        yield from self.errors.collect()


def build_collector(host_root: str | os.PathLike = "/", state_dir: str | os.PathLike | None = DEFAULT_STATE_DIR,
                    config_path: str | os.PathLike = DEFAULT_CONFIG_PATH,
                    replicas: list[ReplicaDescription] | None = None, fleet_url: str | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, replica_budget_s: float = DEFAULT_BUDGET_S,
                    cards: bool = True, debugfs: str | os.PathLike | None = None,
                    energy_sample_hz: float = 0.0, host_name: str | None = None) -> R9kCollector:
    """``cards=False``: replicas only (the fleet's own exporter; each host's exporter has the cards).
    ``debugfs``: debugfs mount point under ``host_root`` for the MES event-log collector (off when None).
    ``energy_sample_hz`` > 0: each card's power sampled that often and integrated (a thread,
    started here), exported as r9k_gpu_energy_joules_total{host,bdf} (``host_name``, default
    the hostname: the fleet's name for this host)."""
    errors = ScrapeErrors()
    parts: dict[str, _Collector] = {}
    if cards:
        for name, collector in CARD_COLLECTORS.items():
            parts[name] = collector(errors, host_root, state_dir, config_path)
        if debugfs is not None:
            parts["mes_log"] = MesLogCollector(errors, host_root, debugfs)
        if energy_sample_hz > 0:
            meter = EnergyMeter(str(host_root), sample_hz=energy_sample_hz, host=host_name).start()
            parts["energy"] = EnergyCollector(meter)
    parts["replicas"] = ReplicaCollector(errors, replicas, fleet_url, timeout_s, replica_budget_s)
    return R9kCollector(parts, errors)


def build_registry(collector: R9kCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def serve(registry: CollectorRegistry, port: int, listen: str = "127.0.0.1", web=None):
    """Start the HTTP(S) server in a daemon thread; returns (server, thread). Port 0 picks a free one;
    ``web``: :func:`r9k.monitoring.web_config.load_web_config`'s result (TLS, basic auth)."""
    return web_config.serve(registry, port, listen, web)
