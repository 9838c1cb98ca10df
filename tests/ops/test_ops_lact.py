"""Apply through the LACT double: a real Unix socket speaking LACT's JSON lines, with auto-revert."""
from __future__ import annotations

import json
import socket
import time

import pytest
import yaml
from click.testing import CliRunner

from r9k.cli import main
from r9k.ops.config import parse_config
from doubles.ops_host import CardSpec, build_host_tree, read_cap_watts, read_od_offset_mv
from r9k.ops.lact import LactClient, LactError, bdf_of_gpu_id
from doubles.lact_double import LactDouble
from r9k.ops.power import apply_power, choose_backend

A, B = "0000:03:00.0", "0000:04:00.0"
GPU_A = "1002:7551-1002:0E0D-0000:03:00.0"


@pytest.fixture()
def host(tmp_path):
    return build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B, power_files=("input",))])


@pytest.fixture()
def sock(tmp_path):
    return str(tmp_path / "lactd.sock")


def _config(sock, backend="auto", extra=""):
    return parse_config(f"backend: {backend}\nlact_socket: {sock}\n"
                        f"defaults: {{power_cap_watts: 210, voltage_offset_mv: -42}}\n{extra}")


def _raw(sock, line: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock)
        s.sendall(line)
        return json.loads(s.makefile("rb").readline())


def test_protocol_on_the_wire(host, sock):
    with LactDouble(sock, host):
        assert _raw(sock, b'{"command": "ping"}\n') == {"status": "ok", "data": None}
        devices = _raw(sock, b'{"command": "list_devices"}\n')["data"]
        assert [d["id"] for d in devices] == [GPU_A, "1002:7551-1002:0E0D-0000:04:00.0"]
        stats = _raw(sock, json.dumps({"command": "device_stats", "args": {"id": GPU_A}}).encode() + b"\n")
        assert stats["data"]["power"]["cap_max"] == 300.0 and stats["data"]["power"]["cap_current"] == 300.0
        assert _raw(sock, b'not json\n')["status"] == "error"
        assert _raw(sock, b'{"command": "frobnicate"}\n') == {"status": "error", "data": "unknown command frobnicate"}
    assert bdf_of_gpu_id(GPU_A) == A


def test_unconfirmed_change_is_reverted_by_the_daemon_timer(host, sock):
    with LactDouble(sock, host, apply_settings_timer=0.3) as lact:
        client = LactClient(sock)
        assert client.set_gpu_config(GPU_A, {"power_cap": 210.0, "voltage_offset": -42}) == 0.3
        assert (read_cap_watts(host, A), read_od_offset_mv(host, A)) == (210.0, -42)
        time.sleep(0.6)
        assert (read_cap_watts(host, A), read_od_offset_mv(host, A)) == (300.0, 0)
        assert lact.reverts == 1
        # A confirmed change stays after the timer.
        client.set_gpu_config(GPU_A, {"power_cap": 220.0})
        client.confirm()
        time.sleep(0.45)
        assert read_cap_watts(host, A) == 220.0 and lact.reverts == 1
        with pytest.raises(LactError, match="no pending config"):
            client.confirm()


def test_default_timer_is_five_seconds(host, sock):
    with LactDouble(sock, host) as lact:
        assert LactClient(sock).set_gpu_config(GPU_A, {"power_cap": 250.0}) == 5.0
        LactClient(sock).revert()
        assert read_cap_watts(host, A) == 300.0 and lact.reverts == 1


def test_apply_through_lact_confirms_after_read_back(host, sock, tmp_path):
    lact_config = tmp_path / "etc/lact/config.yaml"
    with LactDouble(sock, host, apply_settings_timer=1.0, config_path=lact_config) as lact:
        backend = choose_backend(_config(sock))
        assert backend.name == "lact" and sock in backend.reason
        report = apply_power(_config(sock), host, tmp_path / "state", settle_s=0.5)
        commands = [r["command"] for r in lact.requests]
        time.sleep(1.2)  # past the revert window: confirmed settings must stay
    assert report.ok and report.backend == "lact"
    for bdf in (A, B):
        assert (read_cap_watts(host, bdf), read_od_offset_mv(host, bdf)) == (210.0, -42)
    assert commands.count("set_gpu_config") == 2 and commands.count("confirm_pending_config") == 2
    assert commands.index("get_gpu_config") < commands.index("set_gpu_config")
    saved = yaml.safe_load(lact_config.read_text())
    assert saved["version"] == 6 and saved["gpus"][GPU_A] == {"power_cap": 210.0, "voltage_offset": -42}
    assert lact.reverts == 0


def test_a_cap_that_does_not_stick_is_reverted_and_reported_as_drift(host, sock, tmp_path):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text(f"backend: lact\nlact_socket: {sock}\ndefaults: {{power_cap_watts: 210, voltage_offset_mv: -42}}\n")
    with LactDouble(sock, host, ignore_cap_for={B}) as lact:
        result = CliRunner().invoke(main, ["ops", "apply", "--config", str(cfg), "--host-root", str(host),
                                           "--state-dir", str(tmp_path / "state"), "--settle-seconds", "0.3"])
        requests = [r.get("args", {}).get("command") for r in lact.requests if r["command"] == "confirm_pending_config"]
    assert result.exit_code == 1, result.output
    assert "0000:04:00.0 cap 300/210 W" in result.output and "power cap 300 W, wanted 210 W" in result.output
    assert requests == ["confirm", "revert"]
    assert (read_cap_watts(host, B), read_od_offset_mv(host, B)) == (300.0, 0)  # reverted, offset too
    assert (read_cap_watts(host, A), read_od_offset_mv(host, A)) == (210.0, -42)


def test_auto_falls_back_to_sysfs_and_says_why(sock):
    backend = choose_backend(_config(sock))
    assert backend.name == "sysfs" and "does not exist" in backend.reason


@pytest.mark.parametrize("fail", [None, "list_devices", "ping"])
def test_lact_backend_unavailable_is_bad_input_and_changes_nothing(host, sock, tmp_path, fail):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text(f"backend: lact\nlact_socket: {sock}\ndefaults: {{power_cap_watts: 210}}\n")
    args = ["ops", "apply", "--config", str(cfg), "--host-root", str(host), "--state-dir", str(tmp_path / "s")]
    if fail is None:
        result = CliRunner().invoke(main, args)
        assert "does not exist" in result.output
    else:
        with LactDouble(sock, host, fail_commands={fail: "permission denied"}) as lact:
            result = CliRunner().invoke(main, args)
            assert not any(r["command"] == "set_gpu_config" for r in lact.requests)
        assert f"LACT {fail} failed: permission denied" in result.output
    assert result.exit_code == 2 and "nothing was changed" in result.output
    assert read_cap_watts(host, A) == 300.0


def test_lact_error_on_set_leaves_the_card_and_reports(host, sock, tmp_path):
    with LactDouble(sock, host, fail_commands={"set_gpu_config": "gpu busy"}):
        report = apply_power(_config(sock), host, None, settle_s=0.2)
    assert not report.ok
    assert all("LACT set_gpu_config failed: gpu busy" in c.drift[0] for c in report.cards)
    assert read_cap_watts(host, A) == 300.0
