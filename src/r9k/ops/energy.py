"""Energy per card: each amdgpu card's package power sampled at a fixed rate (well above the
scrape rate) and integrated into a running total of joules (the exporter's
`r9k_gpu_energy_joules_total{host,bdf}`, `r9k ops sweep` and `r9k bench compare` read it).

Source per card, first found: the hwmon energy counter `energy1_input` (microjoules: the card
integrates itself, gaps do not matter), else `power1_average`, else `power1_input` (microwatts,
as ops reads power), integrated by the trapezoid rule between samples. An interval longer than
`max_gap_factor` sample periods (a stalled read, a card in reset, a suspended host) is not
guessed: it is added to `r9k_gpu_energy_gap_seconds_total` instead, and a decreasing energy
counter (a card reset) the same. The total starts at 0 when the meter starts, as counters do.
`host` is the fleet's name for this host (the label the fleet's `r9k_replica_card_info`
carries), so recording rules can join cards to replicas.
"""
from __future__ import annotations

import dataclasses
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from r9k.ops import sysfs

ENERGY_SOURCES = ("energy1_input", "power1_average", "power1_input")
MIN_SAMPLE_HZ, MAX_SAMPLE_HZ = 0.1, 100.0
_MICRO = 1e6


@dataclass
class CardEnergy:
    """One card's integral so far."""

    bdf: str
    hwmon_dir: Path | None = None
    source: str | None = None
    joules: float = 0.0
    samples: int = 0
    gap_seconds: float = 0.0
    read_errors: int = 0
    watts: float | None = None          # the last power sample (power sources)
    _last_t: float | None = field(default=None, repr=False)
    _last_value: float | None = field(default=None, repr=False)  # watts, or the counter in joules

    def add(self, t: float, value: float, max_gap_s: float) -> None:
        """One reading at monotonic time ``t``: watts, or joules for the energy counter."""
        self.samples += 1
        last_t, last = self._last_t, self._last_value
        self._last_t, self._last_value = t, value
        if self.source != "energy1_input":
            self.watts = value
        if last_t is None or last is None:
            return
        dt = t - last_t
        if dt <= 0:
            return
        if self.source == "energy1_input":
            if value < last:      # the card's counter restarted (reset, driver reload)
                self.gap_seconds += dt
            else:
                self.joules += value - last
            return
        if dt > max_gap_s:
            self.gap_seconds += dt
            return
        self.joules += (value + last) / 2.0 * dt

    def lost(self) -> None:
        """A failed read: the next good one starts a new interval (the gap is counted then)."""
        self.read_errors += 1


def _read_microunits(path: Path) -> float:
    value = sysfs._read_int(path)  # ops' one reader of a sysfs number (EPERM, EBUSY: NotReady)
    if value is None or value < 0:
        raise ValueError(f"{path.name}: missing, not a number or negative ({value})")
    return value / _MICRO


def source_of(hwmon: Path) -> str | None:
    """The file a card's energy comes from (ENERGY_SOURCES order), or None."""
    for name in ENERGY_SOURCES:
        if (hwmon / name).exists():
            return name
    return None


