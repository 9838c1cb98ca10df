"""A real Prometheus server (Debian's package) on loopback for the monitoring tests: find its
tools, run it against scrape targets, query its HTTP API."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "src" / "r9k" / "monitoring"


def prometheus_tool(name: str) -> str:
    """Debian's `prometheus` or `promtool`: a missing one fails the test (the repo's setup
    installs it), unless R9K_SKIP_PROMETHEUS=1 asks to skip."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("R9K_SKIP_PROMETHEUS") == "1":
            pytest.skip(f"{name} not installed and R9K_SKIP_PROMETHEUS=1")
        pytest.fail(f"{name} not found: install Debian's prometheus package (bash scripts/ci-system-deps.sh)")
    return path


def prometheus_binary() -> str:
    return prometheus_tool("prometheus")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PromAPI:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params) -> dict:
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def wait(self, what: str, predicate, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                last = predicate()
                if last:
                    return last
            except (OSError, AssertionError, KeyError) as exc:
                last = exc
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}: last {last!r}")


@contextlib.contextmanager
def running_prometheus(jobs: dict[str, str], tmp_path: Path):
    """A real Prometheus on loopback scraping `jobs` (name -> host:port) every second, with the
    repo's alert and recording rules loaded; yields its API."""
    binary = prometheus_binary()
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(MONITORING / "alerts/r9k.rules.yml"),
                       *sorted(str(p) for p in (MONITORING / "rules").glob("*.rules.yml"))],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                           for job, target in jobs.items()],
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    api = PromAPI(f"http://127.0.0.1:{port}")
    try:
        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            with urllib.request.urlopen(f"{api.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        api.wait("prometheus ready", ready)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
