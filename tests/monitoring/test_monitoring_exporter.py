"""Exporter collectors against fixture host trees, ops state written by the real watcher, and
fake replicas / fleet served over loopback HTTP: values, units, labels, counted failures."""
from __future__ import annotations

import json
import re
import time
import shutil
import socket
import urllib.request

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from r9k.core import capacity
from r9k.cli import main
from r9k.monitoring.exporter import build_collector, build_registry, render, serve
from doubles.monitored_host import (CARD_A, CARD_B, FakeFleet, FakeReplica, HungReplicas,
                                     build_monitored_host, record_kernel_log)
from r9k.monitoring.replicas import ReplicaDescription, ReplicaSpecError, parse_replica_spec
from doubles.ops_host import device_dir, hwmon_dir
from r9k.ops.state import EVENT_TYPES
from r9k.devtools.tiny_model import build_config


def scrape(registry) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(render(registry)):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def names(samples) -> set[str]:
    return {n for n, _ in samples}


@pytest.fixture
def host(tmp_path):
    return build_monitored_host(tmp_path)


@pytest.fixture
def tiny_model_dir(tmp_path):
    path = tmp_path / "tiny-model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(build_config()))
    return path


def dead_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def test_card_metrics_in_base_units(host):
    root, state, config = host
    (device_dir(root, CARD_A) / "gpu_busy_percent").write_text("73\n")
    s = scrape(build_registry(build_collector(root, state, config)))
    assert val(s, "r9k_gpu_power_watts", bdf=CARD_A) == 180.0
    assert val(s, "r9k_gpu_power_watts", bdf=CARD_B) == 224.0  # only power1_input on B
    assert val(s, "r9k_gpu_power_cap_watts", bdf=CARD_A) == 210.0
    assert val(s, "r9k_gpu_power_cap_watts", bdf=CARD_B) == 225.0
    assert val(s, "r9k_gpu_power_cap_wanted_watts", bdf=CARD_B) == 210.0
    assert val(s, "r9k_gpu_power_cap_default_watts", bdf=CARD_A) == 300.0
    assert val(s, "r9k_gpu_voltage_offset_volts", bdf=CARD_A) == pytest.approx(-0.042)
    assert val(s, "r9k_gpu_voltage_offset_wanted_volts", bdf=CARD_A) == pytest.approx(-0.042)
    assert val(s, "r9k_gpu_config_drift", bdf=CARD_A) == 0.0
    assert val(s, "r9k_gpu_config_drift", bdf=CARD_B) == 1.0
    assert val(s, "r9k_gpu_temperature_celsius", bdf=CARD_A, sensor="junction") == 97.5
    assert val(s, "r9k_gpu_temperature_celsius", bdf=CARD_B, sensor="mem") == 90.0
    assert val(s, "r9k_gpu_vram_used_bytes", bdf=CARD_A) == 8 * 1024**3
    assert val(s, "r9k_gpu_vram_total_bytes", bdf=CARD_A) == 32 * 1024**3
    assert val(s, "r9k_gpu_busy_ratio", bdf=CARD_A) == pytest.approx(0.73)
    assert val(s, "r9k_gpu_vddgfx_volts", bdf=CARD_A) == pytest.approx(0.85)
    assert val(s, "r9k_gpu_clock_hertz", bdf=CARD_A, clock="sclk") == 1.2e9
    assert val(s, "r9k_host_gpu_recovery_disabled") == 0.0  # fixture default: gpu_recovery=-1
    assert all(val(s, "r9k_scrape_errors_total", source=src) == 0 for src in ("sysfs", "ops_config", "ops_state"))


