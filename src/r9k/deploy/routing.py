"""Which ready replica takes a request: pure scoring over what the router knows.

The router knows its own outstanding count per replica (instant) and, from the controller's
probe of each replica's /metrics every `health.probe_interval_s`, the engine's own state:
running and waiting requests and the KV pool in use (`vllm:kv_cache_usage_perc`). A one-page
replica holds 1.3-1.8x the requests a stock one holds in the same bytes, so its pool fills
later: scoring by free pool sends it the work a stock replica would queue.

Policies (fleet config `entry.routing`):
- `least-outstanding`: the router's own count only (the stage-1 router).
- `pool-aware` (default): requests ahead of this one per unit of free pool,
  `(max(outstanding, running + waiting) + 1) / max(1 - kv_usage, MIN_FREE_POOL)`; engine state
  older than `STALE_S` counts as unknown (free pool 1, outstanding only).
- `prefix-affinity`: requests whose prompts start alike go to the same replica (rendezvous
  hashing of the prompt's first `entry.prefix_chars` characters, so its prefix cache hits),
  unless that replica's pool-aware score exceeds `AFFINITY_LOAD_FACTOR` x the best one's; then,
  and for prompts shorter than the prefix, pool-aware.
- `round-robin`: each replica in turn, blind to load (the baseline the others are measured
  against).
Ties go to the replica chosen longest ago (a restarted replica takes its turn at once).
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Any, Protocol

POLICIES = ("least-outstanding", "pool-aware", "prefix-affinity", "round-robin")
STALE_S = 10.0               # engine state older than this is unknown
MAX_SANE_REQUESTS = 1e9     # a count above this is a broken report, not a load
MIN_FREE_POOL = 0.02         # a full pool still ranks, far behind any with room
AFFINITY_LOAD_FACTOR = 2.0   # prefix affinity yields when its replica is this much worse off


@dataclass(frozen=True)
class EngineLoad:
    """One replica's engine state from its /metrics, and when (monotonic seconds) it was read."""

    running: float
    waiting: float
    kv_usage_ratio: float
    read_at_s: float


class Candidate(Protocol):
    name: str
    outstanding: int
    last_pick: int
    engine: EngineLoad | None


def fresh_engine(c: Candidate, now_s: float) -> EngineLoad | None:
    """The candidate's engine state if it is recent and sane; None (unknown) otherwise: a
    replica reporting NaN or a negative count must not win every request (NaN compares false
    with everything, so its score would never lose)."""
    e = c.engine
    if e is None or not 0 <= now_s - e.read_at_s <= STALE_S:
        return None
    values = (e.running, e.waiting, e.kv_usage_ratio)
    if not all(isinstance(v, (int, float)) and 0 <= v <= MAX_SANE_REQUESTS for v in values):
        return None  # NaN fails both comparisons
    return e


def requests_ahead(c: Candidate, now_s: float) -> float:
    """Requests this replica works on or queues: the engine's count, or the router's own when
    that is higher (requests sent since the last probe)."""
    e = fresh_engine(c, now_s)
    return float(max(c.outstanding, e.running + e.waiting if e else 0.0))


def free_pool(c: Candidate, now_s: float) -> float:
    e = fresh_engine(c, now_s)
    usage = min(max(e.kv_usage_ratio, 0.0), 1.0) if e else 0.0
    return max(1.0 - usage, MIN_FREE_POOL)


def pool_score(c: Candidate, now_s: float) -> float:
    """Lower is better: requests ahead (this one included) per unit of free pool."""
    return (requests_ahead(c, now_s) + 1.0) / free_pool(c, now_s)


def prefix_key(body: dict[str, Any], prefix_chars: int) -> str | None:
    """The first `prefix_chars` characters of an OpenAI request's prompt (completions: `prompt`;
    chat: the messages' roles and text in order); None when the prompt is shorter (it shares no
    whole prefix worth pinning) or has no text."""
    if prefix_chars <= 0:
        return None
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role', '')}>{content if isinstance(content, str) else ''}")
        text = "".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
        text = prompt if isinstance(prompt, str) else ""
    return text[:prefix_chars] if len(text) >= prefix_chars else None


def rendezvous(key: str, names: list[str]) -> str:
    """Highest-random-weight hashing: the same key picks the same name while it is present, and
    removing a name moves only the keys it had."""
    return max(names, key=lambda n: hashlib.sha256(f"{n}\0{key}".encode()).digest())


_picks = itertools.count(1)


def choose(candidates: list[Candidate], policy: str, now_s: float,
           key: str | None = None) -> Candidate | None:
    """The replica for one request (marks it picked), or None when there is none."""
    if policy not in POLICIES:
        raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
    if not candidates:
        return None
    if policy == "round-robin":
        best = min(candidates, key=lambda c: (c.last_pick, c.name))
    elif policy == "least-outstanding":
        best = min(candidates, key=lambda c: (c.outstanding, c.last_pick, c.name))
    else:
        best = min(candidates, key=lambda c: (pool_score(c, now_s), c.last_pick, c.name))
        if policy == "prefix-affinity" and key is not None:
            preferred = next(c for c in candidates
                             if c.name == rendezvous(key, [c.name for c in candidates]))
            if pool_score(preferred, now_s) <= AFFINITY_LOAD_FACTOR * pool_score(best, now_s):
                best = preferred
    best.last_pick = next(_picks)
    return best
