"""Routing policies as pure functions (r9k.deploy.routing), and the entry point routing by the
engines' reported pool over real HTTP (fake OpenAI replicas, no engine)."""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from aiohttp import web

from r9k.deploy.config import FleetConfigError, parse_fleet
from r9k.deploy.entry import EntryPoint, Route
from r9k.deploy.routing import (
    AFFINITY_LOAD_FACTOR, MIN_FREE_POOL, STALE_S, EngineLoad, choose, pool_score, prefix_key,
    rendezvous, requests_ahead)
from r9k.core.http_client import http_request

from doubles.entry_fleet import LoopServers, Table

NOW = 1000.0


def route(name, outstanding=0, running=None, waiting=0, kv=None, age_s=1.0) -> Route:
    r = Route(name, "m", f"http://{name}")
    r.outstanding = outstanding
    if running is not None:
        r.engine = EngineLoad(running, waiting, kv, NOW - age_s)
    return r


def test_pool_aware_sends_work_to_the_replica_with_free_pool():
    """Stock: 3 running, pool 90% full; one-page: 5 running, 40% full (it holds more requests
    in the same bytes). Least-outstanding picks stock; pool-aware picks one-page."""
    stock = route("stock", outstanding=3, running=3, kv=0.9)
    onepage = route("onepage", outstanding=5, running=5, kv=0.4)
    assert pool_score(stock, NOW) == pytest.approx(4 / 0.1)
    assert pool_score(onepage, NOW) == pytest.approx(6 / 0.6)
    assert choose([stock, onepage], "pool-aware", NOW).name == "onepage"
    assert choose([stock, onepage], "least-outstanding", NOW).name == "stock"


def test_waiting_requests_and_the_routers_own_count_are_ahead():
    queued = route("a", outstanding=2, running=2, waiting=4, kv=0.3)
    assert requests_ahead(queued, NOW) == 6
    # sent since the last probe: the router's count is higher than the engine's
    fresh_burst = route("b", outstanding=9, running=1, kv=0.3)
    assert requests_ahead(fresh_burst, NOW) == 9
    assert choose([queued, fresh_burst], "pool-aware", NOW).name == "a"


def test_stale_or_missing_engine_state_counts_as_unknown():
    stale = route("a", outstanding=1, running=50, waiting=50, kv=0.99, age_s=STALE_S + 1)
    none = route("b", outstanding=2)
    assert pool_score(stale, NOW) == 2.0 and pool_score(none, NOW) == 3.0
    assert choose([stale, none], "pool-aware", NOW).name == "a"


def test_a_full_pool_still_ranks_but_last():
    full = route("full", running=0, kv=1.0)
    assert pool_score(full, NOW) == pytest.approx(1 / MIN_FREE_POOL)
    busy = route("busy", outstanding=20, running=20, kv=0.5)
    assert choose([full, busy], "pool-aware", NOW).name == "busy"
    assert choose([full], "pool-aware", NOW).name == "full"


def test_ties_alternate_and_bad_policy_is_refused():
    a, b = route("a"), route("b")
    assert [choose([a, b], "pool-aware", NOW).name for _ in range(4)] == ["a", "b", "a", "b"]
    assert choose([], "pool-aware", NOW) is None
    with pytest.raises(ValueError, match="fastest.*pool-aware"):
        choose([a], "fastest", NOW)


def test_round_robin_takes_turns_blind_to_load():
    """The baseline: every replica in turn, whatever its pool or queue."""
    full = route("full", outstanding=30, running=8, waiting=22, kv=0.99)
    idle = route("idle", outstanding=0, running=0, kv=0.0)
    assert choose([full, idle], "pool-aware", NOW).name == "idle"
    picks = [choose([full, idle], "round-robin", NOW).name for _ in range(6)]
    assert Counter(picks) == {"full": 3, "idle": 3}
    assert picks[0::2] == [picks[0]] * 3 and picks[1::2] == [picks[1]] * 3


