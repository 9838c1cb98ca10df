"""MES event-log liveness (optional, ``r9k exporter --debugfs``): per card, has amdgpu's MES event
log changed since this exporter last saw it change, and for how many seconds has it not.

Why: on gfx1201 (R9700) the MES firmware has been seen going silent minutes before the driver's
first ``MES failed to respond to msg=REMOVE_QUEUE``: with ``amdgpu.mes_log_enable=1`` the event
log in debugfs stopped advancing while the card read 100 % busy and every ring was idle (ROCm
issue ROCm/legacy-rocm-build#6630, "gfx1201 R9700 ... MES queue failure and PSP reset").

Facts relied on, from the kernel sources (drivers/gpu/drm/amd/amdgpu/amdgpu_mes.c, mes_v11_0.c,
mes_v12_0.c; drivers/gpu/drm/drm_debugfs.c; fs/seq_file.c and lib/hexdump.c):
amdgpu creates ``amdgpu_mes_event_log`` (mode 0444) in the primary DRM minor's debugfs directory,
``/sys/kernel/debug/dri/<minor>/``, only when the card runs MES and ``amdgpu.mes_log_enable=1``
(the default is 0, so a missing file means "not enabled", not a fault). Reading it prints the whole
firmware ring buffer with ``seq_hex_dump(..., DUMP_PREFIX_OFFSET, 32, 4, ..., false)``: rows of
``<8-hex-digit byte offset>: `` and up to eight 32-bit words as 8 lowercase hex digits separated by
one blank, offsets 0, 0x20, 0x40, ...; the ring is ``AMDGPU_MES_LOG_BUFFER_SIZE`` (0x4000 bytes),
times the MES pipes with unified MES on gfx12, plus a scratch area on MES v11. The file reports
no size and no write pointer, so "advanced" here means its content digest changed. Each
``dri/<minor>/name`` reads ``amdgpu dev=<PCI address> unique=<PCI address>`` (drm_name_info),
which keys a directory to its card; on current kernels ``dri/<minor>`` and the render minor's
``dri/<128+n>`` are symlinks to one ``dri/<PCI address>/`` directory, on older ones the render
minor has its own directory without amdgpu's files; ``dri/client-N/`` (per open file) have no
``name``. debugfs is mounted root-only (mode 0700) on common distributions: a non-root exporter
cannot list it, which is exported as ``r9k_host_debugfs_readable 0`` and counted, never raised.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from r9k.monitoring.scrape_errors import ScrapeErrors
from r9k.ops import sysfs
from r9k.ops.state import BDF_RE

DEFAULT_DEBUGFS = "/sys/kernel/debug"
LOG_FILE = "amdgpu_mes_event_log"
_ROW_BYTES = 32
_ROW_RE = re.compile(r"([0-9a-f]{8}): [0-9a-f]{8}(?: [0-9a-f]{8}){0,7}")
# The dump of the largest ring (2 x 0x4000 bytes + scratch) is about 100 KB; far more is not this file.
_MAX_TEXT_BYTES = 4 * 1024 * 1024
# A scrape waits this long for the cards' reads together; a read still blocked then (a debugfs
# read can wait on the hung firmware's lock) reads as unreadable this scrape, in its own thread.
READ_DEADLINE_S = 1.0


class MesLogMalformed(ValueError):
    """A card's event log is not the hex dump amdgpu prints (the format changed, or a torn read)."""


def card_of_name(text: str) -> str | None:
    """The PCI address in a ``dri/<minor>/name`` line of amdgpu; None for another driver or no address."""
    fields = text.split()
    if not fields or fields[0] != "amdgpu":
        return None
    values = dict(field.split("=", 1) for field in fields[1:] if "=" in field)
    for key in ("dev", "unique"):
        value = values.get(key, "").lower()
        if BDF_RE.match(value):
            return value
    return None


def log_digest(data: bytes) -> bytes:
    """Digest of an event log after checking it is the documented hex dump; MesLogMalformed if not."""
    if len(data) > _MAX_TEXT_BYTES:
        raise MesLogMalformed(f"{len(data)} bytes; expected a hex dump of at most {_MAX_TEXT_BYTES}")
    try:
        rows = data.decode("ascii").splitlines()
    except UnicodeDecodeError as exc:
        raise MesLogMalformed(f"not ASCII (byte {exc.start})") from None
    if not rows:
        raise MesLogMalformed("empty; expected hex dump rows")
    for index, row in enumerate(rows):
        match = _ROW_RE.fullmatch(row)
        if match is None or int(match.group(1), 16) != index * _ROW_BYTES:
            raise MesLogMalformed(f"row {index + 1} {row[:40]!r}; expected "
                                  f"'{index * _ROW_BYTES:08x}: ' and 32-bit hex words")
    return hashlib.blake2b(data, digest_size=16).digest()


def find_card_logs(dri: Path) -> tuple[dict[str, Path | None], int]:
    """Per card (PCI address) its event log, or None where amdgpu made none (mes_log_enable=0),
    and the number of directories that could not be read. Raises OSError when ``dri`` cannot be
    listed (debugfs not mounted, or root-only and this process not root)."""
    logs: dict[str, Path | None] = {}
    failures = 0
    for entry in sorted(os.listdir(dri)):
        directory = dri / entry
        try:
            bdf = card_of_name((directory / "name").read_text(errors="replace"))
        except (FileNotFoundError, NotADirectoryError):
            continue  # client-N directories, stray files
        except OSError:
            failures += 1
            continue
        if bdf is None:
            continue
        log = directory / LOG_FILE
        if _absent(log):
            logs.setdefault(bdf, None)  # e.g. a render minor's own directory on older kernels
            continue
        logs[bdf] = log
    return logs, failures


