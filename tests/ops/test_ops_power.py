"""Discovery and apply/verify/status/reconcile through sysfs, against realistic fixture trees."""
from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from r9k.cli import main
from doubles import ops_host as fixtures
from r9k.ops.config import parse_config
from doubles.ops_host import CardSpec, FakeKernel, build_host_tree, read_cap_watts, read_od_offset_mv
from r9k.ops.power import apply_power, power_status
from r9k.ops.state import read_card_state
from r9k.ops.sysfs import discover_cards, parse_od_table, recovery_status

A, B, C = "0000:03:00.0", "0000:04:00.0", "0000:0a:00.0"
CONFIG = "backend: sysfs\ndefaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n"


def _host(tmp_path, **host_kw):
    cards = [
        CardSpec(A),
        CardSpec(B, power_files=("input",), od_style="inline", cap_max_watts=280, offset_range_mv=(-150, 0)),
        CardSpec(C, power_files=("average",), cap_watts=225),
        CardSpec("0000:0b:00.0", device_id=0x73BF),  # another amdgpu card: reported, not managed
    ]
    return build_host_tree(tmp_path / "host", cards, fixtures.HostSpec(**host_kw) if host_kw else None)


def _cli(tmp_path, host, *args, config=CONFIG):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text(config)
    return CliRunner().invoke(main, ["ops", *args, "--config", str(cfg), "--host-root", str(host),
                                     "--state-dir", str(tmp_path / "state")])


def test_discovery_reads_every_card_by_pci_address(tmp_path):
    host = _host(tmp_path)
    (host / "sys/class/drm/card0-DP-1").mkdir()  # connector entries are not cards
    cards = {c.bdf: c for c in discover_cards(host)}
    assert sorted(cards) == [A, B, C, "0000:0b:00.0"]
    assert [cards[b].is_r9700 for b in (A, B, C, "0000:0b:00.0")] == [True, True, True, False]
    assert (cards[A].cap_min_watts, cards[A].cap_max_watts, cards[A].cap_default_watts) == (150.0, 300.0, 300.0)
    assert cards[B].cap_max_watts == 280.0 and cards[B].offset_range_mv == (-150, 0)
    assert cards[C].cap_watts == 225.0
    assert (cards[A].power_source, cards[B].power_source, cards[C].power_source) == ("average", "input", "average")
    assert all(c.hwmon_dir is not None and c.hwmon_dir.parent.parent == c.device_dir for c in cards.values())
    assert cards[A].runtime_status == "active" and cards[A].errors == []


def test_pp_od_clk_voltage_parsing_is_tolerant():
    padded = "OD_SCLK_OFFSET:\n0Mhz\nOD_VDDGFX_OFFSET:\n-50mV\nOD_RANGE:\nSCLK_OFFSET:    -500Mhz       1000Mhz\nVDDGFX_OFFSET:    -200mv          0mv\n"
    assert parse_od_table(padded).offset_mv == -50 and parse_od_table(padded).offset_range_mv == (-200, 0)
    inline = "OD_VDDGFX_OFFSET: -42mV\nOD_RANGE:\nVDDGFX_OFFSET: -120MV 0MV\n"
    assert (parse_od_table(inline).offset_mv, parse_od_table(inline).offset_range_mv) == (-42, (-120, 0))
    no_od = "OD_SCLK_OFFSET:\n0Mhz\nOD_RANGE:\nSCLK_OFFSET: -500Mhz 1000Mhz\n"
    assert (parse_od_table(no_od).offset_mv, parse_od_table(no_od).offset_range_mv) == (None, None)


def test_apply_through_sysfs_writes_microwatts_and_vo_commit(tmp_path):
    host = _host(tmp_path)
    config = CONFIG + 'cards: {"0000:04:00.0": {power_cap_watts: 200, voltage_offset_mv: -30}}\n'
    with FakeKernel(host) as kernel:
        result = _cli(tmp_path, host, "apply", "--settle-seconds", "1", "--json", config=config)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["backend"].startswith("sysfs")
    assert (fixtures.hwmon_dir(host, A) / "power1_cap").read_text() == "210000000\n"
    assert (read_cap_watts(host, B), read_od_offset_mv(host, B)) == (200.0, -30)
    assert (read_cap_watts(host, C), read_od_offset_mv(host, C)) == (210.0, -42)
    assert kernel.commands[A] == ["vo -42", "c"]
    assert read_cap_watts(host, "0000:0b:00.0") == 300.0  # not an R9700, not named: untouched
    assert read_card_state(tmp_path / "state", A).power_ok is True
    # Applying again changes nothing and still verifies.
    with FakeKernel(host) as kernel:
        again = _cli(tmp_path, host, "apply", "--settle-seconds", "1", config=config)
    assert again.exit_code == 0 and kernel.commands == {}


@pytest.mark.parametrize(
    "override, needle, b_after",
    [
        ('"0000:04:00.0": {power_cap_watts: 290}', "power_cap_watts 290 is outside the card's range 150-280 W",
         (300.0, -42)),
        ('"0000:04:00.0": {voltage_offset_mv: -160}', "voltage_offset_mv -160 is outside the card's range -150..0 mV",
         (210.0, 0)),
        ('"0000:04:00.0": {power_cap_watts: 100}', "outside the card's range 150-280 W", (300.0, -42)),
    ],
)
def test_a_value_a_card_does_not_declare_is_refused_for_that_card_alone(tmp_path, override, needle, b_after):
    """The refused setting is never written and is that card's drift (named,
    with the card's declared range, exit 1); every other setting and card is applied."""
    host = _host(tmp_path)
    with FakeKernel(host):
        result = _cli(tmp_path, host, "apply", "--settle-seconds", "1", config=CONFIG + "cards: {" + override + "}\n")
    assert result.exit_code == 1, result.output
    assert needle in result.output and "nothing was changed" not in result.output
    assert [(read_cap_watts(host, b), read_od_offset_mv(host, b)) for b in (A, B, C)] == [
        (210.0, -42), b_after, (210.0, -42)]


