"""Recording rules for energy: promtool checks them and runs their cases (joules per token per
replica and per page mode, a TP replica summing its cards, an idle replica without a figure),
and every metric they read is one the stack exports."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from doubles.prometheus_server import prometheus_tool

RULES_DIR = Path(__file__).resolve().parents[2] / "src" / "r9k" / "monitoring" / "rules"
RULES = RULES_DIR / "r9k.energy.rules.yml"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([prometheus_tool("promtool"), *args], cwd=RULES_DIR, capture_output=True,
                          text=True, timeout=60)


def test_promtool_checks_the_energy_rules_and_their_cases_pass():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    check = _promtool("check", "rules", RULES.name)
    assert check.returncode == 0 and f"SUCCESS: {len(rules)} rules found" in check.stdout, check.stderr
    test = _promtool("test", "rules", "r9k.energy.rules.test.yml")
    assert test.returncode == 0, test.stdout + test.stderr


def test_every_recorded_rule_has_a_case():
    recorded = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    cases = yaml.safe_load((RULES_DIR / "r9k.energy.rules.test.yml").read_text())
    tested = {re.match(r"[\w:]+", c["expr"]).group(0)
              for t in cases["tests"] for c in t.get("promql_expr_test", [])}
    assert recorded - tested == set()


def test_the_rules_read_only_metrics_the_stack_exports():
    text = RULES.read_text()
    read = set(re.findall(r"\b(r9k_[a-z_]+)\b", text))
    sources = "".join(p.read_text() for p in (RULES_DIR.parents[0]).glob("*.py"))
    sources += (RULES_DIR.parents[1] / "ops" / "energy.py").read_text()
    for name in read:
        base = name.removesuffix("_total")
        assert f'"{base}"' in sources, f"{name} is not exported by src/r9k/monitoring/"
