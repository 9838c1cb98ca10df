"""`r9k bench soak` against a fake OpenAI server: counts, over-length by design, memory
sources (process tree in a fixture /proc, a Prometheus gauge), faults and partial results."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from doubles.fake_openai import FakeOpenAI

from r9k.bench.memory import (MemorySourceError, ProcessTreeRss, process_tree,
                              process_tree_rss_bytes)
from r9k.cli import main


def run(*args):
    return CliRunner().invoke(main, ["bench", "soak", *args])


@pytest.fixture
def fake():
    with FakeOpenAI(max_model_len=512, token_delay_s=0.002) as f:
        yield f


def fake_proc(root: Path, procs: dict[int, tuple[int, str, int]]) -> Path:
    """procs: pid -> (ppid, comm, rss_kib); /proc/<pid>/stat and status as the kernel writes them."""
    for pid, (ppid, comm, rss_kib) in procs.items():
        d = root / "proc" / str(pid)
        d.mkdir(parents=True)
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")
        (d / "status").write_text(f"Name:\t{comm}\nPid:\t{pid}\nPPid:\t{ppid}\n"
                                  f"VmRSS:\t{rss_kib} kB\nThreads:\t4\n")
    return root


def test_process_tree_rss_sums_the_replica_and_its_children_only(tmp_path):
    root = fake_proc(tmp_path, {1: (0, "init", 10), 100: (1, "python -m vllm (api)", 1000),
                                101: (100, "VLLM::EngineCore", 2000), 102: (101, "VLLM::Worker) x", 3000),
                                200: (1, "other", 5000)})
    assert sorted(process_tree(100, root)) == [100, 101, 102]
    assert process_tree_rss_bytes(100, root) == 6000 * 1024
    src = ProcessTreeRss(100, root)
    assert src() == 6000 * 1024
    (root / "proc" / "102" / "status").write_text("Name:\tVLLM::Worker) x\nVmRSS:\t3500 kB\n")
    assert src() == 6500 * 1024
    growth = {g["process"]: g["growth_bytes"] for g in src.growth_by_process()}
    assert growth == {"100 python -m vllm (api)": 0, "101 VLLM::EngineCore": 0, "102 VLLM::Worker) x": 500 * 1024}
    with pytest.raises(MemorySourceError, match="process 555 is gone"):
        process_tree_rss_bytes(555, root)


def test_mixed_soak_counts_over_length_as_rejected_by_design(fake, tmp_path):
    out = tmp_path / "soak.json"
    # 4 s of 8 clients serves a few hundred requests and takes ~40 samples on an idle machine;
    # the bounds below leave room for a loaded 2-core CI runner
    r = run("--endpoint", fake.url, "--clients", "8", "--duration", "4", "--min-tokens", "8",
            "--max-tokens", "700", "--max-output-tokens", "8", "--pid", str(os.getpid()),
            "--sample-interval", "0.1", "--tolerance-mib", "256", "--quiet", "--out", str(out))
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())
    assert s["errors"] == 0 and s["served"] > 40 and s["rejected_by_design"] > 0
    assert s["served"] + s["rejected_by_design"] == s["requests_sent"]
    assert s["latency_s"]["p50"] <= s["latency_s"]["p99"] <= s["latency_s"]["max"]
    assert s["ttft_s"]["n"] == s["served"]
    assert s["prompt_chars_served"]["max"] < 512
    m = s["memory"]
    assert m["verdict"] == "flat" and m["samples"] >= 15 and "RSS of process" in m["source"]
    assert "rejected by design" in r.output and "memory flat" in r.output
    assert any(g["process"].startswith(f"{os.getpid()} ") for g in m["growth_by_process"])


def test_growing_gauge_fails_the_memory_verdict(fake, tmp_path):
    fake.metric_step = 50 * 2**20  # 50 MiB more at every scrape: a leak
    r = run("--endpoint", fake.url, "--clients", "2", "--duration", "2.5", "--min-tokens", "8",
            "--max-tokens", "64", "--max-output-tokens", "4", "--memory-url", fake.url + "/metrics",
            "--memory-label", "bdf=0000:03:00.0", "--sample-interval", "0.1", "--quiet", "--json")
    assert r.exit_code == 1
    s = json.loads(r.output[r.output.index("{"):])
    assert s["memory"]["verdict"] == "growing" and s["errors"] == 0 and s["passed"] is False


def test_endpoint_dying_mid_soak_stops_early_with_partial_results(fake, tmp_path):
    out = tmp_path / "soak.json"
    fake.behaviour = {"die_after": 40}
    # --timeout 5: a request caught on a connection the dying server never closes waits that
    # long, not the default 600 s (seen once in CI under load: wall 600.8 s)
    r = run("--endpoint", fake.url, "--clients", "8", "--duration", "30", "--min-tokens", "8",
            "--max-tokens", "64", "--max-output-tokens", "4", "--timeout", "5", "--quiet",
            "--out", str(out))
    assert r.exit_code == 1
    s = json.loads(out.read_text())
    assert s["stopped_early"] and "stopped answering" in s["stopped_early"]
    assert s["served"] >= 30 and s["errors"] >= 8 and s["wall_s"] < 20
    assert set(s["errors_by_kind"]) <= {"refused", "disconnected", "http_5xx"}
    assert s["errors_by_kind"].get("refused", 0) >= 1  # the listener is gone
    assert s["memory"]["verdict"] == "not_sampled"


def test_soak_bad_inputs_exit_2(fake, tmp_path):
    cases = [(["--pid", "1", "--memory-url", "http://x"], "one memory source"),
             (["--memory-label", "nolabel", "--memory-url", fake.url + "/metrics"], "NAME=VALUE"),
             (["--min-tokens", "100", "--max-tokens", "10"], "expected a range"),
             (["--memory-url", fake.url + "/metrics", "--memory-metric", "nope"], "no sample of nope")]
    for extra, words in cases:
        r = run("--endpoint", fake.url, "--duration", "1", "--quiet", *extra)
        assert r.exit_code == 2 and words in r.output, (extra, r.output)


def test_sampled_process_dying_makes_the_memory_verdict_source_lost(fake, tmp_path):
    import subprocess
    import threading
    victim = subprocess.Popen(["sleep", "60"])
    threading.Timer(1.0, victim.kill).start()
    out = tmp_path / "soak.json"
    r = run("--endpoint", fake.url, "--clients", "2", "--duration", "3", "--min-tokens", "8",
            "--max-tokens", "64", "--max-output-tokens", "4", "--pid", str(victim.pid),
            "--sample-interval", "0.1", "--quiet", "--out", str(out))
    victim.wait()
    s = json.loads(out.read_text())
    assert r.exit_code == 1 and s["errors"] == 0
    assert s["memory"]["verdict"] == "source_lost" and s["passed"] is False
    assert f"process {victim.pid} is gone" in r.output


def test_soak_rides_through_an_outage_and_reports_its_window(tmp_path):
    """--outage-tolerance: the endpoint goes away (listener closed) and comes back on the same
    port 2 s later; the soak keeps going, counts the refused requests, reports one outage of
    about that length, and serves again after it. Without the option it stops early (the test
    above)."""
    import threading
    import time

    from doubles.fake_openai import FakeOpenAI

    out = tmp_path / "soak.json"
    first = FakeOpenAI(max_model_len=512, token_delay_s=0.002).__enter__()
    second = FakeOpenAI(max_model_len=512, token_delay_s=0.002, port=first.port)

    def outage():
        time.sleep(2.0)
        first.shutdown()
        time.sleep(2.0)
        second.__enter__()

    t = threading.Thread(target=outage)
    t.start()
    try:
        r = run("--endpoint", first.url, "--clients", "4", "--duration", "8", "--min-tokens", "8",
                "--max-tokens", "64", "--max-output-tokens", "4", "--quiet", "--out", str(out),
                "--outage-tolerance", "10")
        t.join()
    finally:
        second.shutdown()
    s = json.loads(out.read_text())
    assert r.exit_code == 1 and s["stopped_early"] is None, r.output  # errors fail it, no stop
    # bounds loose enough for a loaded 2-core host: the window opens after the first server's
    # 2 s and closes once the second one answers
    [o] = s["outages"]
    assert o["to_s"] is not None and 0.5 <= o["duration_s"] <= 6.0, o
    assert o["from_s"] >= 1.5 and o["failed_requests"] >= 1, o
    assert o["failed_requests"] == s["errors_by_kind"].get("refused", 0) + \
        s["errors_by_kind"].get("disconnected", 0)
    assert second.completions > 0 and s["wall_s"] >= 8
    assert "outage from" in r.output
