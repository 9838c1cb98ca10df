"""Ops state directory: one small JSON file per card, shared with deploy and monitoring.

Layout: ``<state_dir>/cards/<BDF>.json`` (written atomically, updated under a lock) plus the
watcher's own ``<state_dir>/watch-cursor.json``. Readers use :func:`read_card_states`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

# The shared event vocabulary (metrics and alerts use the same names).
EVENT_TYPES: tuple[str, ...] = (
    "mes_timeout",
    "ring_timeout",
    "reset_begin",
    "reset_succeeded",
    "reset_failed",
    "device_lost",
    "recovery_disabled",
)
# Events that fence a card (mark it unhealthy and run the hooks) unless the config says otherwise.
DEFAULT_FAULT_EVENTS: tuple[str, ...] = (
    "mes_timeout",
    "ring_timeout",
    "reset_begin",
    "reset_failed",
    "device_lost",
)
DEFAULT_STATE_DIR = "/var/lib/r9k/ops"
SCHEMA_VERSION = 1
# A PCI address (domain:bus:device.function) as sysfs and the kernel write it; the one pattern.
BDF_PATTERN = r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]"
BDF_RE = re.compile(rf"^{BDF_PATTERN}$")
# Positions kept per card for exactly-once counting; older streams (earlier boots) are dropped.
_MAX_STREAMS = 8


@dataclass
class LastEvent:
    type: str
    message: str
    time: float  # unix seconds when the watcher recorded it
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class CardState:
    """What ops knows about one card. ``healthy`` False means: fenced, do not place work on it."""

    bdf: str
    healthy: bool = True
    unhealthy_reason: str | None = None
    unhealthy_since: float | None = None
    unhealthy_boot_id: str | None = None  # fencing of sysfs access lasts until the next boot
    counts: dict[str, int] = field(default_factory=lambda: {t: 0 for t in EVENT_TYPES})
    last_event: LastEvent | None = None
    # stream id -> last counted ordinal (kmsg seq, journal seqnum, file offset): exactly-once.
    positions: dict[str, int] = field(default_factory=dict)
    power_ok: bool | None = None
    power_drift: list[str] = field(default_factory=list)
    power_checked_at: float | None = None
    updated_at: float | None = None
    version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CardState":
        if not isinstance(data, dict) or not isinstance(data.get("bdf"), str):
            raise ValueError("card state: expected an object with a 'bdf' string")
        counts = {t: 0 for t in EVENT_TYPES}
        for k, v in (data.get("counts") or {}).items():
            if k in counts and isinstance(v, int):
                counts[k] = v
        last = data.get("last_event")
        known = {f.name for f in dataclasses.fields(cls)} - {"counts", "last_event"}
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(
            counts=counts,
            last_event=LastEvent(**last) if isinstance(last, dict) else None,
            **kwargs,
        )

    def sysfs_fenced(self, current_boot_id: str | None) -> bool:
        """Do not touch this card's sysfs: it faulted in this boot and no reset has restored it."""
        if self.healthy or self.unhealthy_boot_id is None or self.unhealthy_boot_id != current_boot_id:
            return False
        return not (self.last_event and self.last_event.type == "reset_succeeded")

    def seen(self, stream: str, ordinal: int) -> bool:
        return stream in self.positions and ordinal <= self.positions[stream]

    def mark_seen(self, stream: str, ordinal: int) -> None:
        self.positions.pop(stream, None)
        self.positions[stream] = ordinal  # re-insert: dict order is recency
        while len(self.positions) > _MAX_STREAMS:
            self.positions.pop(next(iter(self.positions)))


def cards_dir(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / "cards"


def card_state_path(state_dir: str | os.PathLike, bdf: str) -> Path:
    if not BDF_RE.match(bdf):
        raise ValueError(f"card {bdf!r}: expected a full PCI address like 0000:03:00.0")
    return cards_dir(state_dir) / f"{bdf}.json"


def read_card_state(state_dir: str | os.PathLike, bdf: str) -> CardState | None:
    path = card_state_path(state_dir, bdf)
    try:
        return CardState.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def read_card_states(state_dir: str | os.PathLike) -> dict[str, CardState]:
    """All card states by BDF; unreadable files are skipped (a reader must never crash on them)."""
    out: dict[str, CardState] = {}
    directory = cards_dir(state_dir)
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.json")):
        try:
            state = CardState.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[state.bdf] = state
    return out


def atomic_write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(state_dir: str | os.PathLike) -> Iterator[None]:
    directory = cards_dir(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def update_card_state(
    state_dir: str | os.PathLike, bdf: str, change: Callable[[CardState], Any]
) -> CardState:
    """Read-modify-write one card's state under the state-dir lock (watcher and reconcile share it)."""
    path = card_state_path(state_dir, bdf)
    with _locked(state_dir):
        state = read_card_state(state_dir, bdf) or CardState(bdf=bdf)
        change(state)
        state.updated_at = time.time()
        atomic_write_json(path, state.to_json())
    return state


def clear_card(state_dir: str | os.PathLike, bdf: str) -> CardState:
    """Mark a card healthy again (operator action after a reboot or reset restored it)."""

    def _clear(state: CardState) -> None:
        state.healthy = True
        state.unhealthy_reason = None
        state.unhealthy_since = None
        state.unhealthy_boot_id = None

    return update_card_state(state_dir, bdf, _clear)
