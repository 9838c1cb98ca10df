"""Memory samplers for the soak: process-tree RSS of a CPU replica, or a Prometheus gauge
(the exporter's `r9k_gpu_vram_used_bytes`) for GPU replicas."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Callable

from r9k.core.http_client import http_get


class MemorySourceError(Exception):
    """The memory source cannot be read (the message says which and why)."""


def process_tree(pid: int, host_root: Path = Path("/")) -> list[int]:
    """`pid` and all its descendants, from <host_root>/proc/*/stat."""
    proc = host_root / "proc"
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        # the command name may hold spaces and parentheses; the fields after the last ')' don't
        fields = text[text.rfind(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def process_tree_rss_by_process(pid: int, host_root: Path = Path("/")) -> dict[str, int]:
    """VmRSS per process of the tree, keyed '<pid> <name>'; MemorySourceError when `pid` is gone."""
    out: dict[str, int] = {}
    for p in process_tree(pid, host_root):
        try:
            status = (host_root / "proc" / str(p) / "status").read_text()
        except OSError:
            if p == pid:
                raise MemorySourceError(f"process {pid} is gone (no {host_root}/proc/{pid}/status)") from None
            continue
        if p == pid and re.search(r"^State:\s+[ZX]", status, re.M):
            raise MemorySourceError(f"process {pid} is gone (exited, not yet reaped)")
        m = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.M)
        name = re.search(r"^Name:\s*(.*)$", status, re.M)
        if m:
            out[f"{p} {name.group(1).strip() if name else '?'}"] = int(m.group(1)) * 1024
    return out


def process_tree_rss_bytes(pid: int, host_root: Path = Path("/")) -> int:
    """Sum of VmRSS over the tree; MemorySourceError when `pid` itself is gone."""
    return sum(process_tree_rss_by_process(pid, host_root).values())


class ProcessTreeRss:
    """A sampler source that also keeps the first and latest per-process breakdown, so a
    report can say which process of a replica grew."""

    def __init__(self, pid: int, host_root: Path = Path("/")) -> None:
        self.pid, self.host_root = pid, host_root
        self.first: dict[str, int] | None = None
        self.last: dict[str, int] | None = None

    def __call__(self) -> int:
        by_process = process_tree_rss_by_process(self.pid, self.host_root)
        if self.first is None:
            self.first = by_process
        self.last = by_process
        return sum(by_process.values())

    def growth_by_process(self) -> list[dict]:
        first, last = self.first or {}, self.last or {}
        return [{"process": k, "first_bytes": first.get(k), "last_bytes": last.get(k),
                 "growth_bytes": (last[k] - first[k]) if k in first and k in last else None}
                for k in sorted(set(first) | set(last))]


def prometheus_gauge_bytes(url: str, metric: str, label_filter: dict[str, str] | None = None,
                           timeout_s: float = 5) -> int:
    """Sum of a metric's samples in a Prometheus text page (optionally only matching labels)."""
    try:
        text = http_get(url, timeout_s=timeout_s).decode(errors="replace")
    except OSError as exc:
        raise MemorySourceError(f"cannot read {url}: {exc}") from None
    total, found = 0.0, False
    pattern = re.compile(rf"^{re.escape(metric)}(\{{[^}}]*\}})?\s+(\S+)", re.M)
    for m in pattern.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if label_filter and any(labels.get(k) != v for k, v in label_filter.items()):
            continue
        try:
            total += float(m.group(2))
        except ValueError:
            continue
        found = True
    if not found:
        raise MemorySourceError(f"{url} has no sample of {metric}"
                                + (f" with {label_filter}" if label_filter else ""))
    return int(total)


class MemorySampler:
    """Samples `read()` every `interval_s` in a thread; keeps (seconds since t0, bytes)."""

    def __init__(self, read: Callable[[], int], interval_s: float, t0: float, source: str) -> None:
        self.read, self.interval_s, self.t0, self.source = read, interval_s, t0, source
        self.samples: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> "MemorySampler":
        self._thread.start()
        return self

    def sample_once(self) -> None:
        try:
            self.samples.append((round(time.monotonic() - self.t0, 2), self.read()))
        except MemorySourceError as exc:
            if not self.errors or self.errors[-1] != str(exc):
                self.errors.append(str(exc))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 10)
        self.sample_once()
