"""Kernel-log lines -> classified amdgpu events (the shared vocabulary in :mod:`r9k.ops.state`).

Understands /dev/kmsg records (``pri,seq,ts,flags;msg`` with `` DEVICE=+pci:BDF`` continuation
lines), ``journalctl -k -o json`` objects and plain dmesg/syslog text. Only kernel records count:
kmsg records of the kernel facility, journal records with ``_TRANSPORT=kernel``, syslog lines
tagged ``kernel:`` (a process's line naming a card must not fence it). A syslog line is a kernel
record by its tag alone, which any local process can write (``logger -t kernel``): such lines are
marked ``syslog_tagged`` and the watcher does not act on them unless told to trust the tag. The
message is matched; the BDF comes from the ``amdgpu 0000:03:00.0:`` prefix or the record's
device, or, for a line without either, from the addressed amdgpu lines just before it (at most
``CONTEXT_MAX_LINES`` lines and ``CONTEXT_WINDOW_S`` seconds earlier) when they all name one card.
Anything else stays unattributed (bdf None): a host event.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from r9k.ops.state import BDF_PATTERN

RESET_SOURCES = {0: "unknown", 1: "job", 2: "ras", 3: "mes", 4: "hws", 5: "user"}

_BDF = rf"(?i:{BDF_PATTERN})"  # as the kernel writes it, any case
# The subsystem prefixes amdgpu and drm put before their messages, in the order they come:
# `amdgpu 0000:03:00.0: `, `amdgpu: `, `[drm] ` or `[drm:func [amdgpu]] `, `*ERROR* `. Rules match
# the text right after them only: a process name or other text later in a record (a segfault of
# a process named `ring x timeout`, `Process information: process ...`) is never a GPU event.
_DEVICE_PREFIX = re.compile(rf"(?:amdgpu|pci)\s+({_BDF}):\s*")
_GPU_PREFIX = re.compile(r"(?:amdgpu:|\[drm(?::[^\[\]\s]*(?:\s*\[[^\[\]\s]*\])?)?\])\s*")
_SEVERITY = re.compile(r"\*(?:ERROR|WARNING|WARN|INFO|NOTICE|DEBUG)\*\s*")
_KMSG = re.compile(r"^(\d+),(\d+),(\d+),([^;]*);(.*)$")
_DMESG_TS = re.compile(r"^\[\s*(\d+\.\d+)\]\s?(.*)$")
# RFC 3164 (``Nov 30 05:24:01 host tag[pid]: msg``) or RFC 3339 stamps; the tag says who wrote it.
_SYSLOG = re.compile(
    r"^(?:[A-Z][a-z]{2}\s+\d{1,2}\s+\d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:?\d\d)?)"
    r"\s+\S+\s+(?P<tag>[^\s:\[]+)(?:\[\d+\])?:\s?(?P<msg>.*)$"
)
# Kernel records carry facility 0 (LOG_KERN); a process writing to /dev/kmsg gets LOG_USER (8+).
_KERNEL_PRIORITY_MAX = 7
# Evidence window for a line without an address: the addressed amdgpu line just before it.
CONTEXT_MAX_LINES = 3
CONTEXT_WINDOW_S = 2.0

# (type, pattern); the first match wins. Follow-up lines of one fault (``failed to remove hardware
# queue from MES``, ``GPU reset end with ret``, ``VRAM is lost``) are deliberately not events.
_RULES: list[tuple[str, re.Pattern[str]]] = [
    ("mes_timeout", re.compile(r"MES(?:\((?P<pipe>\d+)\))? failed to respond to msg=\s*(?P<msg>.+?)\s*$")),
    ("mes_timeout", re.compile(r"MES failed to response msg=\s*(?P<msg>\S+)")),
    ("ring_timeout", re.compile(r"ring (?P<ring>\S+) timeout(?P<soft>, but soft recovered)?")),
    ("reset_begin", re.compile(r"GPU reset begin!(?:\.?\s*Source:\s*(?P<source>\d+))?")),
    ("reset_succeeded", re.compile(r"\bGPU reset\((?P<n>\d+)\) succeeded!")),
    ("reset_failed", re.compile(r"\bGPU reset\((?P<n>\d+)\) failed")),
    ("reset_failed", re.compile(r"GPU Recovery Failed:?\s*(?P<ret>-?\d+)?")),
    ("device_lost", re.compile(r"device lost from bus!")),
    ("recovery_disabled", re.compile(r"GPU recovery disabled\.?")),
]


# Every rule above contains one of these words: substring tests skip the rules for most lines.
_RULE_WORDS = ("MES", "timeout", "GPU ", "device lost")


@dataclass
class Subsystem:
    """A kernel message split at its prefix: whether amdgpu/drm wrote it, the card its device
    prefix names, and the message body the rules apply to."""

    gpu: bool
    bdf: str | None
    body: str


def split_subsystem(message: str) -> Subsystem:
    """``amdgpu 0000:03:00.0: amdgpu: MES failed ...`` -> (True, 0000:03:00.0, ``MES failed ...``).
    A message is amdgpu's or drm's only when it starts with their prefix; a ``pci BDF:`` prefix
    names the card but is the PCI core's, not a GPU message."""
    text = message.lstrip()
    bdf, gpu = None, False
    device = _DEVICE_PREFIX.match(text)
    if device:
        bdf, gpu = device.group(1).lower(), text.startswith("amdgpu")
        text = text[device.end():]
    while True:
        prefix = _GPU_PREFIX.match(text)
        if not prefix:
            break
        gpu, text = True, text[prefix.end():]
    severity = _SEVERITY.match(text)
    if severity and gpu:
        text = text[severity.end():]
    return Subsystem(gpu, bdf, text)


