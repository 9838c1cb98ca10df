"""Bad input to the `r9k` command line is exit 2 and one line, never a crash or a hang.
Every config loader (ops config, fleet file, exporter web config) refuses a complex YAML key; a
fleet file that is not UTF-8 or is a directory is bad input; every float option of the `r9k`
command line takes one rule (finite, in range), and a refused value changes nothing."""
from __future__ import annotations

import math

import click
import pytest
from click.testing import CliRunner

from doubles.ops_host import CardSpec, build_host_tree, read_cap_watts
from r9k.cli import main
from r9k.core.config_errors import YamlKeyError, load_yaml_strict
from r9k.cli_errors import FiniteFloat

A = "0000:03:00.0"
COMPLEX_KEY = "? [a, b]\n: 1\n"


def _r9k(*args):
    return CliRunner().invoke(main, list(args))


def _one_line_error(result) -> str:
    text = result.output.strip()
    assert "Traceback" not in text and text.count("\n") == 0, text
    return text


def test_a_complex_yaml_key_is_bad_input_in_every_config(tmp_path):
    with pytest.raises(YamlKeyError, match=r"a sequence used as a key \(line 1\)"):
        load_yaml_strict(COMPLEX_KEY)
    with pytest.raises(YamlKeyError, match="a mapping used as a key"):
        load_yaml_strict("defaults:\n  ? {x: 1}\n  : 2\n")
    path = tmp_path / "complex.yaml"
    path.write_text(COMPLEX_KEY)
    path.chmod(0o644)
    for args in (["ops", "check-config", "--config", str(path)],
                 ["fleet", "check", "--config", str(path)],
                 ["exporter", "--once", "--no-cards", "--web-config-file", str(path)]):
        result = _r9k(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "a sequence used as a key (line 1); expected a plain name" in _one_line_error(result)


def test_a_fleet_file_that_is_not_utf8_or_is_a_directory_is_bad_input(tmp_path):
    latin = tmp_path / "fleet.yaml"
    latin.write_bytes(b"models: []  # caf\xe9\n")
    result = _r9k("fleet", "check", "--config", str(latin))
    assert result.exit_code == 2
    assert "not UTF-8 text (byte 0xe9 at offset 17)" in _one_line_error(result)
    result = _r9k("fleet", "check", "--config", str(tmp_path))
    assert result.exit_code == 2 and "is a directory; expected a regular file" in _one_line_error(result)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_finite_float_refuses_nan_and_inf(value):
    kind = FiniteFloat(0, 10)
    with pytest.raises(click.BadParameter, match="is not a finite number|not in the range"):
        kind.convert(value, None, None)
    assert kind.convert("2.5", None, None) == 2.5
    assert math.isfinite(FiniteFloat(0).convert("1e300", None, None))


def test_apply_with_a_nan_or_infinite_wait_changes_nothing(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    cfg = tmp_path / "ops.yaml"
    cfg.write_text("backend: sysfs\ndefaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n")
    cfg.chmod(0o644)
    before = read_cap_watts(host, A)
    for opt, value in (("--wait-seconds", "nan"), ("--settle-seconds", "inf"),
                       ("--wait-seconds", "-inf")):
        result = _r9k("ops", "apply", "--config", str(cfg), "--host-root", str(host),
                      "--state-dir", str(tmp_path / "state"), opt, value)
        assert result.exit_code == 2, result.output
        assert opt in result.output and ("finite" in result.output or "range" in result.output)
        assert read_cap_watts(host, A) == before == 300.0


@pytest.mark.parametrize("args", [
    ["exporter", "--once", "--no-cards", "--replica-budget", "inf"],
    ["exporter", "--once", "--no-cards", "--timeout", "nan"],
    ["exporter", "--once", "--no-cards", "--timeout", "0"],
    ["ops", "reconcile", "--interval", "nan", "--count", "1"],
    ["ops", "reconcile", "--interval", "inf", "--count", "1"],
    ["ops", "watch", "--once", "--interval", "nan"],
    ["capacity", "--preset", "tiny", "--num-spec", "3", "--max-model-len", "4096",
     "--kv-gib-per-rank", "nan"],
    ["bench", "sanity", "--endpoint", "http://127.0.0.1:9", "--timeout", "nan"],
])
def test_every_float_option_refuses_nan_and_inf(args):
    result = _r9k(*args)
    assert result.exit_code == 2, (args, result.output)
    opt = next(a for a, v in zip(args, args[1:]) if v in ("nan", "inf", "0"))
    assert f"'{opt}'" in result.output and "Traceback" not in result.output, result.output


def test_check_config_and_fleet_check_speak_json_and_so_do_their_refusals(tmp_path, tiny_model):
    """`--json` on `ops check-config` and `fleet check`; under `--json` a refusal
    is one JSON object on stdout ({"ok": false, "error", "exit_code"}), not click's plain text."""
    import json

    ops_cfg = tmp_path / "ops.yaml"
    ops_cfg.write_text("defaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n")
    ops_cfg.chmod(0o644)
    result = _r9k("ops", "check-config", "--config", str(ops_cfg), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["ok"] and doc["settings"]["defaults"] == {"power_cap_watts": 210, "voltage_offset_mv": -42}
    assert doc["settings"]["fault_events"]  # defaults shown, fencing on

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({
        "platform": "gpu", "hosts": [{"name": "a", "cards": ["0000:03:00.0", "0000:04:00.0"]}],
        "models": [{"name": "m", "path": str(tiny_model), "replicas": 2,
                    "kv_cache_memory_bytes": 64 << 20}]}))
    result = _r9k("fleet", "check", "--config", str(fleet), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert (doc["ok"], doc["replicas"], doc["cards"]) == (True, 2, 2)
    assert doc["fleet"]["models"][0]["name"] == "m"

    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: nope\n")
    bad.chmod(0o644)
    for args in (["ops", "check-config", "--config", str(bad), "--json"],
                 ["fleet", "check", "--config", str(tmp_path / "missing.yaml"), "--json"],
                 ["capacity", "--preset", "qwen3.5-27b", "--num-spec", "3", "--tp", "3", "--json"],
                 ["ops", "apply", "--wait-seconds", "nan", "--json"]):
        result = _r9k(*args)
        assert result.exit_code == 2, (args, result.output)
        doc = json.loads(result.output)  # the whole output is one JSON document
        assert doc["ok"] is False and doc["exit_code"] == 2 and doc["error"], (args, doc)
    # without --json the same refusal stays one plain line
    plain = _r9k("ops", "check-config", "--config", str(bad))
    assert plain.exit_code == 2 and not plain.output.lstrip().startswith("{")
