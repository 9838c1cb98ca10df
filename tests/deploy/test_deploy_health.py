"""Health verdicts, restart backoff and the page proof, as pure functions with times as numbers."""
from __future__ import annotations

import pytest

from r9k import capacity
from r9k.deploy.engine import prove_pages
from r9k.deploy.health import EngineCounters, HealthLimits, ReadyHealth, parse_counters, restart_backoff_s

LIMITS = HealthLimits(heartbeat_timeout_s=10, progress_timeout_s=30, grace_after_ready_s=20)


def obs(h, t, tokens, running=0, waiting=0, in_flight=0, heartbeat=True, alive=True):
    return h.observe(t, alive=alive, heartbeat_ok=heartbeat,
                     counters=EngineCounters(tokens, running, waiting), in_flight=in_flight)


def test_progress_hang_needs_queued_work_and_stuck_tokens():
    h = ReadyHealth(LIMITS, ready_at=100)
    assert obs(h, 101, 50) is None
    assert obs(h, 200, 50) is None                       # idle for 100 s: fine
    assert obs(h, 201, 50, running=2) is None            # work arrives; last progress seen at 200
    assert obs(h, 230, 50, running=2) is None            # 29 s
    why = obs(h, 232, 50, running=2)
    assert why.startswith("hung: 2 request(s) queued or running and no new token for 32 s")


def test_tokens_moving_or_router_in_flight_count():
    h = ReadyHealth(LIMITS, ready_at=0)
    for t in range(30, 300, 10):
        assert obs(h, t, t * 3, running=8) is None       # busy but making tokens
    # vLLM's gauges are stale when its engine core is stopped: the router's own count still says queued
    assert obs(h, 300, 900, in_flight=1) is None
    assert obs(h, 331, 900, in_flight=1).startswith("hung: 1 request(s)")


def test_grace_after_ready_suppresses_progress_verdict():
    h = ReadyHealth(HealthLimits(10, 5, grace_after_ready_s=60), ready_at=0)
    assert obs(h, 1, 0, waiting=3) is None
    assert obs(h, 40, 0, waiting=3) is None              # stuck 39 s but within grace
    assert obs(h, 61, 0, waiting=3).startswith("hung")


def test_heartbeat_timeout_and_process_exit():
    h = ReadyHealth(LIMITS, ready_at=0)
    assert obs(h, 5, 0, heartbeat=False) is None
    assert obs(h, 10, 0, heartbeat=False) is None
    assert obs(h, 11, 0, heartbeat=False) == "no heartbeat (/health) for 11 s"
    assert ReadyHealth(LIMITS, 0).observe(1, alive=False, heartbeat_ok=True, counters=None,
                                          in_flight=0) == "engine process exited"
    assert ReadyHealth(LIMITS, 0).observe(100, alive=True, heartbeat_ok=True, counters=None,
                                          in_flight=5) is None  # unreadable metrics decide nothing


def test_backoff_doubles_up_to_the_cap():
    assert [restart_backoff_s(n, 5, 60) for n in range(1, 7)] == [0, 5, 10, 20, 40, 60]


def test_parse_counters_sums_engines():
    text = """# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 120.0
vllm:generation_tokens_total{engine="1",model_name="m"} 30.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
"""
    assert parse_counters(text) == EngineCounters(150.0, 2.0, 1.0)


@pytest.fixture(scope="module")
def plan():
    return capacity.plan(capacity.preset("tiny"), tp=1, num_spec=3, kv_bytes_per_rank=64 << 20,
                         max_model_len=4096, platform="cpu", state_dtype="float32", running=0)


def _log(lines, tokens):
    return "\n".join(lines + [f"INFO [kv_cache_utils.py] GPU KV cache size: {tokens:,} tokens"])


def test_proof_accepts_onepage_only_with_matching_pool(plan):
    one = plan.onepage
    ok = prove_pages(_log(["INFO r9k: one-page GDN state pages (1 page per request instead of 1 + 3)"], one.tokens),
                     one.num_blocks, plan, "onepage", block_size=one.attention_block_size)
    assert ok.ok and ok.page_mode == "onepage" and ok.reason is None
    assert ok.kv_cache_tokens == one.tokens != plan.stock.tokens
    # the log says one-page but the pool is the stock one: some rank sized stock pages
    bad = prove_pages(_log(["r9k: one-page GDN state pages"], plan.stock.tokens), plan.stock.num_blocks,
                      plan, "onepage", block_size=plan.stock.attention_block_size)
    assert not bad.ok and bad.page_mode == "unknown" and "a rank runs other pages" in bad.reason


def test_proof_reports_why_stock_and_missing_plugin(plan):
    stock = prove_pages(_log(["WARNING r9k: stock GDN state pages: prefix caching is on (mamba_cache_mode='align')"],
                             plan.stock.tokens), plan.stock.num_blocks, plan, "onepage",
                        block_size=plan.stock.attention_block_size)
    assert not stock.ok and stock.page_mode == "stock" and stock.reason.startswith("prefix caching is on")
    assert prove_pages(_log(["r9k: stock GDN state pages: R9K_GDN_STATE=stock"], plan.stock.tokens),
                       plan.stock.num_blocks, plan, "stock").ok
    missing = prove_pages(_log(["INFO no plugin here"], plan.stock.tokens), plan.stock.num_blocks, plan, "onepage")
    assert not missing.ok and "plugin did not load" in missing.reason
    no_metrics = prove_pages(_log(["r9k: one-page GDN state pages"], plan.onepage.tokens), None, plan, "onepage")
    assert not no_metrics.ok and "num_gpu_blocks" in no_metrics.reason