def test_events_and_health_come_from_the_ops_watcher_state(host, tmp_path):
    root, state, config = host
    s = scrape(build_registry(build_collector(root, state, config)))
    # Every card and event type is exported from the start (so increase() sees a first fault).
    for bdf in (CARD_A, CARD_B):
        assert {e for (n, labels) in s if n == "r9k_gpu_events_total" and ("bdf", bdf) in labels
                for k, e in labels if k == "event"} == set(EVENT_TYPES)
    assert val(s, "r9k_gpu_events_total", bdf=CARD_B, event="reset_begin") == 1.0
    assert val(s, "r9k_gpu_events_total", bdf=CARD_A, event="mes_timeout") == 0.0
    assert val(s, "r9k_gpu_unhealthy", bdf=CARD_B) == 1.0
    assert val(s, "r9k_gpu_unhealthy", bdf=CARD_A) == 0.0

    # A MES timeout on A: counted, A fenced. A's cap then drifts, but a fenced card reports no
    # drift (ops leaves it alone on purpose; GpuUnhealthy pages instead). B's reset succeeded,
    # so B is reconciled again and its drift still shows.
    record_kernel_log(root, state, tmp_path / "kern-2.log", [
        f"[  200.000001] amdgpu {CARD_A}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE",
        f"[  200.000002] amdgpu {CARD_A}: amdgpu: MES failed to respond to msg=SUSPEND",
    ])
    (hwmon_dir(root, CARD_A) / "power1_cap").write_text("300000000\n")
    s = scrape(build_registry(build_collector(root, state, config)))
    assert val(s, "r9k_gpu_events_total", bdf=CARD_A, event="mes_timeout") == 2.0
    assert val(s, "r9k_gpu_unhealthy", bdf=CARD_A) == 1.0
    assert val(s, "r9k_gpu_config_drift", bdf=CARD_A) == 0.0
    assert val(s, "r9k_gpu_config_drift", bdf=CARD_B) == 1.0
    assert val(s, "r9k_gpu_last_event_timestamp_seconds", bdf=CARD_A) > 0


def test_missing_and_unreadable_sources_are_counted_not_fatal(host, tmp_path):
    root, state, _ = host
    collector = build_collector(root, tmp_path / "no-state", tmp_path / "no-ops.yaml",
                                replicas=[ReplicaDescription(name="gone", url=dead_url())], timeout_s=0.5)
    registry = build_registry(collector)
    s = scrape(registry)
    assert val(s, "r9k_scrape_errors_total", source="ops_config") == 1
    assert val(s, "r9k_scrape_errors_total", source="ops_state") == 1
    assert val(s, "r9k_scrape_errors_total", source="replica") == 1
    assert val(s, "r9k_replica_up", replica="gone", model="") == 0.0
    assert "r9k_gpu_power_cap_wanted_watts" not in names(s)  # nothing wanted without a config
    assert val(s, "r9k_gpu_power_cap_watts", bdf=CARD_A) == 210.0  # actual values still exported

    (device_dir(root, CARD_A) / "mem_info_vram_used").unlink()
    junction = hwmon_dir(root, CARD_B) / "temp2_input"
    junction.unlink()
    junction.mkdir()  # reading it fails with an OSError, as a card in reset does with EPERM
    s = scrape(registry)
    assert val(s, "r9k_scrape_errors_total", source="sysfs") == 2
    assert ("r9k_gpu_vram_used_bytes", frozenset({("bdf", CARD_A)})) not in s
    assert val(s, "r9k_gpu_vram_used_bytes", bdf=CARD_B) == 512 * 1024**2
    assert val(s, "r9k_scrape_errors_total", source="ops_config") == 2  # counted per scrape

    # A corrupt card state file is counted; the other card's state is still read.
    shutil.copytree(state, tmp_path / "state2")
    (tmp_path / "state2/cards/0000:05:00.0.json").write_text("{not json")
    s = scrape(build_registry(build_collector(root, tmp_path / "state2", tmp_path / "no-ops.yaml")))
    assert val(s, "r9k_scrape_errors_total", source="ops_state") == 1
    assert val(s, "r9k_gpu_unhealthy", bdf=CARD_B) == 1.0

    # No sysfs at all (exporter on a host without GPUs): counted, scrape still answers.
    empty = tmp_path / "empty-host"
    (empty / "sys").mkdir(parents=True)
    s = scrape(build_registry(build_collector(empty, None, tmp_path / "no-ops.yaml")))
    assert val(s, "r9k_scrape_errors_total", source="sysfs") == 1
    assert not [k for k in s if k[0].startswith("r9k_gpu_") and k[1]]  # no per-card series
    assert (val(s, "r9k_gpu_expected_cards"), val(s, "r9k_gpu_present_cards")) == (1.0, 0.0)


