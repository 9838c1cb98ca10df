"""Per-card collectors, one per source, each isolated by the exporter: `gpu` (sysfs telemetry
and identity), `ops_power` (the ops config against the cards: wanted vs actual, drift,
presence), `ops_state` (the ops state files: health, events, unattributed faults, the watcher's
heartbeat).

Everything is read at scrape time under ``host_root`` (default ``/``) through :mod:`r9k.ops`:
``power_status`` for wanted vs actual and drift, ``discover_cards`` for the hwmon directory,
``read_card_states`` for the watcher's event counts and health (a corrupt card file reads unhealthy
and unreadable, never absent), ``card_presence`` for expected vs present cards, ``read_host_events``
for faults no card could be named for. Labels: ``bdf`` (PCI address).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from r9k.monitoring.scrape_errors import ScrapeErrors
from r9k.ops import sysfs
from r9k.ops.config import DEFAULT_CONFIG_PATH, ConfigError, OpsConfig, load_config
from r9k.ops.power import CardStatus, power_status
from r9k.ops.state import (EVENT_TYPES, CardStates, HostEvent, StateFileError, card_presence, cards_dir,
                           last_heartbeat, read_card_states, read_host_events)

_SENSOR_FALLBACK = {"temp1": "edge", "temp2": "junction", "temp3": "mem"}
_CLOCK_FALLBACK = {"freq1": "sclk", "freq2": "mclk"}


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _read_number(path: Path) -> float | None:
    """A sysfs number, or None when the file is absent; other failures raise OSError."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return float(int(text, 0))
    except ValueError:
        raise OSError(errno.EINVAL, f"{path.name}: not a number: {text[:40]!r}") from None


def _label(hwmon: Path, prefix: str, fallback: dict[str, str]) -> str:
    try:
        return (hwmon / f"{prefix}_label").read_text().strip() or fallback.get(prefix, prefix)
    except OSError:
        return fallback.get(prefix, prefix)


class _Source:
    """What the three collectors share: where the host is, the ops config and state files, and
    the scrape-error tally each source's failures go to."""

    def __init__(self, errors: ScrapeErrors, host_root: str | os.PathLike = "/",
                 state_dir: str | os.PathLike | None = None,
                 config_path: str | os.PathLike = DEFAULT_CONFIG_PATH) -> None:
        self.errors = errors
        self.host_root = host_root
        self.state_dir = state_dir
        self.config_path = config_path

    def _config(self) -> tuple[OpsConfig, bool]:
        """The ops config and whether it loaded; a missing or refused one gives the defaults
        (nothing wanted, at least one card expected) and leaves drift unknown."""
        try:
            return load_config(self.config_path), True
        except (ConfigError, OSError, ValueError):  # ValueError: e.g. not UTF-8
            self.errors.count("ops_config")
            return OpsConfig(), False

    def _states(self, tally: bool = True) -> CardStates:
        """The card state files; unreadable ones counted once per scrape (by the state
        collector: `tally`)."""
        if self.state_dir is None:
            return CardStates()
        if not cards_dir(self.state_dir).is_dir():
            if tally:
                self.errors.count("ops_state")
            return CardStates()
        try:
            states = read_card_states(self.state_dir)
        except (OSError, StateFileError):
            if tally:
                self.errors.count("ops_state")
            return CardStates()
        if tally:
            self.errors.count("ops_state", len(states.corrupt))
        return states

    def _cards(self, tally: bool = False) -> dict:
        """The amdgpu cards on the bus; a failed read counted once per scrape (by the gpu
        collector: `tally`)."""
        try:
            return {c.bdf: c for c in sysfs.discover_cards(self.host_root)}
        except (OSError, sysfs.NotReady):  # e.g. a device file vanishing mid-read (card off the bus)
            if tally:
                self.errors.count("sysfs")
            return {}


