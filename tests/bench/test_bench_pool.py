"""Pool-bound reporting of `r9k bench compare`: the /metrics sampler on a fake replica, the
planner's running requests beside the observed peak, the crossover, and vLLM's benchmark client
as the load generator (its result read into a level; its own parser takes our options)."""
from __future__ import annotations

import threading

import pytest

from doubles.monitored_host import FakeReplica

from r9k.bench.compare import (PoolSampler, pool_markdown, Workload, aggregate, capacity_block, crossover,
                               expected_running, level_from_vllm_bench, markdown,
                               read_metrics_text, run_level, vllm_bench_argv)

# (running, waiting, kv usage, preemptions counter) the fake replica shows scrape by scrape
SEQUENCE = [(0, 0, 0.0, 5), (2, 6, 0.80, 5), (2, 6, 0.97, 6), (1, 3, 0.50, 8), (0, 0, 0.0, 8)]


class Clock:
    def __init__(self, start: float = 100.0, step: float = 0.5) -> None:
        self.now, self.step = start - step, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def scripted_reader(replica: FakeReplica, sequence: list[tuple]):
    """Reads the replica's real /metrics page after setting its gauges to the next entry."""
    it = iter(sequence)

    def read() -> str | None:
        step = next(it, None)
        if step is None:
            return "not prometheus { text"
        replica.running, replica.waiting, replica.kv_usage_ratio, replica.preemptions = step
        return read_metrics_text(replica.url)
    return read


def test_sampler_numbers_on_a_fake_metrics_sequence():
    with FakeReplica(model_name="tiny") as replica:
        # an interval no level reaches: entry, three explicit samples, exit
        sampler = PoolSampler(scripted_reader(replica, SEQUENCE), interval_s=3600, clock=Clock())
        with sampler:
            for _ in range(3):
                sampler.sample()
        s = sampler.summary()
    assert s["samples"] == 5 and s["interval_s"] == 3600
    assert s["peak_running"] == 2 and s["peak_waiting"] == 6
    assert s["peak_kv_usage"] == pytest.approx(0.97)
    assert s["preemptions"] == 3                      # 8 - 5 over the level
    assert s["series"]["t_s"] == [0.5, 1.0, 1.5, 2.0, 2.5]     # the clock ticks 0.5 per call
    assert s["series"]["running"] == [0, 2, 2, 1, 0]
    assert s["series"]["waiting"] == [0, 6, 6, 3, 0]


def test_sampler_skips_bad_pages_and_a_restarted_counter():
    with FakeReplica(model_name="tiny") as replica:
        sampler = PoolSampler(scripted_reader(replica, [(1, 0, 0.2, 9), (3, 1, 0.9, 2)]),
                              interval_s=3600, clock=Clock())
        with sampler:
            sampler.sample()
            sampler.sample()                          # not Prometheus text: no sample
        s = sampler.summary()
    assert s["samples"] == 2 and s["peak_running"] == 3
    assert s["preemptions"] is None                   # counter went 9 -> 2: the replica restarted


def test_sampler_thread_samples_while_the_level_runs():
    with FakeReplica(model_name="tiny", running=4, waiting=2) as replica:
        reads = 0
        enough = threading.Event()

        def read() -> str | None:
            nonlocal reads
            reads += 1
            if reads >= 4:
                enough.set()
            return read_metrics_text(replica.url)
        with PoolSampler(read, interval_s=0.01) as sampler:
            assert enough.wait(10)
    s = sampler.summary()
    assert s["samples"] >= 5 and s["peak_running"] == 4 and s["peak_waiting"] == 2
    assert s["preemptions"] == 0


def test_planner_running_requests_for_the_pool_bound_setting(tiny_model):
    capb = capacity_block(tiny_model, num_spec=3, kv_bytes=8 << 20, max_model_len=1280,
                          concurrencies=[8], max_num_seqs=8)
    # 32 blocks of 256 tokens; a request of 1,280 tokens: stock 2 GDN groups x 4 pages + 5
    # attention blocks = 13, one-page 2 x 1 + 5 = 7; vLLM keeps one block as its null block
    assert capb["num_blocks"] == {"stock": 32, "onepage": 32}
    assert capb["max_concurrency"]["stock"] == pytest.approx(32 / 13)
    assert capb["max_concurrency"]["onepage"] == pytest.approx(32 / 7)
    assert capb["requests_fit"] == {"stock": 2, "onepage": 4}
    assert [expected_running(capb, "onepage", c) for c in (1, 2, 4, 8)] == [1, 2, 4, 4]
    assert expected_running(capb, "stock", 8) == 2
    capb["max_num_seqs"] = 3
    assert expected_running(capb, "onepage", 8) == 3