def expected_layout(page_mode: str, num_spec: int):
    shape = capacity.HybridModelShape.from_config(build_config())
    return capacity.plan_pool(shape, tp=1, num_spec=num_spec, kv_bytes_per_rank=0, max_model_len=1,
                              platform="cpu", onepage=page_mode == "onepage", running=0)


@pytest.mark.parametrize("page_mode, gdn, attention", [
    # tiny model: 3 GDN layers, 1 attention + 1 MTP attention layer -> groups of 2: 2 GDN groups,
    # 1 attention group. k = 2: stock pins 1 + k = 3 GDN pages per group, one-page pins 1.
    ("onepage", 3 * 2 * 1 / 100, 3 * 1 / 100),
    ("stock", 3 * 2 * 3 / 100, 3 * 1 / 100),
])
def test_pinned_ratio_matches_the_capacity_module(tiny_model_dir, page_mode, gdn, attention):
    with FakeReplica(model_name="tiny", running=3, waiting=2, kv_usage_ratio=0.42, preemptions=5,
                     num_gpu_blocks=100, block_size=128, max_model_len=4096) as replica:
        desc = parse_replica_spec(f"{replica.url},name=r1,model_config={tiny_model_dir},num_spec=2,"
                                  f"page_mode={page_mode},platform=cpu")
        s = scrape(build_registry(build_collector("/nonexistent", None, "/nonexistent", [desc])))
    lay = expected_layout(page_mode, 2)
    predicted = capacity.pinned_fraction(3, num_blocks=100, num_gdn_groups=lay.num_gdn_groups,
                                         num_attention_groups=lay.num_attention_groups,
                                         gdn_pages_per_request=lay.gdn_pages_per_request)
    r = dict(replica="r1", model="tiny")
    assert val(s, "r9k_kv_pinned_ratio", kind="gdn", **r) == pytest.approx(predicted["gdn"]) == pytest.approx(gdn)
    assert val(s, "r9k_kv_pinned_ratio", kind="attention", **r) == pytest.approx(attention)
    assert val(s, "r9k_kv_pool_blocks", **r) == 100
    assert val(s, "r9k_kv_block_size_tokens", **r) == 128
    assert val(s, "r9k_kv_usage_ratio", **r) == 0.42
    assert val(s, "r9k_replica_requests_running", **r) == 3
    assert val(s, "r9k_replica_requests_waiting", **r) == 2
    assert val(s, "r9k_replica_preemptions_total", **r) == 5
    assert val(s, "r9k_replica_up", **r) == 1.0
    assert val(s, "r9k_replica_info", page_mode=page_mode, tp="1", num_spec="2", layout_source="capacity", **r) == 1
    live = capacity.live_plan(capacity.HybridModelShape.from_config(build_config()), num_blocks=100, tp=1,
                              num_spec=2, onepage=page_mode == "onepage", max_model_len=4096, platform="cpu")
    assert getattr(live, page_mode).num_blocks == 100  # the recovered memory holds exactly the engine's pool
    assert val(s, "r9k_kv_capacity_tokens", page_mode="stock", **r) == live.stock.tokens
    assert val(s, "r9k_kv_capacity_tokens", page_mode="onepage", **r) == live.onepage.tokens
    assert live.onepage.tokens > live.stock.tokens
    for mode in ("stock", "onepage"):  # the same live plan: (blocks less the null one) // per request
        pool = getattr(live, mode)
        assert val(s, "r9k_kv_whole_requests", page_mode=mode, **r) == pool.whole_requests \
            == (pool.num_blocks - 1) // pool.blocks_per_request


