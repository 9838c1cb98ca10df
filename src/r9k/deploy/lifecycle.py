"""Replica lifecycle as a pure state machine: events and the time in, actions out.

No Ray, no processes, no clock: the controller passes what it observed (the supervisor's report,
/health, /metrics counters, the page proof) with ``now`` (monotonic seconds) and carries out the
actions it gets back: kill the engine, restart it after a backoff, place the replica again, note
an event in its history. States are monitoring's vocabulary ``loading | ready | draining |
unhealthy``, plus ``stopped`` (holds no cards; not exported).

Health verdicts for a ready replica come from :class:`r9k.deploy.health.ReadyHealth` and the
backoff from :func:`r9k.deploy.health.restart_backoff_s`; this module decides what follows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Mapping, Sequence

from r9k.deploy.config import HealthSpec
from r9k.deploy.health import EXITED, HealthLimits, ReadyHealth, restart_backoff_s

if TYPE_CHECKING:
    from r9k.deploy.engine import PageProof
    from r9k.core.vllm_metrics import VllmMetrics

LOADING, READY, DRAINING, UNHEALTHY, STOPPED = "loading", "ready", "draining", "unhealthy", "stopped"
STATES = (LOADING, READY, DRAINING, UNHEALTHY, STOPPED)
PROBED_STATES = (LOADING, READY)
# A plugin that did not load is usually a broken install (restarts will not help), but an
# install being rewritten under a starting engine is transient: allow a couple of tries.
MAX_PAGE_FAILURES = 3
FAULT_FROM_OPS = "ops: "   # prefix of the reasons of cards fenced because ops said so


# -- actions: what the controller is asked to do ---------------------------------------------------

@dataclass(frozen=True)
class Note:
    """Add a line to the replica's history (and the log)."""
    text: str


@dataclass(frozen=True)
class Fail:
    """The replica is unhealthy: run :meth:`ReplicaLifecycle.fail` in the replica's own task."""
    reason: str
    verdict: str | None = None   # the health verdict's kind (r9k.deploy.health), if one said so


@dataclass(frozen=True)
class KillEngine:
    """SIGKILL the engine through the supervisor (which may be gone: then say so)."""


@dataclass(frozen=True)
class RestartAfter:
    """Wait, then ask :meth:`ReplicaLifecycle.restart_due` what to do."""
    delay_s: float


@dataclass(frozen=True)
class StartEngine:
    """Start the engine again in the same supervisor, on the same cards."""


@dataclass(frozen=True)
class Replace:
    """Release the supervisor, placement group and cards, then place the replica again."""
    why: str


Action = Note | Fail | KillEngine | RestartAfter | StartEngine | Replace


@dataclass(frozen=True)
class Observation:
    """One health probe of a replica, as the controller saw it."""
    supervisor_error: str | None = None      # the supervisor actor did not answer (type of error)
    alive: bool = True                        # the api_server process runs
    returncode: int | None = None
    heartbeat_ok: bool = False                # /health answered 200 in time
    counters: VllmMetrics | None = None    # from /metrics (ready replicas)
    in_flight: int = 0                        # requests the entry point has at the replica
    proof: PageProof | None = None            # from /metrics (loading replicas whose /health answered)


