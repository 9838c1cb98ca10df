"""The replica lifecycle without Ray, processes or a clock: fake time, fake replicas, real decisions."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r9k.deploy.config import HealthSpec
from r9k.deploy.engine import PageProof
from r9k.deploy.lifecycle import (DRAINING, LOADING, READY, STOPPED, UNHEALTHY, Fail, KillEngine,
                                  Note, Observation, Replace, ReplicaLifecycle, RestartAfter,
                                  RollingRestart, StartEngine, ops_fence_changes, replicas_to_drain)
from r9k.deploy.health import EXITED, HUNG, NO_HEARTBEAT
from r9k.core.vllm_metrics import VllmMetrics

HEALTH = HealthSpec(probe_interval_s=1, heartbeat_timeout_s=20, progress_timeout_s=8,
                    startup_timeout_s=900, grace_after_ready_s=2, restart_backoff_s=5,
                    restart_backoff_max_s=30, stable_after_s=300, drain_timeout_s=20)
PLANNED = {"stock": 10, "onepage": 13}


def proof(ok: bool = True, mode: str = "onepage", reason: str | None = None) -> PageProof:
    return PageProof(page_mode=mode, reason=reason, ok=ok, num_blocks=PLANNED[mode] if mode in PLANNED else None,
                     block_size=64, cache_mode="none", planned_blocks=PLANNED,
                     planned_tokens={"stock": 640, "onepage": 832}, plugin={"page_mode": mode})


def counters(tokens: float, running: float = 0, waiting: float = 0) -> VllmMetrics:
    return VllmMetrics(generation_tokens=tokens, running=running, waiting=waiting)


def notes(actions) -> list[str]:
    return [a.text for a in actions if isinstance(a, Note)]


def started(now: float = 0.0, health: HealthSpec = HEALTH) -> ReplicaLifecycle:
    lc = ReplicaLifecycle("tiny-0", health)
    lc.placing("h1", ("0000:c1:00.0",))
    lc.engine_started(now, 1, 4242, "http://127.0.0.1:18700", "/logs/tiny-0.1.log")
    return lc


def ready(now: float = 10.0, health: HealthSpec = HEALTH) -> ReplicaLifecycle:
    lc = started(0.0, health)
    assert lc.observe(now, Observation(heartbeat_ok=True, proof=proof())) != []
    assert lc.state == READY
    return lc


class FakeReplica:
    """Carries out the lifecycle's actions the way the controller does, on a fake clock."""

    def __init__(self, lc: ReplicaLifecycle, now: float = 0.0) -> None:
        self.lc, self.now = lc, now
        self.supervisor_alive = True
        self.stopping = False
        self.calls: list[str] = []
        self.history: list[str] = []

    def run(self, actions) -> None:
        alive = True
        for a in actions:
            if isinstance(a, Note):
                self.history.append(a.text)
            elif isinstance(a, Fail):
                self.run(self.lc.fail(self.now, a.reason))
            elif isinstance(a, KillEngine):
                self.calls.append("kill")
                alive = self.supervisor_alive
            elif isinstance(a, RestartAfter):
                self.calls.append(f"wait {a.delay_s:g}")
                self.now += a.delay_s
                self.run(self.lc.restart_due(self.stopping, alive))
            elif isinstance(a, StartEngine):
                self.calls.append("start")
                self.run(self.lc.engine_started(self.now, self.lc.starts + 1, 1000 + self.lc.starts, "u", "l"))
            elif isinstance(a, Replace):
                self.calls.append(f"replace: {a.why}")
            else:
                raise AssertionError(a)


def test_start_proves_pages_then_ready():
    lc = started(now=100.0)
    assert (lc.state, lc.starts, lc.reason) == (LOADING, 1, "engine starting (/logs/tiny-0.1.log)")
    assert lc.observe(130.0, Observation(heartbeat_ok=False)) == []  # still loading, no failure
    actions = lc.observe(142.0, Observation(heartbeat_ok=True, proof=proof()))
    assert notes(actions) == ["ready, onepage pages: 13 blocks (planner {'stock': 10, 'onepage': 13}), after 42 s"]
    assert (lc.state, lc.ready_at, lc.page_failures, lc.proof.page_mode) == (READY, 142.0, 0, "onepage")