class GpuCollector(_Source):
    """sysfs: card identity, power draw, default cap, temperatures, clocks, voltage, VRAM, busy,
    and whether GPU recovery is off."""

    def collect(self) -> Iterator[Metric]:
        if not sysfs.host_path(self.host_root, "/sys/class/drm").is_dir():
            self.errors.count("sysfs")
        cards = self._cards(tally=True)
        yield from self._identity(cards)
        yield from self._telemetry(cards)
        recovery = sysfs.recovery_status(self.host_root)
        off = _gauge("r9k_host_gpu_recovery_disabled",
                     "1 when amdgpu.gpu_recovery=0 is in effect (a hung MES wedges only its GPU).", [])
        off.add_metric([], 1.0 if recovery.in_effect else 0.0)
        yield off

    def _identity(self, cards: dict) -> Iterable[Metric]:
        info = _gauge("r9k_gpu_info", "Card identity (value 1).",
                      ["bdf", "card", "device_id", "unique_id", "model"])
        power = _gauge("r9k_gpu_power_watts", "Package power (power1_average, else power1_input).", ["bdf"])
        cap_default = _gauge("r9k_gpu_power_cap_default_watts", "Card default power cap.", ["bdf"])
        for bdf, card in sorted(cards.items()):
            self.errors.count("sysfs", len(card.errors))
            info.add_metric([bdf, card.card_name,
                             f"0x{card.device_id:04x}" if card.device_id is not None else "",
                             _unique_id(card.device_dir), "R9700" if card.is_r9700 else "amdgpu"], 1.0)
            if card.power_watts is not None:
                power.add_metric([bdf], card.power_watts)
            if card.cap_default_watts is not None:
                cap_default.add_metric([bdf], card.cap_default_watts)
        return [info, power, cap_default]

    def _telemetry(self, cards: dict) -> Iterable[Metric]:
        temp = _gauge("r9k_gpu_temperature_celsius", "Temperature by sensor (edge, junction, mem).",
                      ["bdf", "sensor"])
        vddgfx = _gauge("r9k_gpu_vddgfx_volts", "Graphics core voltage (in0_input).", ["bdf"])
        clock = _gauge("r9k_gpu_clock_hertz", "Clock by domain (sclk, mclk).", ["bdf", "clock"])
        used = _gauge("r9k_gpu_vram_used_bytes", "VRAM in use (mem_info_vram_used).", ["bdf"])
        total = _gauge("r9k_gpu_vram_total_bytes", "VRAM size (mem_info_vram_total).", ["bdf"])
        busy = _gauge("r9k_gpu_busy_ratio", "GPU busy share 0-1 (gpu_busy_percent / 100).", ["bdf"])
        for bdf, card in cards.items():
            reads = [(used, card.device_dir / "mem_info_vram_used", 1.0, []),
                     (total, card.device_dir / "mem_info_vram_total", 1.0, []),
                     (busy, card.device_dir / "gpu_busy_percent", 0.01, [])]
            hw = card.hwmon_dir
            if hw is not None:
                for path in sorted(hw.glob("temp*_input")):
                    prefix = path.name.removesuffix("_input")
                    reads.append((temp, path, 0.001, [_label(hw, prefix, _SENSOR_FALLBACK)]))
                for path in sorted(hw.glob("freq*_input")):
                    prefix = path.name.removesuffix("_input")
                    reads.append((clock, path, 1.0, [_label(hw, prefix, _CLOCK_FALLBACK)]))
                reads.append((vddgfx, hw / "in0_input", 0.001, []))
            for family, path, scale, extra in reads:
                try:
                    value = _read_number(path)
                except OSError:
                    self.errors.count("sysfs")
                    continue
                if value is None:
                    self.errors.count("sysfs")
                else:
                    family.add_metric([bdf, *extra], value * scale)
        return [temp, vddgfx, clock, used, total, busy]


class OpsPowerCollector(_Source):
    """The ops config against the cards: whether it loaded, cap and undervolt in effect and
    wanted, drift, expected and present cards."""

    def collect(self) -> Iterator[Metric]:
        config, config_valid = self._config()
        states = self._states(tally=False)
        # over-cap drift from the state reconcile keeps: the same value `ops reconcile` shows
        since = {bdf: st.over_cap_since for bdf, st in states.items() if st.over_cap_since is not None}
        try:
            # health: the state collector
            statuses = power_status(config, self.host_root, None, over_cap_since=since)
        except (OSError, sysfs.NotReady):  # counted by the gpu collector
            statuses = []
        valid = _gauge("r9k_ops_config_valid",
                       "1 when the ops config loaded; 0 when missing or refused (drift is then unknown).", [])
        valid.add_metric([], 1.0 if config_valid else 0.0)
        yield valid
        yield from self._power(statuses, states, config_valid)
        yield from self._presence(config, self._cards())

    def _power(self, statuses: list[CardStatus], states: CardStates, config_valid: bool
               ) -> Iterable[Metric]:
        cap = _gauge("r9k_gpu_power_cap_watts", "Power cap the card enforces (power1_cap).", ["bdf"])
        cap_wanted = _gauge("r9k_gpu_power_cap_wanted_watts", "Power cap the ops config wants.", ["bdf"])
        offset = _gauge("r9k_gpu_voltage_offset_volts", "VDDGFX offset in effect (negative: undervolt).",
                        ["bdf"])
        offset_wanted = _gauge("r9k_gpu_voltage_offset_wanted_volts",
                               "VDDGFX offset the ops config wants.", ["bdf"])
        drift = _gauge("r9k_gpu_config_drift",
                       "1 when the card's cap or offset differs from the ops config (0 when fenced; absent "
                       "while the config is refused or the card's state unreadable).", ["bdf"])
        for status in statuses:
            bdf = status.bdf
            if status.actual_cap_watts is not None:
                cap.add_metric([bdf], status.actual_cap_watts)
            if status.actual_offset_mv is not None:
                offset.add_metric([bdf], status.actual_offset_mv / 1000.0)
            if status.wanted_cap_watts is not None:
                cap_wanted.add_metric([bdf], float(status.wanted_cap_watts))
            if status.wanted_offset_mv is not None:
                offset_wanted.add_metric([bdf], status.wanted_offset_mv / 1000.0)
            st = states.get(bdf)
            fenced = st is not None and st.sysfs_fenced(sysfs.boot_id(self.host_root))
            # A fenced card is not reconciled on purpose; GpuUnhealthy pages for it instead.
            if config_valid and bdf not in states.corrupt:
                drift.add_metric([bdf], 1.0 if status.managed and status.drift and not fenced else 0.0)
        return [cap, cap_wanted, offset, offset_wanted, drift]

    def _presence(self, config: OpsConfig, cards: dict) -> Iterable[Metric]:
        presence = card_presence(config, sorted(cards))
        expected = _gauge("r9k_gpu_expected_cards", "Cards the ops config expects (expected_cards; default 1).", [])
        present = _gauge("r9k_gpu_present_cards",
                         "Expected cards present on the bus (all amdgpu cards when expected_cards is a count).", [])
        missing = _gauge("r9k_gpu_missing", "1 for each card the ops config lists that is not on the bus.",
                         ["bdf"])
        expected.add_metric([], float(presence.expected))
        present.add_metric([], float(presence.present))
        for bdf in presence.missing:
            missing.add_metric([bdf], 1.0)
        return [expected, present, missing]


