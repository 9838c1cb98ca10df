"""A restarted controller adopts the replicas a previous one left running, instead of restarting
them: the supervisors in the fleet's Ray namespace whose engine still runs, on usable cards,
what this fleet file would launch there (`engine.launch_spec`'s digest). The others (gone from
the file, launched differently, engine dead, card fenced, supervisor silent) are released.
"""
from __future__ import annotations

import logging
from typing import Any

from r9k.deploy.config import FleetConfig, HostSpec
from r9k.deploy.engine import launch_spec
from r9k.deploy.placement import Assignment, CardPool, ReplicaSlot

log = logging.getLogger("r9k.fleet")
SUPERVISOR_TIMEOUT_S = 10.0


def _why_not(name: str, desc: dict, wanted: dict[str, ReplicaSlot], hosts: set[str],
             pool: CardPool) -> str | None:
    spec = desc.get("spec") or {}
    if name not in wanted:
        return "not in the fleet file any more"
    if not (desc.get("alive") and desc.get("engine")):
        return "its engine is not running"
    host = spec.get("host")
    if host not in hosts or any((host, b) in pool.unusable for b in spec.get("cards", [])):
        return f"its cards {spec.get('host')} {spec.get('cards')} are not usable now"
    return None


async def adoptable(cfg: FleetConfig, ray_side: Any, hosts: list[HostSpec], pool: CardPool,
                    slots: list[ReplicaSlot], api_key: str | None
                    ) -> dict[str, tuple[Assignment, Any, dict]]:
    """{replica: (assignment, its RayReplica, its supervisor's description)} of the replicas to
    adopt; every other supervisor of the fleet is released."""
    wanted = {s.name: s for s in slots}
    host_names = {h.name for h in hosts}
    out = {}
    for name in ray_side.fleet_replicas(cfg):
        rr = ray_side.find(name, cfg)
        if rr is None:
            continue
        why, desc = None, {}
        try:
            desc = await rr.describe(SUPERVISOR_TIMEOUT_S)
        except Exception as exc:
            why = f"its supervisor does not answer ({type(exc).__name__})"
        why = why or _why_not(name, desc, wanted, host_names, pool)
        if why is None:
            spec = desc["spec"]
            a = Assignment(name, wanted[name].model, spec["host"], tuple(spec["cards"]),
                           spec.get("cpu_bind"))
            model = cfg.model(a.model).for_replica(name)
            if spec.get("model") != a.model or spec.get("launch") != \
                    launch_spec(model, cfg, a, hosts, api_key)[2]["launch"]:
                why = "the fleet file launches it differently now"
        if why is not None:
            log.warning("%s: not adopting the running replica: %s; releasing it", name, why)
            await rr.release(cfg.health.drain_timeout_s)
            continue
        log.info("%s: adopting the running replica (engine pid %s)", name,
                 desc["engine"]["pid"])
        out[name] = (a, rr, desc)
    return out