def test_loading_fails_only_after_the_startup_timeout():
    lc = started(now=0.0)
    assert lc.observe(900.0, Observation(heartbeat_ok=False)) == []
    assert lc.observe(900.5, Observation(heartbeat_ok=False)) == [Fail("not ready after 900 s")]
    assert lc.state == LOADING  # the failure is acted on by fail(), in the replica's own task


def test_loading_heartbeat_without_proof_is_bad_input():
    lc = started()
    with pytest.raises(ValueError, match="needs its page proof"):
        lc.observe(5.0, Observation(heartbeat_ok=True))


def test_dead_process_and_lost_supervisor_fail_in_any_probed_state():
    assert started().observe(1.0, Observation(alive=False, returncode=-9)) == [
        Fail("engine process exited with -9", EXITED)]
    assert ready().observe(11.0, Observation(supervisor_error="RayActorError")) == [
        Fail("supervisor lost: RayActorError")]


@pytest.mark.parametrize("state", [DRAINING, UNHEALTHY, STOPPED])
def test_probes_of_replicas_not_loading_or_ready_decide_nothing(state):
    lc = ready()
    lc.state = state
    assert lc.observe(50.0, Observation(alive=False, returncode=1)) == []


def test_restart_backoff_grows_and_is_capped():
    lc = ready()
    delays = []
    for i in range(6):
        actions = lc.fail(20.0 + i, "engine process exited with -9")
        assert actions[:2] == [Note("unhealthy: engine process exited with -9"), KillEngine()]
        delays.append(actions[-1].delay_s)
        assert lc.restart_due(stopping=False, supervisor_alive=True) == [StartEngine()]
    assert delays == [0, 5, 10, 20, 30, 30]
    assert (lc.failures, lc.restarts, lc.state) == (6, 6, UNHEALTHY)


def test_failure_count_resets_after_stable_ready_time():
    lc = ready(now=10.0)
    lc.fail(20.0, "x")
    lc.fail(21.0, "x")
    assert lc.failures == 2
    # ready again, then stable for longer than stable_after_s: the next failure is a first one
    lc.engine_started(30.0, 3, 1, "u", "l")
    lc.observe(40.0, Observation(heartbeat_ok=True, proof=proof()))
    assert lc.fail(40.0 + HEALTH.stable_after_s - 1, "x")[-1] == RestartAfter(10)   # third in a row
    lc.engine_started(400.0, 4, 1, "u", "l")
    lc.observe(410.0, Observation(heartbeat_ok=True, proof=proof()))
    assert lc.fail(410.0 + HEALTH.stable_after_s + 1, "x")[-1] == RestartAfter(0)
    assert lc.failures == 1


def test_restart_due_restarts_in_place_replaces_or_does_nothing():
    lc = ready()
    lc.fail(20.0, "x")
    assert lc.restart_due(stopping=True, supervisor_alive=True) == []
    assert lc.restart_due(stopping=False, supervisor_alive=False) == [Replace("supervisor lost")]
    assert lc.restarts == 1
    lc.begin_drain(21.0, "card fenced")  # drained meanwhile: the backoff's restart is stale
    assert lc.restart_due(stopping=False, supervisor_alive=True) == []
    assert lc.restarts == 1


def test_page_proof_failures_stop_restarts_at_the_maximum():
    r = FakeReplica(started(0.0))
    bad = proof(ok=False, mode="stock", reason="prefix caching is on")
    for i in range(1, 3):
        r.now = 10.0 * i
        r.run(r.lc.observe(r.now, Observation(heartbeat_ok=True, proof=bad)))
        assert (r.lc.page_failures, r.lc.page_failed, r.lc.state) == (i, False, LOADING)
    assert r.calls == ["kill", "wait 0", "start", "kill", "wait 5", "start"]
    r.now = 100.0
    r.run(r.lc.observe(r.now, Observation(heartbeat_ok=True, proof=bad)))
    assert (r.lc.page_failures, r.lc.page_failed, r.lc.state) == (3, True, UNHEALTHY)
    assert r.calls[6:] == ["kill"]  # no restart: it would run stock pages again
    assert r.history[-2:] == ["unhealthy: page proof failed: prefix caching is on",
                              "not restarted: the page proof failed 3 times"]
    assert r.lc.starts == 3