def test_prefix_affinity_sticks_spreads_and_yields_under_load():
    names = ["r0", "r1", "r2"]
    reps = [route(n, running=1, kv=0.2) for n in names]
    keys = [f"system prompt {i} " * 20 for i in range(300)]
    owner = {k: choose(reps, "prefix-affinity", NOW, k).name for k in keys}
    assert all(owner[k] == rendezvous(k, names) for k in keys)
    share = Counter(owner.values())
    assert set(share) == set(names) and min(share.values()) > 60, share  # 100 each if even
    k = keys[0]
    assert {choose(reps, "prefix-affinity", NOW, k).name for _ in range(5)} == {owner[k]}
    # a replica leaving moves only its own keys
    left = [r for r in reps if r.name != "r2"]
    assert all(choose(left, "prefix-affinity", NOW, key).name == owner[key]
               for key in keys if owner[key] != "r2")
    # the preferred replica far busier than the best: pool-aware takes over
    pref = next(r for r in reps if r.name == owner[k])
    pref.engine = EngineLoad(40, 10, 0.95, NOW)
    assert pool_score(pref, NOW) > AFFINITY_LOAD_FACTOR * min(pool_score(r, NOW) for r in reps)
    assert choose(reps, "prefix-affinity", NOW, k).name != owner[k]
    # no key (short prompt): pool-aware
    assert choose(reps, "prefix-affinity", NOW, None).name != owner[k]


@pytest.mark.parametrize("body, want", [
    ({"prompt": "abcdef"}, "abcd"),
    ({"prompt": ["abcdef", "zzzz"]}, "abcd"),
    ({"prompt": "abc"}, None),
    ({"prompt": [1, 2, 3]}, None),
    ({"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "cd"}]},
     "<sys"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}, "<use"),
    ({}, None),
])
def test_prefix_key(body, want):
    assert prefix_key(body, 4) == want


def test_fleet_config_names_the_routing_policies():
    """The fleet file's `entry.routing`: a bad value is refused in one line naming the choices."""
    def fleet(entry):
        return json.dumps({"entry": entry, "hosts": [{"name": "a", "cards": ["0000:03:00.0"]}],
                           "models": [{"name": "m", "path": "/nonexistent", "tp": 1,
                                       "kv_cache_memory_bytes": 1 << 30}]})

    with pytest.raises(FleetConfigError) as exc:
        parse_fleet(fleet({"routing": "fastest"}), "fleet.yaml")
    assert "entry.routing" in str(exc.value) and "pool-aware" in str(exc.value)
    assert "\n" not in str(exc.value)
    cfg = parse_fleet(fleet({"routing": "prefix-affinity", "prefix_chars": 512}))
    assert (cfg.entry.routing, cfg.entry.prefix_chars) == ("prefix-affinity", 512)
    assert parse_fleet(fleet({})).entry.routing == "pool-aware"


def test_entry_point_routes_by_the_reported_pool_over_http():
    servers = LoopServers()

    def app(name):
        a = web.Application()

        async def completions(request):
            return web.json_response({"replica": name})
        a.router.add_post("/v1/completions", completions)
        return a

    try:
        routes = [Route(name, "m", servers.app(app(name))) for name in ("stock", "onepage")]
        url = servers.entry(EntryPoint(Table(routes), routing="pool-aware"))
        now = time.monotonic()
        routes[0].engine = EngineLoad(6, 2, 0.97, now)   # stock: pool nearly full, queueing
        routes[1].engine = EngineLoad(8, 0, 0.45, now)   # one-page: more running, room left
        got = [http_request(f"{url}/v1/completions", method="POST",
                            json_body={"model": "m", "prompt": "x"}, timeout_s=10).json()["replica"]
               for _ in range(5)]
        assert got == ["onepage"] * 5
        with pytest.raises(ValueError, match="not one of"):
            EntryPoint(Table(routes), routing="random")
    finally:
        servers.close()
