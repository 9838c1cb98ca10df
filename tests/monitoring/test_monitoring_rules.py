"""Alert rules (promtool check/test, every rule positive and negative, runbooks), scrape config,
Grafana dashboards and provisioning: valid, and naming only metrics the exporter really exports."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from r9k.monitoring.exporter import build_collector, build_registry, render
from doubles.monitored_host import OPS_CONFIG, FakeFleet, TokenCountingReplica, build_monitored_host
from r9k.devtools.tiny_model import build_config
from doubles.prometheus_server import prometheus_tool

MONITORING = Path(__file__).resolve().parents[2] / "src" / "r9k" / "monitoring"
ALERTS = MONITORING / "alerts"
RULES = ALERTS / "r9k.rules.yml"
RULE_TESTS = ALERTS / "r9k.rules.test.yml"
DASHBOARDS = sorted((MONITORING / "grafana").glob("*.json"))


def promtool() -> str:
    return prometheus_tool("promtool")


def run_promtool(*args: str, cwd: Path = ALERTS) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_check_and_test_rules_pass():
    check = run_promtool("check", "rules", RULES.name)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout
    test = run_promtool("test", "rules", RULE_TESTS.name)
    assert test.returncode == 0, test.stdout + test.stderr


def test_every_rule_has_a_positive_and_a_negative_case():
    cases: dict[str, list[bool]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    for rule in rules():
        assert True in cases.get(rule["alert"], []), f"{rule['alert']}: no case where it fires"
        assert False in cases.get(rule["alert"], []), f"{rule['alert']}: no case where it stays quiet"


def test_promtool_catches_a_wrong_threshold(tmp_path):
    """The rule tests can fail: a junction threshold of 110 C instead of 100 C breaks them."""
    text = RULES.read_text()
    assert 'sensor="junction"} >= 100' in text
    (tmp_path / RULES.name).write_text(text.replace('sensor="junction"} >= 100', 'sensor="junction"} >= 110'))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0 and "GpuJunctionTemperatureHigh" in result.stdout + result.stderr


def test_rules_follow_the_conventions_and_link_existing_runbooks():
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    for rule in rules():
        assert re.fullmatch(r"(?:[A-Z][a-z0-9]*)+", rule["alert"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"]
        runbook = MONITORING / "runbooks" / ann["runbook_url"].rsplit("/", 1)[1]
        assert runbook.is_file(), f"{rule['alert']}: {runbook} missing"
        body = runbook.read_text()
        assert rule["alert"] in body and "**Check:**" in body and "**Do:**" in body
    wanted = {"GpuMesTimeout", "GpuRingTimeout", "GpuReset", "GpuDeviceLost", "GpuUnhealthy",
              "GpuPowerConfigDrift", "GpuJunctionTemperatureHigh", "KvPoolSaturated", "ReplicaDown",
              "ExporterDown"}
    assert wanted <= set(names)


def test_alerts_for_recovery_on_card_missing_unattributed_faults_and_refused_config():
    """Items 6, 8, 9, 17: the new host-level alerts exist on the series the exporter writes, and
    promtool's cases (positive and negative, above) pass for them."""
    by_name = {r["alert"]: r for r in rules()}
    for name, metric in (("GpuCardMissing", "r9k_gpu_present_cards"),
                         ("GpuUnattributedFault", "r9k_host_unattributed_faults_total"),
                         ("GpuRecoveryEnabled", "r9k_host_gpu_recovery_disabled"),
                         ("OpsConfigInvalid", "r9k_ops_config_valid")):
        assert name in by_name and metric in by_name[name]["expr"], name
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test.get("alert_rule_test", [])}
    assert {"GpuCardMissing", "GpuUnattributedFault", "GpuRecoveryEnabled", "OpsConfigInvalid"} <= tested