def test_a_good_proof_resets_the_page_failure_count():
    r = FakeReplica(started(0.0))
    r.run(r.lc.observe(1.0, Observation(heartbeat_ok=True, proof=proof(ok=False, mode="unknown", reason="no series"))))
    r.run(r.lc.observe(2.0, Observation(heartbeat_ok=True, proof=proof())))
    assert (r.lc.page_failures, r.lc.state) == (0, READY)


def test_killed_engine_is_restarted_on_its_cards_and_proved_again():
    r = FakeReplica(ready(now=10.0), now=50.0)
    r.run(r.lc.observe(r.now, Observation(alive=False, returncode=-9)))
    assert r.calls == ["kill", "wait 0", "start"]
    assert (r.lc.state, r.lc.starts, r.lc.restarts, r.lc.proof) == (LOADING, 2, 1, None)
    assert "unhealthy: engine process exited with -9" in r.history
    r.run(r.lc.observe(60.0, Observation(heartbeat_ok=True, proof=proof())))
    assert r.lc.state == READY and r.lc.ready_at == 60.0


def test_lost_supervisor_is_placed_again():
    r = FakeReplica(ready(now=10.0), now=50.0)
    r.supervisor_alive = False
    r.run(r.lc.observe(r.now, Observation(supervisor_error="RayActorError")))
    assert r.calls == ["kill", "wait 0", "replace: supervisor lost"]


def test_hung_engine_is_unhealthy_after_the_progress_timeout():
    lc = ready(now=100.0)   # grace 2 s, progress timeout 8 s
    busy = dict(heartbeat_ok=True, in_flight=2)
    assert lc.observe(101.0, Observation(counters=counters(50, running=2), **busy)) == []
    assert lc.observe(105.0, Observation(counters=counters(80, running=2), **busy)) == []  # tokens moved
    assert lc.observe(113.0, Observation(counters=counters(80, running=2), **busy)) == []  # stuck 8 s
    [fail] = lc.observe(113.5, Observation(counters=counters(80, running=2), **busy))
    assert fail.reason == ("hung: 4 request(s) queued or running and no new token for 8 s "
                           "(generation_tokens_total stuck at 80)")
    assert fail.verdict == HUNG
    # the typed verdict stands exactly as long as its reason: through the failure, not the restart
    lc.fail(113.5, fail.reason, fail.verdict)
    assert (lc.state, lc.verdict) == (UNHEALTHY, HUNG)
    assert lc.restart_due(stopping=False, supervisor_alive=True) == [StartEngine()]
    lc.engine_started(114.0, lc.starts + 1, 1, "u", "l")
    assert lc.verdict is None and lc.reason.startswith("engine starting")
    lc.fail(115.0, "page proof failed: x")        # a failure no verdict said
    assert (lc.state, lc.verdict) == (UNHEALTHY, None)


def test_idle_ready_replica_stays_healthy_and_heartbeat_loss_fails_it():
    lc = ready(now=100.0)
    assert lc.observe(200.0, Observation(heartbeat_ok=True, counters=counters(7))) == []  # nothing queued
    assert lc.observe(220.0, Observation(heartbeat_ok=False, counters=counters(7))) == []
    assert lc.observe(220.5, Observation(heartbeat_ok=False)) == [
        Fail("no heartbeat (/health) for 20 s", NO_HEARTBEAT)]


