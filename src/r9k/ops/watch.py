"""Kernel-log watcher: follow the log, classify amdgpu events, count each exactly once, contain faults.

Exactly once across restarts: every event carries the kernel's own record identity -- kmsg boot id
+ sequence number, journal seqnum (per seqnum id) -- or, for saved text logs that have none, a
chained hash of the record and every record before it in the file (two boots of one kernel share
their first lines, never their whole history). Each card's state file records what it counted in
the same atomic write as the counts. The cursor file only says where to resume reading (written
when it moved, not synced: losing it costs a re-read); a file that was truncated or replaced under
the cursor is read again from the start, which the identities make safe. Files are streamed in
chunks with records cut at ``MAX_RECORD_BYTES``; a complete record is handled at once.

Provenance: kmsg facility 0 and the journal's ``_TRANSPORT=kernel`` prove a record is the
kernel's; a syslog file's ``kernel:`` tag does not (``logger -t kernel`` writes the same line).
Events from such lines are reported, not counted or acted on, unless the tag is trusted.

Containment (decided by the pure core `r9k.ops.containment`): a fault fences its card first (state
written), then the hooks run in their own threads, once per change of a card from healthy to
unhealthy, each with the configured timeout.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from r9k.ops import sysfs
from r9k.ops.config import HOOK_CWD, hook_problem
from r9k.ops.containment import Containment
from r9k.ops.kernlog import Classifier, KernelEvent, LogLine, parse_journal_json, parse_kmsg_record, parse_text_line
from r9k.ops.state import (
    DEFAULT_FAULT_EVENTS, atomic_write_json, beat, cap_message, read_card_states, update_card_state,
    update_host_events,
)

CURSOR_FILE = "watch-cursor.json"
_KMSG_HEADER = re.compile(r"^\d+,\d+,\d+,[^;]*;")
# Kernel records are under 1 KiB; a longer line is cut here so one line cannot exhaust memory.
MAX_RECORD_BYTES = 16 * 1024
READ_CHUNK_BYTES = 1 << 20
# Bytes before the resume offset that must be unchanged for the cursor to still apply.
_CHECK_BYTES = 4096


class SourceError(Exception):
    """The log source failed (journalctl exited, the file vanished): the watcher cannot go on."""


def _parse_any(text: str, stream: str, ordinal: int, record_id: str) -> LogLine | None:
    """One record from a saved log in whatever format it was saved."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        # The journal's own identity (seqnum), so a file export and the live journal agree.
        return parse_journal_json(stripped)
    if _KMSG_HEADER.match(text):
        kmsg = parse_kmsg_record(text, stream)  # None for a process's record (LOG_USER)
        if kmsg is None:
            return None
        return LogLine(kmsg.message, stream, ordinal, kmsg.device_bdf, kmsg.timestamp, kmsg.mono_s, record_id)
    line = parse_text_line(text.split("\n", 1)[0], stream, ordinal)
    if line is not None:
        line.record_id = record_id
    return line


def iter_records(fh: IO[bytes], start: int, final: bool) -> Iterator[tuple[int, str, int]]:
    """Stream records (a line plus its `` KEY=value`` continuation lines) from ``fh`` at ``start``.

    Yields (offset, text, end offset). Lines longer than MAX_RECORD_BYTES are cut (the rest of the
    line is skipped). An unfinished last line is left for the next read unless ``final`` (with
    its record, when it is a continuation line). A finished record is yielded at once, also the
    last one: the kernel hands out a record with its continuation lines in one read, so they are
    written together (waiting for the next record left the MES timeout before a hang unhandled).
    """
    pending: list[Any] | None = None  # [offset, text, end]
    pending_unfinished = False  # its next continuation line is still being written
    pos = start
    while True:
        raw = fh.readline(MAX_RECORD_BYTES)  # buffered, in C; bounded
        if not raw:
            break
        line_start, end = pos, pos + len(raw)
        complete = raw.endswith(b"\n")
        while not complete and len(raw) >= MAX_RECORD_BYTES:  # an over-long line: skip its rest
            rest = fh.readline(READ_CHUNK_BYTES)
            if not rest:
                break
            end += len(rest)
            complete = rest.endswith(b"\n")
            if complete or len(rest) < READ_CHUNK_BYTES:
                break
        if not complete and not final:
            pending_unfinished = raw.startswith(b" ")
            break  # unfinished: read again next time
        pos = end
        text = raw.rstrip(b"\n").decode("utf-8", "replace")
        if text.startswith(" ") and "=" in text and pending is not None:
            pending[1] += "\n" + text
            pending[2] = end
            continue
        if pending is not None:
            yield tuple(pending)
        pending = [line_start, text, end]
    if pending is not None and not pending_unfinished:
        yield tuple(pending)


