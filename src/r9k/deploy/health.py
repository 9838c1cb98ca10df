"""Layered replica health as pure state machines (time is an argument, so tests need no clock).

vLLM's /health only reports the engine's errored flag: a deadlocked engine, or one on a wedged
GPU, passes it. Layers, cheapest first: the process is alive; the HTTP server answers /health
within the heartbeat timeout; and **progress**: while requests are queued or running (vLLM's
gauges, or requests the entry point has in flight to the replica) the generated-token counter
must move within the progress timeout. Start-up and the first seconds after ready are graced.
"""
from __future__ import annotations

from dataclasses import dataclass

from r9k.core.fleet_status import EXITED, HUNG, NO_HEARTBEAT  # the kinds, typed for every reader
from r9k.core.vllm_metrics import VllmMetrics


@dataclass(frozen=True)
class Verdict:
    """Why a ready replica is unhealthy: its kind and the words for people."""
    kind: str
    text: str


@dataclass
class HealthLimits:
    heartbeat_timeout_s: float
    progress_timeout_s: float
    grace_after_ready_s: float


class ReadyHealth:
    """Verdict for a ready replica; ``observe`` returns None (healthy) or a :class:`Verdict`."""

    def __init__(self, limits: HealthLimits, ready_at: float) -> None:
        self.limits = limits
        self.ready_at = ready_at
        self.last_heartbeat = ready_at
        self.last_tokens: float | None = None
        self.progress_at = ready_at      # last time tokens moved or nothing was queued

    def observe(self, now: float, *, alive: bool, heartbeat_ok: bool,
                counters: VllmMetrics | None, in_flight: int) -> Verdict | None:
        if not alive:
            return Verdict(EXITED, "engine process exited")
        if heartbeat_ok:
            self.last_heartbeat = now
        elif now - self.last_heartbeat > self.limits.heartbeat_timeout_s:
            return Verdict(NO_HEARTBEAT, f"no heartbeat (/health) for {now - self.last_heartbeat:.0f} s")
        if counters is None or counters.generation_tokens is None:
            return None  # metrics unreadable this time: the heartbeat layer decides
        queued = in_flight + (counters.running or 0) + (counters.waiting or 0)
        if self.last_tokens is None or counters.generation_tokens != self.last_tokens or queued == 0:
            self.progress_at = now
        self.last_tokens = counters.generation_tokens
        if now - self.ready_at < self.limits.grace_after_ready_s:
            return None
        stalled = now - self.progress_at
        if stalled > self.limits.progress_timeout_s:
            return Verdict(HUNG, f"hung: {queued:.0f} request(s) queued or running and no new "
                                 f"token for {stalled:.0f} s (generation_tokens_total stuck at "
                                 f"{counters.generation_tokens:.0f})")
        return None


def restart_backoff_s(failures: int, base_s: float, max_s: float) -> float:
    """0 for the first restart, then base, 2 base, 4 base ... up to max."""
    if failures <= 1:
        return 0.0
    return min(max_s, base_s * 2 ** (failures - 2))