@dataclass
class LogLine:
    """One kernel message with where it came from: ``stream`` + ``ordinal`` order the log."""

    message: str
    stream: str
    ordinal: int
    device_bdf: str | None = None  # from the record's metadata (kmsg DEVICE=, journal _KERNEL_DEVICE)
    timestamp: str | None = None
    mono_s: float | None = None  # kernel monotonic seconds, where the format has them
    record_id: str | None = None  # identity for sources without an ordinal (saved text logs)
    # a syslog line taken as the kernel's by its `kernel:` tag alone: any local process can
    # write one (`logger -t kernel` adds no [pid]; the default file templates show no facility)
    syslog_tagged: bool = False


@dataclass
class KernelEvent:
    type: str
    bdf: str | None
    message: str
    stream: str
    ordinal: int
    attribution: str  # "prefix", "device", "context" (the addressed line just before) or "none"
    detail: dict[str, Any] = field(default_factory=dict)
    timestamp: str | None = None
    record_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _device_bdf(value: str | None) -> str | None:
    if value and value.startswith("+pci:"):
        bdf = value[5:].lower()
        if re.fullmatch(_BDF, bdf):
            return bdf
    return None


def parse_kmsg_record(record: str, boot_stream: str) -> LogLine | None:
    """``pri,seq,ts,flags;message`` plus continuation lines (``" KEY=value"``)."""
    first, *more = record.split("\n")
    match = _KMSG.match(first)
    if not match or int(match.group(1)) > _KERNEL_PRIORITY_MAX:
        return None
    device = None
    for line in more:
        if line.startswith(" DEVICE="):
            device = _device_bdf(line[len(" DEVICE="):].strip())
    ts_us = int(match.group(3))
    return LogLine(match.group(5), boot_stream, int(match.group(2)), device, f"{ts_us / 1e6:.6f}", ts_us / 1e6)


def parse_journal_json(text: str) -> LogLine | None:
    try:
        entry = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("_TRANSPORT") != "kernel":
        return None  # stdout, syslog, journal: written by a process, not the kernel
    message = entry.get("MESSAGE")
    if isinstance(message, list):  # journald emits non-UTF-8 messages as byte arrays
        try:
            message = bytes(message).decode("utf-8", "replace")
        except (TypeError, ValueError):
            return None
    if not isinstance(message, str):
        return None
    boot = entry.get("_BOOT_ID", "unknown")
    try:
        if "__SEQNUM" in entry:
            stream, ordinal = f"journal:{entry.get('__SEQNUM_ID', boot)}", int(entry["__SEQNUM"])
        else:
            stream, ordinal = f"journal:{boot}", int(entry["__MONOTONIC_TIMESTAMP"])
    except (KeyError, ValueError, TypeError):
        return None
    mono = entry.get("_SOURCE_MONOTONIC_TIMESTAMP") or entry.get("__MONOTONIC_TIMESTAMP")
    try:
        mono_s = int(mono) / 1e6 if mono is not None else None
    except (TypeError, ValueError):
        mono_s = None
    return LogLine(message, stream, ordinal, _device_bdf(entry.get("_KERNEL_DEVICE")),
                   entry.get("__REALTIME_TIMESTAMP"), mono_s)


