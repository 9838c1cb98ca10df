"""Ops state directory: one small JSON file per card, shared with deploy and monitoring.

Layout: ``<state_dir>/cards/<BDF>.json`` (written atomically, updated under a lock), host-level
events (faults no card can be named for) in ``<state_dir>/host-events.json``, the record ids each
of them counted from saved text logs in ``cards/<BDF>.seen`` and ``host-events.seen`` (appended
to), and the watcher's own ``<state_dir>/watch-cursor.json``. Readers use
:func:`read_card_states`, :func:`read_host_events` and :func:`card_presence`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import stat
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
# PCI domain: 4 hex digits, or more behind a VMD bridge (Intel VMD numbers its domains 10000+)
BDF_PATTERN = r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]"
BDF_RE = re.compile(rf"^{BDF_PATTERN}$")
# Positions kept per card for exactly-once counting; older streams (earlier boots) are dropped.
_MAX_STREAMS = 8
# Identities of records from unordered sources (saved text logs) kept per card / for the host:
# at least this many, appended one per line to a ``.seen`` file (an event adds ~17 bytes instead
# of rewriting them all); at twice this many the file is cut back to the last ones.
_MAX_SEEN_IDS = 1024
# Kernel records are under 1 KiB; anything longer is not a kernel message worth storing whole.
MAX_MESSAGE_CHARS = 1024
HOST_EVENTS_FILE = "host-events.json"
HOST_SEEN_FILE = "host-events.seen"


def cap_message(message: str) -> str:
    """A message as stored and handed to hooks: at most MAX_MESSAGE_CHARS (state JSON, env)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 20] + f"... [{len(message)} chars]"