class OpsStateCollector(_Source):
    """The ops state files: each card's health and kernel-log event counts, faults no card could
    be named for, the watcher's heartbeat."""

    def collect(self) -> Iterator[Metric]:
        states, cards = self._states(), self._cards()
        yield from self._health(cards, states)
        yield from self._events(cards, states)
        yield from self._unattributed(self._host_events())
        yield from self._watcher()

    def _host_events(self) -> list[HostEvent] | None:
        """Unattributed faults; None (unknown, not zero) when the file cannot be read."""
        if self.state_dir is None:
            return []
        try:
            return read_host_events(self.state_dir)
        except (OSError, StateFileError):
            self.errors.count("ops_state")
            return None

    def _health(self, cards: dict, states: CardStates) -> Iterable[Metric]:
        unhealthy = _gauge("r9k_gpu_unhealthy",
                           "1 when ops fenced the card after a fault, or its state file is unreadable.", ["bdf"])
        unreadable = _gauge("r9k_gpu_state_unreadable", "1 when the card's ops state file is corrupt.", ["bdf"])
        for bdf in sorted(set(cards) | set(states) | set(states.corrupt)):
            # A card that left the bus keeps its health; an unreadable file may hide a fence.
            st = states.get(bdf)
            bad = bdf in states.corrupt or (st is not None and not st.healthy)
            unhealthy.add_metric([bdf], 1.0 if bad else 0.0)
            unreadable.add_metric([bdf], 1.0 if bdf in states.corrupt else 0.0)
        return [unhealthy, unreadable]

    def _events(self, cards: dict, states: CardStates) -> Iterable[Metric]:
        events = CounterMetricFamily("r9k_gpu_events", "Kernel-log events counted by the ops watcher.",
                                     labels=["bdf", "event"])
        last = _gauge("r9k_gpu_last_event_timestamp_seconds", "When the watcher recorded the last event.",
                      ["bdf"])
        # Every known card is exported at 0 per event type, so increase() sees its first fault;
        # a card whose state is unreadable has unknown counts (a 0 would fake an increase later).
        for bdf in sorted((set(cards) | set(states)) - set(states.corrupt)):
            st = states.get(bdf)
            for event in EVENT_TYPES:
                events.add_metric([bdf, event], float(st.counts.get(event, 0)) if st else 0.0)
            if st is not None and st.last_event is not None:
                last.add_metric([bdf], st.last_event.time)
        return [events, last]

    def _unattributed(self, events: list[HostEvent] | None) -> Iterable[Metric]:
        if events is None:
            return []
        family = CounterMetricFamily("r9k_host_unattributed_faults",
                                     "Kernel-log faults no card could be named for, by event type.", labels=["event"])
        counts = {e.type: e.count for e in events}
        for event in sorted(set(EVENT_TYPES) | set(counts)):  # 0 from the start, so increase() sees the first
            family.add_metric([event], float(counts.get(event, 0)))
        return [family]

    def _watcher(self) -> Iterable[Metric]:
        if self.state_dir is None:
            return []
        when = last_heartbeat(self.state_dir)
        if when is None:
            return []  # never ran here: absent, which OpsWatcherStale also catches
        beat_gauge = _gauge("r9k_ops_watch_heartbeat_timestamp_seconds",
                            "Unix time the ops kernel-log watcher last finished a poll (every "
                            "--interval while it runs).", [])
        beat_gauge.add_metric([], when)
        return [beat_gauge]


CARD_COLLECTORS = {"gpu": GpuCollector, "ops_power": OpsPowerCollector,
                   "ops_state": OpsStateCollector}  # name in r9k_exporter_collect_*{collector}


def _unique_id(device_dir: Path) -> str:
    try:
        return (device_dir / "unique_id").read_text().strip()
    except OSError:
        return ""