def _chain(previous: str, text: str) -> str:
    """The identity of a record: CRC-32 and Adler-32 chained over every record of the file up to
    and including it (cheap C calls per line; 64 bits, compared only among one card's ids)."""
    crc, adler = (int(previous[:8], 16), int(previous[8:16], 16)) if previous else (0, 1)
    data = text.encode("utf-8", "replace") + b"\n"
    return f"{zlib.crc32(data, crc):08x}{zlib.adler32(data, adler):08x}"


class FileSource:
    """A saved or growing log file, streamed. Records are identified by a hash chained from the
    file's first record (see the module docstring); the cursor keeps offset, chain and a hash of
    the bytes before the offset, so truncation (``copytruncate``) or replacement is noticed."""

    def __init__(self, path: str | os.PathLike, resume: dict[str, Any] | None = None):
        self.path = Path(path)
        self.key = f"file:{self.path.resolve()}"
        self.stream = self.key
        self.offset = 0
        self.chain = ""
        self.check: str | None = None
        self.gaps: list[str] = []
        self._before: tuple[int, str] = (0, "")  # offset and chain just before the last line read
        resume = resume or {}
        if isinstance(resume.get("offset"), int) and isinstance(resume.get("chain"), str):
            self.offset, self.chain, self.check = resume["offset"], resume["chain"], resume.get("check")

    def _tail_hash(self, fh: IO[bytes], offset: int) -> str:
        begin = max(0, offset - _CHECK_BYTES)
        fh.seek(begin)
        return hashlib.sha1(fh.read(offset - begin)).hexdigest()

    def _still_valid(self, fh: IO[bytes]) -> bool:
        if self.offset == 0:
            return True
        size = os.fstat(fh.fileno()).st_size
        if size < self.offset:
            self.gaps.append(f"{self.path} was truncated (size {size} < offset {self.offset}): reading it again")
            return False
        if self.check is not None and self._tail_hash(fh, self.offset) != self.check:
            self.gaps.append(f"{self.path} was truncated or replaced under the cursor: reading it again")
            return False
        return True

    def read(self, final: bool = False) -> Iterator[LogLine]:
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return  # rotated away; a new file of that name is read when it appears
        with fh:
            if not self._still_valid(fh):
                self.offset, self.chain = 0, ""
            fh.seek(self.offset)
            for offset, text, end in iter_records(fh, self.offset, final):
                self._before = (offset, self.chain)
                self.chain = _chain(self.chain, text)
                self.offset = end
                line = _parse_any(text, self.stream, offset, self.chain)
                if line is not None:
                    yield line
            self.check = self._tail_hash(fh, self.offset)

    def position(self) -> dict[str, Any]:
        return {"offset": self.offset, "chain": self.chain, "check": self.check}

    def position_before(self) -> dict[str, Any]:
        """Where to resume to read the last line again (no tail check: it was taken mid-file)."""
        return {"offset": self._before[0], "chain": self._before[1], "check": None}

    def close(self) -> None:
        pass


