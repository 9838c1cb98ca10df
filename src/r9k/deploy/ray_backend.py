"""The fleet's Ray side: connect or start Ray, find the hosts, and for each replica a placement
group on its assigned cards with a supervisor actor in it.

Both are named after the replica and detached: they outlive the controller, so a controller that
was killed and started again finds them (`RayReplica.find`) and adopts the running engines
instead of restarting them. That needs a Ray cluster that outlives the controller too (`ray
start --head` and `ray.address: auto`); a one-host Ray the controller starts itself
(`ray.address: local`) goes down with it.

Actor calls and ``pg.ready()`` return ObjectRefs, which are awaited (never ``ray.get``, which
would block the controller's event loop). ``ray.nodes``, ``ray.kill`` and
``remove_placement_group`` are short synchronous calls to the GCS.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

from r9k.deploy.config import HOST_LABEL, CardSpec, FleetConfig, HostSpec
from r9k.deploy.placement import Assignment, PlacementError, placement_group_args

AGENT_TIMEOUT_S = 5.0      # a host agent that does not answer this fast reports nothing this tick
RELEASE_SLACK_S = 5.0      # beyond the engine's stop grace, for a supervisor on a vanishing node


def connect(cfg: FleetConfig) -> bool:
    """Join the cluster of the fleet file, or start a one-host Ray; True if this process started it."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.ray.address != "local":
        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=False,
                 configure_logging=False)
        return False
    if len(cfg.hosts) > 1:
        raise PlacementError("ray.address local starts one host; the file lists "
                             f"{len(cfg.hosts)} hosts: join a cluster (ray.address: auto)")
    host = cfg.hosts[0].name if cfg.hosts else os.uname().nodename
    ncards = len(cfg.hosts[0].cards) if cfg.hosts else len(local_cards())
    ray.init(num_cpus=cfg.ray.num_cpus, resources={cfg.placement.card_resource: ncards},
             labels={HOST_LABEL: host}, include_dashboard=False, namespace=cfg.ray.namespace,
             log_to_driver=False, configure_logging=False)
    return True


def live_hosts(cfg: FleetConfig) -> dict[str, str]:
    """{host label: node id} of the live Ray nodes that offer the card resource (one GCS call)."""
    import ray

    resource = cfg.placement.card_resource
    return {n["Labels"][HOST_LABEL]: n["NodeID"] for n in ray.nodes()
            if n["Alive"] and n["Resources"].get(resource, 0) > 0
            and (n.get("Labels") or {}).get(HOST_LABEL)}


async def inventory(cfg: FleetConfig, nodes: dict[str, str] | None = None,
                    known: dict[str, HostSpec] | None = None) -> list[HostSpec]:
    """The fleet file's hosts that are Ray nodes now (by label), else discovered on the nodes
    (`known`: node id -> host already discovered, asked again only for new nodes)."""
    nodes = live_hosts(cfg) if nodes is None else nodes
    if cfg.hosts:
        return [h for h in cfg.hosts if h.name in nodes]
    known = {} if known is None else known
    new = {name: nid for name, nid in nodes.items() if nid not in known}
    found = await asyncio.gather(*(discover_host(name, nid) for name, nid in sorted(new.items())))
    for (name, nid), host in zip(sorted(new.items()), found):
        known[nid] = host
    return [known[nid] for name, nid in sorted(nodes.items())]


def local_cards() -> list[str]:
    from r9k.ops.sysfs import discover_cards

    return [c.bdf for c in discover_cards("/") if getattr(c, "is_r9700", False)]


async def discover_host(name: str, node_id: str) -> HostSpec:
    """Ask the node itself which R9700s it has (sysfs, through ops)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cards = await ray.remote(num_cpus=0)(local_cards).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    return HostSpec(name=name, cards=[CardSpec(bdf=b) for b in cards])


class HostAgent:
    """One per live node, on that node: reads its host's ops state (the cards ops fenced there),
    so a fence written on any host reaches the controller without a hook."""

    def __init__(self) -> None:
        from r9k.deploy.supervisor import exit_with_raylet

        exit_with_raylet()   # an agent outliving its raylet would be an orphan on that host

    def card_states(self, state_dir: str) -> dict[str, str]:
        from r9k.ops.state import read_card_states

        return read_card_states(state_dir).unhealthy()  # a corrupt card file counts as fenced

    def pid(self) -> int:
        return os.getpid()


def actor_name(replica: str) -> str:
    return f"r9k-{replica}"


def fleet_actor_replicas(cfg: FleetConfig) -> list[str]:
    """Replica names of the supervisors alive in the fleet's namespace."""
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"].removeprefix("r9k-") for a in names
                  if a.get("namespace") == cfg.ray.namespace and a["name"].startswith("r9k-"))


