"""Health verdicts, restart backoff and the page proof, as pure functions with times as numbers."""
from __future__ import annotations

import dataclasses

import pytest

from r9k.core import capacity
from r9k.deploy.engine import prove_pages
from r9k.deploy.health import (EXITED, HUNG, NO_HEARTBEAT, HealthLimits, ReadyHealth, Verdict,
                               restart_backoff_s)
from r9k.core.vllm_metrics import VllmMetrics, parse_vllm_metrics

LIMITS = HealthLimits(heartbeat_timeout_s=10, progress_timeout_s=30, grace_after_ready_s=20)


def obs(h, t, tokens, running=0, waiting=0, in_flight=0, heartbeat=True, alive=True):
    return h.observe(t, alive=alive, heartbeat_ok=heartbeat,
                     counters=VllmMetrics(running=running, waiting=waiting, generation_tokens=tokens), in_flight=in_flight)


def test_progress_hang_needs_queued_work_and_stuck_tokens():
    h = ReadyHealth(LIMITS, ready_at=100)
    assert obs(h, 101, 50) is None
    assert obs(h, 200, 50) is None                       # idle for 100 s: fine
    assert obs(h, 201, 50, running=2) is None            # work arrives; last progress seen at 200
    assert obs(h, 230, 50, running=2) is None            # 29 s
    why = obs(h, 232, 50, running=2)
    assert why.kind == HUNG
    assert why.text.startswith("hung: 2 request(s) queued or running and no new token for 32 s")


def test_tokens_moving_or_router_in_flight_count():
    h = ReadyHealth(LIMITS, ready_at=0)
    for t in range(30, 300, 10):
        assert obs(h, t, t * 3, running=8) is None       # busy but making tokens
    # vLLM's gauges are stale when its engine core is stopped: the router's own count still says queued
    assert obs(h, 300, 900, in_flight=1) is None
    assert obs(h, 331, 900, in_flight=1).text.startswith("hung: 1 request(s)")


def test_grace_after_ready_suppresses_progress_verdict():
    h = ReadyHealth(HealthLimits(10, 5, grace_after_ready_s=60), ready_at=0)
    assert obs(h, 1, 0, waiting=3) is None
    assert obs(h, 40, 0, waiting=3) is None              # stuck 39 s but within grace
    assert obs(h, 61, 0, waiting=3).kind == HUNG


def test_heartbeat_timeout_and_process_exit():
    h = ReadyHealth(LIMITS, ready_at=0)
    assert obs(h, 5, 0, heartbeat=False) is None
    assert obs(h, 10, 0, heartbeat=False) is None
    assert obs(h, 11, 0, heartbeat=False) == Verdict(NO_HEARTBEAT, "no heartbeat (/health) for 11 s")
    assert ReadyHealth(LIMITS, 0).observe(1, alive=False, heartbeat_ok=True, counters=None,
                                          in_flight=0) == Verdict(EXITED, "engine process exited")
    assert ReadyHealth(LIMITS, 0).observe(100, alive=True, heartbeat_ok=True, counters=None,
                                          in_flight=5) is None  # unreadable metrics decide nothing


def test_backoff_doubles_up_to_the_cap():
    assert [restart_backoff_s(n, 5, 60) for n in range(1, 7)] == [0, 5, 10, 20, 40, 60]


def test_one_metrics_reader_sums_engines():
    text = """# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 120.0
vllm:generation_tokens_total{engine="1",model_name="m"} 30.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
"""
    m = parse_vllm_metrics(text)
    assert (m.generation_tokens, m.running, m.waiting, m.model_name) == (150.0, 2.0, 1.0, "m")
    assert m.page_mode is None and m.num_blocks is None


@pytest.fixture(scope="module")
def plan():
    return capacity.plan(capacity.preset("tiny"), tp=1, num_spec=3, kv_bytes_per_rank=64 << 20,
                         max_model_len=4096, platform="cpu", state_dtype="float32", running=0)