def test_drain_waits_for_requests_until_its_deadline_then_replaces():
    lc = ready()
    assert notes(lc.begin_drain(100.0, "card 0000:c1:00.0 fenced: ops: mes_timeout")) == [
        "draining: card 0000:c1:00.0 fenced: ops: mes_timeout"]
    assert lc.state == DRAINING
    assert lc.drain_waiting(110.0, outstanding=2) is True
    assert lc.drain_waiting(110.0, outstanding=0) is False
    assert lc.drain_waiting(120.0, outstanding=2) is False   # drain_timeout_s 20 passed
    assert lc.drained(replace=True, stopping=False) == [
        Note("stopped"), Replace("card 0000:c1:00.0 fenced: ops: mes_timeout")]
    assert lc.state == STOPPED


def test_drain_by_operator_or_during_shutdown_does_not_replace():
    lc = ready()
    lc.begin_drain(0.0, "drained by operator")
    assert lc.drained(replace=False, stopping=False) == [Note("stopped")]
    lc2 = ready()
    lc2.begin_drain(0.0, "card fenced")
    assert lc2.drained(replace=True, stopping=True) == [Note("stopped")]


def test_drain_waiting_before_begin_drain_is_an_error():
    with pytest.raises(RuntimeError, match="before begin_drain"):
        ready().drain_waiting(0.0, 1)


def test_not_placed_waits_unhealthy_with_both_reasons_and_retries_after_backoff_or_a_join():
    lc = ready()
    lc.not_placed(100.0, "supervisor lost", "replica tiny-0 (TP1) does not fit")
    assert (lc.state, lc.reason) == (UNHEALTHY, "supervisor lost; waiting for cards: replica tiny-0 (TP1) does not fit")
    assert lc.placement_due(100.0, stopping=False)   # first failure: no backoff
    lc.not_placed(100.0, "supervisor lost", "still no cards")
    b = HEALTH.restart_backoff_s
    assert not lc.placement_due(100.0 + b - 0.01, stopping=False)
    assert lc.placement_due(100.0 + b, stopping=False)
    assert not lc.placement_due(100.0 + b, stopping=True)
    lc.hosts_changed(100.5)   # a host joined: due at once
    assert lc.placement_due(100.5, stopping=False)
    lc.placing("h2", ["0000:c2:00.0"])
    assert lc.place_due is None and not lc.placement_due(1e9, stopping=False)


def test_step_failure_is_unhealthy_counted_and_placed_again_after_the_backoff():
    lc = started()
    lc.failures = 2
    b = HEALTH.restart_backoff_s
    assert notes(lc.step_failed(50.0, "PlacementError: not ready after 120 s")) == [
        f"lifecycle error: PlacementError: not ready after 120 s; placing again in {2 * b:.0f} s"]
    assert (lc.state, lc.failures) == (UNHEALTHY, 3)
    assert not lc.placement_due(50.0 + 2 * b - 0.01, False) and lc.placement_due(50.0 + 2 * b, False)


def test_host_lost_is_unhealthy_and_due_for_placement_at_once():
    lc = ready()
    assert notes(lc.host_lost(7.0, "hB")) == ["unhealthy: host hB lost; placing again on a live host"]
    assert (lc.state, lc.reason) == (UNHEALTHY, "host hB lost") and lc.placement_due(7.0, False)
    lc.shut_down()
    assert not lc.placement_due(7.0, False)


def test_bad_max_page_failures_is_refused():
    with pytest.raises(ValueError, match="max_page_failures 0"):
        ReplicaLifecycle("x", HEALTH, max_page_failures=0)


def test_rolling_restart_one_at_a_time_and_halts_when_one_does_not_come_back():
    lcs = {n: ready() for n in ("a-0", "a-1", "a-2", "a-3")}
    lcs["a-1"].state = UNHEALTHY
    rolling = RollingRestart(list(lcs))
    assert rolling.next(lcs, busy={"a-0"}) == "a-2"    # a-0 busy, a-1 not ready
    assert lcs["a-2"].begin_rolling_restart(0.0) == [Note("rolling restart: draining")]
    assert lcs["a-2"].rolling_restart_due() == [StartEngine()] and lcs["a-2"].restarts == 1
    rolling.finished("a-2", LOADING)                  # did not come back ready
    assert rolling.next(lcs, busy=set()) is None      # a-3 is not taken down
    assert rolling.results == ["a-2: loading"]


