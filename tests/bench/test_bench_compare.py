"""`r9k bench compare` on two running fake endpoints, and its aggregation on known inputs."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from doubles.fake_openai import FakeOpenAI

from r9k.bench.compare import MODES, Workload, aggregate, capacity_block, markdown
from r9k.cli import main


def level(c: int, tps: float, ttft: float, errors: int = 0) -> dict:
    return {"concurrency": c, "errors": errors, "output_tokens_per_s": tps,
            "ttft_s": {"p50": ttft}, "decode_tokens_per_s_per_request": {"p50": tps / c}}


def test_ratios_are_paired_within_repeats():
    w = Workload([1, 4], 8, 16, 8)
    runs = [{"repeat": 0, "mode": "stock", "levels": [level(1, 100, 0.10), level(4, 300, 0.2)]},
            {"repeat": 0, "mode": "onepage", "levels": [level(1, 110, 0.10), level(4, 330, 0.1)]},
            {"repeat": 1, "mode": "onepage", "levels": [level(1, 90, 0.10), level(4, 270, 0.1)]},
            {"repeat": 1, "mode": "stock", "levels": [level(1, 100, 0.10), level(4, 300, 0.2, errors=2)]}]
    agg = aggregate(runs, w)
    r1, r4 = agg["by_concurrency"]
    assert r1["throughput_ratio_onepage_over_stock"]["values"] == pytest.approx([1.1, 0.9])
    assert r1["throughput_ratio_onepage_over_stock"]["half_range_pct"] == pytest.approx(10.0)
    assert r4["ttft_ratio_onepage_over_stock"]["mean"] == pytest.approx(0.5)
    assert r4["stock"]["output_tokens_per_s"]["mean"] == 300 and agg["errors"] == 2
    md = markdown({"workload": w.__dict__, "repeats": 2, **agg})
    assert ("| 1 | 100.0 | 100.0 | 1.000 (0.900..1.100) | 100 ms | 100 ms | 1.000 "
            "| 1.000 (1.000..1.000) |") in md
    assert ("| 4 | 300.0 | 300.0 | 1.000 (0.900..1.100) | 200 ms | 100 ms | 1.000 "
            "| 0.500 (0.500..0.500) |") in md


def test_capacity_block_comes_from_the_planner(tmp_path):
    from r9k.devtools.tiny_model import make_tiny
    make_tiny(tmp_path / "tiny")
    capb = capacity_block(tmp_path / "tiny", num_spec=3, kv_bytes=64 << 20, max_model_len=4096,
                          concurrencies=[1, 8, 16], max_num_seqs=8)
    assert capb["planner_tokens"]["onepage"] > capb["planner_tokens"]["stock"] > 0
    p = capb["pinned_fraction_by_concurrency"]
    assert p[16]["running"] == 8 and p[16]["stock"] == p[8]["stock"]
    assert p[8]["onepage"] < p[8]["stock"] and p[1]["stock"] == pytest.approx(p[8]["stock"] / 8)


def test_compare_two_endpoints_end_to_end(tmp_path):
    with FakeOpenAI(token_delay_s=0.001) as a, FakeOpenAI(token_delay_s=0.001) as b:
        prefix = tmp_path / "cmp"
        r = CliRunner().invoke(main, [
            "bench", "compare", "--stock-endpoint", a.url, "--onepage-endpoint", b.url,
            "--concurrency", "1,4", "--repeats", "2", "--requests-per-level", "6",
            "--prompt-tokens", "32", "--output-tokens", "8", "--quiet", "--out-prefix", str(prefix)])
        assert r.exit_code == 0, r.output
        res = json.loads(prefix.with_suffix(".json").read_text())
        assert [run["mode"] for run in res["runs"]] == ["stock", "onepage", "onepage", "stock"]
        assert res["errors"] == 0 and a.completions == b.completions == 2 * (4 + 6 + 8)
        for row in res["by_concurrency"]:
            assert row["throughput_ratio_onepage_over_stock"]["n"] == 2
            for m in MODES:
                assert row[m]["output_tokens_per_s"]["min"] > 0
        assert "ratio one-page/stock" in prefix.with_suffix(".md").read_text()
        assert prefix.with_suffix(".png").stat().st_size > 1000


def test_compare_bad_inputs_exit_2():
    for args, words in ((["--concurrency", "0,2"], "positive integers"),
                        (["--stock-endpoint", "http://127.0.0.1:1"], "both or neither"),
                        (["--engine-cpus", "9999"], "not available")):
        r = CliRunner().invoke(main, ["bench", "compare", *args])
        assert r.exit_code == 2 and words in r.output, (args, r.output)


def test_partial_results_aggregate_only_paired_repeats(tmp_path):
    from r9k.bench.compare import plot
    w = Workload([1, 4], 8, 16, 8)
    runs = [{"repeat": 0, "mode": "stock", "levels": [level(1, 100, 0.1), level(4, 300, 0.2)]}]
    agg = aggregate(runs, w)
    assert agg["by_concurrency"][0]["throughput_ratio_onepage_over_stock"]["n"] == 0
    res = {"workload": w.__dict__, "repeats": 2, **agg}
    assert "| 1 |" not in markdown(res)
    assert plot(res, tmp_path / "p.png") is False


def test_the_client_opens_a_connection_per_request():
    """Kept-alive connections reused against vLLM's server failed requests once they queued for
    seconds (lab/results/compare_cpu_admission.md): each request now has its own."""
    import asyncio

    from r9k.bench.client import drive, new_session

    async def run(url: str):
        async with new_session(2) as session:
            return await drive(lambda i: ({"model": "fake", "prompt": f"p{i}", "max_tokens": 4,
                                           "stream": True}, {}),
                               session, url, concurrency=2, total=6, timeout_s=30)

    with FakeOpenAI(token_delay_s=0.001) as srv:
        results, stopped = asyncio.run(run(srv.url))
        assert stopped is None and [r.status for r in results] == ["ok"] * 6
        assert len(srv.peers) == 6 and len(set(srv.peers)) == 6, srv.peers