class KmsgSource:
    """``/dev/kmsg`` (one record per read, EPIPE when records were overwritten) or a file in that
    format. Stream = boot id; ordinal = sequence number, so a restart skips what it counted."""

    def __init__(self, path: str | os.PathLike, boot: str | None, resume: dict[str, Any] | None = None):
        self.path = Path(path)
        self.key = "kmsg"
        self.stream = f"kmsg:{boot or 'unknown-boot'}"
        resume = resume or {}
        self.last_seq: int | None = resume.get("seq") if resume.get("stream") == self.stream else None
        self._before_seq = self.last_seq
        self.gaps: list[str] = []
        self._is_device = stat.S_ISCHR(os.stat(self.path).st_mode)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._offset = 0

    def _raw_records(self, final: bool) -> Iterator[str]:
        if self._is_device:
            while True:
                try:
                    chunk = os.read(self._fd, 16384)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EPIPE:
                        self.gaps.append("kmsg: records overwritten before they were read")
                        continue
                    raise
                if not chunk:
                    break
                yield chunk.decode("utf-8", "replace").rstrip("\n")
            return
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            for _, text, end in iter_records(fh, self._offset, final):
                self._offset = end
                yield text

    def read(self, final: bool = False) -> Iterator[LogLine]:
        for text in self._raw_records(final):
            line = parse_kmsg_record(text, self.stream)
            if line is None:
                continue
            if self.last_seq is not None:
                if line.ordinal <= self.last_seq:
                    continue
                if line.ordinal > self.last_seq + 1:
                    self.gaps.append(f"kmsg: {line.ordinal - self.last_seq - 1} records lost after seq {self.last_seq}")
            self._before_seq, self.last_seq = self.last_seq, line.ordinal
            yield line

    def position(self) -> dict[str, Any]:
        return {"stream": self.stream, "seq": self.last_seq}

    def position_before(self) -> dict[str, Any]:
        return {"stream": self.stream, "seq": self._before_seq}

    def close(self) -> None:
        os.close(self._fd)