class ReplicaLifecycle:
    """One replica's state, counters and decisions."""

    def __init__(self, name: str, health: HealthSpec, max_page_failures: int = MAX_PAGE_FAILURES) -> None:
        if max_page_failures < 1:
            raise ValueError(f"max_page_failures {max_page_failures}: expected >= 1")
        self.name = name
        self.health = health
        self.limits = HealthLimits(health.heartbeat_timeout_s, health.progress_timeout_s,
                                   health.grace_after_ready_s)
        self.max_page_failures = max_page_failures
        self.state = STOPPED
        self._reason: str | None = None
        self.verdict: str | None = None  # the health verdict's kind, while its reason stands
        self.starts = 0                # engine starts
        self.restarts = 0              # starts after a failure or a rolling restart
        self.failures = 0              # consecutive failures (reset once ready for stable_after_s)
        self.page_failures = 0         # consecutive failed page proofs
        self.page_failed = False       # proof failed max_page_failures times: no more restarts
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.drain_deadline: float | None = None
        self.ready_health: ReadyHealth | None = None
        self.proof: PageProof | None = None
        self.place_due: float | None = None  # unplaced: place again from then (monotonic s)

    @property
    def reason(self) -> str | None:
        return self._reason

    @reason.setter
    def reason(self, value: str | None) -> None:
        # a new reason ends the verdict that came with the old one (`fail` sets it again)
        self._reason, self.verdict = value, None

    # -- start ------------------------------------------------------------------------------------

    def placing(self, host: str, cards: Sequence[str]) -> list[Action]:
        self.state, self.reason = LOADING, f"placing on {host} {','.join(cards)}"
        self.place_due = None
        return []

    def placed(self, host: str, cards: Sequence[str], why: str) -> list[Action]:
        return [Note(f"placed on {host} {','.join(cards)} ({why})")]

    def _place_later(self, now: float) -> float:
        delay = restart_backoff_s(self.failures, self.health.restart_backoff_s,
                                  self.health.restart_backoff_max_s)
        self.place_due = now + delay
        return delay

    def not_placed(self, now: float, why: str, error: str) -> list[Action]:
        """No live host has the cards now: unplaced, tried again after the backoff and at once
        when a host (re)joins (:meth:`hosts_changed`)."""
        self.failures += 1
        self.state, self.reason = UNHEALTHY, f"{why}; waiting for cards: {error}"
        delay = self._place_later(now)
        return [Note(f"{self.reason} (next try in {delay:.0f} s or when a host joins)")]

    def host_lost(self, now: float, host: str) -> list[Action]:
        """Its host left the cluster: the controller releases what Ray still holds for it and
        places it again on a live host, now."""
        self.state, self.reason = UNHEALTHY, f"host {host} lost"
        self.ready_health = None
        self.place_due = now
        return [Note(f"unhealthy: host {host} lost; placing again on a live host")]

    def hosts_changed(self, now: float) -> None:
        """A host joined or came back: an unplaced replica tries again now."""
        if self.place_due is not None:
            self.place_due = min(self.place_due, now)

    def placement_due(self, now: float, stopping: bool) -> bool:
        return (not stopping and self.state == UNHEALTHY and self.place_due is not None
                and now >= self.place_due)

    def engine_started(self, now: float, start_no: int, pid: int, url: str, log_path: str) -> list[Action]:
        self.starts += 1
        self.proof, self.ready_health, self.ready_at = None, None, None
        self.state, self.reason, self.started_at = LOADING, f"engine starting ({log_path})", now
        return [Note(f"engine start {start_no} pid {pid} at {url}")]

    def adopted(self, now: float, start_no: int, pid: int, url: str) -> list[Action]:
        """A running engine a previous controller started: loading until the probes find it
        answering with the pages it should have (its counters start again here)."""
        self.starts = start_no
        self.proof, self.ready_health, self.ready_at = None, None, None
        self.state, self.reason, self.started_at = LOADING, "adopted: proving pages", now
        return [Note(f"adopted running engine (start {start_no}, pid {pid}) at {url}")]

    # -- probes -----------------------------------------------------------------------------------

    def observe(self, now: float, obs: Observation) -> list[Action]:
        """A probe's result: ready after a good page proof, or a failure to act on."""
        if self.state not in PROBED_STATES:
            return []
        if obs.supervisor_error is not None:
            return [Fail(f"supervisor lost: {obs.supervisor_error}")]
        if not obs.alive:
            # any exit the supervisor did not ask for fails the replica, status 0 included:
            # vLLM can crash with exit status 0 (hybrid GDN + MTP + async scheduling)
            return [Fail(f"engine process exited with {obs.returncode}"
                         + (" (a clean exit nobody asked for)" if obs.returncode == 0 else ""),
                         EXITED)]
        if self.state == LOADING:
            return self._observe_loading(now, obs)
        assert self.ready_health is not None
        verdict = self.ready_health.observe(now, alive=True, heartbeat_ok=obs.heartbeat_ok,
                                            counters=obs.counters, in_flight=obs.in_flight)
        return [Fail(verdict.text, verdict.kind)] if verdict else []

    def _observe_loading(self, now: float, obs: Observation) -> list[Action]:
        assert self.started_at is not None
        if not obs.heartbeat_ok:
            if now - self.started_at > self.health.startup_timeout_s:
                return [Fail(f"not ready after {self.health.startup_timeout_s:.0f} s")]
            return []
        if obs.proof is None:
            raise ValueError(f"{self.name}: a loading replica answered /health; observe() needs "
                             "its page proof (prove_pages on its /metrics)")
        self.proof = obs.proof
        if not obs.proof.ok:
            self.page_failures += 1
            self.page_failed = self.page_failures >= self.max_page_failures
            return [Fail(f"page proof failed: {obs.proof.reason}")]
        self.page_failures = 0
        self.state, self.reason, self.ready_at = READY, obs.proof.reason, now
        self.ready_health = ReadyHealth(self.limits, now)
        return [Note(f"ready, {obs.proof.page_mode} pages: {obs.proof.num_blocks} blocks "
                     f"(planner {obs.proof.planned_blocks}), after {now - self.started_at:.0f} s")]

    # -- failure and restart ----------------------------------------------------------------------

    def fail(self, now: float, reason: str, verdict: str | None = None) -> list[Action]:
        """Unhealthy: kill the engine; restart on the same cards after the backoff, unless the
        plugin is proven not to load (a restart would run stock pages again). `verdict`: the
        health verdict's kind that said so, kept while this reason stands."""
        if self.ready_at is not None and now - self.ready_at > self.health.stable_after_s:
            self.failures = 0
        self.failures += 1
        self.state, self.reason = UNHEALTHY, reason
        self.verdict = verdict
        actions: list[Action] = [Note(f"unhealthy: {reason}"), KillEngine()]
        if self.page_failed:
            return actions + [Note(f"not restarted: the page proof failed {self.page_failures} times")]
        return actions + [RestartAfter(restart_backoff_s(self.failures, self.health.restart_backoff_s,
                                                         self.health.restart_backoff_max_s))]

    def restart_due(self, stopping: bool, supervisor_alive: bool) -> list[Action]:
        """The backoff is over: restart in place, or place again if the supervisor (or its node)
        is gone. Nothing if the fleet is stopping or the replica moved on (drained, fenced)."""
        if stopping or self.state != UNHEALTHY:
            return []
        self.restarts += 1
        return [StartEngine()] if supervisor_alive else [Replace("supervisor lost")]

    def step_failed(self, now: float, error: str) -> list[Action]:
        """A lifecycle step itself raised (placement group timeout, actor start failed, the
        model missing on the host): the controller released its cards; placed again after the
        backoff, or at once when a host (re)joins."""
        self.state, self.reason = UNHEALTHY, error
        self.failures += 1
        delay = self._place_later(now)
        return [Note(f"lifecycle error: {error}; placing again in {delay:.0f} s")]

    # -- drain, rolling restart, shutdown ---------------------------------------------------------

    def begin_drain(self, now: float, reason: str) -> list[Action]:
        """Stop routing (only ready replicas are routed) and wait for in-flight requests."""
        self.state, self.reason = DRAINING, reason
        self.drain_deadline = now + self.health.drain_timeout_s
        return [Note(f"draining: {reason}")]

    def drain_waiting(self, now: float, outstanding: int) -> bool:
        """Keep waiting: requests are still in flight and the drain timeout has not passed."""
        if self.drain_deadline is None:
            raise RuntimeError(f"{self.name}: drain_waiting before begin_drain (no drain deadline)")
        return outstanding > 0 and now < self.drain_deadline

    def drained(self, replace: bool, stopping: bool) -> list[Action]:
        """Released: stopped, and placed elsewhere if asked (a fenced card) and not shutting down."""
        why = self.reason or "drained"
        self.state, self.place_due = STOPPED, None
        actions: list[Action] = [Note("stopped")]
        return actions + [Replace(why)] if replace and not stopping else actions

    def begin_rolling_restart(self, now: float) -> list[Action]:
        self.state, self.reason = DRAINING, "rolling restart"
        self.drain_deadline = now + self.health.drain_timeout_s
        return [Note("rolling restart: draining")]

    def rolling_restart_due(self) -> list[Action]:
        self.restarts += 1
        return [StartEngine()]

    def shut_down(self) -> None:
        self.state, self.place_due = STOPPED, None


