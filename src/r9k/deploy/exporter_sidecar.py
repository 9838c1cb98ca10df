"""The fleet's own exporter (replicas only, beside each host's `r9k exporter` with its cards): a
child process the controller starts, restarts when it exits and stops with it.

Restarts follow the replicas' policy (`health.restart_backoff_s`): the first at once, then the
fleet's `restart_backoff_s`, doubling up to `restart_backoff_max_s`, so a port someone else took
is retried, not spun on. An exporter a killed controller left running (it holds the port) is
stopped before a new one starts, if its pid file still names this fleet's exporter.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from r9k.deploy.config import ExporterSpec, HealthSpec
from r9k.deploy.health import restart_backoff_s
from r9k.core.fleet_status import ExporterStatus
from r9k.core.http_client import host_url

log = logging.getLogger("r9k.fleet")
PID_FILE = "exporter.pid"
LOG_FILE = "exporter.log"


class ExporterSidecar:
    def __init__(self, spec: ExporterSpec, health: HealthSpec, run_dir: Path,
                 fleet_status_url: str) -> None:
        self.spec, self.health, self.run_dir = spec, health, Path(run_dir)
        self.fleet_status_url = fleet_status_url
        self.proc: subprocess.Popen | None = None
        self.exits = 0                       # exits noticed (each one restarts it)
        self.restarts = 0
        self.last_exit: int | None = None
        self.restart_at: float | None = None  # monotonic time of the next start attempt

    def argv(self) -> list[str]:
        argv = [sys.executable, "-c", "from r9k.cli import main; main()", "exporter", "--no-cards",
                "--port", str(self.spec.port), "--listen", self.spec.listen,
                "--fleet", self.fleet_status_url]
        if sys.platform.startswith("linux"):  # dies with the controller, even by SIGKILL
            argv = [sys.executable, "-m", "r9k.deploy.child", str(os.getpid()), *argv]
        return argv

    def start(self) -> None:
        self.stop_stale()
        with open(self.run_dir / LOG_FILE, "a") as out:  # appended: earlier exits stay readable
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        (self.run_dir / PID_FILE).write_text(str(self.proc.pid))
        self.restart_at = None

    def stop_stale(self) -> None:
        import psutil

        try:
            proc = psutil.Process(int((self.run_dir / PID_FILE).read_text().strip()))
            cmdline = proc.cmdline()
        except (OSError, ValueError, psutil.Error):
            return
        if "exporter" in cmdline and "--fleet" in cmdline and proc.pid != os.getpid():
            log.warning("stopping the exporter an earlier controller left running (pid %d)",
                        proc.pid)
            proc.terminate()
            try:
                proc.wait(10)
            except psutil.TimeoutExpired:
                proc.kill()

    def supervise(self, now: float | None = None) -> None:
        """An exited exporter: its exit logged and kept for the status, a restart scheduled
        after the backoff; a due restart carried out."""
        if self.proc is not None and self.proc.poll() is None:
            return
        now = time.monotonic() if now is None else now
        if self.proc is not None:
            self.last_exit = self.proc.returncode
            self.proc = None
            self.exits += 1
            delay = restart_backoff_s(self.exits, self.health.restart_backoff_s,
                                      self.health.restart_backoff_max_s)
            self.restart_at = now + delay
            log.warning("exporter exited with status %s; restarting in %.0f s (log: %s)",
                        self.last_exit, delay, self.run_dir / LOG_FILE)
        if self.restart_at is not None and now >= self.restart_at:
            self.restarts += 1
            self.start()

    def status(self) -> ExporterStatus:
        running = self.proc is not None and self.proc.poll() is None
        return ExporterStatus(url=host_url(self.spec.listen, self.spec.port) + "/metrics",
                              pid=self.proc.pid if running else None, running=running,
                              restarts=self.restarts, last_exit=self.last_exit)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
