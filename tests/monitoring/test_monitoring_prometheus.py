"""A real Prometheus server on loopback scrapes the real exporter (fixture host tree, ops state
written by the ops watcher, a replica and a fleet served over HTTP) and evaluates the real rules:
series values, the pinned ratio, a MES timeout turning into a firing alert, and every dashboard
panel's query returning data."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from r9k.core import capacity
from r9k.monitoring.exporter import build_collector, build_registry, serve
from doubles.monitored_host import (CARD_A, CARD_B, OPS_CONFIG, FakeFleet, TokenCountingReplica,
                                     build_monitored_host, record_kernel_log)
from r9k.devtools.tiny_model import build_config
from doubles.prometheus_server import free_port, running_prometheus

MONITORING = Path(__file__).resolve().parents[2] / "src" / "r9k" / "monitoring"
# Grafana's variables and interval macros, as a person viewing "All" over the last hour sees them.
DASHBOARD_SUBSTITUTIONS = {"$__rate_interval": "5s", "$__range": "1h", "$instance": ".*", "$bdf": ".*",
                           "$replica": ".*", "$host": ".*"}


@pytest.fixture
def site(tmp_path):
    root, state, config = build_monitored_host(tmp_path)
    config.write_text(OPS_CONFIG + f"expected_cards: ['{CARD_A}', '{CARD_B}', '0000:05:00.0']\n")
    model = tmp_path / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_config()))
    dead = free_port()
    with TokenCountingReplica(model_name="tiny", root=str(model), max_model_len=4096, running=3, waiting=2,
                              kv_usage_ratio=0.97, preemptions=1, num_gpu_blocks=100, block_size=128,
                              tokens_per_read=40) as replica:
        doc = {"replicas": [
            {"name": "r1", "url": replica.url, "num_spec": 2, "mode": "onepage", "platform": "cpu",
             "state": "ready", "cards": [CARD_A], "host": "fixture-host"},
            {"name": "r2", "url": f"http://127.0.0.1:{dead}", "model": "tiny", "state": "unhealthy",
             "cards": [CARD_B], "host": "fixture-host"},
        ]}
        with FakeFleet(doc) as fleet:
            collector = build_collector(root, state, config, fleet_url=fleet.url + "/status", timeout_s=0.5,
                                        debugfs="/sys/kernel/debug", energy_sample_hz=5.0,
                                        host_name="fixture-host")
            server, _ = serve(build_registry(collector), 0, "127.0.0.1")
            try:
                yield {"root": root, "state": state, "tmp": tmp_path, "replica": replica,
                       "exporter": f"127.0.0.1:{server.server_address[1]}"}
            finally:
                server.shutdown()
                server.server_close()
                collector.parts["energy"].meter.stop()


@pytest.fixture
def prometheus(site, tmp_path):
    jobs = {"r9k-exporter": site["exporter"], "vllm": site["replica"].url.removeprefix("http://")}
    with running_prometheus(jobs, tmp_path) as api:
        yield api


def test_real_prometheus_scrapes_the_exporter_and_fires_rules(site, prometheus):
    api = prometheus
    api.wait("three exporter scrapes", lambda: api.query('count_over_time(up{job="r9k-exporter"}[1m]) >= 3'))
    assert api.value('up{job="r9k-exporter"}') == 1.0
    assert api.value('up{job="vllm"}') == 1.0
    assert api.value('vllm:kv_cache_usage_perc{job="vllm"}') == 0.97  # the replica's own metrics too

    # Cards: power against the cap, undervolt, thermals, drift, health from the ops state.
    assert api.value(f'r9k_gpu_power_cap_watts{{bdf="{CARD_B}"}}') == 225.0
    assert api.value(f'r9k_gpu_power_cap_wanted_watts{{bdf="{CARD_B}"}}') == 210.0
    assert api.value(f'r9k_gpu_power_watts{{bdf="{CARD_A}"}}') == 180.0
    assert api.value(f'r9k_gpu_voltage_offset_volts{{bdf="{CARD_A}"}}') == pytest.approx(-0.042)
    assert api.value(f'r9k_gpu_temperature_celsius{{bdf="{CARD_B}",sensor="junction"}}') == 104.0
    assert api.value("sum(r9k_gpu_config_drift)") == 1.0
    assert api.value(f'r9k_gpu_config_drift{{bdf="{CARD_B}"}}') == 1.0
    assert api.value(f'r9k_gpu_events_total{{bdf="{CARD_B}",event="reset_begin"}}') == 1.0
    assert api.value(f'r9k_gpu_unhealthy{{bdf="{CARD_B}"}}') == 1.0
    assert api.value(f'r9k_gpu_vram_total_bytes{{bdf="{CARD_A}"}}') == 32 * 1024**3

    # Replicas: pinned split as the capacity module predicts for 3 running requests.
    shape = capacity.HybridModelShape.from_config(build_config())
    pool = capacity.plan_pool(shape, tp=1, num_spec=2, kv_bytes_per_rank=0, max_model_len=1, platform="cpu",
                              onepage=True, running=0)
    predicted = capacity.pinned_fraction(3, num_blocks=100, num_gdn_groups=pool.num_gdn_groups,
                                         num_attention_groups=pool.num_attention_groups,
                                         gdn_pages_per_request=pool.gdn_pages_per_request)
    assert api.value('r9k_kv_pinned_ratio{replica="r1",kind="gdn"}') == pytest.approx(predicted["gdn"])
    assert api.value('sum(r9k_kv_pinned_ratio{replica="r1"})') == pytest.approx(predicted["total"]) \
        == pytest.approx(0.09)
    live = capacity.live_plan(shape, num_blocks=100, tp=1, num_spec=2, onepage=True, max_model_len=4096,
                              platform="cpu")
    assert api.value('r9k_kv_capacity_tokens{replica="r1",page_mode="onepage"}') == live.onepage.tokens
    assert api.value('r9k_kv_capacity_tokens{replica="r1",page_mode="stock"}') == live.stock.tokens
    assert api.value('r9k_kv_pool_blocks{replica="r1"}') == 100
    assert api.value('r9k_replica_state{replica="r1",state="ready"}') == 1
    assert api.value('r9k_replica_up{replica="r2"}') == 0
    assert api.value('r9k_scrape_errors_total{source="replica"}') >= 1

    # The replica gets busier; the next scrapes follow (collect-on-scrape, nothing cached).
    site["replica"].running = 6
    api.wait("pinned ratio to follow 6 running requests",
             lambda: abs(api.value('sum(r9k_kv_pinned_ratio{replica="r1"})') - 2 * predicted["total"]) < 1e-9)

    # A MES timeout lands in the kernel log: ops counts it, the exporter shows it, the rule fires.
    record_kernel_log(site["root"], site["state"], site["tmp"] / "kern-mes.log", [
        f"[  300.000001] amdgpu {CARD_A}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE"])

    def firing(name, **labels):
        return [a for a in api.get("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == "firing"
                and all(a["labels"].get(k) == v for k, v in labels.items())]

    alerts = api.wait("GpuMesTimeout to fire", lambda: firing("GpuMesTimeout", bdf=CARD_A), timeout_s=20)
    assert alerts[0]["labels"]["severity"] == "warning"
    assert alerts[0]["annotations"]["runbook_url"].endswith("/gpu-mes-timeout.md")
    assert not firing("GpuMesTimeout", bdf=CARD_B)
    assert api.value(f'r9k_gpu_unhealthy{{bdf="{CARD_A}"}}') == 1.0

    # Every rule loads and evaluates without error.
    groups = api.get("/api/v1/rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    in_file = [r for f in [MONITORING / "alerts/r9k.rules.yml", *(MONITORING / "rules").glob("*.rules.yml")]
               for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]
    assert len(loaded) == len(in_file) >= 17
    assert all(r["health"] == "ok" for r in loaded), [(r["name"], r.get("lastError")) for r in loaded]

    # Every dashboard panel's query returns data; every metric named by rules and dashboards exists.
    stored = {r["metric"]["__name__"] for r in api.query('count by (__name__) ({__name__=~"r9k_.+"})')}
    used: set[str] = set()
    empty = []
    for path in sorted((MONITORING / "grafana").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in DASHBOARD_SUBSTITUTIONS.items():
                    expr = expr.replace(var, value)
                used |= set(re.findall(r"\br9k_[a-z0-9_]+", expr))
                if not api.query(expr):
                    empty.append((path.name, panel["title"], expr))
    assert not empty, empty
    # A count over no matching host is 0, not "No data".
    faults = json.loads((MONITORING / "grafana/r9k-faults.json").read_text())
    recovery = next(p for p in faults["panels"] if p["title"] == "Hosts with GPU recovery on")
    expr = recovery["targets"][0]["expr"].replace("$instance", "no-such-host")
    assert [float(r["value"][1]) for r in api.query(expr)] == [0.0]
    assert api.value('r9k_gpu_present_cards') == 2 and api.value('r9k_gpu_expected_cards') == 3
    # the MES log table: one row per card and kind (enabled, readable), in one instant table query
    mes = next(p for p in faults["panels"] if p["title"] == "MES event log per card (1 = yes)")
    (target,) = mes["targets"]
    assert target["instant"] and target["format"] == "table"
    expr = target["expr"].replace("$instance", ".*").replace("$bdf", ".*")
    rows = {(r["metric"]["bdf"], r["metric"]["log"]): float(r["value"][1]) for r in api.query(expr)}
    assert rows == {(bdf, log): 1.0 for bdf in (CARD_A, CARD_B) for log in ("enabled", "readable")}, rows
    for rule in loaded:
        used |= set(re.findall(r"\br9k_[a-z0-9_]+", rule["query"]))
    assert used and not used - stored, used - stored
