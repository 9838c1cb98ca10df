"""Placement as pure functions: fleet file + host inventory + card health -> cards and Ray bundles.

A replica is one vLLM engine over 1, 2 or 4 cards of one host. It gets its own placement group:
one bundle per card asking for the card resource (plus CPU, plus Ray's GPU on GPU hosts),
strategy STRICT_PACK, and a label selector pinning every bundle to the host the planner chose,
so a replica never spans hosts and never lands on a card ops has fenced or the file avoids.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

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


# A card is (host, PCI address): two hosts of the same model have the same addresses.
CardKey = tuple[str, str]


def card_label(key: CardKey) -> str:
    """A card as people read it: `host/0000:03:00.0`."""
    return f"{key[0]}/{key[1]}"


def parse_card_label(text: str) -> CardKey | tuple[None, str]:
    """`host/BDF` -> (host, BDF); a bare BDF -> (None, BDF) (every host, or the only one)."""
    host, sep, bdf = text.rpartition("/")
    return (host, bdf) if sep and host else (None, bdf)


@dataclass
class CardPool:
    """Which cards are usable now: inventory minus fenced/avoided, minus those in use."""

    hosts: list[HostSpec]
    unusable: dict[CardKey, str] = field(default_factory=dict)   # (host, BDF) -> why
    in_use: dict[CardKey, str] = field(default_factory=dict)     # (host, BDF) -> replica

    def free(self, host: HostSpec) -> list[CardSpec]:
        return [c for c in host.cards
                if (host.name, c.bdf) not in self.unusable and (host.name, c.bdf) not in self.in_use]

    def usable_count(self, host: HostSpec) -> int:
        return sum(1 for c in host.cards if (host.name, c.bdf) not in self.unusable)

    def release(self, replica: str) -> None:
        """The cards a replica held are free again."""
        for key in [k for k, owner in self.in_use.items() if owner == replica]:
            del self.in_use[key]


def replica_slots(cfg: FleetConfig) -> list[ReplicaSlot]:
    return [ReplicaSlot(f"{m.name}-{i}", m.name, m.tp) for m in cfg.models for i in range(m.replicas)]


def avoided_cards(cfg: FleetConfig, hosts: list[HostSpec]) -> dict[CardKey, str]:
    """The fleet file's avoid list on these hosts: `BDF` on every host, `host/BDF` on one."""
    out: dict[CardKey, str] = {}
    for entry in cfg.placement.avoid_cards:
        only, bdf = parse_card_label(entry)
        for h in hosts:
            if only in (None, h.name) and any(c.bdf == bdf for c in h.cards):
                out[(h.name, bdf)] = "avoided by the fleet file"
    return out


def unusable_cards(cfg: FleetConfig, hosts: list[HostSpec],
                   unhealthy: Mapping[CardKey, str] = {}) -> dict[CardKey, str]:
    """Cards not to place on: the file's avoid list and ops-fenced cards (with ops' reason)."""
    out = avoided_cards(cfg, hosts)
    for key, why in unhealthy.items():
        out[key] = f"ops: {why}"
    return out


def check_fits(cfg: FleetConfig, hosts: list[HostSpec], unusable: Mapping[CardKey, str]) -> None:
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
            f"card(s) on the live hosts ({', '.join(h.name for h in pool.hosts) or 'none'}); "
            f"unusable: {', '.join(card_label(k) for k in sorted(pool.unusable)) or 'none'}")
    host = best[2]
    cards = _pick_cards(pool.free(host), slot.tp)
    assert cards is not None
    for c in cards:
        pool.in_use[(host.name, c.bdf)] = slot.name
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