def test_rolling_restart_goes_through_every_ready_replica_in_order():
    lcs = {n: ready() for n in ("a-0", "a-1")}
    rolling = RollingRestart(list(lcs))
    order = []
    while (name := rolling.next(lcs, busy=())) is not None:
        order.append(name)
        rolling.finished(name, READY)
    assert order == ["a-0", "a-1"] and rolling.results == ["a-0: ready", "a-1: ready"]


def test_fence_drains_replicas_on_the_card_that_still_hold_it():
    lcs = {n: ready() for n in ("t-0", "t-1", "t-2", "t-3")}
    lcs["t-2"].state = DRAINING
    lcs["t-3"].state = STOPPED
    cards = {"t-0": ("0000:c1:00.0", "0000:c1:00.1"), "t-1": ("0000:c2:00.0",),
             "t-2": ("0000:c1:00.0",), "t-3": ("0000:c1:00.0",)}
    assert replicas_to_drain("0000:c1:00.0", cards, lcs) == ["t-0"]
    assert replicas_to_drain("0000:c3:00.0", cards, lcs) == []


def test_ops_fence_changes_fence_unhealthy_and_return_cleared_cards_only():
    unusable = {("a", "0000:c1:00.0"): "ops: mes_timeout", ("a", "0000:c2:00.0"): "avoided by the fleet file",
                ("a", "0000:c3:00.0"): "ops: reset", ("b", "0000:c3:00.0"): "ops: reset",
                ("c", "0000:c1:00.0"): "ops: hang"}
    # host a and b report; c's agent did not answer this time
    fence, unfence = ops_fence_changes({"a": {"0000:c1:00.0": "mes_timeout", "0000:c4:00.0": "hang"},
                                        "b": {"0000:c3:00.0": "reset"}}, unusable)
    assert fence == {("a", "0000:c4:00.0"): "ops: hang"}   # a's c1 is fenced already, as it was
    # cleared by `r9k ops clear` on a; the same address on b stays fenced, the avoided card
    # avoided, and c's fence stays while c does not report
    assert unfence == [("a", "0000:c3:00.0")]


_VERDICT_STEPS = st.lists(st.one_of(
    st.tuples(st.just("fail"), st.sampled_from([None, "exited", "no_heartbeat", "hung"])),
    st.tuples(st.sampled_from(["restart", "drain", "step_failed", "host_lost", "not_placed",
                               "placing", "rolling"]), st.none())), max_size=12)


@given(_VERDICT_STEPS)
@settings(max_examples=300, deadline=None)
def test_a_verdict_stands_exactly_while_the_reason_it_came_with_does(steps):
    """Whatever the lifecycle does, `verdict` is the kind `fail` was given for the reason the
    replica shows now, and None once anything else set the reason (the exporter's hung gauge
    reads it)."""
    lc = started()
    given_with = None  # (reason, verdict) as the last fail set them
    for i, (step, kind) in enumerate(steps):
        now = 10.0 * (i + 1)
        if step == "fail":
            lc.fail(now, f"failure {i}", kind)
            given_with = (lc.reason, kind)
        elif step == "restart":
            lc.restart_due(stopping=False, supervisor_alive=True)
            lc.engine_started(now, lc.starts + 1, 1, "u", "l")
        elif step == "drain":
            lc.begin_drain(now, f"drain {i}")
        elif step == "step_failed":
            lc.step_failed(now, f"error {i}")
        elif step == "host_lost":
            lc.host_lost(now, "h1")
        elif step == "not_placed":
            lc.not_placed(now, "placing", f"no cards {i}")
        elif step == "placing":
            lc.placing("h1", ("0000:c1:00.0",))
        else:
            lc.begin_rolling_restart(now)
        want = given_with[1] if given_with and given_with[0] == lc.reason else None
        assert lc.verdict == want, (step, lc.reason, lc.verdict)
        if lc.verdict is not None:
            assert lc.state == UNHEALTHY