def test_layout_from_plugin_info_and_from_v1_models_root(tiny_model_dir):
    plugin = {"page_mode": "onepage", "num_gdn_groups": 4, "num_attention_groups": 2, "gdn_pages_per_request": 1}
    with FakeReplica(model_name="m", running=5, num_gpu_blocks=200, plugin_info=plugin) as with_plugin, \
         FakeReplica(model_name="tiny", root=str(tiny_model_dir), max_model_len=2048, running=4,
                     num_gpu_blocks=80) as plain:
        descs = [parse_replica_spec(f"{with_plugin.url},name=p"), parse_replica_spec(f"{plain.url},name=q")]
        s = scrape(build_registry(build_collector("/nonexistent", None, "/nonexistent", descs)))
        assert "/v1/models" in plain.requests
    # The plugin's gauge wins over everything: 5 running x 4 GDN groups x 1 page / 200.
    assert val(s, "r9k_kv_pinned_ratio", replica="p", model="m", kind="gdn") == pytest.approx(0.1)
    assert val(s, "r9k_kv_pinned_ratio", replica="p", model="m", kind="attention") == pytest.approx(0.05)
    assert val(s, "r9k_replica_info", replica="p", model="m", page_mode="onepage", tp="1", num_spec="0",
               layout_source="plugin") == 1
    # No plugin, no description: config.json from /v1/models' root, stock pages, k = 0.
    lay = expected_layout("stock", 0)
    assert val(s, "r9k_kv_pinned_ratio", replica="q", model="tiny", kind="gdn") == pytest.approx(
        4 * lay.num_gdn_groups * 1 / 80)
    live = capacity.live_plan(capacity.HybridModelShape.from_config(build_config()), num_blocks=80, tp=1,
                              num_spec=0, onepage=False, max_model_len=2048, platform="gpu")
    assert val(s, "r9k_kv_capacity_tokens", replica="q", model="tiny", page_mode="stock") == live.stock.tokens


def test_plugin_layout_counts_qwen4exps_ple_pages():
    """Flash-Next: PLE short-conv groups keep stock pages in both modes and pin pool blocks too."""
    plugin = {"page_mode": "onepage", "num_gdn_groups": 36, "num_attention_groups": 13,
              "gdn_pages_per_request": 1, "num_ple_groups": 1, "ple_pages_per_request": 4}
    with FakeReplica(model_name="fn", running=8, num_gpu_blocks=6608, plugin_info=plugin) as r:
        s = scrape(build_registry(build_collector("/nonexistent", None, "/nonexistent",
                                                  [parse_replica_spec(f"{r.url},name=fn")])))
    want = capacity.pinned_fraction(8, num_blocks=6608, num_gdn_groups=36, num_attention_groups=13,
                                    gdn_pages_per_request=1, num_ple_groups=1, ple_pages_per_request=4)
    assert want["ple"] == pytest.approx(8 * 4 / 6608)
    got = {kind: val(s, "r9k_kv_pinned_ratio", replica="fn", model="fn", kind=kind)
           for kind in ("gdn", "attention", "ple")}
    assert got["ple"] == pytest.approx(want["ple"]) and got["gdn"] == pytest.approx(want["gdn"])
    assert sum(got.values()) == pytest.approx((8 * 36 + 8 * 4 + 8 * 13) / 6608)


def test_fleet_status_gives_replicas_and_states(tiny_model_dir):
    with FakeReplica(model_name="tiny", running=1, num_gpu_blocks=64) as replica:
        fleet_doc = {"replicas": [
            {"name": "r1", "url": replica.url, "model_config": str(tiny_model_dir), "tp": 1, "num_spec": 2,
             "mode": "onepage", "platform": "cpu", "max_model_len": 4096, "state": "ready",
             "cards": [CARD_A, CARD_B], "host": "gpu-b", "future_field": "ignored"},
            {"name": "r2", "url": dead_url(), "model": "tiny", "state": "unhealthy"},
        ]}
        with FakeFleet(fleet_doc) as fleet:
            collector = build_collector("/nonexistent", None, "/nonexistent", fleet_url=fleet.url + "/status",
                                        timeout_s=0.5)
            registry = build_registry(collector)
            s = scrape(registry)
            assert val(s, "r9k_replica_state", replica="r1", model="tiny", state="ready") == 1
            assert val(s, "r9k_replica_state", replica="r1", model="tiny", state="draining") == 0
            assert val(s, "r9k_replica_state", replica="r2", model="tiny", state="unhealthy") == 1
            assert val(s, "r9k_replica_up", replica="r2", model="tiny") == 0
            assert val(s, "r9k_replica_card_info", replica="r1", host="gpu-b", bdf=CARD_B) == 1
            assert val(s, "r9k_kv_pinned_ratio", replica="r1", model="tiny", kind="gdn") == pytest.approx(2 / 64)
            fleet.document = None  # the fleet entry point stops answering
            s = scrape(registry)
    assert val(s, "r9k_scrape_errors_total", source="fleet") == 1
    assert val(s, "r9k_replica_up", replica="r1", model="tiny") == 1  # still scraped from the last list
    assert not [k for k in s if k[0] == "r9k_replica_state"]  # state unknown now: not exported


