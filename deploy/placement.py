"""Placement as pure functions: fleet file + host inventory + card health -> cards and Ray bundles.

A replica is one vLLM engine over 1, 2 or 4 cards of one host. It gets its own placement group:
one bundle per card asking for the card resource (plus CPU, plus Ray's GPU on GPU hosts),
strategy STRICT_PACK, and a label selector pinning every bundle to the host the planner chose,
so a replica never spans hosts and never lands on a card ops has fenced or the file avoids.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from r9k.deploy.config import HOST_LABEL, CardSpec, FleetConfig, FleetConfigError, HostSpec

STRATEGY = "STRICT_PACK"


class PlacementError(FleetConfigError):
    """The fleet does not fit the cards that exist and are healthy; nothing was started."""


@dataclass(frozen=True)
class ReplicaSlot:
    name: str      # "<model>-<i>", stable across restarts
    model: str
    tp: int


@dataclass(frozen=True)
class Assignment:
    replica: str
    model: str
    host: str
    cards: tuple[str, ...]                  # PCI addresses, in rank order
    cpu_bind: str | None = None             # platform cpu: VLLM_CPU_OMP_THREADS_BIND


@dataclass
class CardPool:
    """Which cards are usable now: inventory minus fenced/avoided, minus those in use."""

    hosts: list[HostSpec]
    unusable: dict[str, str] = field(default_factory=dict)   # BDF -> why
    in_use: dict[str, str] = field(default_factory=dict)     # BDF -> replica

    def free(self, host: HostSpec) -> list[CardSpec]:
        return [c for c in host.cards if c.bdf not in self.unusable and c.bdf not in self.in_use]

    def usable_count(self, host: HostSpec) -> int:
        return sum(1 for c in host.cards if c.bdf not in self.unusable)


def replica_slots(cfg: FleetConfig) -> list[ReplicaSlot]:
    return [ReplicaSlot(f"{m.name}-{i}", m.name, m.tp) for m in cfg.models for i in range(m.replicas)]


def unusable_cards(cfg: FleetConfig, unhealthy: dict[str, str] | Iterable[str] = ()) -> dict[str, str]:
    """Cards not to place on: ops-fenced (with ops' reason) and the file's avoid list."""
    out = {b: "avoided by the fleet file" for b in cfg.placement.avoid_cards}
    items = unhealthy.items() if isinstance(unhealthy, dict) else ((b, "unhealthy in ops state") for b in unhealthy)
    for bdf, why in items:
        out[bdf] = f"ops: {why}"
    return out


def check_fits(cfg: FleetConfig, hosts: list[HostSpec], unusable: dict[str, str]) -> None:
    """Refuse, before anything starts, a fleet that cannot be placed on these hosts."""
    if not hosts:
        raise PlacementError(f"no host offers the card resource {cfg.placement.card_resource!r}; "
                             "expected `ray start --resources '{\"R9700\": N}'` on each GPU host")
    pool = CardPool(hosts, dict(unusable))
    biggest = max(pool.usable_count(h) for h in hosts)
    for m in cfg.models:
        if m.replicas and m.tp > biggest:
            raise PlacementError(
                f"models.{m.name}.tp {m.tp} does not fit a host: the largest host has {biggest} "
                f"usable card(s) and a replica never spans hosts")
    need = sum(m.tp * m.replicas for m in cfg.models)
    have = sum(pool.usable_count(h) for h in hosts)
    if need > have:
        total = sum(len(h.cards) for h in hosts)
        raise PlacementError(
            f"the fleet asks for {need} cards ({', '.join(f'{m.name}: {m.replicas}x TP{m.tp}' for m in cfg.models)}) "
            f"but {have} of the {total} cards on {len(hosts)} host(s) are usable")
    plan_placement(replica_slots(cfg), pool, cfg.platform)  # fragmentation can still refuse


def _pick_cards(free: list[CardSpec], tp: int) -> list[CardSpec] | None:
    """A contiguous run in BDF order first (TP pairs sit on the same PCIe switch), else any."""
    if len(free) < tp:
        return None
    ordered = sorted(free, key=lambda c: c.bdf)
    return ordered[:tp]


def place_one(slot: ReplicaSlot, pool: CardPool, platform: str = "gpu") -> Assignment:
    """Spread: the host with the most free usable cards that fits; ties go to file order."""
    best: tuple[int, int, HostSpec] | None = None
    for i, host in enumerate(pool.hosts):
        free = pool.free(host)
        if len(free) >= slot.tp and (best is None or len(free) > best[0]):
            best = (len(free), i, host)
    if best is None:
        raise PlacementError(
            f"replica {slot.name} (TP{slot.tp}) does not fit: no host has {slot.tp} free usable "
            f"card(s); unusable: {', '.join(sorted(pool.unusable)) or 'none'}")
    host = best[2]
    cards = _pick_cards(pool.free(host), slot.tp)
    assert cards is not None
    for c in cards:
        pool.in_use[c.bdf] = slot.name
    cpu_bind = ",".join(c.cpu_bind for c in cards if c.cpu_bind) if platform == "cpu" else None
    return Assignment(slot.name, slot.model, host.name, tuple(c.bdf for c in cards), cpu_bind or None)


def plan_placement(slots: list[ReplicaSlot], pool: CardPool, platform: str = "gpu") -> dict[str, Assignment]:
    """Largest TP first, so TP4 replicas find whole hosts before TP1 replicas scatter."""
    out: dict[str, Assignment] = {}
    for slot in sorted(slots, key=lambda s: -s.tp):
        out[slot.name] = place_one(slot, pool, platform)
    return {s.name: out[s.name] for s in slots}


def replica_bundles(tp: int, card_resource: str, cpus_per_card: float, gpu: bool) -> list[dict[str, float]]:
    bundle: dict[str, float] = {card_resource: 1}
    if cpus_per_card:
        bundle["CPU"] = cpus_per_card
    if gpu:
        bundle["GPU"] = 1
    return [dict(bundle) for _ in range(tp)]


def placement_group_args(assignment: Assignment, cfg: FleetConfig) -> dict:
    """Keyword arguments for ``ray.util.placement_group``."""
    tp = len(assignment.cards)
    return {
        "bundles": replica_bundles(tp, cfg.placement.card_resource, cfg.placement.cpus_per_card,
                                   cfg.use_gpu_resource),
        "strategy": STRATEGY,
        "bundle_label_selector": [{HOST_LABEL: assignment.host} for _ in range(tp)],
        "name": f"r9k-{assignment.replica}",
    }


def hip_visible_devices(cards: tuple[str, ...], host_cards: list[str]) -> str:
    """HIP enumerates a host's GPUs in PCI order: a card's device index is its rank in BDF order."""
    order = sorted(host_cards)
    return ",".join(str(order.index(b)) for b in cards)