class EnergyMeter:
    """Samples every card at ``sample_hz`` in its own thread (`start`), or once per
    `sample_once` call (tests drive it with their own clock)."""

    def __init__(self, host_root: str = "/", sample_hz: float = 1.0, host: str | None = None,
                 max_gap_factor: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(sample_hz, (int, float)) and math.isfinite(sample_hz)
                and MIN_SAMPLE_HZ <= sample_hz <= MAX_SAMPLE_HZ):
            raise ValueError(f"energy sample rate {sample_hz!r} Hz: expected {MIN_SAMPLE_HZ:g} to "
                             f"{MAX_SAMPLE_HZ:g}")
        if not max_gap_factor >= 1:
            raise ValueError(f"max_gap_factor {max_gap_factor!r}: expected >= 1")
        self.host_root = host_root
        self.sample_hz = float(sample_hz)
        self.period_s = 1.0 / self.sample_hz
        self.max_gap_s = max_gap_factor * self.period_s
        self.host = host or socket.gethostname()
        self.clock = clock
        self.cards: dict[str, CardEnergy] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rediscover = True
        self.late_samples = 0    # samples taken later than one period after the one before

    # -- sampling ----------------------------------------------------------------------------

    def _discover(self) -> None:
        found = {c.bdf: c.hwmon_dir for c in sysfs.discover_cards(self.host_root, enrich=False)}
        with self._lock:
            for bdf, hwmon in found.items():
                card = self.cards.setdefault(bdf, CardEnergy(bdf))
                source = source_of(hwmon) if hwmon is not None else None
                if card.hwmon_dir != hwmon or card.source != source:
                    # hwmon numbers change across a reset: the integral goes on, a new interval
                    card.hwmon_dir, card.source = hwmon, source
                    card._last_t = card._last_value = None
            for bdf, card in self.cards.items():
                if bdf not in found:   # off the bus: kept (a counter never goes backwards)
                    card.hwmon_dir = None
                    card._last_t = card._last_value = None
        self._rediscover = False

    def sample_once(self) -> None:
        if self._rediscover or not self.cards:
            self._discover()
        with self._lock:
            cards = list(self.cards.values())
        for card in cards:
            if card.hwmon_dir is None or card.source is None:
                continue
            try:
                value = _read_microunits(card.hwmon_dir / card.source)
            except (OSError, ValueError, sysfs.NotReady):
                with self._lock:
                    card.lost()
                self._rediscover = True   # a vanished hwmon (reset) is found again next sample
                continue
            t = self.clock()
            with self._lock:
                card.add(t, value, self.max_gap_s)

    def _run(self) -> None:
        next_t = self.clock()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 - a sampler that dies silently stops the counter
                self._rediscover = True
            next_t += self.period_s
            now = self.clock()
            if now > next_t:   # fell behind (a slow read): skip, do not burst to catch up
                self.late_samples += 1
                next_t = now
            self._stop.wait(max(0.0, next_t - now))

    def start(self) -> "EnergyMeter":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="r9k-energy")
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def snapshot(self) -> list[CardEnergy]:
        with self._lock:
            return [dataclasses.replace(c) for c in sorted(self.cards.values(), key=lambda c: c.bdf)]

    def samples_in(self, bdfs: list[str] | None = None) -> int:
        return min((c.samples for c in self.snapshot() if bdfs is None or c.bdf in bdfs), default=0)

    def joules(self, bdfs: list[str] | None = None) -> tuple[float, float, int]:
        """(joules, gap seconds, cards with a source) summed over ``bdfs`` (every card: None)."""
        cards = [c for c in self.snapshot() if bdfs is None or c.bdf in bdfs]
        return (sum(c.joules for c in cards), sum(c.gap_seconds for c in cards),
                sum(1 for c in cards if c.source is not None))


class EnergyWindow:
    """Joules drawn by some cards over a stretch of work: ``with EnergyWindow(meter, bdfs) as w:``
    ... then ``w.joules``, ``w.seconds``, ``w.gap_seconds``; ``w.measured`` False when no card
    had a power or energy file (say "not measured", never 0)."""

    def __init__(self, meter: EnergyMeter, bdfs: list[str] | None = None) -> None:
        self.meter, self.bdfs = meter, bdfs
        self.joules = self.seconds = self.gap_seconds = 0.0
        self.measured = False

    def __enter__(self) -> "EnergyWindow":
        self.meter.sample_once()
        self._j0, self._g0, _ = self.meter.joules(self.bdfs)
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.meter.sample_once()
        j1, g1, sources = self.meter.joules(self.bdfs)
        self.seconds = time.monotonic() - self._t0
        self.joules, self.gap_seconds = j1 - self._j0, g1 - self._g0
        self.measured = sources > 0 and self.meter.samples_in(self.bdfs) > 1

    @property
    def watts(self) -> float | None:
        return self.joules / self.seconds if self.measured and self.seconds > 0 else None
