"""Placement as pure functions: bundles per card, STRICT_PACK, one host per replica, avoided and
fenced cards, refusals before anything starts."""
from __future__ import annotations

import json

import pytest

from r9k.deploy.config import HOST_LABEL, parse_fleet
from r9k.deploy.engine import engine_env
from r9k.deploy.placement import (Assignment, CardPool, PlacementError, ReplicaSlot, check_fits,
                                  hip_visible_devices, place_one, placement_group_args,
                                  plan_placement, replica_bundles, replica_slots, unusable_cards)


def bdfs(host: int, n: int) -> list[str]:
    return [f"0000:{host:02x}:{i:02x}.0" for i in range(n)]


def fleet(models, hosts=None, **over):
    doc = {"hosts": hosts if hosts is not None else [
        {"name": "a", "cards": bdfs(0x10, 4)}, {"name": "b", "cards": bdfs(0x20, 4)}],
        "models": models}
    if len(doc["hosts"]) > 1:
        doc["replica_bind"] = "node-ip"   # loopback replicas of several hosts are refused
    doc.update(over)
    return parse_fleet(json.dumps(doc))


def model(name, tp, replicas):
    return {"name": name, "path": "/x", "tp": tp, "replicas": replicas, "kv_cache_memory_bytes": 1 << 30}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bundles_one_per_card_strict_pack_pinned_to_one_host(tp):
    cfg = fleet([model("m", tp, 8 // tp)])
    plan = plan_placement(replica_slots(cfg), CardPool(cfg.hosts))
    host_of = {c.bdf: h.name for h in cfg.hosts for c in h.cards}
    assert len(plan) == 8 // tp
    for a in plan.values():
        args = placement_group_args(a, cfg)
        assert args["strategy"] == "STRICT_PACK"
        assert args["bundles"] == [{"R9700": 1, "CPU": 1.0, "GPU": 1}] * tp
        assert args["bundle_label_selector"] == [{HOST_LABEL: a.host}] * tp
        assert len(a.cards) == tp and {host_of[b] for b in a.cards} == {a.host}  # never spans hosts
    used = [b for a in plan.values() for b in a.cards]
    assert sorted(used) == sorted(host_of)  # 8 cards, each once


def test_cpu_bundles_have_no_gpu_and_custom_resource_name():
    assert replica_bundles(2, "RX9070", 0.5, gpu=False) == [{"RX9070": 1, "CPU": 0.5}] * 2
    cfg = fleet([model("m", 1, 1)], hosts=[{"name": "a", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "1"}]}],
                platform="cpu", placement={"card_resource": "R9700", "cpus_per_card": 1})
    a = plan_placement(replica_slots(cfg), CardPool(cfg.hosts), "cpu")["m-0"]
    assert a.cpu_bind == "1" and placement_group_args(a, cfg)["bundles"] == [{"R9700": 1, "CPU": 1.0}]


def test_largest_tp_first_and_spread_keeps_tp4_on_a_whole_host():
    cfg = fleet([model("small", 1, 4), model("big", 4, 1)])
    plan = plan_placement(replica_slots(cfg), CardPool(cfg.hosts))
    big = plan["big-0"]
    assert len(big.cards) == 4
    assert {plan[f"small-{i}"].host for i in range(4)} == ({"a", "b"} - {big.host})
    # TP pairs take neighbouring cards in PCI order
    pairs = plan_placement(replica_slots(fleet([model("p", 2, 2)], hosts=[{"name": "a", "cards": bdfs(0x10, 4)}])),
                           CardPool(fleet([model("p", 2, 2)], hosts=[{"name": "a", "cards": bdfs(0x10, 4)}]).hosts))
    assert [a.cards for a in pairs.values()] == [tuple(bdfs(0x10, 4)[:2]), tuple(bdfs(0x10, 4)[2:])]


def test_avoided_and_fenced_cards_are_never_used():
    cfg = fleet([model("m", 1, 6)], placement={"avoid_cards": ["0000:10:00.0"]})
    unusable = unusable_cards(cfg, cfg.hosts, {("b", "0000:20:03.0"): "mes_timeout: MES failed"})
    assert unusable == {("a", "0000:10:00.0"): "avoided by the fleet file",
                        ("b", "0000:20:03.0"): "ops: mes_timeout: MES failed"}
    pool = CardPool(cfg.hosts, unusable)
    plan = plan_placement(replica_slots(cfg), pool)
    used = {(a.host, b) for a in plan.values() for b in a.cards}
    assert not used & set(unusable) and len(used) == 6
    with pytest.raises(PlacementError, match="does not fit: no host has 1 free usable card.s. on the live hosts .a, b."):
        place_one(ReplicaSlot("m-6", "m", 1), pool)


def test_more_cards_than_exist_is_refused():
    cfg = fleet([model("m", 2, 3), model("n", 1, 3)])
    with pytest.raises(PlacementError, match=r"asks for 9 cards \(m: 3x TP2, n: 3x TP1\) but 8 of the 8 cards"):
        check_fits(cfg, cfg.hosts, {})
    cfg = fleet([model("m", 1, 8)])
    with pytest.raises(PlacementError, match="but 7 of the 8 cards on 2 host"):
        check_fits(cfg, cfg.hosts, {("a", "0000:10:00.0"): "ops"})


def test_tp_that_does_not_fit_a_host_is_refused():
    cfg = fleet([model("m", 4, 1)], hosts=[{"name": "a", "cards": bdfs(0x10, 2)}, {"name": "b", "cards": bdfs(0x20, 2)}])
    with pytest.raises(PlacementError, match=r"models.m.tp 4 does not fit a host: the largest host has 2"):
        check_fits(cfg, cfg.hosts, {})
    # fragmentation: 2 + 2 free cards but no host with 3 free
    cfg = fleet([model("m", 2, 3)], hosts=[{"name": "a", "cards": bdfs(0x10, 3)}, {"name": "b", "cards": bdfs(0x20, 3)}])
    with pytest.raises(PlacementError, match="replica m-2 .TP2. does not fit"):
        check_fits(cfg, cfg.hosts, {})


def test_no_host_with_the_card_resource_is_refused():
    cfg = fleet([model("m", 1, 1)])
    with pytest.raises(PlacementError, match="no host offers the card resource 'R9700'"):
        check_fits(cfg, [], {})


def test_hip_devices_and_env_carry_plugin_and_rccl_settings():
    host = ["0000:44:00.0", "0000:03:00.0", "0000:23:00.0", "0000:04:00.0"]
    assert hip_visible_devices(("0000:23:00.0", "0000:44:00.0"), host) == "2,3"
    cfg = fleet([model("m", 2, 1) | {"env": {"R9K_EXTRA": "1"}}])
    env = engine_env(cfg.models[0], cfg, Assignment("m-0", "m", "a", ("0000:10:02.0", "0000:10:03.0")),
                     [c.bdf for c in cfg.hosts[0].cards])
    assert env["R9K_GDN_STATE"] == "onepage" and env["NCCL_PROTO"] == "Simple"
    assert env["HIP_VISIBLE_DEVICES"] == "2,3" and env["VLLM_PLUGINS"] == "r9k"
    # vLLM's Ray executor copies only VLLM_/NCCL_/HF_ prefixes: the rest must be listed
    assert set(env["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"].split(",")) == {"R9K_GDN_STATE", "R9K_EXTRA", "HIP_VISIBLE_DEVICES"}


def identical_hosts(n_hosts: int = 2, cards: int = 4) -> list[dict]:
    """Identical servers: the same PCI addresses on every host."""
    return [{"name": f"h{i}", "cards": bdfs(0x03, cards)} for i in range(n_hosts)]


def test_identical_servers_place_every_card_once_keyed_by_host_and_address():
    """Two identical 4-card servers: 4 x TP2 uses all 8 cards, 2 x TP2 spreads over both hosts."""
    cfg = fleet([model("m", 2, 4)], hosts=identical_hosts())
    check_fits(cfg, cfg.hosts, {})
    plan = plan_placement(replica_slots(cfg), CardPool(cfg.hosts))
    used = [(a.host, b) for a in plan.values() for b in a.cards]
    assert len(used) == len(set(used)) == 8
    cfg = fleet([model("m", 2, 2)], hosts=identical_hosts())
    plan = plan_placement(replica_slots(cfg), CardPool(cfg.hosts))
    assert sorted(a.host for a in plan.values()) == ["h0", "h1"]


def test_a_fence_on_one_host_leaves_the_same_address_on_the_other_usable():
    cfg = fleet([model("m", 1, 7)], hosts=identical_hosts())
    bad = ("h1", bdfs(0x03, 4)[0])
    pool = CardPool(cfg.hosts, unusable_cards(cfg, cfg.hosts, {bad: "mes_timeout"}))
    plan = plan_placement(replica_slots(cfg), pool)
    used = {(a.host, b) for a in plan.values() for b in a.cards}
    assert bad not in used and ("h0", bad[1]) in used and len(used) == 7


def test_avoid_cards_by_address_on_every_host_or_by_host_slash_address():
    cfg = fleet([model("m", 1, 1)], hosts=identical_hosts(),
                placement={"avoid_cards": ["0000:03:01.0", "h1/0000:03:02.0"]})
    assert set(unusable_cards(cfg, cfg.hosts)) == {("h0", "0000:03:01.0"), ("h1", "0000:03:01.0"),
                                                   ("h1", "0000:03:02.0")}


def test_loopback_replicas_with_several_hosts_are_refused():
    from r9k.deploy.config import FleetConfigError

    doc = {"hosts": identical_hosts(), "models": [model("m", 1, 1)], "replica_bind": "127.0.0.1"}
    with pytest.raises(FleetConfigError, match="replica_bind 127.0.0.1 with 2 hosts.*expected replica_bind: node-ip"):
        parse_fleet(json.dumps(doc))
    doc["placement"] = {"avoid_cards": ["h9/0000:03:00.0"]}
    doc["replica_bind"] = "node-ip"
    with pytest.raises(FleetConfigError, match="avoid_cards: 'h9/0000:03:00.0' names host 'h9'"):
        parse_fleet(json.dumps(doc))
