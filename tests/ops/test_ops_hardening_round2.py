"""Issue 25 (hardening round two), ops half: against fixture host trees and the real CLI."""
from __future__ import annotations

import json

from click.testing import CliRunner

from doubles.ops_host import CardSpec, FakeKernel, build_host_tree, read_cap_watts, read_od_offset_mv
from r9k.cli import main

A, B = "0000:03:00.0", "0000:04:00.0"
CONFIG = "backend: sysfs\ndefaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n"


def _ops(tmp_path, host, *args):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text(CONFIG)
    cfg.chmod(0o644)
    return CliRunner().invoke(main, ["ops", *args, "--config", str(cfg), "--host-root", str(host),
                                     "--state-dir", str(tmp_path / "state")])


def test_item1_one_odd_card_does_not_stop_reconcile_repairing_the_others(tmp_path):
    """A card declaring 250-350 W: reconcile keeps going every round (exit 1 at the end, not 2
    at the first), repairs the card that drifted and names the odd one with its range."""
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B, cap_min_watts=250,
                                                                      cap_max_watts=350)])
    with FakeKernel(host):
        result = _ops(tmp_path, host, "reconcile", "--interval", "0.01", "--count", "2",
                      "--settle-seconds", "1", "--json")
    assert result.exit_code == 1, result.output
    rounds = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    last = {c["bdf"]: c for c in rounds[-1]["cards"]}
    assert last[A]["ok"] and (read_cap_watts(host, A), read_od_offset_mv(host, A)) == (210.0, -42)
    assert "refused: 0000:04:00.0: power_cap_watts 210 is outside the card's range 250-350 W" in \
        last[B]["drift"]
    assert (read_cap_watts(host, B), read_od_offset_mv(host, B)) == (300.0, -42)
