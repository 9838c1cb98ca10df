"""`r9k_scrape_errors_total{source}`: read failures the exporter counted instead of failing a scrape."""
from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client.core import CounterMetricFamily

# Every source is exported from the first scrape (at 0), so increase() sees the first failure.
SOURCES: tuple[str, ...] = (
    "sysfs",         # a card file unreadable or missing (EPERM during reset, no hwmon yet, ...)
    "ops_config",    # the ops config missing or refused: no wanted cap/offset to compare
    "ops_state",     # the ops state directory missing, or a card state file unreadable
    "replica",       # a replica's /metrics or /v1/models unreachable or unparsable
    "model_config",  # a replica's model config.json unreadable, or the capacity module refused it
    "fleet",         # the fleet status URL unreachable or not the documented JSON
    "debugfs",       # --debugfs: dri/ not listable (root-only), or a card's MES event log unreadable or malformed
)


class ScrapeErrors:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {s: 0 for s in SOURCES}

    def count(self, source: str, n: int = 1) -> None:
        if source not in self._counts:
            raise ValueError(f"scrape error source {source!r}: expected one of {', '.join(SOURCES)}")
        with self._lock:
            self._counts[source] += n

    def value(self, source: str) -> int:
        with self._lock:
            return self._counts[source]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "r9k_scrape_errors", "Read failures counted by the exporter instead of failing the scrape.",
            labels=["source"])
        with self._lock:
            for source, n in self._counts.items():
                family.add_metric([source], n)
        yield family
