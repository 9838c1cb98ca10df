"""The replica supervisor: a Ray actor, in its replica's placement group, that owns one vLLM
OpenAI server process (and its engine/worker children) on the replica's host.

The plugin and RCCL settings come in through the actor's ``runtime_env.env_vars``, so the server,
the engine core and every worker inherit them. The controller decides; the actor only starts,
reports, reads its log and stops.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import ray


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class ReplicaProcess:
    """Plain class (testable without Ray); :data:`ReplicaSupervisor` is its Ray actor form."""

    def __init__(self, replica: str, argv: list[str], log_dir: str, bind: str,
                 port_range: tuple[int, int], preferred_port: int | None = None) -> None:
        self.replica = replica
        self.argv_template = argv
        self.log_dir = Path(log_dir)
        self.bind = bind
        self.port_range = port_range
        self.preferred_port = preferred_port
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.starts = 0

    def node(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "pid": os.getpid()}

    def start(self) -> dict:
        self.kill()
        host = ray.util.get_node_ip_address() if self.bind == "node-ip" else self.bind
        lo, hi = self.port_range
        order = ([self.preferred_port] if self.preferred_port else []) + list(range(lo, hi + 1))
        port = next((p for p in order if _port_free(host, p)), None)
        if port is None:
            raise RuntimeError(f"no free port in {lo}-{hi} on {host}")
        argv = [a.replace("{host}", host).replace("{port}", str(port)) for a in self.argv_template]
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.replica}.{self.starts}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return {"url": f"http://{host}:{port}", "pid": self.proc.pid, "log": str(self.log_path),
                "start": self.starts}

    def status(self) -> dict:
        if self.proc is None:
            return {"alive": False, "returncode": None, "pid": None, "engine_pids": []}
        rc = self.proc.poll()
        return {"alive": rc is None, "returncode": rc, "pid": self.proc.pid,
                "engine_pids": self._children() if rc is None else []}

    def _children(self) -> list[int]:
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return []

    def read_log(self) -> str:
        from r9k.deploy.engine import read_log

        return read_log(self.log_path) if self.log_path else ""

    def log_tail(self, chars: int = 3000) -> str:
        return self.read_log()[-chars:]

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT the server's process group (vLLM shuts its engine down), SIGKILL after grace."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self._signal_group(signal.SIGCONT)  # a stopped (hung) process cannot handle SIGINT
        self._signal_group(signal.SIGINT)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int | None:
        if self.proc is None:
            return None
        self._signal_group(signal.SIGKILL)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


# Threaded, so status() answers while stop() waits.
ReplicaSupervisor = ray.remote(max_concurrency=4)(ReplicaProcess)