def level(c: int, tps: float, peak_running: int, preemptions: int) -> dict:
    return {"concurrency": c, "errors": 0, "ok": 16, "output_tokens_per_s": tps,
            "ttft_s": {"p50": 1.0}, "decode_tokens_per_s_per_request": {"p50": 10.0},
            "pool": {"interval_s": 0.5, "samples": 3, "peak_running": peak_running,
                     "peak_waiting": 8 - peak_running, "peak_kv_usage": 0.9,
                     "preemptions": preemptions,
                     "series": {"t_s": [0, 0.5, 1], "running": [0, peak_running, 0],
                                "waiting": [0, 8 - peak_running, 0], "kv_usage": [0, 0.9, 0]}}}


def test_aggregate_and_markdown_put_planner_beside_observed(tmp_path):
    from r9k.bench.compare import plot
    w = Workload([8], 16, 1100, 64)
    runs = [{"repeat": 0, "mode": "stock", "levels": [level(8, 100, 2, 0)]},
            {"repeat": 0, "mode": "onepage", "levels": [level(8, 180, 4, 0)]},
            {"repeat": 1, "mode": "onepage", "levels": [level(8, 170, 5, 2)]},
            {"repeat": 1, "mode": "stock", "levels": [level(8, 110, 2, 0)]}]
    agg = aggregate(runs, w)
    row = agg["by_concurrency"][0]
    assert row["onepage"]["peak_running"]["values"] == [4, 5]
    assert row["onepage"]["preemptions"]["max"] == 2 and row["stock"]["peak_waiting"]["median"] == 6
    capb = {"max_num_seqs": 8, "requests_fit": {"stock": 2, "onepage": 4},
            "max_concurrency": {"stock": 32 / 13, "onepage": 32 / 7},
            "planner_tokens": {"stock": 3150, "onepage": 5851}, "planner_ratio": 1.857,
            "pinned_fraction_by_concurrency": {}}
    res = {"workload": w.public(), "repeats": 2, "runs": runs, "capacity": capb, **agg}
    md = markdown(res)
    assert "| 8 | stock | 2 (pool 2.46x) | 2 (2..2) | 6 (6..6) | 90% (90%..90%) | 0 (0..0) |" in md
    assert "| 8 | one-page | 4 (pool 4.57x) | 4 (4..5) | 4 (3..4) | 90% (90%..90%) | 1 (0..2) |" in md
    assert plot(res, tmp_path / "pool.png") and (tmp_path / "pool.png").stat().st_size > 1000


def test_crossover_interpolates_on_log2_concurrency():
    def row(c: int, r: float | None) -> dict:
        return {"concurrency": c, "throughput_ratio_onepage_over_stock":
                {"n": 3, "median": r} if r is not None else {"n": 0}}
    rows = [row(1, 0.9), row(2, 0.95), row(4, 1.2), row(8, 1.5), row(16, 1.4)]
    cross = crossover(rows)
    assert (cross["below"], cross["above"]) == (2, 4)
    assert cross["concurrency"] == pytest.approx(2 ** 1.2)
    wander = [row(1, 0.9), row(2, 1.1), row(4, 0.95), row(8, 1.3), row(16, 1.6)]
    assert (crossover(wander)["below"], crossover(wander)["above"]) == (4, 8)  # the last one
    assert crossover([row(1, 0.9), row(2, 1.2), row(4, 0.9)]) is None  # below 1 at the top
    assert crossover([row(1, 1.05), row(2, 1.2)]) is None          # never below 1
    assert crossover([row(1, 0.9), row(2, 0.95)]) is None          # never above
    assert crossover([row(1, 0.9), row(2, None), row(4, 1.0)])["concurrency"] == 4


VLLM_RESULT = {"completed": 16, "failed": 0, "duration": 8.0, "total_input_tokens": 17600,
               "total_output_tokens": 1024, "request_throughput": 2.0, "output_throughput": 128.0,
               "total_token_throughput": 2328.0, "mean_ttft_ms": 900.0, "median_ttft_ms": 800.0,
               "p50_ttft_ms": 800.0, "p90_ttft_ms": 2000.0, "p99_ttft_ms": 2500.0,
               "median_tpot_ms": 50.0, "p99_tpot_ms": 80.0, "errors": [""] * 16,
               "generated_texts": ["x"] * 16, "max_concurrent_requests": 8}