def test_forty_hung_replicas_cost_neither_the_scrape_timeout_nor_the_card_metrics(host):
    """The replica phase has its own deadline; unanswered replicas read up=0."""
    root, state, config = host
    with HungReplicas(40) as hung, FakeReplica(model_name="tiny", running=1) as alive:
        descs = [ReplicaDescription(name=f"hung-{i}", url=u) for i, u in enumerate(hung.urls)]
        descs.append(ReplicaDescription(name="alive", url=alive.url))
        registry = build_registry(build_collector(root, state, config, descs))  # default timeouts
        started = time.monotonic()
        s = scrape(registry)
        elapsed_s = time.monotonic() - started
        # The phase deadline holds even when one replica's own timeout is longer than it.
        slow = build_registry(build_collector(root, state, config, descs, timeout_s=30, replica_budget_s=1.0))
        started = time.monotonic()
        s_slow = scrape(slow)
        budget_elapsed_s = time.monotonic() - started
    assert budget_elapsed_s < 2.0 and val(s_slow, "r9k_gpu_power_cap_watts", bdf=CARD_B) == 225.0
    assert val(s_slow, "r9k_replica_up", replica="hung-0", model="") == 0.0
    assert elapsed_s < 7.0, f"scrape took {elapsed_s:.1f} s; Prometheus gives up at 10 s"
    assert val(s, "r9k_gpu_power_cap_watts", bdf=CARD_B) == 225.0
    assert val(s, "r9k_gpu_config_drift", bdf=CARD_B) == 1.0
    assert [val(s, "r9k_replica_up", replica=f"hung-{i}", model="") for i in range(40)] == [0.0] * 40
    assert val(s, "r9k_replica_up", replica="alive", model="tiny") == 1.0
    assert val(s, "r9k_scrape_errors_total", source="replica") == 40


def test_http_server_serves_the_registry(host):
    root, state, config = host
    server, _ = serve(build_registry(build_collector(root, state, config)), 0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    assert f'r9k_gpu_power_cap_watts{{bdf="{CARD_B}"}} 225.0' in text


def test_replica_spec_parsing():
    d = parse_replica_spec("http://h:8000/,tp=2,num_spec=3,page_mode=onepage,cards=0000:03:00.0|0000:04:00.0")
    assert (d.name, d.url, d.tp, d.num_spec, d.page_mode, d.cards) == (
        "h:8000", "http://h:8000", 2, 3, "onepage", ["0000:03:00.0", "0000:04:00.0"])
    for bad, needle in (("h:8000", "http(s)://host:port"), ("http://h:1,tp=0", "tp"),
                        ("http://h:1,colour=red", "key=value"), ("http://h:1,page_mode=two", "page_mode")):
        with pytest.raises(ReplicaSpecError, match=re.escape(needle)):
            parse_replica_spec(bad)


def test_cli_once_json_and_bad_input(host, tmp_path):
    root, state, config = host
    runner = CliRunner()
    result = runner.invoke(main, ["exporter", "--once", "--json", "--host-root", str(root),
                                  "--state-dir", str(state), "--config", str(config)])
    assert result.exit_code == 0, result.output
    samples = json.loads(result.output)["samples"]
    assert {"name": "r9k_gpu_power_cap_wanted_watts", "labels": {"bdf": CARD_A}, "value": 210.0} in samples
    result = runner.invoke(main, ["exporter", "--once", "--host-root", str(root), "--state-dir", str(state),
                                  "--config", str(config)])
    assert result.exit_code == 0 and f'r9k_gpu_config_drift{{bdf="{CARD_B}"}} 1.0' in result.output
    for args, needle in ((["--host-root", str(tmp_path / "nowhere")], "no sys/ directory"),
                         (["--replica", "localhost:8000"], "http(s)://host:port"),
                         (["--fleet", "fleet:8000"], "--fleet"),
                         (["--port", "70000"], "--port 70000"),
                         (["--json"], "--once"),
                         (["--replica", "http://a:1", "--replica", "http://a:1"], "given twice")):
        result = runner.invoke(main, ["exporter", *args])
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, result.output)