def test_prometheus_scrape_config_is_valid():
    result = run_promtool("check", "config", "prometheus.yml", cwd=MONITORING)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert {j["job_name"] for j in config["scrape_configs"]} >= {"r9k-exporter", "vllm"}
    am = yaml.safe_load((MONITORING / "alertmanager.yml").read_text())
    receivers = {r["name"] for r in am["receivers"]}
    assert am["route"]["receiver"] in receivers
    assert {r["receiver"] for r in am["route"]["routes"]} <= receivers
    amtool = shutil.which("amtool")
    if amtool:
        check = subprocess.run([amtool, "check-config", str(MONITORING / "alertmanager.yml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.fixture(scope="module")
def exported_names(tmp_path_factory) -> set[str]:
    """Every family the exporter writes for a host with cards, events, MES event logs (--debugfs)
    and a one-page replica."""
    base = tmp_path_factory.mktemp("names")
    root, state, config = build_monitored_host(base)
    config.write_text(OPS_CONFIG + "expected_cards: ['0000:03:00.0', '0000:04:00.0', '0000:05:00.0']\n")
    model = base / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_config()))
    with TokenCountingReplica(running=2, num_gpu_blocks=50) as replica:
        doc = {"replicas": [{"name": "r1", "url": replica.url, "model_config": str(model), "num_spec": 2,
                             "mode": "onepage", "platform": "cpu", "state": "ready", "cards": ["0000:03:00.0"]}]}
        with FakeFleet(doc) as fleet:
            collector = build_collector(root, state, config, fleet_url=fleet.url + "/status",
                                        debugfs="/sys/kernel/debug", energy_sample_hz=10.0)
            collector.parts["energy"].meter.sample_once()   # the thread's first sample, now
            text = render(build_registry(collector))
            collector.parts["energy"].meter.stop()
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
    return names


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\br9k_[a-z0-9_]+", expr))


def test_rule_metrics_exist_in_exporter_output(exported_names):
    for rule in rules():
        missing = metric_names(rule["expr"]) - exported_names
        assert not missing, f"{rule['alert']}: {missing} not exported"


def dashboard_targets() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel["targets"]:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def load_generator():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("r9k_dashboards", MONITORING / "grafana/dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dashboards_are_generated_by_grafanas_builders_and_pass_its_schema():
    """The JSON files are what grafana-foundation-sdk's typed builders write (no hand
    edits), and each equals its round trip through Grafana's dashboard model, so a field the
    schema does not know (a typo, a misplaced option) fails here."""
    generator = load_generator()
    for name, text in generator.render_all().items():
        assert (MONITORING / "grafana" / name).read_text() == text, \
            f"{name} differs from src/r9k/monitoring/grafana/dashboards.py: run python src/r9k/monitoring/grafana/dashboards.py"
        dash = json.loads(text)
        assert generator.through_schema(dash) == dash, name
        typo = json.loads(text)
        typo["panels"][0]["fieldConfig"]["defaults"]["unitt"] = "watt"
        assert generator.through_schema(typo) != typo, "the schema round trip must catch an unknown field"


def test_kv_dashboard_has_an_instance_variable_and_counts_show_zero():
    """The KV dashboard filters by exporter instance; count panels show 0, not No data."""
    dashes = {p.name: json.loads(p.read_text()) for p in DASHBOARDS}
    kv = dashes["r9k-kv-cache.json"]
    assert "instance" in {v["name"] for v in kv["templating"]["list"]}
    for panel in kv["panels"]:
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
    recovery = next(p for p in dashes["r9k-faults.json"]["panels"] if p["title"] == "Hosts with GPU recovery on")
    assert recovery["targets"][0]["expr"].endswith("or vector(0)")
    assert recovery["fieldConfig"]["defaults"]["noValue"] == "0"


def test_dashboards_are_valid_and_use_exported_metrics(exported_names):
    assert {p.name for p in DASHBOARDS} == {"r9k-power-thermals.json", "r9k-faults.json", "r9k-kv-cache.json",
                                           "r9k-energy.json"}
    uids = set()
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        assert dash["uid"] not in uids
        uids.add(dash["uid"])
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), path.name
        variables = {v["name"] for v in dash["templating"]["list"]}
        for panel in dash["panels"]:
            assert panel["targets"], (path.name, panel["title"])
            for target in panel["targets"]:
                used = set(re.findall(r"\$([a-z_]+)", target["expr"])) - {"__range", "__rate_interval"}
                assert used <= variables, (path.name, panel["title"], used)
    used_metrics = set().union(*(metric_names(e) for _, _, e in dashboard_targets()))
    assert not used_metrics - exported_names, used_metrics - exported_names
    # recorded series the dashboards read are recorded by a rule file Prometheus loads
    recorded = {r["record"] for f in (MONITORING / "rules").glob("*.rules.yml")
                for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]}
    used_recorded = set().union(*(set(re.findall(r"\br9k:[a-z0-9_:]+", e)) for _, _, e in dashboard_targets()))
    assert used_recorded and used_recorded <= recorded, used_recorded - recorded
    loaded = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["rule_files"]
    assert {f"rules/{f.name}" for f in (MONITORING / "rules").glob("*.rules.yml")} <= set(loaded)
    # The three views: power and thermals, faults, KV cache and pinning.
    assert {"r9k_gpu_power_watts", "r9k_gpu_temperature_celsius", "r9k_gpu_events_total",
            "r9k_gpu_unhealthy", "r9k_kv_pinned_ratio", "r9k_kv_capacity_tokens"} <= used_metrics
    prov = yaml.safe_load((MONITORING / "grafana/provisioning.yml").read_text())
    assert prov["apiVersion"] == 1 and prov["providers"][0]["type"] == "file"
    ds = yaml.safe_load((MONITORING / "grafana/datasource.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
