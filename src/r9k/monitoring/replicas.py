"""Per-replica collector: vLLM's /metrics plus the capacity module's pinned split and capacity.

A replica is described by :class:`r9k.core.fleet_status.ReplicaDescription` (the typed interface the
fleet serves at its status URL as :class:`r9k.core.fleet_status.FleetStatus`, the model the controller
builds, or given as ``--replica URL[,key=value...]``). The page
layout used for the pinned split comes, in order, from the replica's own ``r9k_plugin_info``
gauge (labels ``r9k.core.vllm_metrics.PLUGIN_INFO_LABELS``), else from the capacity module applied to the model's
config.json (description, else the ``root`` that vLLM's ``/v1/models`` reports when it is a local
directory). Labels: ``replica`` and ``model``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import ValidationError

from r9k.core import capacity
from r9k.core.config_errors import read_config_bytes, validation_message
from r9k.core.fleet_status import HUNG, FleetStatus, ReplicaDescription, ReplicaStatus  # the typed interface
from r9k.core.http_client import HttpDeadline, HttpUnreachable, http_get
from r9k.core.vllm_metrics import PAGE_MODES, VllmMetrics, parse_vllm_metrics
from r9k.monitoring.scrape_errors import ScrapeErrors

REPLICA_STATES = ("loading", "ready", "draining", "unhealthy")
PINNED_KINDS = ("gdn", "attention", "ple")  # ple: Qwen4Exp's short-conv pages (0 elsewhere)
DEFAULT_TIMEOUT_S = 2.0
# The whole replica phase (fleet status and every replica) ends by this deadline, so hung replicas
# cannot push a scrape past Prometheus' 10 s scrape_timeout and take the card metrics with them.
DEFAULT_BUDGET_S = 5.0
MAX_PARALLEL_READS = 64  # replicas are read all at once up to this many; the rest queue
MAX_BODY_BYTES = 16 << 20  # vLLM's /metrics is some 100 KB; far more is not a replica's answer


def _series(plugin: dict | None) -> str:
    """The release series a replica's plugin reports (its block alignment); the planner's
    default when it reports none or one the planner does not know."""
    return capacity.known_series((plugin or {}).get("vllm_version")) or capacity.VLLM_SERIES


class ReplicaSpecError(ValueError):
    """A --replica value that cannot be used; the message says what was expected."""


_SPEC_KEYS = {"name", "model", "model_config", "tp", "num_spec", "page_mode", "platform",
              "max_model_len", "metrics_path", "cards", "host"}


def parse_replica_spec(spec: str) -> ReplicaDescription:
    """``URL[,key=value...]``, keys: name, model, model_config, tp, num_spec, page_mode, platform,
    max_model_len, metrics_path, cards (PCI addresses joined by ``|``), host. ReplicaSpecError,
    naming what was wrong, for anything that is not such a spec."""
    url, *pairs = [p.strip() for p in spec.split(",")]
    data: dict[str, Any] = {"url": url}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in _SPEC_KEYS:
            raise ReplicaSpecError(
                f"--replica {spec!r}: {pair!r} is not key=value with a key among "
                f"{', '.join(sorted(_SPEC_KEYS))}")
        if key in data:
            raise ReplicaSpecError(f"--replica {spec!r}: {key} given twice; expected each key once")
        data[key] = [c for c in value.split("|") if c] if key == "cards" else value
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises for a port that is not a number in 0-65535)
    except ValueError as exc:  # e.g. 'http://[::1' (an unclosed IPv6 bracket), 'http://h:99999'
        raise ReplicaSpecError(f"--replica {spec!r}: URL {url!r} cannot be parsed ({exc}); "
                               "expected http(s)://host:port") from None
    if parts.scheme in ("http", "https") and not parts.hostname:
        raise ReplicaSpecError(f"--replica {spec!r}: URL {url!r} has no host; expected http(s)://host:port")
    data.setdefault("name", parts.netloc or url)
    try:
        return ReplicaDescription.model_validate(data)
    except ValidationError as exc:
        raise ReplicaSpecError(validation_message(exc, f"--replica {spec!r}", limit=1)) from None


def _drop_out_of_range(metrics: VllmMetrics) -> bool:
    """Set to None what no replica can report (a usage ratio outside 0-1, a negative count);
    True when something was."""
    bad = False
    if metrics.kv_usage_ratio is not None and not 0.0 <= metrics.kv_usage_ratio <= 1.0:
        metrics.kv_usage_ratio, bad = None, True
    for name in ("running", "waiting", "generation_tokens", "preemptions"):
        if (getattr(metrics, name) or 0.0) < 0:
            setattr(metrics, name, None)
            bad = True
    return bad


def get_by(url: str, deadline: float, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body of a 200 answer to GET ``url``, read whole by ``deadline`` (time.monotonic()):
    the stack's HTTP client bounds connecting, sending and every byte by one deadline, so a
    replica that trickles its /metrics cannot hold the read or its thread. HttpUnreachable (an
    OSError) for no answer, a late or oversized one, or a status other than 200."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise HttpDeadline(url)
        body = http_get(url, timeout_s=left, max_bytes=max_bytes + 1)
    except HttpDeadline:
        raise HttpUnreachable(f"{url}: no complete answer by the deadline") from None
    if len(body) > max_bytes:
        raise HttpUnreachable(f"{url}: answer over {max_bytes} bytes")
    return body


@dataclass
class Layout:
    page_mode: str
    num_gdn_groups: int
    num_attention_groups: int
    gdn_pages_per_request: int
    source: str  # "plugin" or "capacity"
    num_ple_groups: int = 0          # Qwen4Exp's PLE groups keep stock pages in both modes
    ple_pages_per_request: int = 0


@dataclass
class ReplicaReading:
    desc: ReplicaDescription
    up: bool
    model: str
    metrics: VllmMetrics = field(default_factory=VllmMetrics)
    page_mode: str = "stock"
    layout: Layout | None = None
    pinned: dict[str, float] | None = None
    capacity_tokens: dict[str, int] | None = None
    whole_requests: dict[str, int] | None = None   # per page mode, from the same live plan


class ReplicaCollector:
    """Scrapes every replica (in parallel, with a timeout) each time Prometheus scrapes us."""

    def __init__(self, errors: ScrapeErrors, replicas: list[ReplicaDescription] | None = None,
                 fleet_url: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.errors = errors
        self.static = list(replicas or [])
        self.fleet_url = fleet_url
        self.timeout_s = timeout_s
        self.budget_s = budget_s
        self._lock = threading.Lock()
        self._tally = threading.local()  # per read thread: failures not yet counted
        self._last_fleet: list[ReplicaDescription] = []
        self._models: dict[str, dict[str, Any]] = {}   # url -> /v1/models entry (stable per engine)
        self._shapes: dict[str, capacity.HybridModelShape] = {}
        self._last_model: dict[str, str] = {}         # replica -> model label, kept while it is down

    def descriptions(self, timeout_s: float | None = None) -> list[ReplicaDescription]:
        by_name = {d.name: d for d in self.static}
        if self.fleet_url:
            try:
                status = FleetStatus.model_validate(json.loads(
                    get_by(self.fleet_url, time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))))
                fleet = status.replicas
                with self._lock:
                    self._last_fleet = fleet
            except (OSError, ValueError):  # unreachable, not JSON, or not the documented shape
                self.errors.count("fleet")
                with self._lock:  # keep scraping what we knew; its state is unknown now
                    fleet = [d.model_copy(update={"state": None}) for d in self._last_fleet]
            by_name.update({d.name: d for d in fleet})
        return list(by_name.values())

    def collect(self) -> Iterator[Metric]:
        deadline = time.monotonic() + self.budget_s
        descs = self.descriptions(min(self.timeout_s, self.budget_s / 2))  # half left for replicas
        readings: list[ReplicaReading] = []
        if descs:
            # No `with`: every read ends by the deadline (get_by), so none outlives the scrape
            # by more than a moment, and a DNS lookup that hangs must not hold the scrape.
            pool = ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_READS, len(descs)),
                                      thread_name_prefix="r9k-replica")
            futures = [pool.submit(self._read_tallied, d, deadline) for d in descs]
            wait(futures, timeout=max(0.0, deadline - time.monotonic()))
            pool.shutdown(wait=False, cancel_futures=True)
            for desc, future in zip(descs, futures):
                if future.done() and not future.cancelled():
                    reading, tally = future.result()
                    for source in tally:
                        self.errors.count(source)
                    readings.append(reading)
                else:  # past the phase deadline: unanswered this scrape
                    readings.append(self._down(desc))
        yield from self._families(readings)

    def _read_tallied(self, desc: ReplicaDescription, deadline: float) -> tuple[ReplicaReading, list[str]]:
        """A read whose failures count only if it ends within the phase deadline (a late read
        was already counted as down); its every request ends by that deadline too, so no read
        thread outlives the scrape."""
        self._tally.sources = []
        self._tally.deadline = deadline
        try:
            return self.read_replica(desc), self._tally.sources
        finally:
            self._tally.sources = self._tally.deadline = None

    def _get(self, url: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        phase = getattr(self._tally, "deadline", None)
        return get_by(url, deadline if phase is None else min(deadline, phase))

    def _count(self, source: str) -> None:
        sources = getattr(self._tally, "sources", None)
        if sources is None:
            self.errors.count(source)
        else:
            sources.append(source)

    def _down(self, desc: ReplicaDescription) -> ReplicaReading:
        self._count("replica")
        with self._lock:
            model = desc.model or self._last_model.get(desc.name, "")
        return ReplicaReading(desc, False, model, page_mode=desc.page_mode or "stock")

    # -- one replica -----------------------------------------------------------------------------

    def read_replica(self, desc: ReplicaDescription) -> ReplicaReading:
        try:
            text = self._get(desc.url + desc.metrics_path).decode("utf-8", "replace")
            metrics = parse_vllm_metrics(text)  # drops NaN and infinite samples, names them in .invalid
        except (OSError, ValueError):
            return self._down(desc)
        if any(name.startswith("vllm:") for name in metrics.invalid) | _drop_out_of_range(metrics):
            self._count("replica")  # up, but a value it reported is not one: left out, counted
        model = desc.model or metrics.model_name or ""
        with self._lock:
            self._last_model[desc.name] = model
        reading = ReplicaReading(desc, True, model, metrics)
        reading.page_mode = metrics.page_mode or desc.page_mode or "stock"
        reading.layout = self._plugin_layout(metrics.plugin or {}, reading.page_mode)
        need_shape = reading.layout is None or metrics.num_blocks
        shape = self._shape(desc) if need_shape else None
        if reading.layout is None and shape is not None:
            reading.layout = self._capacity_layout(shape, desc, reading.page_mode,
                                                   metrics.cache_mode == "align",
                                                   _series(metrics.plugin))
        if reading.layout is not None and metrics.num_blocks and metrics.running is not None:
            lay = reading.layout
            reading.pinned = capacity.pinned_fraction(
                int(metrics.running), num_blocks=metrics.num_blocks, num_gdn_groups=lay.num_gdn_groups,
                num_attention_groups=lay.num_attention_groups,
                gdn_pages_per_request=lay.gdn_pages_per_request, num_ple_groups=lay.num_ple_groups,
                ple_pages_per_request=lay.ple_pages_per_request)
        if shape is not None and metrics.num_blocks:
            live = self._live_plan(shape, desc, reading.page_mode, metrics.num_blocks,
                                   metrics.ssm_state_dtype, metrics.cache_mode == "align",
                                   _series(metrics.plugin))
            if live is not None:
                reading.capacity_tokens = {m: getattr(live, m).tokens for m in PAGE_MODES}
                reading.whole_requests = {m: getattr(live, m).whole_requests for m in PAGE_MODES}
        return reading

    def _plugin_layout(self, plugin: dict[str, str], page_mode: str) -> Layout | None:
        keys = ("num_gdn_groups", "num_attention_groups", "gdn_pages_per_request")
        if not plugin or (all(k in plugin for k in keys) and not all(plugin[k] for k in keys)):
            return None  # no plugin, or one whose planner could not read the model: use ours
        try:
            return Layout(page_mode, int(plugin["num_gdn_groups"]), int(plugin["num_attention_groups"]),
                          int(plugin["gdn_pages_per_request"]), "plugin",
                          # absent from plugins before PLE accounting: no PLE groups
                          int(plugin.get("num_ple_groups") or 0),
                          int(plugin.get("ple_pages_per_request") or 0))
        except (KeyError, ValueError):
            self._count("replica")  # the plugin's gauge lacks a label we document
            return None

    def _model_entry(self, desc: ReplicaDescription) -> dict[str, Any] | None:
        with self._lock:
            cached = self._models.get(desc.url)
        if cached is not None:
            return cached
        try:
            data = json.loads(self._get(desc.url + "/v1/models"))
            entry = data["data"][0]
            if not isinstance(entry, dict):
                raise ValueError("model entry is not an object")
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            self._count("replica")
            return None
        with self._lock:
            self._models[desc.url] = entry
        return entry

    def _shape(self, desc: ReplicaDescription) -> capacity.HybridModelShape | None:
        path = desc.model_config_path
        if path is None:
            entry = self._model_entry(desc)
            root = entry.get("root") if entry else None
            if not isinstance(root, str) or not os.path.isdir(root):
                return None  # a hub id or another host's path: the layout needs the plugin's gauge
            path = root
        with self._lock:
            shape = self._shapes.get(path)
        if shape is None:
            try:
                shape = capacity.HybridModelShape.from_path(path)
            except capacity.CapacityInputError:
                self._count("model_config")
                return None
            with self._lock:
                self._shapes[path] = shape
        return shape

    def _max_model_len(self, desc: ReplicaDescription) -> int | None:
        if desc.max_model_len is not None:
            return desc.max_model_len
        entry = self._model_entry(desc)
        value = entry.get("max_model_len") if entry else None
        return value if isinstance(value, int) and value > 0 else None

    def _capacity_layout(self, shape: capacity.HybridModelShape, desc: ReplicaDescription,
                         page_mode: str, prefix_caching: bool = False,
                         vllm: str = capacity.VLLM_SERIES) -> Layout | None:
        try:
            capacity.validate(shape, tp=desc.tp, num_spec=desc.num_spec, kv_bytes_per_rank=1,
                              max_model_len=1, platform=desc.platform, state_dtype=None, running=0)
        except capacity.CapacityInputError:
            self._count("model_config")
            return None
        # Group counts and pages per request do not depend on memory or length.
        pool = capacity.plan_pool(shape, tp=desc.tp, num_spec=desc.num_spec, kv_bytes_per_rank=0,
                                  max_model_len=1, platform=desc.platform,
                                  onepage=page_mode == "onepage", running=0,
                                  prefix_caching=prefix_caching, vllm=vllm)
        return Layout(page_mode, pool.num_gdn_groups, pool.num_attention_groups,
                      pool.gdn_pages_per_request, "capacity", pool.num_ple_groups,
                      pool.ple_pages_per_request)

    def _live_plan(self, shape: capacity.HybridModelShape, desc: ReplicaDescription,
                   page_mode: str, num_blocks: int, state_dtype: str | None = None,
                   prefix_caching: bool = False,
                   vllm: str = capacity.VLLM_SERIES) -> capacity.CapacityPlan | None:
        max_len = self._max_model_len(desc)
        if max_len is None:
            return None
        try:
            result = capacity.live_plan(shape, num_blocks=num_blocks, tp=desc.tp, num_spec=desc.num_spec,
                                        onepage=page_mode == "onepage", max_model_len=max_len,
                                        platform=desc.platform, state_dtype=state_dtype,
                                        prefix_caching=prefix_caching, vllm=vllm)
        except capacity.CapacityInputError:
            self._count("model_config")
            return None
        return result

    # -- families --------------------------------------------------------------------------------

    def _families(self, readings: list[ReplicaReading]) -> Iterator[Metric]:
        rm = ["replica", "model"]

        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=rm + (extra or []))

        up = gauge("r9k_replica_up", "1 when the replica's /metrics answered this scrape.")
        info = gauge("r9k_replica_info", "Replica page mode and layout source (value 1).",
                     ["page_mode", "tp", "num_spec", "layout_source"])
        cards = GaugeMetricFamily("r9k_replica_card_info", "Cards a replica runs on (value 1): "
                                  "a card is its host and PCI address.",
                                  labels=["replica", "host", "bdf"])
        state = gauge("r9k_replica_state", "Fleet state, one-hot (loading, ready, draining, unhealthy).",
                      ["state"])
        running = gauge("r9k_replica_requests_running", "Requests running (vllm:num_requests_running).")
        waiting = gauge("r9k_replica_requests_waiting", "Requests waiting (vllm:num_requests_waiting).")
        preempt = CounterMetricFamily("r9k_replica_preemptions", "Preemptions (vllm:num_preemptions_total).",
                                      labels=rm)
        tokens = CounterMetricFamily("r9k_replica_generation_tokens",
                                     "Tokens generated (vllm:generation_tokens_total, summed over engines): "
                                     "flat while requests run means the replica is hung.", labels=rm)
        hung = gauge("r9k_replica_hung",
                     "1 while the fleet reports the replica hung by its token-progress check (requests "
                     "queued or running, no new token for progress_timeout_s), until it restarts it; "
                     "fleet replicas only.")
        usage = gauge("r9k_kv_usage_ratio", "Share of the KV pool in use, 0-1 (vllm:kv_cache_usage_perc).")
        blocks = gauge("r9k_kv_pool_blocks", "Blocks in the replica's KV pool (num_gpu_blocks).")
        block_size = gauge("r9k_kv_block_size_tokens", "Tokens per attention block.")
        pinned = gauge("r9k_kv_pinned_ratio",
                       "Share of the pool pinned by running requests before any context, by kind "
                       "(gdn state pages, attention, ple: Qwen4Exp short-conv pages); sum over kind "
                       "for the total.", ["kind"])
        cap_tokens = gauge("r9k_kv_capacity_tokens",
                           "KV cache tokens the replica's pool holds, by page mode (capacity module).",
                           ["page_mode"])
        whole = gauge("r9k_kv_whole_requests",
                      "Requests of max_model_len the replica's pool runs at once, by page mode "
                      "(capacity module); running above it, requests may be preempted as they grow.",
                      ["page_mode"])
        for r in readings:
            labels = [r.desc.name, r.model]
            up.add_metric(labels, 1.0 if r.up else 0.0)
            info.add_metric(labels + [r.page_mode, str(r.desc.tp), str(r.desc.num_spec),
                                      r.layout.source if r.layout else "none"], 1.0)
            for bdf in r.desc.cards:
                cards.add_metric([r.desc.name, r.desc.host or "", bdf], 1.0)
            if r.desc.state is not None:
                for s in REPLICA_STATES:
                    state.add_metric(labels + [s], 1.0 if s == r.desc.state else 0.0)
                if isinstance(r.desc, ReplicaStatus):
                    hung.add_metric(labels, 1.0 if r.desc.verdict == HUNG else 0.0)
            m = r.metrics
            for family, value in ((running, m.running), (waiting, m.waiting), (usage, m.kv_usage_ratio),
                                  (preempt, m.preemptions), (tokens, m.generation_tokens), (blocks, m.num_blocks),
                                  (block_size, m.block_size)):
                if value is not None:
                    family.add_metric(labels, float(value))
            if r.pinned is not None:
                for kind in PINNED_KINDS:
                    pinned.add_metric(labels + [kind], r.pinned[kind])
            if r.capacity_tokens is not None:
                for mode in PAGE_MODES:
                    cap_tokens.add_metric(labels + [mode], float(r.capacity_tokens[mode]))
            if r.whole_requests is not None:
                for mode in PAGE_MODES:
                    whole.add_metric(labels + [mode], float(r.whole_requests[mode]))
        yield from (up, info, cards, state, hung, running, waiting, preempt, tokens, usage, blocks, block_size,
                    pinned, cap_tokens, whole)


def load_replica_file(path: str | os.PathLike) -> list[ReplicaDescription]:
    """A JSON file in the fleet status format (``{"replicas": [...]}``), read like every config
    file (a FIFO or a device refused without blocking, at most 1 MiB)."""
    try:
        raw = read_config_bytes(path)
    except FileNotFoundError:
        raise ReplicaSpecError(f"{path}: no such file; expected JSON {{\"replicas\": [...]}}") from None
    except OSError as exc:
        raise ReplicaSpecError(f"{path}: cannot read ({exc.strerror}); expected JSON {{\"replicas\": [...]}}") from None
    except ValueError as exc:
        raise ReplicaSpecError(str(exc).replace("(YAML)", "(JSON)")) from None
    try:
        return FleetStatus.model_validate(json.loads(raw)).replicas
    except (ValueError, ValidationError) as exc:
        raise ReplicaSpecError(f"{path}: expected JSON {{\"replicas\": [...]}} ({str(exc).splitlines()[0]})") from None
