"""What the fleet takes from outside and must not trust: admin request bodies (any JSON object:
a 400 naming the field, never a 500 or a garbage card recorded) and replicas' reported load (a
NaN or negative figure is unknown, never the best score)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from r9k.deploy.controller import admin_body
from r9k.deploy.routing import POLICIES, EngineLoad, choose, pool_score
from r9k.core.vllm_metrics import parse_vllm_metrics

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
ACTIONS = ["drain", "undrain", "restart", "down"]


@pytest.mark.parametrize("action,body,needle", [
    ("drain", {"card": ["0000:03:00.0"]}, "card ['0000:03:00.0']: expected a PCI address"),
    ("drain", {"replica": ["tiny-0"]}, "replica ['tiny-0']: expected a string"),
    ("drain", {"card": "0000:03:00.0", "reason": {"x": 1}}, "reason {'x': 1}: expected a string"),
    ("drain", {"card": "0000:03:00.0", "reason": "r" * 201}, "reason 'rrrr"),
    ("drain", {"card": "../../etc"}, "card '../../etc': expected a PCI address"),
    ("drain", {"card": "0000:03:00.0", "colour": "red"}, "unknown field 'colour'"),
    ("drain", {}, "expected a card or a replica"),
    ("undrain", {"replica": "tiny-0"}, "unknown field 'replica'"),
    ("down", {"now": True}, "unknown field 'now'; expected an empty object"),
])
def test_admin_bodies_are_checked_field_by_field(action, body, needle):
    with pytest.raises(ValueError) as exc:
        admin_body(action, body)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@settings(max_examples=400, deadline=None)
@given(action=st.sampled_from(ACTIONS), body=st.dictionaries(
    st.sampled_from(["card", "host", "event", "reason", "replica", "x"]), JSON, max_size=4))
def test_any_admin_body_is_accepted_as_strings_of_their_form_or_refused_by_name(action, body):
    try:
        checked = admin_body(action, body)
    except ValueError as exc:
        assert str(exc).startswith(f"{action}: ")
        return
    for key, value in checked.items():  # what passes is what the controller can use safely
        assert value is None or (isinstance(value, str) and value.isprintable() and len(value) <= 200)
    if action == "drain":
        assert bool(checked.get("card")) != bool(checked.get("replica"))


def test_a_nan_kv_usage_is_dropped_where_metrics_are_read():
    m = parse_vllm_metrics('vllm:kv_cache_usage_perc{model_name="m"} NaN\n'
                           'vllm:num_requests_running{model_name="m"} +Inf\n'
                           'vllm:num_requests_waiting{model_name="m"} 0\n')
    assert m.kv_usage_ratio is None and m.running is None and m.waiting == 0
    assert m.invalid == ["vllm:kv_cache_usage_perc", "vllm:num_requests_running"]


class _Cand:
    def __init__(self, name, engine, outstanding=0):
        self.name, self.engine, self.outstanding, self.last_pick = name, engine, outstanding, 0


def test_a_replica_reporting_nan_does_not_get_every_request():
    """Before: NaN made the pool score NaN, which no comparison ranks below: that replica
    took every request."""
    now = 100.0
    bad = _Cand("bad", EngineLoad(0.0, 0.0, float("nan"), now))
    good = _Cand("good", EngineLoad(0.0, 0.0, 0.1, now))
    picks = {"bad": 0, "good": 0}
    for _ in range(40):
        c = choose([bad, good], "pool-aware", now)
        picks[c.name] += 1
        c.outstanding += 1   # requests stay in flight: each pick weighs on the next
    assert picks["bad"] <= 24 and picks["good"] >= 16, picks


_figure = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 50).map(float)


@settings(max_examples=400, deadline=None)
@given(loads=st.lists(st.tuples(_figure, _figure, _figure, st.integers(0, 20)), min_size=1,
                      max_size=5),
       policy=st.sampled_from(list(POLICIES)))
def test_scores_stay_finite_and_a_replica_is_always_chosen(loads, policy):
    now = 100.0
    cands = [_Cand(f"r{i}", EngineLoad(run, wait, kv, now), out)
             for i, (run, wait, kv, out) in enumerate(loads)]
    for c in cands:
        score = pool_score(c, now)
        assert math.isfinite(score) and score > 0
    assert choose(cands, policy, now, key="k" * 10) in cands


@pytest.mark.parametrize("returncode", [0, 1, -9])
@pytest.mark.parametrize("state", ["loading", "ready"])
def test_an_engine_exit_nobody_asked_for_fails_the_replica_even_with_status_0(state, returncode):
    """vLLM can crash with exit status 0: an exit is a failure unless the supervisor stopped it."""
    from r9k.deploy.config import HealthSpec
    from r9k.deploy.lifecycle import Fail, Observation, ReplicaLifecycle

    lc = ReplicaLifecycle("tiny-0", HealthSpec())
    lc.placing("h1", ("0000:c1:00.0",))
    lc.engine_started(0.0, 1, 4242, "http://127.0.0.1:18700", "/logs/tiny-0.1.log")
    if state == "ready":
        lc.state = "ready"
    [action] = lc.observe(5.0, Observation(alive=False, returncode=returncode))
    assert isinstance(action, Fail) and f"exited with {returncode}" in action.reason


def test_the_supervisor_reports_a_clean_exit_of_its_engine_as_an_exit(tmp_path):
    """The real supervisor and guard: an engine that exits 0 on its own is reported dead with 0
    (not running, not hidden), which the lifecycle above fails."""
    import sys
    import time

    from r9k.deploy.supervisor import ReplicaProcess

    proc = ReplicaProcess("tiny-0", [sys.executable, "-c", "import time; time.sleep(0.3)", "{port}"],
                          str(tmp_path), "127.0.0.1", (18900, 18999))
    proc.start()
    deadline = time.monotonic() + 20
    while proc.status()["alive"] and time.monotonic() < deadline:
        time.sleep(0.1)
    status = proc.status()
    assert status["alive"] is False and status["returncode"] == 0