class JournalSource:
    """``journalctl _TRANSPORT=kernel -o json`` (``-f`` to follow), resuming after the saved cursor.

    journalctl reports failures on stderr with a non-zero exit: both are checked, and a journalctl
    that exits (while following, or non-zero) raises SourceError with its last stderr line."""

    def __init__(self, host_root: str | os.PathLike, follow: bool, resume: dict[str, Any] | None = None,
                 journalctl: str = "journalctl"):
        self.key = "journal"
        self.cursor = (resume or {}).get("cursor")
        self._before_cursor = self.cursor
        self.gaps: list[str] = []
        self._buf = bytearray()
        self._follow = follow
        self._host_root, self._journalctl = host_root, journalctl
        # the saved cursor is on trial until journalctl hands out a record after it
        self._cursor_on_trial = bool(self.cursor)
        self._start(journal_argv(host_root, follow, self.cursor, journalctl))

    def _start(self, argv: list[str]) -> None:
        self.argv = argv
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self._stderr,
                                      stdin=subprocess.DEVNULL)
        os.set_blocking(self._proc.stdout.fileno(), False)

    def _fall_back_from_cursor(self) -> bool:
        """journalctl exited non-zero before handing out any record after the saved cursor, how
        soon after starting does not matter (rotated away, another machine's journal, a slow
        seek): read this boot from its start instead of failing every restart; the per-card
        positions keep what was counted counted once. True when it started again."""
        if not self._cursor_on_trial or self._proc.poll() in (None, 0):
            return False
        why = self._last_stderr_line()
        self.gaps.append(f"journal: saved cursor unusable ({why}); read this boot from its start")
        self._cursor_on_trial = False
        self.cursor = self._before_cursor = None
        self._stderr.close()
        self._buf.clear()
        self._start(journal_argv(self._host_root, self._follow, None, self._journalctl))
        return True

    def _last_stderr_line(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 4096))
        lines = self._stderr.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1].strip() if lines else "no message on stderr"

    def _lines(self, final: bool) -> Iterator[bytes]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        if final and not self._follow:
            os.set_blocking(fd, True)  # read to EOF: waiting first would deadlock on a full pipe
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buf += chunk
            while True:
                nl = self._buf.find(b"\n")
                if nl < 0:
                    break
                line = bytes(self._buf[:nl])
                del self._buf[:nl + 1]
                yield line
            if len(self._buf) > MAX_RECORD_BYTES:  # a line without end: keep its head only
                yield bytes(self._buf[:MAX_RECORD_BYTES])
                self._buf.clear()

    def read(self, final: bool = False) -> Iterator[LogLine]:
        while True:
            for raw in self._lines(final):
                self._cursor_on_trial = False  # journalctl answered: the cursor was taken
                text = raw.decode("utf-8", "replace")
                line = parse_journal_json(text)
                if line is None:
                    continue
                try:
                    cursor = json.loads(text).get("__CURSOR", self.cursor)
                except json.JSONDecodeError:
                    cursor = self.cursor
                self._before_cursor, self.cursor = self.cursor, cursor
                yield line
            if final and not self._follow:
                self._proc.wait()
            if not self._fall_back_from_cursor():
                break
        self._check_exit()

    def _check_exit(self) -> None:
        returncode = self._proc.poll()
        if returncode is None or (returncode == 0 and not self._follow):
            return
        raise SourceError(f"journalctl exited with status {returncode}: {self._last_stderr_line()} "
                          f"({' '.join(self.argv)})")

    def position(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def position_before(self) -> dict[str, Any]:
        return {"cursor": self._before_cursor}

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        self._stderr.close()


def journal_argv(host_root: str | os.PathLike, follow: bool, cursor: str | None,
                 journalctl: str = "journalctl") -> list[str]:
    # _TRANSPORT=kernel, not -k: -k implies -b, which after a reboot skipped the previous boot's
    # records the cursor had not reached yet
    argv = [journalctl, "_TRANSPORT=kernel", "-o", "json", "--no-pager"]
    if Path(host_root).resolve() != Path("/"):
        argv += ["--root", str(host_root)]
    argv += [f"--after-cursor={cursor}"] if cursor else ["-b"]
    if follow:
        argv.append("-f")
    return argv


def open_source(spec: str, host_root: str | os.PathLike, state_dir: str | os.PathLike | None,
                follow: bool) -> FileSource | KmsgSource | JournalSource:
    """``kmsg``, ``journal``, ``auto`` (kmsg when readable, else journal) or a file path."""
    cursors = load_cursors(state_dir)
    if spec == "auto":
        kmsg = sysfs.host_path(host_root, "/dev/kmsg")
        spec = "kmsg" if os.access(kmsg, os.R_OK) else "journal"
    if spec == "kmsg":
        return KmsgSource(sysfs.host_path(host_root, "/dev/kmsg"), sysfs.boot_id(host_root), cursors.get("kmsg"))
    if spec == "journal":
        journalctl = shutil.which("journalctl")
        if journalctl is None:
            raise FileNotFoundError("journalctl not found on PATH (use --source kmsg or a file)")
        return JournalSource(host_root, follow, cursors.get("journal"), journalctl)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"log source {spec}: not a readable file (expected kmsg, journal or a file)")
    with open(path, "rb"):
        pass
    return FileSource(path, cursors.get(f"file:{path.resolve()}"))