def _exporter_process(*args: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "from r9k.cli import main; main()", "exporter", "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_exporter_listens_on_loopback_unless_told_otherwise(host):
    """The default bind is 127.0.0.1; a wider bind without TLS/auth warns."""
    root, state, config = host
    common = ["--host-root", str(root), "--state-dir", str(state), "--config", str(config)]
    proc = _exporter_process(*common)
    try:
        first = proc.stdout.readline()
        port = int(re.search(r":(\d+)/metrics", first).group(1))
        assert first.startswith("r9k exporter: http://127.0.0.1:"), first
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        listening = {conn.laddr for conn in __import__("psutil").Process(proc.pid).net_connections("tcp")
                     if conn.status == "LISTEN"}
        assert listening == {("127.0.0.1", port)}, listening
    finally:
        proc.terminate()
        proc.wait(10)
    proc = _exporter_process("--listen", "0.0.0.0", *common)
    try:
        assert proc.stdout.readline().startswith("r9k exporter: http://0.0.0.0:")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "warning: --listen 0.0.0.0" in err and "--web-config-file" in err


@pytest.fixture
def tls_files(tmp_path):
    """A self-signed certificate for 127.0.0.1 and a web config with TLS and one bcrypt user."""
    import datetime
    import ipaddress

    import bcrypt
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "r9k-exporter-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    hashed = bcrypt.hashpw(b"scrape-secret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return web


def test_web_config_file_gives_tls_and_basic_auth(host, tls_files):
    """node_exporter's web config: TLS with the given certificate, 401 without the user."""
    import base64
    import ssl
    import urllib.error

    from r9k.monitoring.web_config import load_web_config

    root, state, config = host
    server, _ = serve(build_registry(build_collector(root, state, config)), 0, "127.0.0.1",
                      load_web_config(tls_files))
    url = f"https://127.0.0.1:{server.server_address[1]}/metrics"
    trusted = ssl.create_default_context(cafile=str(tls_files.parent / "tls.crt"))

    def get(auth: str | None, context=trusted) -> tuple[int, str]:
        req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
        try:
            with urllib.request.urlopen(req, timeout=5, context=context) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    def basic(user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    try:
        status, text = get(basic("prometheus", "scrape-secret"))
        assert status == 200 and f'r9k_gpu_power_cap_watts{{bdf="{CARD_B}"}} 225.0' in text
        assert get(None)[0] == 401
        assert get(basic("prometheus", "wrong"))[0] == 401
        assert get(basic("nobody", "scrape-secret"))[0] == 401
        with pytest.raises(OSError):  # plain HTTP is not served on the TLS port
            urllib.request.urlopen(url.replace("https:", "http:"), timeout=5)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(basic("prometheus", "scrape-secret"), ssl.create_default_context())
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("text, needle", [
    ("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n", "cannot load cert_file"),
    ("basic_auth_users:\n  prometheus: plain-password\n", "expected a bcrypt hash"),
    ("tls_config: {}\n", "tls_config"),
    ("- a list\n", "expected a mapping"),
])
def test_bad_web_config_file_is_refused_in_one_line(host, tmp_path, text, needle):
    root, state, config = host
    web = tmp_path / "bad-web.yml"
    web.write_text(text)
    result = CliRunner().invoke(main, ["exporter", "--port", "0", "--web-config-file", str(web),
                                       "--host-root", str(root), "--state-dir", str(state), "--config", str(config)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], result.output


def test_refused_ops_config_leaves_drift_unknown_and_says_so(host, tmp_path):
    """A refused config leaves drift absent (unknown, not 0 for every card), r9k_ops_config_valid
    is 0 and the failure is counted; actual values are still exported."""
    root, state, config = host
    s = scrape(build_registry(build_collector(root, state, config)))
    assert val(s, "r9k_ops_config_valid") == 1.0 and val(s, "r9k_gpu_config_drift", bdf=CARD_B) == 1.0
    refused = tmp_path / "refused.yaml"
    refused.write_text("defaults: {power_cap_watts: '210 # watts', voltage_offset_mv: -42}\n")
    for bad in (refused, tmp_path / "missing.yaml"):
        s = scrape(build_registry(build_collector(root, state, bad)))
        assert val(s, "r9k_ops_config_valid") == 0.0, bad
        assert "r9k_gpu_config_drift" not in names(s), bad
        assert val(s, "r9k_scrape_errors_total", source="ops_config") == 1
        assert val(s, "r9k_gpu_power_cap_watts", bdf=CARD_B) == 225.0


def test_expected_and_present_cards_name_the_missing_one(host, tmp_path):
    """The config's expected_cards against the cards on the bus, per host."""
    root, state, _ = host
    listed = tmp_path / "listed.yaml"
    listed.write_text(f"defaults: {{power_cap_watts: 210, voltage_offset_mv: -42}}\n"
                      f"expected_cards: ['{CARD_A}', '{CARD_B}', '0000:05:00.0']\n")
    s = scrape(build_registry(build_collector(root, state, listed)))
    assert (val(s, "r9k_gpu_expected_cards"), val(s, "r9k_gpu_present_cards")) == (3.0, 2.0)
    assert val(s, "r9k_gpu_missing", bdf="0000:05:00.0") == 1.0
    assert not [k for k in s if k[0] == "r9k_gpu_missing" and ("bdf", CARD_A) in k[1]]
    counted = tmp_path / "counted.yaml"
    counted.write_text("defaults: {power_cap_watts: 210, voltage_offset_mv: -42}\nexpected_cards: 4\n")
    s = scrape(build_registry(build_collector(root, state, counted)))
    assert (val(s, "r9k_gpu_expected_cards"), val(s, "r9k_gpu_present_cards")) == (4.0, 2.0)
    # No amdgpu card at all (module not loaded yet): present 0 against the default of one.
    empty = tmp_path / "empty-host"
    (empty / "sys/class/drm").mkdir(parents=True)
    s = scrape(build_registry(build_collector(empty, None, tmp_path / "no-ops.yaml")))
    assert (val(s, "r9k_gpu_expected_cards"), val(s, "r9k_gpu_present_cards")) == (1.0, 0.0)


def test_unattributed_host_faults_are_exported_by_type(host, tmp_path):
    """Faults the watcher could not pin on a card are host-level counters, 0 from the start."""
    from r9k.ops.containment import Containment
    from r9k.ops.kernlog import KernelEvent
    from r9k.ops.state import DEFAULT_FAULT_EVENTS, host_events_path, update_host_events

    root, state, config = host
    registry = build_registry(build_collector(root, state, config))
    s = scrape(registry)
    assert {val(s, "r9k_host_unattributed_faults_total", event=e) for e in EVENT_TYPES} == {0.0}
    core = Containment(DEFAULT_FAULT_EVENTS, "boot")
    for ordinal, message in ((1, "MES failed to respond to msg=REMOVE_QUEUE"),
                             (2, "MES failed to respond to msg=SUSPEND")):  # as the watcher counts them
        event = KernelEvent("mes_timeout", None, message, "test", ordinal, "none")
        assert update_host_events(state, lambda doc: core.count_on_host(doc, event, 1.0)) is True
    s = scrape(registry)
    assert val(s, "r9k_host_unattributed_faults_total", event="mes_timeout") == 2.0
    assert val(s, "r9k_host_unattributed_faults_total", event="ring_timeout") == 0.0
    assert val(s, "r9k_gpu_events_total", bdf=CARD_A, event="mes_timeout") == 0.0  # no card blamed
    # Through the real watcher: a ring timeout that names no card is the host's, not a card's.
    record_kernel_log(root, state, tmp_path / "kern-noaddr.log",
                      ["[  500.000001] [drm] *ERROR* ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2"])
    s = scrape(registry)
    assert val(s, "r9k_host_unattributed_faults_total", event="ring_timeout") == 1.0
    assert {val(s, "r9k_gpu_events_total", bdf=b, event="ring_timeout") for b in (CARD_A, CARD_B)} == {0.0}
    host_events_path(state).write_text("{torn")
    s = scrape(registry)
    assert "r9k_host_unattributed_faults_total" not in names(s)  # unknown, not 0
    assert val(s, "r9k_scrape_errors_total", source="ops_state") == 1


def test_corrupt_card_state_reads_unhealthy_and_unreadable_not_absent(host):
    """A card whose state file is corrupt may be fenced: it reads unhealthy, state unreadable."""
    from r9k.ops.state import card_state_path

    root, state, config = host
    card_state_path(state, CARD_B).write_text("{not json")
    s = scrape(build_registry(build_collector(root, state, config)))
    assert val(s, "r9k_gpu_unhealthy", bdf=CARD_B) == 1.0
    assert val(s, "r9k_gpu_state_unreadable", bdf=CARD_B) == 1.0
    assert val(s, "r9k_gpu_state_unreadable", bdf=CARD_A) == 0.0
    assert val(s, "r9k_scrape_errors_total", source="ops_state") == 1
    assert "r9k_gpu_config_drift" in names(s) and ("r9k_gpu_config_drift", frozenset({("bdf", CARD_B)})) not in s


def test_readme_commands_parse_and_name_the_real_fleet_status_path():
    """Every `r9k exporter` line of the monitoring README parses with the real CLI, and its
    fleet URLs use the path the entry point serves (/fleet/status, not /r9k/fleet/status)."""
    import shlex
    from pathlib import Path

    from r9k.deploy.entry import EntryPoint
    from r9k.monitoring.cli import exporter

    readme = (Path(__file__).resolve().parents[2] / "src/r9k/monitoring/README.md").read_text()
    served = {r.resource.canonical for r in EntryPoint(backend=None).app.router.routes() if r.method == "GET"}
    checked = 0
    for text in re.findall(r"r9k exporter[^`\n#]*", readme):
        args = [a for a in shlex.split(text.strip())[2:] if not a.startswith("[")]  # [--json]: optional
        exporter.make_context("exporter", list(args))  # unknown options raise here
        for url in re.findall(r"https?://\S+", text):
            path = "/" + url.split("/", 3)[3] if url.count("/") >= 3 else "/"
            if "fleet" in path:
                assert path in served, (text, served)
        checked += 1
    assert checked >= 4
    assert "/r9k/fleet/status" not in readme and "0.0.0.0)" not in readme


def test_web_config_with_a_user_given_twice_is_refused(tls_files):
    """A user listed twice under basic_auth_users would keep only the last hash (PyYAML's
    default): a security setting silently not what the file says, so start-up stops."""
    from r9k.monitoring.web_config import WebConfigError, load_web_config

    text = tls_files.read_text()
    user_line = next(line for line in text.splitlines() if line.startswith("  prometheus:"))
    tls_files.write_text(text + user_line + "\n")
    with pytest.raises(WebConfigError, match=r"duplicate key 'prometheus' \(line 6\)"):
        load_web_config(tls_files)


def test_replica_planner_series_follows_its_plugin():
    """A replica's capacity figures are planned for the vLLM its plugin reports (0.34's
    64-token default block); an absent or unknown release falls back to the planner's 0.32."""
    from r9k.core import capacity
    from r9k.monitoring.replicas import _series

    assert _series({"vllm_version": "0.34.0"}) == "0.34"
    assert _series({"vllm_version": "0.32.0+cpu"}) == "0.32"
    assert _series({"vllm_version": "0.35.1"}) == _series(None) == capacity.VLLM_SERIES
