"""The replica supervisor: a Ray actor, in its replica's placement group, that owns one vLLM
OpenAI server process (and its engine/worker children) on the replica's host.

The plugin and RCCL settings come in through the actor's ``runtime_env.env_vars``, so the server,
the engine core and every worker inherit them. The controller decides; the actor only picks a
port, starts, reports and stops, through the shared launcher (:mod:`r9k.deploy.server`).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import ray

from r9k.deploy.server import STOP_GRACE_S, ServerProcess
from r9k.core.http_client import host_url


def _port_free(host: str, port: int) -> bool:
    """Bindable as the replica's server binds it (SO_REUSEADDR, as vLLM's launcher sets): a port
    left in TIME_WAIT by a stopped replica is free, one with a listener is not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # a node IP may be IPv6
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def fill_address(argv_template: list[str], host: str, port: int) -> list[str]:
    """The controller's argv has "{host}" and "{port}": only the node knows its free port."""
    return [a.replace("{host}", host).replace("{port}", str(port)) for a in argv_template]


RAYLET_WATCH_S = 0.5


def exit_with_raylet(before_exit=None) -> None:
    """End this Ray worker (after ``before_exit``) as soon as its raylet, its parent, is gone:
    Ray leaves a worker running for minutes after its raylet dies (measured)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(RAYLET_WATCH_S)
        if before_exit is not None:
            before_exit()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="raylet-watchdog").start()


def guarded(argv: list[str]) -> list[str]:
    """The engine under `r9k.deploy.child --guard`: its whole process group dies with this
    supervisor, whatever kills it."""
    return [sys.executable, "-m", "r9k.deploy.child", "--guard", str(os.getpid()), *argv]


class ReplicaProcess:
    """Plain class (testable without Ray); :data:`ReplicaSupervisor` is its Ray actor form.

    ``watch_parent``: the actor's parent is its node's raylet. Ray leaves a worker running when
    its raylet dies (minutes, measured), and the engine with it, keeping the cards' memory: the
    watchdog kills the engine and ends the supervisor as soon as the raylet is gone."""

    def __init__(self, replica: str, argv: list[str], log_dir: str, bind: str,
                 port_range: tuple[int, int], preferred_port: int | None = None,
                 spec: dict | None = None, watch_parent: bool = False) -> None:
        self.replica = replica
        self.spec = spec or {}       # what the controller placed: host, cards, launch key
        self.last_start: dict | None = None
        self.argv_template = argv
        self.log_dir = Path(log_dir)
        self.bind = bind
        self.port_range = port_range
        self.preferred_port = preferred_port
        self.server: ServerProcess | None = None
        self.starts = 0
        if watch_parent:
            exit_with_raylet(self.kill)

    def start(self) -> dict:
        self.kill()
        host = ray.util.get_node_ip_address() if self.bind == "node-ip" else self.bind
        model = self.spec.get("model_path")
        if model and not (Path(model) / "config.json").is_file():  # the file is read on every host
            raise RuntimeError(f"model path {model} has no config.json on host "
                               f"{self.spec.get('host')}; expected the model directory there")
        lo, hi = self.port_range
        # other replicas' own ports are never a fallback: two replicas starting at once would
        # both find the port free and race for it
        avoid = set(self.spec.get("avoid_ports") or ())
        order = ([self.preferred_port] if self.preferred_port else []) + \
            [p for p in range(lo, hi + 1) if p not in avoid]
        port = next((p for p in order if _port_free(host, p)), None)
        if port is None:
            raise RuntimeError(f"no free port in {lo}-{hi} on {host}")
        self.starts += 1
        log_path = self.log_dir / f"{self.replica}.{self.starts}.log"
        # env None: the actor's own environment, which carries runtime_env.env_vars
        self.server = ServerProcess.start(guarded(fill_address(self.argv_template, host, port)), log_path)
        self.last_start = {"url": host_url(host, port), "pid": self.server.pid,
                           "log": str(log_path), "start": self.starts}
        return self.last_start

    def describe(self) -> dict:
        """For a controller that re-adopts this replica: what was placed and what runs."""
        return {"replica": self.replica, "spec": self.spec, "engine": self.last_start,
                **self.status()}

    def status(self) -> dict:
        if self.server is None:
            return {"alive": False, "returncode": None, "pid": None, "engine_pids": []}
        return {"alive": self.server.alive, "returncode": self.server.returncode,
                "pid": self.server.pid, "engine_pids": self.server.children()}

    def log_tail(self, chars: int = 3000) -> str:
        return self.server.log_tail(chars) if self.server else ""

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        return self.server.stop(grace_s) if self.server else None

    def kill(self) -> int | None:
        return self.server.kill() if self.server else None


# Threaded, so status() answers while stop() waits.
ReplicaSupervisor = ray.remote(max_concurrency=4)(ReplicaProcess)