def test_offset_on_a_card_without_overdrive_is_refused(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B, overdrive=False)])
    with FakeKernel(host):
        result = _cli(tmp_path, host, "apply", "--settle-seconds", "1")
    assert result.exit_code == 1
    assert "0000:04:00.0: voltage_offset_mv -42 asked but the card declares no VDDGFX_OFFSET range" in result.output
    assert (read_cap_watts(host, A), read_od_offset_mv(host, A)) == (210.0, -42)
    assert read_cap_watts(host, B) == 210.0  # the cap it declares valid is still applied
    # Managing only the cap works without overdrive.
    with FakeKernel(host):
        ok = _cli(tmp_path, host, "apply", config="backend: sysfs\ndefaults: {power_cap_watts: 210}\n")
    assert ok.exit_code == 0 and read_cap_watts(host, B) == 210.0


def test_every_refused_setting_is_reported_and_the_valid_ones_applied(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A, cap_max_watts=200), CardSpec(B, offset_range_mv=(-30, 0))])
    with FakeKernel(host):
        report = apply_power(parse_config(CONFIG), host, None, settle_s=1)
    by = {c.bdf: c for c in report.cards}
    assert not report.ok
    assert by[A].drift == ["refused: 0000:03:00.0: power_cap_watts 210 is outside the card's range 150-200 W"]
    assert by[B].drift == ["refused: 0000:04:00.0: voltage_offset_mv -42 is outside the card's range -30..0 mV"]
    assert (read_cap_watts(host, A), read_od_offset_mv(host, A)) == (300.0, -42)
    assert (read_cap_watts(host, B), read_od_offset_mv(host, B)) == (210.0, 0)


def test_recovery_status_from_module_parameter_and_cmdline(tmp_path):
    on = build_host_tree(tmp_path / "on", [CardSpec(A)])
    assert recovery_status(on).in_effect is False and "amdgpu.gpu_recovery=0" in recovery_status(on).warning
    off = build_host_tree(tmp_path / "off", [CardSpec(A)], fixtures.HostSpec(
        gpu_recovery=0, cmdline="BOOT_IMAGE=/vmlinuz ro amdgpu.gpu_recovery=0 amdgpu.runpm=0"))
    status = recovery_status(off)
    assert (status.in_effect, status.cmdline_asks_off, status.warning) == (True, True, None)


def test_power_status_api_for_other_components(tmp_path):
    host = _host(tmp_path)
    statuses = {s.bdf: s for s in power_status(parse_config(CONFIG), host)}
    assert statuses[C].actual_cap_watts == 225.0 and statuses[C].wanted_cap_watts == 210
    assert statuses[C].drift[0] == "power cap 225 W, wanted 210 W"
    assert statuses[A].cap_range_watts == (150.0, 300.0)


def test_bad_host_root_is_bad_input(tmp_path):
    result = _cli(tmp_path, tmp_path / "nowhere", "status")
    assert result.exit_code == 2 and "no sys/ directory" in result.output


def test_a_card_without_a_cap_range_keeps_its_cap_and_gets_its_offset(tmp_path):
    """A card that declares no cap range: its cap is never written (not settable, reported), its
    valid voltage offset is applied, and apply does not wait for a range that cannot appear."""
    import time

    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    (fixtures.hwmon_dir(host, A) / "power1_cap_max").unlink()
    started = time.monotonic()
    with FakeKernel(host):
        result = _cli(tmp_path, host, "apply", "--wait-seconds", "20", "--settle-seconds", "1")
    assert time.monotonic() - started < 10, "apply waited for a cap range the card does not have"
    assert result.exit_code == 1
    assert "0000:03:00.0 cap 300/None W offset -42/-42 mV DRIFT: refused" in result.output
    assert "power_cap_watts 210 not settable: the card declares no power cap range" in result.output
    assert read_cap_watts(host, A) == 300.0 and read_cap_watts(host, B) == 210.0
    assert fixtures.read_od_offset_mv(host, A) == -42


def test_config_path_that_cannot_be_read_is_bad_input(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    result = CliRunner().invoke(main, ["ops", "status", "--config", str(tmp_path), "--host-root", str(host)])
    assert result.exit_code == 2 and "is a directory; expected a regular file" in result.output


def test_retry_backs_off_until_the_card_answers():
    from r9k.ops.power import retry_not_ready
    from r9k.ops.sysfs import NotReady

    attempts, sleeps = [], []

    def flaky():
        attempts.append(1)
        if len(attempts) < 4:
            raise NotReady("power1_cap: Operation not permitted")
        return "written"

    assert retry_not_ready(flaky, time.monotonic() + 10, sleep=sleeps.append) == "written"
    assert sleeps == [0.05, 0.1, 0.2]
    with pytest.raises(NotReady):
        retry_not_ready(lambda: (_ for _ in ()).throw(NotReady("EPERM")), time.monotonic() + 0.01, sleep=sleeps.append)
