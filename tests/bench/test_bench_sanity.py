"""`r9k bench sanity` against a fake OpenAI server: calibration, bad answers, faults, exit codes."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from doubles.fake_openai import FakeOpenAI, answer_ids, prompt_hash

from r9k.bench.sanity import candidate_prompts
from r9k.cli import main
from r9k.devtools.local_server import free_port

ARGS = ["--candidates", "24", "--pre-prompt-chars", "200", "--concurrency", "12", "--quiet"]


def run(*args):
    return CliRunner().invoke(main, ["bench", "sanity", *args])


@pytest.fixture
def fake():
    with FakeOpenAI() as f:
        yield f


def test_calibration_keeps_stable_prefixes_and_all_answers_pass(fake, tmp_path):
    out, cal = tmp_path / "s.json", tmp_path / "cal.json"
    r = run("--endpoint", fake.url + "/v1/", "--requests", "100", *ARGS, "--out", str(out),
            "--save-calibration", str(cal))
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())
    assert (s["ok"], s["bad"], s["errors"], s["requests_sent"], s["passed"]) == (100, 0, 0, 100, True)
    prompts = candidate_prompts(24, pre_prompt_max_chars=200)
    expected = {p: (6 if prompt_hash(p) % 4 == 1 else 16) for p in prompts if prompt_hash(p) % 4 != 0}
    answers = json.loads(cal.read_text())["answers"]
    assert {a["prompt"]: a["max_tokens"] for a in answers} == expected
    assert all(a["token_ids"] == answer_ids(a["prompt"], a["max_tokens"]) for a in answers)
    assert s["calibration"]["kept"] == len(expected) < 24
    assert any("\n" in a["prompt"] and len(a["prompt"]) > 50 for a in answers)  # pre-prompts
    assert "PASSED" in r.output


def test_wrong_answers_under_load_are_printed_and_fail(fake, tmp_path):
    out, cal = tmp_path / "s.json", tmp_path / "cal.json"
    assert run("--endpoint", fake.url, "--requests", "5", *ARGS, "--save-calibration", str(cal)).exit_code == 0
    fake.completions = 0
    fake.behaviour = {"wrong_every": 10}
    r = run("--endpoint", fake.url, "--requests", "50", *ARGS, "--calibration", str(cal),
            "--out", str(out))
    assert r.exit_code == 1
    s = json.loads(out.read_text())
    assert (s["bad"], s["ok"], s["passed"]) == (5, 45, False)
    assert r.output.count("BAD request") == 5 and "token ids differ from step" in r.output
    assert len(s["bad_answers"]) == 5 and "FAILED" in r.output


def test_non_json_answers_are_errors_with_kind(fake, tmp_path):
    out, cal = tmp_path / "s.json", tmp_path / "cal.json"
    assert run("--endpoint", fake.url, "--requests", "5", *ARGS, "--save-calibration", str(cal)).exit_code == 0
    fake.behaviour = {"non_json": True}
    r = run("--endpoint", fake.url, "--requests", "20", *ARGS, "--calibration", str(cal), "--out", str(out))
    assert r.exit_code == 1
    s = json.loads(out.read_text())
    assert s["errors"] == 20 and s["ok"] == 0
    assert {e["error_kind"] for e in s["error_samples"]} == {"non_json"}
    assert s["errors_by_kind"] == {"non_json": 20}
    assert "answer is not JSON" in r.output


def test_endpoint_dying_mid_run_stops_early_and_keeps_partial_results(fake, tmp_path):
    out, cal = tmp_path / "s.json", tmp_path / "cal.json"
    assert run("--endpoint", fake.url, "--requests", "5", *ARGS, "--save-calibration", str(cal)).exit_code == 0
    fake.completions = 0
    fake.behaviour = {"die_after": 30}
    r = run("--endpoint", fake.url, "--requests", "2000", *ARGS, "--calibration", str(cal), "--out", str(out))
    assert r.exit_code == 1
    s = json.loads(out.read_text())
    assert 20 <= s["ok"] <= 30 and s["bad"] == 0
    assert s["requests_sent"] < 200 and s["errors"] >= 8
    assert "stopped answering" in s["stopped_early"] and "stopped early" in r.output
    assert s["passed"] is False


def test_bad_url_and_refused_connection_exit_2_with_one_line(tmp_path):
    for url, words in (("localhost:8000", "expected http://HOST:PORT"),
                       ("ftp://example.org", "expected http://HOST:PORT"),
                       ("http://127.0.0.1:99999", "port"),
                       (f"http://127.0.0.1:{free_port()}", "cannot reach")):
        r = run("--endpoint", url, "--requests", "5", "--quiet", "--out", str(tmp_path / "x.json"))
        assert r.exit_code == 2, (url, r.output)
        assert words in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "x.json").exists()


def test_non_json_model_list_is_a_clear_bad_input(fake):
    fake.behaviour = {}
    r = run("--endpoint", fake.url + "/nothing-here", "--requests", "5", "--quiet")
    assert r.exit_code == 2 and "HTTP 404" in r.output


def test_bad_calibration_file_is_bad_input(fake, tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    r = run("--endpoint", fake.url, "--calibration", str(bad), "--quiet")
    assert r.exit_code == 2 and "--calibration" in r.output