class RayReplica:
    """One replica's placement group and supervisor actor."""

    def __init__(self, pg: Any, actor: Any) -> None:
        self.pg = pg
        self.actor = actor

    @classmethod
    def find(cls, replica: str, cfg: FleetConfig) -> "RayReplica | None":
        """The replica's supervisor (and placement group) if a controller left them running."""
        import ray
        from ray.util import get_placement_group

        try:
            actor = ray.get_actor(actor_name(replica), namespace=cfg.ray.namespace)
        except ValueError:
            return None
        try:
            pg = get_placement_group(f"r9k-{replica}")
        except ValueError:
            pg = None
        return cls(pg, actor)

    async def describe(self, timeout_s: float) -> dict:
        return await asyncio.wait_for(self.actor.describe.remote(), timeout=timeout_s)

    @classmethod
    async def place(cls, replica: str, assignment: Assignment, cfg: FleetConfig, argv: list[str],
                    env: dict[str, str], log_dir: str, port: int,
                    spec: dict | None = None) -> "RayReplica":
        """A placement group on the assigned cards (ready within `placement.timeout_s`) and the
        supervisor in its first bundle, both detached and named after the replica; the engine
        is not started yet. A supervisor of the same name left behind is released first."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from r9k.deploy.supervisor import ReplicaSupervisor

        stale = cls.find(replica, cfg)
        if stale is not None:
            await stale.release(0.0)
        else:  # a controller that died between the group and the actor
            from ray.util import get_placement_group
            try:
                ray.util.remove_placement_group(get_placement_group(f"r9k-{replica}"))
            except ValueError:
                pass
        pg = placement_group(**placement_group_args(assignment, cfg), lifetime="detached")
        timeout_s = cfg.placement.timeout_s
        try:
            await asyncio.wait_for(pg.ready(), timeout=timeout_s)
        except asyncio.TimeoutError:
            ray.util.remove_placement_group(pg)
            raise PlacementError(f"placement group for {assignment.host} {','.join(assignment.cards)} "
                                 f"not ready after {timeout_s:g} s") from None
        except BaseException:  # cancelled (its host died meanwhile): never leave it pending
            ray.util.remove_placement_group(pg)
            raise
        actor = ReplicaSupervisor.options(
            name=actor_name(replica), namespace=cfg.ray.namespace, lifetime="detached",
            num_cpus=0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            runtime_env={"env_vars": env},
        ).remote(replica, argv, log_dir, cfg.replica_bind, cfg.port_range, port, spec, True)
        return cls(pg, actor)

    async def start_engine(self) -> dict:
        """{"url", "pid", "log", "start"} of the api_server the supervisor started."""
        return await self.actor.start.remote()

    async def release_lost(self) -> None:
        """Its node is gone: end the actor and remove the group (Ray would place the group again
        on that host's next raylet, holding its cards), without asking the dead supervisor."""
        import ray

        try:
            ray.kill(self.actor)
        except Exception:  # already gone
            pass
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:
                pass

    async def status(self, timeout_s: float) -> dict:
        return await asyncio.wait_for(self.actor.status.remote(), timeout=timeout_s)

    async def kill_engine(self, timeout_s: float = 40.0) -> bool:
        """SIGKILL the engine; False if the supervisor (or its node) is gone or silent."""
        try:
            await asyncio.wait_for(self.actor.kill.remote(), timeout_s)
        except Exception:  # RayActorError and friends: the actor cannot answer any more
            return False
        return True

    async def stop_engine(self, grace_s: float) -> None:
        await self.actor.stop.remote(grace_s)

    async def log_tail(self, chars: int = 3000) -> str:
        return await self.actor.log_tail.remote(chars)

    async def release(self, grace_s: float) -> None:
        """Stop the engine (SIGKILL after ``grace_s``), end the actor, free the cards' bundles."""
        try:
            await asyncio.wait_for(self.actor.stop.remote(grace_s), grace_s + RELEASE_SLACK_S)
        except Exception:  # the actor (or its node) is gone already, or does not answer
            pass
        await self.release_lost()


class RaySide:
    """What the controller asks of Ray, in one place: tests give the controller a fake with
    these methods instead of patching this module."""

    def connect(self, cfg: FleetConfig) -> bool:
        return connect(cfg)

    def __init__(self) -> None:
        self.discovered: dict[str, HostSpec] = {}    # node id -> its cards (discovered inventory)
        self.agents: dict[str, Any] = {}             # node id -> HostAgent actor

    def live_hosts(self, cfg: FleetConfig) -> dict[str, str]:
        return live_hosts(cfg)

    async def inventory(self, cfg: FleetConfig, nodes: dict[str, str] | None = None) -> list[HostSpec]:
        return await inventory(cfg, nodes, self.discovered)

    async def host_fences(self, cfg: FleetConfig, nodes: dict[str, str]) -> dict[str, dict[str, str]]:
        """{host: {BDF: why}} of the cards ops fenced on each live host, read there by its agent;
        a host whose agent does not answer in time is left out (its fences stay as they were)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for nid in [n for n in self.agents if n not in nodes.values()]:
            del self.agents[nid]   # its node is gone, and the agent with it
        for nid in nodes.values():
            if nid not in self.agents:
                self.agents[nid] = ray.remote(num_cpus=0, max_restarts=0)(HostAgent).options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote()

        async def ask(host: str, nid: str):
            try:
                return host, await asyncio.wait_for(
                    self.agents[nid].card_states.remote(cfg.host_state_dir(host)), AGENT_TIMEOUT_S)
            except asyncio.TimeoutError:  # starting, or busy: asked again next tick
                return host, None
            except Exception:  # a dead agent: a new one next tick
                self.agents.pop(nid, None)
                return host, None

        answers = await asyncio.gather(*(ask(h, n) for h, n in nodes.items()))
        return {h: states for h, states in answers if states is not None}

    def fleet_replicas(self, cfg: FleetConfig) -> list[str]:
        return fleet_actor_replicas(cfg)

    def find(self, replica: str, cfg: FleetConfig) -> "RayReplica | None":
        return RayReplica.find(replica, cfg)

    async def place(self, replica: str, assignment: Assignment, cfg: FleetConfig, argv: list[str],
                    env: dict[str, str], log_dir: str, port: int,
                    spec: dict | None = None) -> "RayReplica":
        return await RayReplica.place(replica, assignment, cfg, argv, env, log_dir, port, spec)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
