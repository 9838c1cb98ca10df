"""The exporter as node_exporter does it. The whole /metrics text of a fixture
host (two R9700 cards with ops state and config, their MES event logs, one replica) is compared
with a golden file, so a renamed metric, label or help text shows as a diff; each collector
reports its duration and success, and one that raises is left out while the others are served.

Regenerate after an intended change: R9K_UPDATE_GOLDEN=1 pytest tests/monitoring/test_monitoring_golden.py
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from doubles.monitored_host import FakeReplica, build_monitored_host
from r9k.devtools.tiny_model import build_config
from r9k.monitoring.exporter import R9kCollector, build_collector, build_registry, render
from r9k.monitoring.mes_log import MesLogCollector
from r9k.monitoring.replicas import ReplicaDescription

GOLDEN = Path(__file__).with_name("golden") / "metrics.txt"
# values that are times of this run: durations, file ages, timestamps
_VOLATILE = re.compile(r"^(r9k_exporter_collect_seconds\{[^}]*\}|\S*timestamp_seconds(\{[^}]*\})?) .*$",
                       re.MULTILINE)


def _normalized(text: str) -> str:
    return _VOLATILE.sub(lambda m: f"{m.group(1)} <volatile>", text)


def _fixture(tmp_path: Path):
    root, state, config = build_monitored_host(tmp_path / "host")  # its cards have MES logs too
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_config()))
    return root, state, config, model


def test_metrics_text_matches_the_golden_file(tmp_path):
    root, state, config, model = _fixture(tmp_path)
    with FakeReplica(model_name="tiny", running=2, waiting=1, num_gpu_blocks=64) as replica:
        collector = build_collector(root, state, config, debugfs="/sys/kernel/debug", replicas=[
            ReplicaDescription(name="r1", url=replica.url, model_config=str(model), num_spec=3,
                               platform="cpu", max_model_len=4096)], timeout_s=2)
        text = _normalized(render(build_registry(collector)))
    if os.environ.get("R9K_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "the /metrics text changed: diff it with " + str(GOLDEN)
    for name in ("gpu", "ops_power", "ops_state", "mes_log", "replicas"):  # one per source
        assert f'r9k_exporter_collect_success{{collector="{name}"}} 1.0' in text


class _Broken:
    def collect(self):
        yield from ()
        raise OSError("the source went away mid-scrape")


def test_a_failing_collector_is_isolated_and_marked(tmp_path):
    root, state, config, _ = _fixture(tmp_path)
    good = build_collector(root, state, config, debugfs="/sys/kernel/debug")
    parts = dict(good.parts, mes_log=_Broken())
    text = render(build_registry(R9kCollector(parts, good.errors)))
    assert 'r9k_exporter_collect_success{collector="mes_log"} 0.0' in text
    assert 'r9k_exporter_collect_success{collector="gpu"} 1.0' in text
    assert 'r9k_gpu_present_cards' in text  # the cards are still served
    assert "r9k_gpu_mes_log_unchanged_seconds" not in text
    assert isinstance(good.parts["mes_log"], MesLogCollector)
    # one card source failing leaves the other two: the state files gone mid-scrape
    text = render(build_registry(R9kCollector(dict(good.parts, ops_state=_Broken()), good.errors)))
    assert 'r9k_exporter_collect_success{collector="ops_state"} 0.0' in text
    assert "r9k_gpu_unhealthy" not in text and "r9k_gpu_events_total" not in text
    assert 'r9k_exporter_collect_success{collector="ops_power"} 1.0' in text
    assert "r9k_gpu_power_cap_wanted_watts{" in text and "r9k_gpu_vram_used_bytes{" in text