def parse_text_line(text: str, stream: str, ordinal: int) -> LogLine | None:
    """dmesg (``[  12.345678] msg``), syslog (``... kernel: msg``) or a bare message (``dmesg -t``).
    A syslog line from any tag but ``kernel`` is not a kernel record: None."""
    text = text.rstrip("\r\n")
    if not text.strip():
        return None
    timestamp = None
    match = _SYSLOG.match(text)
    if match:
        if match.group("tag") != "kernel":
            return None
        text = match.group("msg")
    syslog_tagged = match is not None
    match = _DMESG_TS.match(text)
    if match:
        timestamp, text = match.group(1), match.group(2)
    return LogLine(text, stream, ordinal, None, timestamp, float(timestamp) if timestamp else None,
                   syslog_tagged=syslog_tagged)


class Classifier:
    """Stateful: remembers the last addressed amdgpu line (evidence for the line right after it)
    and each card's last event."""

    def __init__(self, last_types: dict[str, str] | None = None):
        self.last_types: dict[str, str] = dict(last_types or {})
        self._lines = 0
        # the addressed amdgpu lines of the last CONTEXT_MAX_LINES lines: (bdf, line number, mono_s)
        self._context: list[tuple[str, int, float | None]] = []

    def _context_bdf(self, line: LogLine) -> str | None:
        """The card the addressed lines just before name, when they all name one card (lines of
        two cards interleaved: no evidence for either, a host event)."""
        near = set()
        for bdf, number, mono_s in self._context:
            if self._lines - number > CONTEXT_MAX_LINES:
                continue
            if mono_s is not None and line.mono_s is not None and not 0 <= line.mono_s - mono_s <= CONTEXT_WINDOW_S:
                continue
            near.add(bdf)
        return near.pop() if len(near) == 1 else None

    def classify(self, line: LogLine) -> KernelEvent | None:
        self._lines += 1
        parts = split_subsystem(line.message)
        bdf, attribution = None, "context"
        if parts.bdf:
            bdf, attribution = parts.bdf, "prefix"
        elif line.device_bdf:
            bdf, attribution = line.device_bdf, "device"
        context = None if bdf else self._context_bdf(line)
        if bdf and (parts.gpu or attribution == "device"):
            self._context = [c for c in self._context if self._lines - c[1] < CONTEXT_MAX_LINES]
            self._context.append((bdf, self._lines, line.mono_s))
        text = parts.body
        if not parts.gpu or not any(word in text for word in _RULE_WORDS):
            return None
        for event_type, pattern in _RULES:
            match = pattern.match(text)
            if not match:
                continue
            if bdf is None:
                bdf = context
            detail = _detail(event_type, match)
            # "GPU Recovery Failed" follows "GPU reset(N) failed" for the same failure.
            if event_type == "reset_failed" and "n" not in detail and self.last_types.get(bdf or "") == "reset_failed":
                return None
            event = KernelEvent(event_type, bdf, line.message.strip(), line.stream, line.ordinal,
                                attribution if bdf else "none", detail, line.timestamp, line.record_id)
            if bdf:
                self.last_types[bdf] = event_type
            return event
        return None


def _detail(event_type: str, match: re.Match[str]) -> dict[str, Any]:
    groups = {k: v for k, v in match.groupdict().items() if v is not None}
    detail: dict[str, Any] = {}
    if event_type == "mes_timeout":
        detail["msg"] = groups.get("msg")
        if "pipe" in groups:
            detail["mes_pipe"] = int(groups["pipe"])
    elif event_type == "ring_timeout":
        detail["ring"] = groups["ring"]
        detail["soft_recovered"] = "soft" in groups
    elif event_type == "reset_begin" and "source" in groups:
        source = int(groups["source"])
        detail["source"] = source
        detail["source_name"] = RESET_SOURCES.get(source, "other")
    elif "n" in groups:
        detail["n"] = int(groups["n"])
    elif "ret" in groups:
        detail["ret"] = int(groups["ret"])
    return detail