def load_cursors(state_dir: str | os.PathLike | None) -> dict[str, Any]:
    if state_dir is None:
        return {}
    try:
        data = json.loads((Path(state_dir) / CURSOR_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


SYSLOG_UNAUTHENTICATED = ("syslog line, a kernel record by its `kernel:` tag alone, which any local user "
                          "can write (logger -t kernel): not counted, fenced or handed to hooks")


@dataclass
class HookRun:
    argv: list[str]
    returncode: int | None
    error: str | None = None
    bdf: str | None = None
    event_type: str | None = None
    duration_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"hook": self.argv, "bdf": self.bdf, "event": self.event_type, "returncode": self.returncode,
                "error": self.error, "duration_s": self.duration_s}


@dataclass
class Seen:
    """An event as the watcher handled it: new (counted now) or already counted before.
    ``host`` marks an event no card could be named for (counted as a host-level event)."""

    event: KernelEvent
    new: bool
    fault: bool
    host: bool = False
    fenced_now: bool = False
    unsaved: str | None = None  # why the state dir did not take this event (contained anyway)
    unauthenticated: str | None = None  # why it was not counted or acted on (a forgeable source)

    def to_json(self) -> dict[str, Any]:
        data = self.event.to_json()
        data.pop("record_id", None)
        data.update(new=self.new, fault=self.fault, host=self.host, fenced_now=self.fenced_now,
                    unsaved=self.unsaved, unauthenticated=self.unauthenticated)
        return data


def run_hooks(hooks: list[list[str]], event: KernelEvent, timeout_s: float = 60.0) -> list[HookRun]:
    """Run each hook once for ``event`` (blocking; the watcher calls it off its loop)."""
    env = dict(os.environ, R9K_EVENT=event.type, R9K_BDF=event.bdf or "", R9K_MESSAGE=cap_message(event.message))
    runs = []
    for argv in hooks:
        started = time.monotonic()
        problem = hook_problem(argv)  # checked again now: the files may have changed since load
        if problem:
            runs.append(HookRun(argv, None, f"not run: {problem}", event.bdf, event.type, 0.0))
            continue
        try:
            # stderr to a file, not a pipe: a child that left the process group (setsid ... &)
            # and kept stderr open would hold a pipe's EOF, and the reader, past the deadline
            with tempfile.TemporaryFile() as stderr_file:
                # its own process group: a hook killed on timeout takes its children with it
                # cwd: the directory hook_problem judged relative words against
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=stderr_file, start_new_session=True, cwd=HOOK_CWD)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    runs.append(HookRun(argv, None, f"timed out after {timeout_s:g} s (killed with its "
                                        "process group)", event.bdf, event.type,
                                        round(time.monotonic() - started, 3)))
                    continue
                error = None
                if proc.returncode:
                    size = os.fstat(stderr_file.fileno()).st_size
                    tail = os.pread(stderr_file.fileno(), 4096, max(0, size - 4096))
                    error = tail.decode(errors="replace").strip()[-200:] or None
            runs.append(HookRun(argv, proc.returncode, error, event.bdf, event.type,
                                round(time.monotonic() - started, 3)))
        except OSError as exc:
            runs.append(HookRun(argv, None, str(exc), event.bdf, event.type, round(time.monotonic() - started, 3)))
    return runs


