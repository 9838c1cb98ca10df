"""`r9k bench paired`: exact McNemar on known tables, lm-eval sample logs, bad input."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from r9k.bench.paired import mcnemar_exact_p
from r9k.cli import main


def test_exact_mcnemar_known_values():
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(5, 5) == 1.0
    # n=10, k=1: 2 * (1 + 10) / 1024
    assert mcnemar_exact_p(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_exact_p(9, 1) == mcnemar_exact_p(1, 9)
    assert mcnemar_exact_p(0, 6) == pytest.approx(2 / 64)


def write_log(path, correct: list[int], resp="x"):
    with path.open("w") as f:
        for i, c in enumerate(correct):
            for flt in ("strict-match", "flexible-extract"):
                f.write(json.dumps({"doc_id": i, "filter": flt, "exact_match": float(c),
                                    "filtered_resps": [f"{resp}{i}{c}"]}) + "\n")


def test_paired_cli_on_lm_eval_logs(tmp_path):
    a, b = tmp_path / "stock.jsonl", tmp_path / "onepage.jsonl"
    base = [1, 0] * 50
    write_log(a, base)
    write_log(b, base)
    r = CliRunner().invoke(main, ["bench", "paired", str(a), str(b), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert (res["paired"], res["identical_answers"], res["mcnemar_exact_p"]) == (100, 100, 1.0)
    worse = [0 if i < 12 and c == 1 else c for i, c in enumerate(base)]  # 6 right -> wrong
    write_log(b, worse)
    r = CliRunner().invoke(main, ["bench", "paired", str(a), str(b)])
    assert r.exit_code == 1 and "SIGNIFICANT" in r.output and "p = 0.03125" in r.output


def test_paired_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"doc_id": 1}\n')
    r = CliRunner().invoke(main, ["bench", "paired", str(bad), str(bad)])
    assert r.exit_code == 2 and "exact_match" in r.output
