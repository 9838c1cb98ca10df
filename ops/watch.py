"""Kernel-log watcher: follow the log, classify amdgpu events, count each exactly once, contain faults.

Exactly once across restarts: every event carries (stream, ordinal) -- kmsg boot id + sequence
number, journal seqnum, or file identity + byte offset -- and each card's state file records the
last ordinal counted per stream, in the same atomic write as the counts. The cursor file only
says where to resume reading.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from r9k.ops import sysfs
from r9k.ops.kernlog import Classifier, KernelEvent, LogLine, parse_journal_json, parse_kmsg_record, parse_text_line
from r9k.ops.state import (
    DEFAULT_FAULT_EVENTS, LastEvent, atomic_write_json, read_card_states, update_card_state,
)

CURSOR_FILE = "watch-cursor.json"
_KMSG_HEADER = re.compile(r"^\d+,\d+,\d+,[^;]*;")


def _parse_any(text: str, stream: str, ordinal: int) -> LogLine | None:
    """One record from a saved log in whatever format it was saved."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        line = parse_journal_json(stripped)
        if line is not None:
            # Position in the file orders lines of a saved log; keep the journal's own for display.
            return LogLine(line.message, stream, ordinal, line.device_bdf, line.timestamp)
        return None
    kmsg = parse_kmsg_record(text, stream)
    if kmsg is not None:
        return LogLine(kmsg.message, stream, ordinal, kmsg.device_bdf, kmsg.timestamp)
    return parse_text_line(text.split("\n", 1)[0], stream, ordinal)


def _split_records(data: bytes, base: int, final: bool) -> tuple[list[tuple[int, str]], int]:
    """Split bytes into records (a line plus its `` KEY=value`` continuation lines).

    Returns [(offset, text)] and how many bytes were consumed. An unfinished line, and a trailing
    kmsg record that may still get continuation lines, wait for the next read unless ``final``.
    """
    records: list[tuple[int, str]] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0 and not final:
            break
        end = len(data) if end < 0 else end
        text = data[pos:end].decode("utf-8", "replace")
        if text.startswith(" ") and "=" in text and records:
            records[-1] = (records[-1][0], records[-1][1] + "\n" + text)
        else:
            records.append((pos, text))
        pos = end + 1
    consumed = min(pos, len(data))
    if records and not final and _KMSG_HEADER.match(records[-1][1]):
        consumed = records.pop()[0]
    return [(base + start, text) for start, text in records], consumed


