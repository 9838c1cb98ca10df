"""MES event-log liveness. The optional collector (`r9k exporter --debugfs`) reads each card's
`amdgpu_mes_event_log` from a fixture debugfs tree laid out as drm and amdgpu do
(doubles.ops_host.add_debugfs_card) and exports how long it has not changed; a clock passed in
stands for time. Unreadable debugfs is run as a user that cannot bypass file modes (nobody, in a
forked child, when the tests run as root)."""
from __future__ import annotations

import json
import os
import pickle
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from doubles.prometheus_server import prometheus_tool
from doubles.ops_host import (CardSpec, add_debugfs_card, build_host_tree, debugfs_dri, mes_ring,
                              render_mes_event_log)
from r9k.cli import main
from r9k.monitoring.cards import CARD_COLLECTORS
from r9k.monitoring.exporter import R9kCollector, build_collector, build_registry, render
from r9k.monitoring.mes_log import MesLogCollector
from r9k.monitoring.scrape_errors import ScrapeErrors

CARD_A, CARD_B = "0000:03:00.0", "0000:04:00.0"
DEBUGFS = "/sys/kernel/debug"
ALERTS = Path(__file__).resolve().parents[2] / "src/r9k/monitoring/alerts"


class FakeClock:
    def __init__(self, now: float = 5000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def host_tree(base, layout: str = "device", logs: tuple[str | None, ...] | None = None):
    root = build_host_tree(base, [CardSpec(CARD_A), CardSpec(CARD_B)])
    logs = logs if logs is not None else (render_mes_event_log(mes_ring(3)), render_mes_event_log(mes_ring(5)))
    for minor, (bdf, text) in enumerate(zip((CARD_A, CARD_B), logs)):
        add_debugfs_card(root, bdf, minor, text, layout)
    return root


def log_path(root, bdf: str):
    return debugfs_dri(root) / bdf / "amdgpu_mes_event_log"


def exporter_with_clock(root, clock) -> R9kCollector:
    """What build_collector(..., debugfs=DEBUGFS) builds, with the clock passed in."""
    errors = ScrapeErrors()
    parts = {name: collector(errors, root, None, root / "no-ops.yaml")
             for name, collector in CARD_COLLECTORS.items()}
    parts["mes_log"] = MesLogCollector(errors, root, DEBUGFS, clock=clock)
    return R9kCollector(parts, errors)


def scrape(collector) -> dict[tuple[str, frozenset], float]:
    text = render(build_registry(collector))
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def debugfs_errors(samples) -> float:
    return value(samples, "r9k_scrape_errors_total", source="debugfs")


def test_an_advancing_log_resets_the_count_and_a_frozen_one_grows(tmp_path):
    root = host_tree(tmp_path)
    clock = FakeClock()
    exporter = exporter_with_clock(root, clock)

    def unchanged():
        s = scrape(exporter)
        return (value(s, "r9k_gpu_mes_log_unchanged_seconds", bdf=CARD_A),
                value(s, "r9k_gpu_mes_log_unchanged_seconds", bdf=CARD_B))

    assert unchanged() == (0.0, 0.0)  # first sight: nothing known before the exporter started
    clock.now += 60
    log_path(root, CARD_A).write_text(render_mes_event_log(mes_ring(4)))  # MES wrote one record
    assert unchanged() == (0.0, 60.0)
    clock.now += 240
    # The same bytes written again (a new mtime) are not progress: only the content counts.
    log_path(root, CARD_B).write_text(log_path(root, CARD_B).read_text())
    assert unchanged() == (240.0, 300.0)
    clock.now += 30
    log_path(root, CARD_B).write_text(render_mes_event_log(mes_ring(6)))
    assert unchanged() == (270.0, 0.0)
    s = scrape(exporter)
    assert value(s, "r9k_gpu_mes_log_enabled", bdf=CARD_A) == value(s, "r9k_gpu_mes_log_readable", bdf=CARD_A) == 1
    assert debugfs_errors(s) == 0 and value(s, "r9k_host_debugfs_readable") == 1
    assert value(s, "r9k_gpu_power_watts", bdf=CARD_A) == 95.0  # the card collector beside it


@pytest.mark.parametrize("layout", ["device", "minor"])
def test_cards_are_named_by_the_debugfs_name_file_in_either_kernel_layout(tmp_path, layout):
    """Current kernels: dri/<BDF>/ with dri/0 and dri/128 linking to it, plus client-N dirs; older:
    dri/0/ holds amdgpu's files and dri/128/ (render minor) only drm's. Another driver's minor is
    not a card of ours."""
    root = host_tree(tmp_path, layout)
    other = debugfs_dri(root) / "2"
    other.mkdir()
    (other / "name").write_text("i915 dev=0000:00:02.0 unique=0000:00:02.0\n")
    s = scrape(exporter_with_clock(root, FakeClock()))
    enabled = {dict(labels)["bdf"]: v for (name, labels), v in s.items() if name == "r9k_gpu_mes_log_enabled"}
    assert enabled == {CARD_A: 1.0, CARD_B: 1.0}
    assert debugfs_errors(s) == 0


def test_a_missing_log_reads_not_enabled_not_a_failure(tmp_path):
    """amdgpu.mes_log_enable=0 (the default): amdgpu makes no amdgpu_mes_event_log."""
    root = host_tree(tmp_path, logs=(None, None))
    s = scrape(exporter_with_clock(root, FakeClock()))
    assert value(s, "r9k_gpu_mes_log_enabled", bdf=CARD_A) == value(s, "r9k_gpu_mes_log_enabled", bdf=CARD_B) == 0
    assert value(s, "r9k_gpu_mes_log_readable", bdf=CARD_A) is None
    assert value(s, "r9k_gpu_mes_log_unchanged_seconds", bdf=CARD_A) is None  # nothing for the rule to see
    assert value(s, "r9k_host_debugfs_readable") == 1 and debugfs_errors(s) == 0
    # Without --debugfs the collector is off: none of its series, the rest as before.
    s = scrape(build_collector(root, None, root / "no-ops.yaml"))
    assert not [n for n, _ in s if "mes_log" in n or "debugfs_readable" in n]
    assert debugfs_errors(s) == 0 and value(s, "r9k_gpu_power_watts", bdf=CARD_B) == 95.0


@pytest.mark.parametrize("content", [
    b"",                                                             # empty
    b"MES log unavailable\n",                                        # not a hex dump
    render_mes_event_log(mes_ring(3))[:-30].encode(),                # a row cut short
    render_mes_event_log(mes_ring(3)).replace("00000020:", "00000040:").encode(),  # offsets skip
    render_mes_event_log(mes_ring(3)).upper().encode(),              # not the kernel's lowercase
    b"00000000: 0000\xff001 00000000\n",                             # not ASCII
])
def test_a_malformed_log_is_counted_and_keeps_the_card_count(tmp_path, content):
    root = host_tree(tmp_path)
    clock = FakeClock()
    exporter = exporter_with_clock(root, clock)
    good = log_path(root, CARD_A).read_bytes()
    scrape(exporter)
    clock.now += 120
    log_path(root, CARD_A).write_bytes(content)
    s = scrape(exporter)
    assert value(s, "r9k_gpu_mes_log_enabled", bdf=CARD_A) == 1
    assert value(s, "r9k_gpu_mes_log_readable", bdf=CARD_A) == 0
    # counts on from the last change: a log that cannot be read must not silence the stall alert
    assert value(s, "r9k_gpu_mes_log_unchanged_seconds", bdf=CARD_A) == 120
    assert debugfs_errors(s) == 1
    assert value(s, "r9k_gpu_mes_log_unchanged_seconds", bdf=CARD_B) == 120  # the other card unaffected
    # The same log readable again: it did not change, so the count went on through the bad read.
    clock.now += 60
    log_path(root, CARD_A).write_bytes(good)
    s = scrape(exporter)
    assert value(s, "r9k_gpu_mes_log_readable", bdf=CARD_A) == 1
    assert value(s, "r9k_gpu_mes_log_unchanged_seconds", bdf=CARD_A) == 180


def as_unprivileged(fn):
    """fn() where file modes bind: here if not root, else in a forked child that became nobody
    (root reads 0700 directories anyway). Its return value comes back pickled."""
    if os.geteuid() != 0:
        return fn()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            nobody = pwd.getpwnam("nobody")
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            payload = pickle.dumps(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 (everything goes back to the parent)
            payload = pickle.dumps(("error", repr(exc)))
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    status, result = pickle.loads(data)
    assert status == "ok", result
    return result


@pytest.fixture
def shared_base():
    """A tree others may traverse (pytest's tmp dirs are 0700 to root)."""
    base = tempfile.mkdtemp(prefix="r9k-mes-log-")
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base)


def test_unreadable_debugfs_is_a_collector_error_and_the_rest_is_served(shared_base):
    """debugfs mounted root-only (0700) and the exporter not root: r9k_host_debugfs_readable 0,
    one debugfs scrape error per scrape, a warning at start; every other metric still there."""
    root = host_tree(os.path.join(shared_base, "host"))

    def run_exporter_once():
        result = CliRunner().invoke(main, ["exporter", "--once", "--json", "--host-root", str(root),
                                           "--config", str(root / "no-ops.yaml"), "--debugfs", DEBUGFS])
        return result.exit_code, result.stdout, result.stderr

    code, stdout, stderr = as_unprivileged(run_exporter_once)
    assert code == 0, stderr
    assert "warning: --debugfs:" in stderr and "Permission denied" in stderr and "root-only" in stderr
    samples = {(s["name"], frozenset(s["labels"].items())): s["value"] for s in json.loads(stdout)["samples"]}
    assert value(samples, "r9k_host_debugfs_readable") == 0
    assert debugfs_errors(samples) == 1
    assert not [n for n, _ in samples if n.startswith("r9k_gpu_mes_log")]
    assert value(samples, "r9k_gpu_power_watts", bdf=CARD_A) == 95.0
    assert value(samples, "r9k_gpu_temperature_celsius", bdf=CARD_B, sensor="junction") == 52.0


def test_one_unreadable_log_is_that_cards_error_alone(shared_base):
    root = host_tree(os.path.join(shared_base, "host"))
    os.chmod(debugfs_dri(root).parent, 0o755)  # debugfs listable, card A's log root-only
    os.chmod(log_path(root, CARD_A), 0o400)
    s = as_unprivileged(lambda: scrape(exporter_with_clock(root, FakeClock())))
    assert value(s, "r9k_host_debugfs_readable") == 1
    assert value(s, "r9k_gpu_mes_log_readable", bdf=CARD_A) == 0 and debugfs_errors(s) == 1
    assert value(s, "r9k_gpu_mes_log_readable", bdf=CARD_B) == 1
    assert value(s, "r9k_gpu_mes_log_unchanged_seconds", bdf=CARD_B) == 0


def test_cli_refuses_debugfs_without_cards_or_a_directory(tmp_path):
    root = host_tree(tmp_path)
    runner = CliRunner()
    for args, needle in ((["--no-cards", "--debugfs", DEBUGFS], "drop --no-cards"),
                         (["--host-root", str(root), "--debugfs", "/sys/kernel/debugfs"], "no such directory")):
        result = runner.invoke(main, ["exporter", "--once", *args])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], result.output
    result = runner.invoke(main, ["exporter", "--once", "--host-root", str(root), "--config",
                                  str(root / "no-ops.yaml"), "--debugfs", DEBUGFS])
    assert result.exit_code == 0 and not result.stderr
    assert f'r9k_gpu_mes_log_unchanged_seconds{{bdf="{CARD_B}"}} 0.0' in result.stdout


def test_the_alert_watches_the_exported_series_and_its_window_is_tested(tmp_path):
    """GpuMesLogStalled reads the collector's series and the card's busy ratio; promtool's cases
    (r9k.rules.test.yml) pin its 300 s window: a 600 s window fails them."""
    rule = next(r for g in yaml.safe_load((ALERTS / "r9k.rules.yml").read_text())["groups"]
                for r in g["rules"] if r["alert"] == "GpuMesLogStalled")
    assert "r9k_gpu_mes_log_unchanged_seconds >= 300" in rule["expr"] and "r9k_gpu_busy_ratio" in rule["expr"]
    assert rule["for"] == "2m" and rule["annotations"]["runbook_url"].endswith("/gpu-mes-log-stalled.md")
    for name in ("r9k.rules.yml", "r9k.rules.test.yml"):
        text = (ALERTS / name).read_text()
        (tmp_path / name).write_text(text.replace("unchanged_seconds >= 300", "unchanged_seconds >= 600"))
    result = subprocess.run([prometheus_tool("promtool"), "test", "rules", "r9k.rules.test.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "GpuMesLogStalled" in result.stdout + result.stderr