def test_level_from_vllm_bench_reads_its_numbers():
    lv = level_from_vllm_bench(VLLM_RESULT, 8, 16)
    assert lv["output_tokens_per_s"] == 128.0 and lv["ok"] == 16 and lv["errors"] == 0
    assert lv["ttft_s"]["p50"] == pytest.approx(0.8) and lv["ttft_s"]["p99"] == pytest.approx(2.5)
    assert lv["decode_tokens_per_s_per_request"]["p50"] == pytest.approx(20.0)
    assert lv["prompt_tokens"] == 17600 and lv["output_tokens"] == 1024 and lv["wall_s"] == 8.0
    assert "generated_texts" not in lv["vllm_bench"]
    failed = level_from_vllm_bench({**VLLM_RESULT, "completed": 15, "failed": 1,
                                    "errors": [""] * 15 + ["HTTP 500"]}, 8, 16)
    assert failed["errors"] == 1 and failed["error_samples"] == [{"message": "HTTP 500"}]


def test_run_level_with_vllm_client_samples_the_replica():
    w = Workload([8], 16, 1100, 64, client="vllm", sample_interval_s=3600)
    seen: list[list[str]] = []
    with FakeReplica(model_name="tiny", running=2, waiting=6, preemptions=1) as replica:
        def fake_bench(argv: list[str]) -> dict:
            seen.append(argv)
            replica.preemptions = 4
            return VLLM_RESULT
        lv = run_level(replica.url, "tiny", w, 8, seed=8, tokenizer="/m/tiny", vllm_bench=fake_bench)
    argv = seen[0]
    assert argv[argv.index("--num-prompts") + 1] == "16"
    assert argv[argv.index("--max-concurrency") + 1] == "8"
    assert argv[argv.index("--tokenizer") + 1] == "/m/tiny" and "--disable-tqdm" in argv
    assert lv["output_tokens_per_s"] == 128.0
    assert lv["pool"]["peak_running"] == 2 and lv["pool"]["preemptions"] == 3


def test_vllm_bench_parser_takes_the_workload():
    pytest.importorskip("vllm.benchmarks.serve")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    w = Workload([8], 16, 1100, 64, client="vllm")
    args = parser.parse_args(vllm_bench_argv("http://127.0.0.1:1", "tiny", "/m/tiny", w, 8, 24,
                                             seed=3, progress=True))
    assert (args.dataset_name, args.random_input_len, args.random_output_len) == ("random", 1100, 64)
    assert float(args.random_range_ratio) == 0 and args.num_prompts == 24
    assert args.max_concurrency == 8 and args.request_rate == float("inf")
    assert args.ignore_eos and args.temperature == 0 and args.seed == 3
    assert args.base_url == "http://127.0.0.1:1" and args.endpoint == "/v1/completions"
    assert args.metric_percentiles == "50,90,99" and not args.disable_tqdm


def test_compare_records_the_scheduler_per_level_and_refuses_vllm_shared_prefix(tmp_path):
    from click.testing import CliRunner

    from doubles.fake_openai import FakeOpenAI
    from r9k.cli import main
    with FakeOpenAI(token_delay_s=0.001) as a, FakeOpenAI(token_delay_s=0.001) as b:
        prefix = tmp_path / "cmp"
        r = CliRunner().invoke(main, [
            "bench", "compare", "--stock-endpoint", a.url, "--onepage-endpoint", b.url,
            "--concurrency", "2", "--repeats", "1", "--requests-per-level", "4",
            "--prompt-tokens", "16", "--output-tokens", "4", "--sample-interval", "3600",
            "--quiet", "--out-prefix", str(prefix)])
        assert r.exit_code == 0, r.output
    import json
    res = json.loads(prefix.with_suffix(".json").read_text())
    assert res["workload"]["client"] == "r9k" and res["workload"]["sample_interval_s"] == 3600
    for run in res["runs"]:
        pool = run["levels"][0]["pool"]
        # entry and exit samples; the double's /metrics has no scheduler gauges
        assert pool["samples"] == 2 and pool["peak_running"] is None
    r = CliRunner().invoke(main, ["bench", "compare", "--workload", "shared-prefix",
                                  "--client", "vllm"])
    assert r.exit_code == 2 and "no equivalent dataset" in r.output, r.output