class StateFileError(ValueError):
    """A state file exists but cannot be read as state (corrupt, not JSON, wrong shape)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: unreadable ops state ({reason})")


@dataclass
class LastEvent:
    type: str
    message: str
    time: float  # unix seconds when the watcher recorded it
    detail: dict[str, Any] = field(default_factory=dict)


class _CountedRecords:
    """The record identities a state file counted (``positions``, ``seen_ids``,
    ``last_seen_ids``), one rule for cards and host events: exactly once."""

    positions: dict[str, int]
    seen_ids: list[str]
    last_seen_ids: list[str]

    def seen(self, stream: str, ordinal: int, record_id: str | None = None) -> bool:
        return _seen(self.positions, self.seen_ids, stream, ordinal, record_id)

    def mark_seen(self, stream: str, ordinal: int, record_id: str | None = None) -> None:
        _mark_seen(self.positions, self.last_seen_ids, stream, ordinal, record_id)
        if record_id is not None:
            self.seen_ids.append(record_id)


@dataclass
class CardState(_CountedRecords):
    """What ops knows about one card. ``healthy`` False means: fenced, do not place work on it."""

    bdf: str
    healthy: bool = True
    unhealthy_reason: str | None = None
    unhealthy_since: float | None = None
    unhealthy_boot_id: str | None = None  # fencing of sysfs access lasts until the next boot
    counts: dict[str, int] = field(default_factory=lambda: {t: 0 for t in EVENT_TYPES})
    last_event: LastEvent | None = None
    # stream id -> last counted ordinal (kmsg boot+seq, journal seqnum): exactly-once.
    positions: dict[str, int] = field(default_factory=dict)
    # record identities from saved text logs (no ordinal there), most recent last: exactly-once.
    # Kept in ``<BDF>.seen``, not in this file (only files written before that carry them here).
    seen_ids: list[str] = field(default_factory=list)
    # the ids this write counted, appended to ``<BDF>.seen`` after it (repaired from here if lost)
    last_seen_ids: list[str] = field(default_factory=list)
    power_ok: bool | None = None
    power_drift: list[str] = field(default_factory=list)
    power_checked_at: float | None = None
    # unix time since when the card draws more than its cap + margin while the cap reads right
    # (reconcile keeps it; every reader derives the same over-cap drift from it)
    over_cap_since: float | None = None
    updated_at: float | None = None
    version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        del data["seen_ids"]  # in <BDF>.seen
        return data

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


def _seen(positions: dict[str, int], seen_ids: list[str], stream: str, ordinal: int,
          record_id: str | None) -> bool:
    if record_id is not None:
        return record_id in seen_ids
    return stream in positions and ordinal <= positions[stream]


def _mark_seen(positions: dict[str, int], seen_ids: list[str], stream: str, ordinal: int,
               record_id: str | None) -> None:
    if record_id is not None:
        seen_ids.append(record_id)
        return
    positions.pop(stream, None)
    positions[stream] = ordinal  # re-insert: dict order is recency
    while len(positions) > _MAX_STREAMS:
        positions.pop(next(iter(positions)))


class _SeenLog:
    """Record ids counted from saved text logs, one per line in an append-only file beside a JSON
    state file. The JSON's atomic write stays the commit point: it names the ids it counted
    (``last_seen_ids``), which are appended here after it; a crash in between is repaired at the
    next load (:meth:`settle`), as are ids an older JSON still carries (``seen_ids``)."""

    def __init__(self, path: Path):
        self.path = path
        self.ids: list[str] = []
        self._legacy: list[str] = []
        self._missing: list[str] = []

    def load(self, legacy: list[str], last: list[str]) -> list[str]:
        """Every id counted so far: the file's, the JSON's older list, the JSON's last ones."""
        try:
            pieces = _read_nofollow(self.path).decode("utf-8", "replace").split("\n")
        except FileNotFoundError:
            pieces = [""]
        ids = [x for x in pieces[:-1] if x]  # the last piece lacks its newline: empty or torn
        known = set(ids)
        self._legacy = [x for x in dict.fromkeys(legacy) if x not in known]
        known.update(self._legacy)
        self._missing = [x for x in dict.fromkeys(last) if x not in known]
        self.ids = self._legacy + ids + self._missing
        return list(self.ids)

    def settle(self) -> None:
        """Before a write that no longer names them: every id of earlier writes is in the file."""
        if self._legacy:
            self._rewrite(self.ids[-2 * _MAX_SEEN_IDS:])
        elif self._missing:
            self._append(self._missing)
        self._legacy, self._missing = [], []

    def add(self, added: list[str]) -> None:
        """After the JSON write that counted ``added``."""
        if not added:
            return
        self.ids += added
        if len(self.ids) > 2 * _MAX_SEEN_IDS:
            self._rewrite(self.ids[-_MAX_SEEN_IDS:])
        else:
            self._append(added)

    def _append(self, ids: list[str]) -> None:
        created = not self.path.exists()
        # O_NOFOLLOW: a planted symlink must not make root append to a file elsewhere
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            size = os.fstat(fd).st_size
            torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"  # a crash cut the last line
            data = (("\n" if torn else "") + "".join(f"{x}\n" for x in ids)).encode()
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(self.path.parent)

    def _rewrite(self, ids: list[str]) -> None:
        _atomic_write_bytes(self.path, "".join(f"{x}\n" for x in ids).encode())
        _fsync_dir(self.path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a file created or renamed in ``directory`` survive a crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cards_dir(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / "cards"


def card_state_path(state_dir: str | os.PathLike, bdf: str) -> Path:
    if not BDF_RE.match(bdf):
        raise ValueError(f"card {bdf!r}: expected a full PCI address like 0000:03:00.0")
    return cards_dir(state_dir) / f"{bdf}.json"


def _read_nofollow(path: Path) -> bytes:
    """A state file's bytes; a symlink planted in its place is refused (ELOOP), never followed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _load_card_file(path: Path) -> CardState:
    """One card file; FileNotFoundError when absent, StateFileError when present but unreadable."""
    try:
        raw = _read_nofollow(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = "a symlink (refused)" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise StateFileError(path, why) from None
    try:
        state = CardState.from_json(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise StateFileError(path, str(exc).splitlines()[0][:200]) from None
    if state.bdf != path.stem:
        raise StateFileError(path, f"names card {state.bdf!r}, expected {path.stem!r}")
    return state


def read_card_state(state_dir: str | os.PathLike, bdf: str) -> CardState | None:
    """One card's state; None when it has none. Raises StateFileError when its file is corrupt."""
    try:
        return _load_card_file(card_state_path(state_dir, bdf))
    except FileNotFoundError:
        return None


class CardStates(dict):
    """{BDF: CardState} plus ``corrupt``: {BDF: reason} for card files that exist but cannot be
    read. A card in ``corrupt`` must be treated as unhealthy (its file may say it is fenced)."""

    def __init__(self, states: dict[str, CardState] | None = None, corrupt: dict[str, str] | None = None,
                 untrusted: str | None = None):
        super().__init__(states or {})
        self.corrupt: dict[str, str] = dict(corrupt or {})
        # why the state dir cannot be trusted (others can write it); every card file is then corrupt
        self.untrusted = untrusted

    def unhealthy(self) -> dict[str, str]:
        """{BDF: reason} for every card not to place work on: fenced ones and corrupt files."""
        out = {b: s.unhealthy_reason or "unhealthy" for b, s in self.items() if not s.healthy}
        out.update({b: f"ops state file unreadable: {why}" for b, why in self.corrupt.items()})
        return out


def read_card_states(state_dir: str | os.PathLike) -> CardStates:
    """All readable card states by BDF, as a :class:`CardStates` dict.

    A card file that exists but cannot be read (not JSON, wrong shape, not UTF-8, unreadable) is
    NOT silently skipped: it is listed in the result's ``corrupt`` mapping {BDF (the file name):
    one-line reason}, and is absent from the dict itself. Fail closed: callers that decide where
    work may go use ``result.unhealthy()``, which counts corrupt cards as unhealthy; exporters export
    ``result.corrupt``. A missing state directory gives an empty result (nothing recorded yet).
    """
    out = CardStates()
    directory = cards_dir(state_dir)
    if not directory.is_dir():
        return out
    out.untrusted = state_dir_problem(state_dir)
    for path in sorted(directory.glob("*.json")):
        if out.untrusted:  # a forged `healthy: true` must not un-fence: fail closed
            out.corrupt[path.stem] = f"not trusted: {out.untrusted}"
            continue
        try:
            state = _load_card_file(path)
        except FileNotFoundError:
            continue  # removed between listing and reading
        except StateFileError as exc:
            out.corrupt[path.stem] = exc.reason
            continue
        out[state.bdf] = state
    return out


def state_dir_problem(state_dir: str | os.PathLike) -> str | None:
    """Why root must not trust the state dir, or None: it, its ``cards/`` and every directory
    above it must be writable by root alone (a root-owned sticky parent such as /tmp is fine).
    Anyone who can write there can forge ``healthy: true`` (un-fence a card) or plant symlinks.
    Checked only when running as root: a user's own state dir is that user's business."""
    if os.geteuid() != 0:
        return None
    from r9k.ops.config import _replaceable, _replaceable_dirs  # config imports this module

    directory = Path(state_dir).absolute()
    if not os.path.lexists(directory):
        # to be created: the nearest directory above it must be root's (a sticky /tmp is fine)
        existing = next(p for p in directory.parents if os.path.lexists(p))
        return _replaceable_dirs(existing / directory.name, "ops state")
    for directory in (directory, cards_dir(directory)):
        if os.path.lexists(directory):
            problem = _replaceable(directory, "ops state")
            if problem:
                return problem
    return None


@dataclass
class CardPresence:
    """Cards the config expects vs cards on the host. ``missing`` names absent expected cards
    (only when the config lists PCI addresses; a bare count cannot name them)."""

    expected: int
    present: int
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.present >= self.expected and not self.missing

    def message(self) -> str:
        """One line for operators when not ``ok``."""
        if self.missing:
            return (f"fewer cards than expected: {', '.join(self.missing)} missing "
                    f"({self.present} of {self.expected} expected cards present; expected_cards in the ops config)")
        return (f"fewer cards than expected: {self.present} amdgpu card(s) present, expected at least "
                f"{self.expected} (expected_cards in the ops config)")


def card_presence(config: Any, present_bdfs: list[str]) -> CardPresence:
    """Pure: compare ``config.expected_cards`` (an int: at least that many amdgpu cards; a list of
    PCI addresses: exactly those must be present) with the BDFs found on the host."""
    expected = config.expected_cards
    present = set(present_bdfs)
    if isinstance(expected, int):
        return CardPresence(expected=expected, present=len(present))
    missing = [bdf for bdf in expected if bdf not in present]
    return CardPresence(expected=len(expected), present=len(expected) - len(missing), missing=missing)


@dataclass
class HostEvent:
    """A kernel event no card could be named for (no PCI address and no evidence in the lines
    around it), by type: ``count`` new occurrences, ``message`` the latest one (capped),
    ``first_seen``/``last_seen`` unix seconds when the watcher recorded them."""

    type: str
    message: str
    first_seen: float
    count: int
    last_seen: float | None = None


def host_events_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / HOST_EVENTS_FILE


def _load_host_file(state_dir: str | os.PathLike) -> dict[str, Any]:
    path = host_events_path(state_dir)
    try:
        data = json.loads(_read_nofollow(path).decode("utf-8"))
    except FileNotFoundError:
        return {"events": {}, "positions": {}, "seen_ids": []}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = "a symlink (refused)" if getattr(exc, "errno", None) == errno.ELOOP else str(exc)
        raise StateFileError(path, why.splitlines()[0][:200] if why else type(exc).__name__) from None
    if not isinstance(data, dict) or not isinstance(data.get("events"), dict):
        raise StateFileError(path, "expected an object with an 'events' mapping")
    data.setdefault("positions", {})
    data.setdefault("seen_ids", [])
    return data


def read_host_events(state_dir: str | os.PathLike) -> list[HostEvent]:
    """Host-level (unattributed) events by type, sorted by type; [] when none were recorded.
    Raises StateFileError when ``host-events.json`` exists but is corrupt (never read as 'none')."""
    data = _load_host_file(state_dir)
    try:
        return [HostEvent(**ev) for _, ev in sorted(data["events"].items())]
    except TypeError as exc:
        raise StateFileError(host_events_path(state_dir), str(exc)) from None


@dataclass
class HostEventsDoc(_CountedRecords):
    """``host-events.json`` as the watcher changes it: events by type (as :class:`HostEvent`
    fields), and the record identities counted, by the same rule as a card's."""

    events: dict[str, dict[str, Any]]
    positions: dict[str, int]
    seen_ids: list[str]
    last_seen_ids: list[str] = field(default_factory=list)



def update_host_events(state_dir: str | os.PathLike, change: Callable[[HostEventsDoc], Any],
                       on_corrupt: Callable[[str], None] | None = None) -> Any:
    """Read-modify-write ``host-events.json`` under the state-dir lock, as `update_card_state`
    does a card's: ``change`` gets the document, its result is returned, and the file is written
    (atomically, the counted record ids appended to ``host-events.seen`` after it) only when the
    document changed. A corrupt file is kept aside as ``host-events.json.corrupt-<ns>`` and
    counting starts over (``on_corrupt`` is told): one torn write must not stop the watcher at
    every later fault."""
    with _locked(state_dir):
        try:
            data = _load_host_file(state_dir)
        except StateFileError as exc:
            kept = keep_corrupt(host_events_path(state_dir))
            if on_corrupt:
                on_corrupt(f"{exc.path}: unreadable ({exc.reason}); kept as {kept.name}, host events "
                           "counted from zero")
            data = _load_host_file(state_dir)
        seen_log = _SeenLog(Path(state_dir) / HOST_SEEN_FILE)
        seen_ids = seen_log.load(data.pop("seen_ids"), data.get("last_seen_ids") or [])
        seen_log.settle()
        doc = HostEventsDoc(data["events"], data["positions"], seen_ids)
        before = json.dumps([doc.events, doc.positions, doc.last_seen_ids])
        result = change(doc)
        if json.dumps([doc.events, doc.positions, doc.last_seen_ids]) == before:
            return result  # nothing counted (a record seen before): write nothing
        data.update(events=doc.events, positions=doc.positions, last_seen_ids=doc.last_seen_ids)
        atomic_write_json(host_events_path(state_dir), data)
        seen_log.add(doc.last_seen_ids)
    return result


def atomic_write_json(path: Path, data: Any, durable: bool = True) -> None:
    """Replace ``path`` whole; ``durable``: its data synced first (not for a file whose loss
    costs only a re-read, such as the watcher's log position)."""
    _atomic_write_bytes(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), durable)


# Temporary names of our writes: `.<name>.<mkstemp suffix>.r9k-tmp` (see clean_stale_temp_files).
_TMP_SUFFIX = ".r9k-tmp"
_STALE_TMP_S = 600.0
# what mkstemp made of our file names before the suffix was added
_LEGACY_TMP = re.compile(r"^\.(?:[0-9a-f:.]+\.(?:json|seen)|host-events\.(?:json|seen)|watch-cursor\.json"
                         r"|write-probe)\.[a-z0-9_]{8}$")


def keep_corrupt(path: Path) -> Path:
    """Move an unreadable state file aside under a name no other file has (ns time, then a
    counter: two in one second must not overwrite the first kept copy)."""
    stamp = time.time_ns()
    for n in range(1000):
        kept = path.with_name(f"{path.name}.corrupt-{stamp}" + (f"-{n}" if n else ""))
        if not os.path.lexists(kept):
            os.rename(path, kept)  # callers hold the state-dir lock
            return kept
    raise FileExistsError(errno.EEXIST, f"no free name to keep {path} aside")


def clean_stale_temp_files(state_dir: str | os.PathLike, older_than_s: float = _STALE_TMP_S) -> list[Path]:
    """Remove temporary files of our own naming that a killed write left behind (older than
    ``older_than_s``: a write in progress in another process is never touched)."""
    removed = []
    now = time.time()
    for directory in (Path(state_dir), cards_dir(state_dir)):
        try:
            candidates = [p for p in directory.iterdir()  # ours alone: `.` + our name + mkstemp's 8
                          if p.name.endswith(_TMP_SUFFIX) or _LEGACY_TMP.match(p.name)]
        except OSError:
            continue
        for path in candidates:
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than_s:
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
    return removed


def _atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


HEARTBEAT_FILE = "watch-heartbeat"  # its mtime: when the watcher last finished a poll


def beat(state_dir: str | os.PathLike) -> None:
    """The watcher's heartbeat: touch the file (no fsync; a missed beat is what the alert is for).
    O_NOFOLLOW: a planted symlink must not make root create or touch the file it points to."""
    with contextlib.suppress(OSError):
        fd = os.open(Path(state_dir) / HEARTBEAT_FILE,
                     os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def last_heartbeat(state_dir: str | os.PathLike) -> float | None:
    """Unix time of the watcher's last finished poll, or None when it never ran here."""
    try:
        return (Path(state_dir) / HEARTBEAT_FILE).stat().st_mtime
    except OSError:
        return None


def write_probe(state_dir: str | os.PathLike) -> None:
    """Create the state dir if needed and write, sync and remove a file in it and in cards/:
    raises OSError (read-only, full, not permitted) where a later fault record would fail.
    Temporary files a killed write left there are removed first."""
    clean_stale_temp_files(state_dir)
    for directory in (Path(state_dir), cards_dir(state_dir)):
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", suffix=_TMP_SUFFIX, dir=directory)
        try:
            os.write(fd, b"ok\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)


@contextlib.contextmanager
def _locked(state_dir: str | os.PathLike) -> Iterator[None]:
    directory = cards_dir(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: a planted `.lock` symlink must not make root create or open a file elsewhere
    fd = os.open(directory / ".lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def update_card_state(
    state_dir: str | os.PathLike, bdf: str, change: Callable[[CardState], Any],
    replace_corrupt: bool = False,
) -> CardState:
    """Read-modify-write one card's state under the state-dir lock (watcher and reconcile share it).

    A corrupt file raises StateFileError and is left alone, unless ``replace_corrupt``: then it is
    kept as ``<BDF>.json.corrupt-<unix ns>`` and ``change`` applies to a fresh state that starts
    unhealthy (the lost file may have said the card was fenced)."""
    path = card_state_path(state_dir, bdf)
    with _locked(state_dir):
        try:
            state = read_card_state(state_dir, bdf) or CardState(bdf=bdf)
        except StateFileError as exc:
            if not replace_corrupt:
                raise
            kept = keep_corrupt(path)
            state = CardState(bdf=bdf, healthy=False, unhealthy_since=time.time(),
                              unhealthy_reason=f"ops state file was unreadable ({exc.reason}); kept as {kept.name}")
        seen_log = _SeenLog(path.with_name(f"{bdf}.seen"))
        state.seen_ids = seen_log.load(state.seen_ids, state.last_seen_ids)
        seen_log.settle()
        state.last_seen_ids = []
        unchanged = state.to_json()
        change(state)
        if state.to_json() == unchanged and path.exists():
            return state  # nothing to record (an event counted before): write nothing
        state.updated_at = time.time()
        atomic_write_json(path, state.to_json())
        seen_log.add(state.last_seen_ids)
    return state


def clear_card(state_dir: str | os.PathLike, bdf: str) -> CardState:
    """Mark a card healthy again (operator action after a reboot or reset restored it)."""

    def _clear(state: CardState) -> None:
        state.healthy = True
        state.unhealthy_reason = None
        state.unhealthy_since = None
        state.unhealthy_boot_id = None

    return update_card_state(state_dir, bdf, _clear, replace_corrupt=True)