class FileSource:
    """A saved or growing log file. Stream identity = hash of its first line (survives renames)."""

    key_prefix = "file:"

    def __init__(self, path: str | os.PathLike, resume: dict[str, Any] | None = None):
        self.path = Path(path)
        self.key = f"file:{self.path.resolve()}"
        self.offset = 0
        self.stream: str | None = None
        self._resume = resume or {}
        self.gaps: list[str] = []

    def _identify(self) -> bool:
        if self.stream is not None:
            return True
        with open(self.path, "rb") as fh:
            head = fh.readline(4096)
        if not head.endswith(b"\n"):
            return False
        self.stream = "file:" + hashlib.sha1(head).hexdigest()[:16]
        if self._resume.get("stream") == self.stream and self._resume.get("offset", 0) <= self.path.stat().st_size:
            self.offset = int(self._resume["offset"])
        return True

    def read(self, final: bool = False) -> list[LogLine]:
        if not self._identify():
            return []
        with open(self.path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < self.offset:
                self.gaps.append(f"{self.path} shrank: reading it again from the start")
                self.offset = 0
            fh.seek(self.offset)
            data = fh.read()
        records, consumed = _split_records(data, self.offset, final)
        self.offset += consumed
        out = []
        for offset, text in records:
            line = _parse_any(text, self.stream, offset)
            if line is not None:
                out.append(line)
        return out

    def position(self) -> dict[str, Any]:
        return {"stream": self.stream, "offset": self.offset}

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
        self.gaps: list[str] = []
        self._is_device = stat.S_ISCHR(os.stat(self.path).st_mode)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._offset = 0

    def _raw_records(self, final: bool) -> list[str]:
        if self._is_device:
            out = []
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
                out.append(chunk.decode("utf-8", "replace").rstrip("\n"))
            return out
        os.lseek(self._fd, self._offset, os.SEEK_SET)
        data = b""
        while True:
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                break
            data += chunk
        records, consumed = _split_records(data, self._offset, final)
        self._offset += consumed
        return [text for _, text in records]

    def read(self, final: bool = False) -> list[LogLine]:
        out = []
        for text in self._raw_records(final):
            line = parse_kmsg_record(text, self.stream)
            if line is None:
                continue
            if self.last_seq is not None:
                if line.ordinal <= self.last_seq:
                    continue
                if line.ordinal > self.last_seq + 1:
                    self.gaps.append(f"kmsg: {line.ordinal - self.last_seq - 1} records lost after seq {self.last_seq}")
            self.last_seq = line.ordinal
            out.append(line)
        return out

    def position(self) -> dict[str, Any]:
        return {"stream": self.stream, "seq": self.last_seq}

    def close(self) -> None:
        os.close(self._fd)


class JournalSource:
    """``journalctl -k -o json`` (``-f`` to follow), resuming after the saved cursor."""

    def __init__(self, host_root: str | os.PathLike, follow: bool, resume: dict[str, Any] | None = None,
                 journalctl: str = "journalctl"):
        self.key = "journal"
        self.cursor = (resume or {}).get("cursor")
        self.gaps: list[str] = []
        self.argv = journal_argv(host_root, follow, self.cursor, journalctl)
        self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._buf = b""
        self._follow = follow

    def read(self, final: bool = False) -> list[LogLine]:
        assert self._proc.stdout is not None
        if not self._follow and final:
            self._proc.wait()
        while True:
            try:
                chunk = os.read(self._proc.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for raw in lines:
            text = raw.decode("utf-8", "replace")
            line = parse_journal_json(text)
            if line is None:
                continue
            try:
                self.cursor = json.loads(text).get("__CURSOR", self.cursor)
            except json.JSONDecodeError:
                pass
            out.append(line)
        return out

    def position(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=5)


def journal_argv(host_root: str | os.PathLike, follow: bool, cursor: str | None,
                 journalctl: str = "journalctl") -> list[str]:
    argv = [journalctl, "-k", "-o", "json", "--no-pager"]
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
        if shutil.which("journalctl") is None:
            raise FileNotFoundError("journalctl not found (use --source kmsg or a file)")
        return JournalSource(host_root, follow, cursors.get("journal"))
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


@dataclass
class HookRun:
    argv: list[str]
    returncode: int | None
    error: str | None = None


@dataclass
class Seen:
    """An event as the watcher handled it: new (counted now) or already counted before."""

    event: KernelEvent
    new: bool
    fault: bool
    hooks: list[HookRun] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = self.event.to_json()
        data.update(new=self.new, fault=self.fault,
                    hooks=[{"argv": h.argv, "returncode": h.returncode, "error": h.error} for h in self.hooks])
        return data


def run_hooks(hooks: list[list[str]], event: KernelEvent, timeout_s: float = 60.0) -> list[HookRun]:
    env = dict(os.environ, R9K_EVENT=event.type, R9K_BDF=event.bdf or "", R9K_MESSAGE=event.message)
    runs = []
    for argv in hooks:
        try:
            proc = subprocess.run(argv, env=env, timeout=timeout_s, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            runs.append(HookRun(argv, proc.returncode,
                                proc.stderr.decode(errors="replace").strip()[-200:] or None if proc.returncode else None))
        except (OSError, subprocess.TimeoutExpired) as exc:
            runs.append(HookRun(argv, None, str(exc)))
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
    ):
        self.source = source
        self.state_dir = state_dir
        self.hooks = hooks or []
        self.fault_events = set(fault_events)
        self.on_event = on_event
        self.boot = sysfs.boot_id(host_root)
        cursors = load_cursors(state_dir)
        states = read_card_states(state_dir) if state_dir else {}
        self.classifier = Classifier(
            context_bdf=(cursors.get(source.key) or {}).get("context_bdf"),
            last_types={b: s.last_event.type for b, s in states.items() if s.last_event},
        )

    def is_fault(self, event: KernelEvent) -> bool:
        if event.type == "ring_timeout" and event.detail.get("soft_recovered"):
            return False
        return event.type in self.fault_events

    def poll(self, final: bool = False) -> list[Seen]:
        seen = [self._handle(e) for e in (self.classifier.classify(line) for line in self.source.read(final)) if e]
        if self.state_dir is not None:
            cursors = load_cursors(self.state_dir)
            cursors[self.source.key] = {**self.source.position(), "context_bdf": self.classifier.context_bdf}
            atomic_write_json(Path(self.state_dir) / CURSOR_FILE, cursors)
        return seen

    def _handle(self, event: KernelEvent) -> Seen:
        fault = self.is_fault(event)
        if self.state_dir is None or event.bdf is None:
            item = Seen(event, new=self.state_dir is None, fault=fault)
        else:
            new = False

            def change(state):
                nonlocal new
                if state.seen(event.stream, event.ordinal):
                    return
                new = True
                state.counts[event.type] = state.counts.get(event.type, 0) + 1
                state.last_event = LastEvent(event.type, event.message, time.time(), dict(event.detail))
                state.mark_seen(event.stream, event.ordinal)
                if fault and state.healthy:
                    state.healthy = False
                    state.unhealthy_reason = f"{event.type}: {event.message}"
                    state.unhealthy_since = time.time()
                    state.unhealthy_boot_id = self.boot
                elif fault:
                    state.unhealthy_boot_id = self.boot

            update_card_state(self.state_dir, event.bdf, change)
            item = Seen(event, new=new, fault=fault)
            if new and fault and self.hooks:
                item.hooks = run_hooks(self.hooks, event)
        if self.on_event:
            self.on_event(item)
        return item

    def run(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        while not stop.is_set():
            self.poll()
            stop.wait(interval_s)


def print_event(item: Seen, as_json: bool, out=None) -> None:
    out = out or sys.stdout
    if as_json:
        print(json.dumps(item.to_json()), file=out, flush=True)
        return
    e = item.event
    flags = ("" if item.new else " (already counted)") + (" FAULT" if item.fault else "")
    detail = " ".join(f"{k}={v}" for k, v in e.detail.items())
    print(f"{e.timestamp or '-':>14} {e.bdf or 'unknown-card':<13} {e.type:<17} {detail}{flags}  | {e.message}",
          file=out, flush=True)
    for hook in item.hooks:
        status = f"rc={hook.returncode}" if hook.returncode is not None else f"error: {hook.error}"
        print(f"{'':>14} hook {' '.join(hook.argv)}: {status}", file=out, flush=True)