# -- fleet-wide decisions ---------------------------------------------------------------------------

class RollingRestart:
    """One replica at a time on its own cards (a fixed pool: no surge). A replica's turn comes
    if it is ready and idle then; after one fails to come back ready, none is taken down."""

    def __init__(self, order: Sequence[str]) -> None:
        self.pending = list(order)
        self.results: list[str] = []
        self.halted = False

    def next(self, replicas: Mapping[str, ReplicaLifecycle], busy: Collection[str]) -> str | None:
        while self.pending and not self.halted:
            name = self.pending.pop(0)
            if replicas[name].state == READY and name not in busy:
                return name
        return None

    def finished(self, name: str, state: str) -> None:
        self.results.append(f"{name}: {state}")
        if state != READY:
            self.halted = True


def replicas_to_drain(card: tuple[str, str], cards: Mapping[str, Sequence[tuple[str, str]]],
                      replicas: Mapping[str, ReplicaLifecycle]) -> list[str]:
    """A fenced card (host, BDF): every replica on it that still holds it (not stopped, not
    draining already)."""
    return [name for name, lc in replicas.items()
            if card in cards.get(name, ()) and lc.state not in (STOPPED, DRAINING)]


def ops_fence_changes(ops_unhealthy: Mapping[str, Mapping[str, str]],
                      unusable: Mapping[tuple[str, str], str]
                      ) -> tuple[dict[tuple[str, str], str], list[tuple[str, str]]]:
    """From each host's ops card states ({host: {BDF: why}}, the hosts that reported this time):
    cards to fence (with the reason to show) and cards ops returned there (`r9k ops clear`) to
    make usable again. Cards of hosts that did not report keep their state; cards the fleet file
    avoids stay avoided."""
    fence = {(host, bdf): FAULT_FROM_OPS + why
             for host, states in ops_unhealthy.items() for bdf, why in states.items()
             if unusable.get((host, bdf)) != FAULT_FROM_OPS + why}
    unfence = [key for key, why in unusable.items()
               if why.startswith(FAULT_FROM_OPS) and key[0] in ops_unhealthy
               and key[1] not in ops_unhealthy[key[0]]]
    return fence, unfence