def _absent(path: Path) -> bool:
    """True only when the file does not exist; another stat error (EACCES, EIO during a reset)
    keeps the path, so reading it reports why, for that card alone."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


class _Read:
    """One read of one card's event log, in a thread of its own: a read that blocks holds that
    thread only (one per card at most: a card's next read waits for it), never a scrape."""

    def __init__(self, bdf: str, path: Path) -> None:
        self.done = threading.Event()
        self.digest: bytes | None = None
        self.error: Exception | None = None
        threading.Thread(target=self._run, args=(path,), name=f"r9k-mes-log-{bdf}",
                         daemon=True).start()

    def _run(self, path: Path) -> None:
        try:
            with open(path, "rb") as log:
                self.digest = log_digest(log.read(_MAX_TEXT_BYTES + 1))
        except (OSError, MesLogMalformed) as exc:
            self.error = exc
        finally:
            self.done.set()


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class MesLogCollector:
    """Per card: log enabled, readable, seconds unchanged; the debugfs tree readable (host)."""

    def __init__(self, errors: ScrapeErrors, host_root: str | os.PathLike = "/",
                 debugfs: str | os.PathLike = DEFAULT_DEBUGFS,
                 clock: Callable[[], float] = time.monotonic, read_deadline_s: float = READ_DEADLINE_S) -> None:
        self.errors = errors
        self.dri = sysfs.host_path(host_root, os.fspath(debugfs)) / "dri"
        self.clock = clock  # monotonic: a wall-clock step must not look like a stall
        self.read_deadline_s = read_deadline_s
        self._lock = threading.Lock()  # scrapes run in parallel server threads
        # bdf -> (digest, when it changed); digest None: never read since it was first seen
        self._last_change: dict[str, tuple[bytes | None, float]] = {}
        self._reads: dict[str, _Read] = {}  # bdf -> its latest read (maybe still blocked)

    def unreadable_reason(self) -> str | None:
        """Why the dri directory cannot be listed (for a warning at start), or None."""
        try:
            os.listdir(self.dri)
        except OSError as exc:
            return _why(self.dri, exc)
        return None

    def _read(self, bdf: str, path: Path) -> _Read:
        """A new read of the card's log, or its last one while that is still blocked."""
        read = self._reads.get(bdf)
        if read is None or read.done.is_set():
            read = self._reads[bdf] = _Read(bdf, path)
        return read

    def collect(self) -> Iterator[Metric]:
        host = _gauge("r9k_host_debugfs_readable",
                      "1 when the exporter could list debugfs dri/ for MES event logs (--debugfs); 0 when "
                      "not: debugfs not mounted, or root-only and the exporter not root.", [])
        try:
            logs, failures = find_card_logs(self.dri)
        except OSError:
            self.errors.count("debugfs")
            host.add_metric([], 0.0)
            yield host
            return
        self.errors.count("debugfs", failures)
        host.add_metric([], 1.0)
        enabled = _gauge("r9k_gpu_mes_log_enabled",
                         "1 when the card has a MES event log in debugfs; 0 when amdgpu made none "
                         "(amdgpu.mes_log_enable=0: not enabled, not a fault).", ["bdf"])
        readable = _gauge("r9k_gpu_mes_log_readable",
                          "1 when the card's MES event log was read as amdgpu's hex dump this scrape; 0 when "
                          "unreadable or malformed (counted in r9k_scrape_errors_total{source=\"debugfs\"}).",
                          ["bdf"])
        unchanged = _gauge("r9k_gpu_mes_log_unchanged_seconds",
                           "Seconds since this exporter last saw the card's MES event log change (0 at the "
                           "first read after the exporter started); it counts on while the log is unreadable.",
                           ["bdf"])
        now = self.clock()
        with self._lock:
            reads = {bdf: self._read(bdf, path) for bdf, path in logs.items() if path is not None}
        deadline = time.monotonic() + self.read_deadline_s
        for read in reads.values():
            read.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for bdf, path in sorted(logs.items()):
                enabled.add_metric([bdf], 0.0 if path is None else 1.0)
                if path is None:
                    self._last_change.pop(bdf, None)
                    continue
                read = reads[bdf]
                seen = self._last_change.setdefault(bdf, (None, now))
                if not read.done.is_set() or read.error is not None:
                    # Unreadable, malformed or blocked: the card's count goes on from its last
                    # change (or from when it was first seen), so a stall still alerts.
                    self.errors.count("debugfs")
                    readable.add_metric([bdf], 0.0)
                else:
                    readable.add_metric([bdf], 1.0)
                    if seen[0] != read.digest:
                        seen = self._last_change[bdf] = (read.digest, now)
                unchanged.add_metric([bdf], max(0.0, now - seen[1]))
            for gone in set(self._last_change) - set(logs):
                del self._last_change[gone]
                self._reads.pop(gone, None)
        yield host
        yield enabled
        yield readable
        yield unchanged


def _why(path: Path, exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{path}: {exc.strerror} (debugfs is root-only; run the exporter as root or drop --debugfs)"
    if exc.errno == errno.ENOENT:
        return f"{path}: no such directory (debugfs not mounted there, or no DRM driver loaded)"
    return f"{path}: {exc.strerror or exc}"