def test_sweep_markdown_and_plot_mark_crossover_and_pool_bounds(tmp_path):
    from r9k.bench.compare import plot
    w = Workload([1, 2, 4, 8, 16], 16, 1100, 64)
    fit = {"stock": 4, "onepage": 9}
    runs = []
    for rep in range(2):
        for mode in ("stock", "onepage") if rep == 0 else ("onepage", "stock"):
            tps = {1: 70, 2: 105, 4: 170, 8: 175, 16: 175} if mode == "stock" else \
                {1: 66, 2: 100, 4: 180, 8: 240, 16: 250}
            runs.append({"repeat": rep, "mode": mode, "levels": [
                level(c, tps[c], min(c, fit[mode]), 0) for c in w.concurrencies]})
    capb = {"max_num_seqs": 16, "requests_fit": fit, "max_concurrency": {"stock": 4.92,
            "onepage": 9.14}, "planner_tokens": {"stock": 6300, "onepage": 11700},
            "planner_ratio": 1.857, "pinned_fraction_by_concurrency": {}}
    res = {"workload": w.public(), "repeats": 2, "runs": runs, "capacity": capb,
           **aggregate(runs, w)}
    md = markdown(res)
    # ratio 0.943 at 1 and 0.952 at 2, 1.059 at 4: crossing 2..4 at 2 ** (1 + 0.048 / 0.107)
    assert "rises through 1 for good between concurrency 2 and 4 (~2.7," in md
    assert "| 16 | one-page | 9 (pool 9.14x) | 9 (9..9) |" in md
    assert plot(res, tmp_path / "sweep.png") and (tmp_path / "sweep.png").stat().st_size > 1000
    for run in runs:                                     # one-page never behind: no crossover
        if run["mode"] == "onepage":
            run["levels"][0]["output_tokens_per_s"] = 75
            run["levels"][1]["output_tokens_per_s"] = 110
    res.update(aggregate(runs, w))
    assert "Crossover: none" in markdown(res)


def test_planner_admission_gives_each_mode_its_whole_requests(tiny_model):
    capb = capacity_block(tiny_model, num_spec=3, kv_bytes=8 << 20, max_model_len=1280,
                          concurrencies=[1, 8], max_num_seqs="planner")
    assert capb["max_num_seqs"] == capb["requests_fit"] == {"stock": 2, "onepage": 4}
    assert [expected_running(capb, "onepage", c) for c in (1, 8)] == [1, 4]
    p = capb["pinned_fraction_by_concurrency"]
    # each mode pins what its own cap lets run: 8 clients run 2 stock and 4 one-page requests
    assert p[8]["running"] == {"stock": 2, "onepage": 4} and p[1]["running"] == 1
    same = capacity_block(tiny_model, num_spec=3, kv_bytes=8 << 20, max_model_len=1280,
                          concurrencies=[1, 2, 4, 8], max_num_seqs=8)["pinned_fraction_by_concurrency"]
    assert p[8]["stock"] == same[2]["stock"] and p[8]["onepage"] == same[4]["onepage"]
    peak = {"n": 1, "median": 2, "min": 2, "max": 2}
    row = {"concurrency": 8, "stock": {"peak_running": peak}, "onepage": {"peak_running": peak}}
    md = "\n".join(pool_markdown({"by_concurrency": [row], "workload": {}, "capacity": capb}))
    assert "(stock 2, one-page 4: each mode's whole requests, planner admission)." in md
    assert "| 8 | one-page | 4 (pool 4.57x) | 2 |" in md


@pytest.mark.parametrize("args, needle", [
    (["--max-num-seqs", "0"], "--max-num-seqs '0': expected a count >= 1 or 'planner'"),
    (["--max-num-seqs", "auto"], "--max-num-seqs 'auto': expected a count >= 1 or 'planner'"),
    (["--max-num-seqs", "planner", "--stock-endpoint", "http://127.0.0.1:9",
      "--onepage-endpoint", "http://127.0.0.1:9"],
     "with --stock-endpoint/--onepage-endpoint expected a count"),
    (["--max-num-seqs", "planner", "--kv-mib", "3", "--max-model-len", "1024"],
     "whole requests of 1024 tokens in 3 MiB: stock 0, one-page 1; expected at least 1 in each"),
])
def test_compare_refuses_bad_admission(args, needle, tmp_path):
    from click.testing import CliRunner

    from r9k.cli import main

    r = CliRunner().invoke(main, ["bench", "compare", *args, "--workdir", str(tmp_path)])
    assert r.exit_code != 0 and needle in r.output, r.output
