"""Config validation: the 225 W story (text glued to numbers, misspelt fields) changes nothing."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from r9k.cli import main
from r9k.ops.config import ConfigError, load_config, parse_config
from doubles.ops_host import CardSpec, build_host_tree, read_cap_watts, read_od_offset_mv


@pytest.fixture()
def host(tmp_path):
    return build_host_tree(tmp_path / "host", [CardSpec("0000:03:00.0"), CardSpec("0000:04:00.0")])


def _apply(tmp_path, host, text):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text(text)
    return CliRunner().invoke(main, ["ops", "apply", "--config", str(cfg), "--host-root", str(host),
                                     "--state-dir", str(tmp_path / "state"), "--backend", "sysfs",
                                     "--settle-seconds", "0.2"])


@pytest.mark.parametrize(
    "text, needle",
    [
        ("defaults: {power_cap_watts: 210W, voltage_offset_mv: -42}\n", "'210W'"),
        ('defaults: {power_cap_watts: "210 # safe", voltage_offset_mv: -42}\n', "'210 # safe'"),
        ('defaults: {power_cap_watts: "210", voltage_offset_mv: -42}\n', "'210'"),
        ("defaults: {power_cap_watt: 210, voltage_offset_mv: -42}\n", "unknown field 'power_cap_watt'"),
        ("defaults: {power_cap_watts: 210, voltage_offset_mv: -42mV}\n", "'-42mV'"),
        ("defaults: {power_cap_watts: 210, voltage_offset_mv: 42}\n", "got +42"),
        ("defualts: {power_cap_watts: 210}\n", "unknown field 'defualts'"),
        ('cards: {"03:00.0": {power_cap_watts: 200}}\n', "full lowercase PCI address"),
        ("backend: lactd\n", "one of auto, lact, sysfs"),
    ],
)
def test_bad_values_are_refused_and_nothing_is_written(tmp_path, host, text, needle):
    result = _apply(tmp_path, host, text)
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "\n" not in result.output.strip().split("Error: ", 1)[1]  # one line
    for bdf in ("0000:03:00.0", "0000:04:00.0"):
        assert read_cap_watts(host, bdf) == 300.0
        assert read_od_offset_mv(host, bdf) == 0
    assert not (tmp_path / "state").exists()


def test_a_real_yaml_comment_is_fine(tmp_path):
    config = parse_config("defaults:\n  power_cap_watts: 210   # safe for this PSU\n  voltage_offset_mv: -42\n")
    assert config.defaults.power_cap_watts == 210
    assert config.defaults.voltage_offset_mv == -42


def test_per_card_override_merges_field_by_field():
    config = parse_config('defaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n'
                          'cards: {"0000:03:00.0": {power_cap_watts: 200}}\n')
    assert config.wanted("0000:03:00.0").model_dump() == {"power_cap_watts": 200, "voltage_offset_mv": -42}
    assert config.wanted("0000:04:00.0").model_dump() == {"power_cap_watts": 210, "voltage_offset_mv": -42}


def test_hooks_need_a_root_only_writable_file(tmp_path):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text("hooks: [/bin/true]\n")  # a hook must exist, root-owned
    os.chmod(cfg, 0o666)
    with pytest.raises(ConfigError, match="writable by someone other than root"):
        load_config(cfg)
    os.chmod(cfg, 0o644)
    if os.geteuid() == 0:
        assert load_config(cfg).hook_argvs() == [["/bin/true"]]
    # Without hooks, a group-writable file is acceptable.
    cfg.write_text("defaults: {power_cap_watts: 210}\n")
    os.chmod(cfg, 0o664)
    assert load_config(cfg).defaults.power_cap_watts == 210


def test_missing_and_unparseable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "broken.yaml").write_text("defaults: {power_cap_watts: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 210\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_unknown_fault_event_is_refused():
    with pytest.raises(ConfigError, match="unknown event 'mes_timout'"):
        parse_config("fault_events: [mes_timout]\n")