class Watcher:
    """Classify lines from a source; with a state dir, count, persist and contain."""

    def __init__(
        self,
        source: FileSource | KmsgSource | JournalSource,
        state_dir: str | os.PathLike | None,
        host_root: str | os.PathLike = "/",
        hooks: list[list[str]] | None = None,
        fault_events: list[str] | tuple[str, ...] = DEFAULT_FAULT_EVENTS,
        on_event: Callable[[Seen], None] | None = None,
        hook_timeout_s: float = 60.0,
        on_hook: Callable[[HookRun], None] | None = None,
        trust_syslog_kernel_tag: bool = False,
        on_warning: Callable[[str], None] | None = None,
        heartbeat: bool = True,
    ):
        self.source = source
        # only a following watcher beats: a one-shot run must not make a dead one look alive
        self.heartbeat = heartbeat
        self.state_dir = state_dir
        self.hooks = hooks or []
        self.hook_timeout_s = hook_timeout_s
        self.on_event = on_event
        self.on_hook = on_hook
        self.hook_runs: list[HookRun] = []
        self._hook_threads: list[threading.Thread] = []
        self._hook_lock = threading.Lock()
        states = read_card_states(state_dir) if state_dir else {}
        self.classifier = Classifier(last_types={b: s.last_event.type for b, s in states.items() if s.last_event})
        # every decision (new? fault? fenced now? hooks?) is the pure core's; when the state dir
        # stops taking writes (full, remounted read-only), it contains faults from memory
        self.containment = Containment(fault_events, sysfs.boot_id(host_root),
                                       fenced=[b for b, st in states.items() if not st.healthy])
        # events the state dir did not take, tried again at every poll; until all are saved the
        # log position saved stays before the first of them, so a restart reads it again
        self._unsaved_events: list[tuple[KernelEvent, bool]] = []
        self._pinned_position: dict[str, Any] | None = None
        self.cursor_error: str | None = None
        # the log position last written: an idle poll (nothing read) writes nothing durable
        self._saved_position = load_cursors(state_dir).get(source.key) if state_dir else None
        self.trust_syslog_kernel_tag = trust_syslog_kernel_tag
        self.on_warning = on_warning or print_warning
        # untrusted syslog lines get a classifier of their own: a forged addressed line must not
        # become the evidence that gives a real unaddressed kernel line to a card
        self._syslog_classifier = Classifier()
        self._syslog_warned = False

    def is_fault(self, event: KernelEvent) -> bool:
        return self.containment.is_fault(event)

    def poll(self, final: bool = False) -> list[Seen]:
        seen = []
        self._save_unsaved()
        for line in self.source.read(final):
            if line.syslog_tagged:
                self._warn_syslog()
                if not self.trust_syslog_kernel_tag:
                    event = self._syslog_classifier.classify(line)
                    if event is not None:
                        seen.append(self._report_unauthenticated(event))
                    continue
            event = self.classifier.classify(line)
            if event is not None:
                item = self._handle(event)
                seen.append(item)
                if item.unsaved and item.new:
                    self._unsaved_events.append((event, item.fault))
                    if self._pinned_position is None:
                        self._pinned_position = self.source.position_before()
        if self.state_dir is not None:
            position = self._pinned_position or self.source.position()
            if position != self._saved_position:
                cursors = load_cursors(self.state_dir)
                cursors[self.source.key] = position
                try:
                    atomic_write_json(Path(self.state_dir) / CURSOR_FILE, cursors, durable=False)
                    self._saved_position = position
                    self.cursor_error = None
                except OSError as exc:  # a restart re-reads; saved events say "already counted"
                    self.cursor_error = f"log position not saved to {self.state_dir}: {exc.strerror or exc}"
            if self.heartbeat:
                beat(self.state_dir)
        return seen

    def _save_unsaved(self) -> None:
        """Try again to record the events the state dir did not take (contained from memory
        meanwhile; their hooks already ran); once all are in, the log position may move on."""
        if not self._unsaved_events:
            return
        left = []
        for event, fault in self._unsaved_events:
            if event.bdf is None:
                try:
                    self._count_on_host(event)
                except OSError:
                    left.append((event, fault))
            elif self._count_for_card(event, fault, retry=True).unsaved:
                left.append((event, fault))
        self._unsaved_events = left
        if not left:
            self._pinned_position = None

    def _warn_syslog(self) -> None:
        if self._syslog_warned:
            return
        self._syslog_warned = True
        where = getattr(self.source, "path", self.source.key)
        if self.trust_syslog_kernel_tag:
            self.on_warning(f"{where}: syslog `kernel:` lines are trusted (trust_syslog_kernel_tag): any "
                            "local user can write one (logger -t kernel) and fence a card; /dev/kmsg "
                            "(facility 0) and the journal (_TRANSPORT=kernel) prove a record is the kernel's")
            return
        self.on_warning(f"{where}: a syslog file cannot prove a `kernel:` line is the kernel's (any local "
                        "user can write one: logger -t kernel); its events are reported, not counted, "
                        "fenced or handed to hooks. Sources that prove it: /dev/kmsg (facility 0, --source "
                        "kmsg) and the journal (_TRANSPORT=kernel, --source journal); to act on syslog "
                        "lines anyway: trust_syslog_kernel_tag: true in the ops config")

    def _report_unauthenticated(self, event: KernelEvent) -> Seen:
        # without a state dir (post-mortem) nothing is counted or acted on anyway: new as read
        item = Seen(event, new=self.state_dir is None, fault=self.is_fault(event), host=event.bdf is None,
                    unauthenticated=SYSLOG_UNAUTHENTICATED)
        if self.on_event:
            self.on_event(item)
        return item

    def _handle(self, event: KernelEvent) -> Seen:
        fault = self.is_fault(event)
        if self.state_dir is None:
            item = Seen(event, new=True, fault=fault, host=event.bdf is None)
        elif event.bdf is None:
            try:
                item = Seen(event, new=self._count_on_host(event), fault=fault, host=True)
            except OSError as exc:
                item = Seen(event, new=self.containment.first_unsaved(event), fault=fault, host=True,
                            unsaved=self._unsaved(exc))
        else:
            item = self._count_for_card(event, fault)
        if self.on_event:
            self.on_event(item)
        return item

    def _count_on_host(self, event: KernelEvent) -> bool:
        """Count an event no card could be named for in the host's stored events (OSError when
        the state dir takes no write); True when counted now."""
        return update_host_events(self.state_dir,
                                  lambda doc: self.containment.count_on_host(doc, event, time.time()),
                                  on_corrupt=self.on_warning)

    def _count_for_card(self, event: KernelEvent, fault: bool, retry: bool = False) -> Seen:
        """Count ``event`` on its card's stored state (the core decides, the state dir keeps it);
        ``retry``: an event contained from memory before, now saved (its hooks ran then)."""
        counted = None

        def change(state):
            nonlocal counted
            counted = self.containment.count(state, event, fault, time.time())

        # A corrupt state file is kept aside and the card starts unhealthy: never lose the fault.
        unsaved = None
        try:
            update_card_state(self.state_dir, event.bdf, change, replace_corrupt=True)
        except OSError as exc:
            unsaved = self._unsaved(exc)
            counted = self.containment.count_unsaved(event, fault)
        if self.containment.hooks_due(event, counted, retry=retry) and self.hooks:
            self._start_hooks(event)
        return Seen(event, new=counted.new, fault=fault, fenced_now=counted.fenced_now, unsaved=unsaved)

    def _unsaved(self, exc: OSError) -> str:
        return f"not saved to {self.state_dir}: {exc.strerror or exc}"

    def _start_hooks(self, event: KernelEvent) -> None:
        def work():
            for run in run_hooks(self.hooks, event, self.hook_timeout_s):
                with self._hook_lock:
                    self.hook_runs.append(run)
                if self.on_hook:
                    self.on_hook(run)

        thread = threading.Thread(target=work, name=f"r9k-hooks-{event.bdf}", daemon=True)
        self._hook_threads.append(thread)
        thread.start()

    def wait_for_hooks(self, timeout_s: float | None = None) -> list[HookRun]:
        """Wait for started hooks (each is bounded by ``hook_timeout_s``); the runs so far."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._hook_threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._hook_threads = [t for t in self._hook_threads if t.is_alive()]
        with self._hook_lock:
            return list(self.hook_runs)

    def run(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        while not stop.is_set():
            self.poll()
            stop.wait(interval_s)


_print_lock = threading.Lock()


def print_event(item: Seen, as_json: bool, out=None) -> None:
    out = out or sys.stdout
    if as_json:
        with _print_lock:
            print(json.dumps(item.to_json()), file=out, flush=True)
        return
    e = item.event
    flags = " (no card: host event)" if item.host else ""
    # an unauthenticated event is not counted at all: "(already counted)" would mislead
    flags += "" if item.new or item.unauthenticated else " (already counted)"
    flags += (" FAULT" if item.fault else "") + (" -> fenced" if item.fenced_now else "")
    flags += f" (NOT SAVED: {item.unsaved})" if item.unsaved else ""
    flags += f" (NOT ACTED ON: {item.unauthenticated})" if item.unauthenticated else ""
    detail = " ".join(f"{k}={v}" for k, v in e.detail.items())
    with _print_lock:
        print(f"{e.timestamp or '-':>14} {e.bdf or 'no-card':<13} {e.type:<17} {detail}{flags}  | {e.message}",
              file=out, flush=True)


def print_warning(message: str, out=None) -> None:
    """``warning: ...`` on stderr (the CLI's other warnings go there too, also with --json)."""
    with _print_lock:
        print(f"warning: {message}", file=out or sys.stderr, flush=True)


def print_hook(run: HookRun, as_json: bool, out=None) -> None:
    out = out or sys.stdout
    with _print_lock:
        if as_json:
            print(json.dumps(run.to_json()), file=out, flush=True)
            return
        status = f"rc={run.returncode}" if run.returncode is not None else f"error: {run.error}"
        print(f"{'':>14} {run.bdf or '-':<13} hook {' '.join(run.argv)}: {status}", file=out, flush=True)
