"""The shared-prefix workload of `r9k bench compare`: prompts, prefix-cache counter deltas,
hit rate and page modes in the aggregate, the markdown table; no engine."""
from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from doubles.fake_openai import FakeOpenAI

from r9k.bench.client import RequestResult, _read_body
from r9k.bench.compare import (Workload, aggregate, cached_token_counts, markdown,
                               prefix_cache_counts, prefix_cache_delta, shared_prefix_prompts)
from r9k.cli import main

METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} %s
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 100.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} %s
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 0.0
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
"""


def test_prompts_share_their_group_prefix_and_nothing_else():
    out = shared_prefix_prompts(random.Random(4), 10, 3, 600, 40)
    assert sorted(g for g, _ in out) == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(len(p) == 640 and p.isascii() for _, p in out)  # byte-level: 640 tokens
    prefixes = {g: {p[:600] for gg, p in out if gg == g} for g in range(3)}
    assert all(len(v) == 1 for v in prefixes.values())
    assert len({next(iter(v)) for v in prefixes.values()}) == 3
    assert len({p[600:] for _, p in out}) == 10            # every suffix its own
    for g in range(3):                                     # groups differ from the first char
        others = [next(iter(prefixes[h])) for h in range(3) if h != g]
        assert all(o[:8] != next(iter(prefixes[g]))[:8] for o in others)
    assert [g for g, _ in out] != sorted(g for g, _ in out)  # shuffled
    assert shared_prefix_prompts(random.Random(4), 10, 3, 600, 40) == out  # same for both modes
    with pytest.raises(ValueError, match="expected all >= 1"):
        shared_prefix_prompts(random.Random(0), 4, 0, 600, 40)


def test_prefix_cache_counts_sum_engines_and_deltas():
    before = prefix_cache_counts(METRICS % (1000.0, 200.0))
    after = prefix_cache_counts(METRICS % (5224.0, 3272.0))
    assert before == {"queries": 1100.0, "hits": 200.0}
    d = prefix_cache_delta(before, after)
    assert d == {"queries": 4224, "hits": 3072, "hit_rate": pytest.approx(3072 / 4224)}
    assert prefix_cache_delta(before, before)["hit_rate"] is None        # nothing queried
    assert prefix_cache_delta(after, before)["hits"] is None             # replica restarted
    assert prefix_cache_delta(None, after) == {"queries": None, "hits": None, "hit_rate": None}
    assert prefix_cache_counts("# TYPE x gauge\nx 1\n") is None


def test_cached_tokens_per_request_from_the_usage_block():
    body = {"choices": [{"text": "ab"}], "usage": {
        "prompt_tokens": 1056, "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 768, "created_cache_tokens": None}}}
    results = []
    for b in (body, {**body, "usage": {"prompt_tokens": 1056, "completion_tokens": 2}}):
        r = RequestResult(index=len(results), status="error")
        _read_body(json.dumps(b), r)
        results.append(r)
    assert results[0].status == "ok" and results[0].cached_prompt_tokens == 768
    assert results[1].cached_prompt_tokens is None       # server without prompt-token details
    zero = RequestResult(index=2, status="ok", cached_prompt_tokens=0)
    assert cached_token_counts(results + [zero, zero]) == {"0": 2, "768": 1}
    assert cached_token_counts(results[1:2]) is None


def level(c: int, tps: float, ttft: float, hit_rate: float | None) -> dict:
    return {"concurrency": c, "errors": 0, "ok": 32, "output_tokens_per_s": tps,
            "ttft_s": {"p50": ttft, "p90": 2 * ttft},
            "decode_tokens_per_s_per_request": {"p50": tps / c},
            "prefix_cache": {"hit_rate": hit_rate},
            "cached_tokens_per_request": {"0": 8, "768": 24}}


def test_aggregate_reports_hit_rate_medians_and_page_modes():
    w = Workload([4], 32, 32, 32, prefix_tokens=1024, prefix_groups=4)
    runs = []
    for rep, (s_tps, o_tps) in enumerate(((200, 180), (100, 110), (150, 150))):
        for mode, tps in (("stock", s_tps), ("onepage", o_tps)):
            runs.append({"repeat": rep, "mode": mode, "replica": {"page_mode": mode},
                         "levels": [level(4, tps, 0.2 if mode == "stock" else 0.3, 0.5 + rep / 10)]})
    agg = aggregate(runs, w)
    row = agg["by_concurrency"][0]
    assert row["stock"]["prefix_cache_hit_rate"]["median"] == pytest.approx(0.6)
    assert row["onepage"]["output_tokens_per_s"]["median"] == 150
    assert row["throughput_ratio_onepage_over_stock"]["median"] == pytest.approx(1.0)
    assert row["throughput_ratio_onepage_over_stock"]["values"] == pytest.approx([0.9, 1.1, 1.0])
    assert row["ttft_ratio_onepage_over_stock"]["median"] == pytest.approx(1.5)
    assert row["stock"]["ttft_p90_s"]["median"] == pytest.approx(0.4)
    assert row["stock"]["requests_ok"] == 96
    assert row["onepage"]["cached_tokens_per_request"] == {"0": 24, "768": 72}
    assert agg["page_modes_seen"] == {"stock": ["stock"], "onepage": ["onepage"]}
    assert not agg["page_mode_mismatch"]
    md = markdown({"workload": w.public(), "repeats": 3, "setup": {"prefix_caching": True}, **agg})
    assert "4 prefixes of 1024 tokens" in md and "prefix caching on" in md
    assert ("| 4 | stock | 96 | 60.0% (50.0%..70.0%) | 150.0 (100.0..200.0) | 200 (200..200) ms "
            "| 400 (400..400) ms |") in md
    assert "| 4 | **ratio** | | | 1.000 (0.900..1.100) | 1.500 (1.500..1.500) | |" in md
    assert "- concurrency 4, one-page: 0: 24, 768: 72" in md
    runs[1]["replica"]["page_mode"] = "stock"   # a one-page replica that kept stock pages
    assert aggregate(runs, w)["page_mode_mismatch"]


def test_shared_prefix_compare_on_two_endpoints(tmp_path):
    with FakeOpenAI(token_delay_s=0.001) as a, FakeOpenAI(token_delay_s=0.001) as b:
        prefix = tmp_path / "sp"
        r = CliRunner().invoke(main, [
            "bench", "compare", "--stock-endpoint", a.url, "--onepage-endpoint", b.url,
            "--workload", "shared-prefix", "--prefix-tokens", "300", "--prefix-groups", "2",
            "--concurrency", "2", "--repeats", "1", "--requests-per-level", "6",
            "--prompt-tokens", "16", "--output-tokens", "4", "--quiet", "--out-prefix", str(prefix)])
        assert r.exit_code == 0, r.output
        res = json.loads(prefix.with_suffix(".json").read_text())
        assert res["workload"]["kind"] == "shared-prefix"
        lv = res["runs"][0]["levels"][0]
        assert lv["ok"] == 6 and lv["prompt_tokens"] == 6 * 316
        assert lv["prefix_cache"]["hit_rate"] is None   # the double has no prefix-cache counters
        assert "shared prefix: 2 prefixes of 300 tokens" in prefix.with_suffix(".md").read_text()


def test_shared_prefix_that_cannot_fit_is_bad_input():
    r = CliRunner().invoke(main, ["bench", "compare", "--workload", "shared-prefix",
                                  "--prefix-tokens", "4000", "--max-model-len", "4096"])
    assert r.exit_code == 2 and "expected requests that fit" in r.output, r.output