def _metrics(pool, plugin: dict | None, cache_mode: str = "none") -> str:
    """A replica's /metrics as vLLM and the plugin write it (prometheus_client's own output)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()
    Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks", "mamba_cache_mode",
                                                "engine"], registry=reg).labels(
        str(pool.attention_block_size), str(pool.num_blocks), cache_mode, "0").set(1)
    if plugin is not None:
        Gauge("r9k_plugin_info", "plugin", list(plugin), registry=reg).labels(**plugin).set(1)
    return generate_latest(reg).decode()


def _plugin(mode: str, reason: str = "", vllm: str = "0.32.0") -> dict:
    return {"page_mode": mode, "reason": reason, "cache_mode": "none", "record_layout": "",
            "vllm_version": vllm, "num_spec": "3", "num_gdn_groups": "3",
            "num_attention_groups": "1", "gdn_pages_per_request": "1" if mode == "onepage" else "4"}


def test_proof_accepts_onepage_only_with_matching_pool(plan):
    ok = prove_pages(_metrics(plan.onepage, _plugin("onepage")), plan, "onepage")
    assert ok.ok and ok.page_mode == "onepage" and ok.reason is None
    assert ok.num_blocks == plan.onepage.num_blocks and ok.cache_mode == "none"
    assert ok.plugin["gdn_pages_per_request"] == "1"
    # the series says one-page but the pool is not the planner's: some rank sized other pages
    other = dataclasses.replace(plan.onepage, num_blocks=plan.onepage.num_blocks - 1)
    bad = prove_pages(_metrics(other, _plugin("onepage")), plan, "onepage")
    assert not bad.ok and bad.page_mode == "unknown" and "a rank runs other pages" in bad.reason


def test_proof_reports_why_stock_and_missing_plugin(plan):
    why = "prefix caching is on (mamba_cache_mode='align')"
    stock = prove_pages(_metrics(plan.stock, _plugin("stock", why), "align"), plan, "onepage")
    assert not stock.ok and stock.page_mode == "stock" and stock.reason == why
    assert stock.cache_mode == "align"
    assert prove_pages(_metrics(plan.stock, _plugin("stock", "R9K_GDN_STATE=stock")), plan, "stock").ok
    # the version-mismatch path: the plugin loaded, said why, and the proof reports its words
    old = "vLLM 0.35.1 is not a release the plugin knows (0.32, 0.33, 0.34; proven: 0.32)"
    mismatch = prove_pages(_metrics(plan.stock, _plugin("stock", old)), plan, "onepage")
    assert mismatch.page_mode == "stock" and mismatch.reason == old
    unknown = prove_pages(_metrics(plan.stock, _plugin("stock", old, vllm="0.35.1")), plan,
                          "onepage")
    assert unknown.page_mode == "stock" and unknown.reason == old  # the plugin's words, still
    missing = prove_pages(_metrics(plan.stock, None), plan, "onepage")
    assert not missing.ok and "no r9k_plugin_info series" in missing.reason
    assert "not Prometheus text" in prove_pages("<html>oops</html>", plan, "onepage").reason


def test_proof_checks_the_fleet_vllm_series():
    """0.34's default block is 64 tokens: a fleet planned for 0.32 cannot prove a 0.34 replica's
    pool, and says which key to set; planned for 0.34, the same pool proves."""
    kw = dict(tp=1, num_spec=3, kv_bytes_per_rank=64 << 20, max_model_len=4096, platform="gpu",
              state_dtype="float32", running=0)
    p032 = capacity.plan(capacity.preset("tiny"), **kw)
    p034 = capacity.plan(capacity.preset("tiny"), vllm="0.34", **kw)
    assert p034.onepage.attention_block_size % 64 == 0
    assert p034.onepage.attention_block_size != p032.onepage.attention_block_size
    served = _metrics(p034.onepage, _plugin("onepage", vllm="0.34.0"))
    assert prove_pages(served, p034, "onepage").ok
    wrong = prove_pages(served, p032, "onepage")
    assert not wrong.ok and wrong.page_mode == "unknown"
    assert wrong.reason == ("the replica runs vLLM 0.34.0 but the fleet plans for 0.32 (set the "
                            "fleet key vllm to its series)")
