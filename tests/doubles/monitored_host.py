"""Test doubles on real loopback HTTP: a vLLM replica's /metrics and /v1/models, a fleet status URL.

The metric text is produced by prometheus-client (what vLLM uses) with vLLM 0.32's metric names
and label names (`model_name`, `engine`; `vllm:cache_config_info` with the CacheConfig fields), so
the exporter parses exactly the format a real replica serves. Usage::

    with FakeReplica(model_name="tiny", num_gpu_blocks=100, running=3) as replica:
        ...  # replica.url; change replica.running etc. between scrapes
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

# vllm:cache_config_info labels as vLLM 0.32 writes them (CacheConfig.metrics_info()), abridged
# to the ones that matter plus a few neighbours; values are strings, 'None' before sizing.
_CACHE_INFO_BASE = {
    "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "False",
    "gpu_memory_utilization": "0.92", "is_attention_free": "False", "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none", "mamba_ssm_cache_dtype": "auto", "num_cpu_blocks": "None",
    "num_gpu_blocks": "None", "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "sha256",
    "sliding_window": "None", "kv_cache_size_tokens": "None", "kv_cache_memory_bytes": "None",
}


def vllm_metrics_text(*, model_name: str, running: int, waiting: int, kv_usage_ratio: float,
                      preemptions: int, num_gpu_blocks: int | None, block_size: int,
                      plugin_info: dict[str, Any] | None = None, engine: str = "0") -> str:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
          registry=registry).labels(model_name, engine).set(running)
    Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
          registry=registry).labels(model_name, engine).set(waiting)
    Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
          registry=registry).labels(model_name, engine).set(kv_usage_ratio)
    Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels,
            registry=registry).labels(model_name, engine).inc(preemptions)
    info = dict(_CACHE_INFO_BASE, block_size=str(block_size),
                num_gpu_blocks=str(num_gpu_blocks) if num_gpu_blocks is not None else "None", engine=engine)
    Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
          registry=registry).labels(**info).set(1)
    if plugin_info is not None:
        Gauge("r9k_plugin_info", "r9k plugin page layout", list(plugin_info),
              registry=registry).labels(**{k: str(v) for k, v in plugin_info.items()}).set(1)
    return generate_latest(registry).decode()


class _Server:
    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                owner.requests.append(self.path)
                found = owner.respond(self.path)
                if found is None:
                    self.send_error(404)
                    return
                body, content_type = found
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.requests: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def respond(self, path: str) -> tuple[bytes, str] | None:
        raise NotImplementedError

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeReplica(_Server):
    def __init__(self, *, model_name: str = "tiny", root: str = "/models/tiny", max_model_len: int = 4096,
                 running: int = 0, waiting: int = 0, kv_usage_ratio: float = 0.0, preemptions: int = 0,
                 num_gpu_blocks: int | None = 100, block_size: int = 128,
                 plugin_info: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.model_name, self.root, self.max_model_len = model_name, root, max_model_len
        self.running, self.waiting, self.kv_usage_ratio = running, waiting, kv_usage_ratio
        self.preemptions, self.num_gpu_blocks, self.block_size = preemptions, num_gpu_blocks, block_size
        self.plugin_info = plugin_info

    def respond(self, path: str) -> tuple[bytes, str] | None:
        if path == "/metrics":
            text = vllm_metrics_text(model_name=self.model_name, running=self.running, waiting=self.waiting,
                                     kv_usage_ratio=self.kv_usage_ratio, preemptions=self.preemptions,
                                     num_gpu_blocks=self.num_gpu_blocks, block_size=self.block_size,
                                     plugin_info=self.plugin_info)
            return text.encode(), "text/plain; version=0.0.4; charset=utf-8"
        if path == "/v1/models":  # vLLM's ModelCard fields
            card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "vllm",
                    "root": self.root, "parent": None, "max_model_len": self.max_model_len,
                    "permission": []}
            return json.dumps({"object": "list", "data": [card]}).encode(), "application/json"
        if path == "/health":
            return b"", "text/plain"
        return None


class FakeFleet(_Server):
    """Serves ``document`` (the fleet status JSON) at ``/status``; ``document = None`` -> 404."""

    def __init__(self, document: dict[str, Any] | None) -> None:
        super().__init__()
        self.document = document

    def respond(self, path: str) -> tuple[bytes, str] | None:
        if path == "/status" and self.document is not None:
            return json.dumps(self.document).encode(), "application/json"
        return None


class HungReplicas:
    """``count`` HTTP servers on loopback that accept a request and never answer (a deadlocked
    engine's API server); ``urls`` while inside the ``with``; leaving releases the handlers."""

    def __init__(self, count: int) -> None:
        release = self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                release.wait(60)

            def log_message(self, *args: Any) -> None:
                pass

        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(count)]
        for server in self.servers:
            server.daemon_threads = True

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers]

    def __enter__(self):
        for server in self.servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        stoppers = [threading.Thread(target=s.shutdown) for s in self.servers]  # each polls 0.5 s
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        for server in self.servers:
            server.server_close()


# -- a whole host for exporter tests: fixture sysfs tree, ops config, ops state written by the watcher

CARD_A, CARD_B = "0000:03:00.0", "0000:04:00.0"
OPS_CONFIG = "defaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n"


def build_monitored_host(base) -> tuple[Any, Any, Any]:
    """(host_root, state_dir, config_path): card A at the wanted 210 W / -42 mV, card B left at 225 W
    and hot; the ops watcher has recorded a reset of B (fenced, then reset_succeeded). Both cards
    have a MES event log in debugfs (amdgpu.mes_log_enable=1; read with --debugfs /sys/kernel/debug)."""
    from pathlib import Path

    from doubles.ops_host import CardSpec, add_debugfs_card, build_host_tree, mes_ring, render_mes_event_log

    base = Path(base)
    root = build_host_tree(base / "host", [
        CardSpec(CARD_A, cap_watts=210, voltage_offset_mv=-42, power_draw_watts=180.0,
                 vram_used_bytes=8 * 1024**3, temps_millic=(61000, 97500, 70000)),
        CardSpec(CARD_B, cap_watts=225, voltage_offset_mv=-42, power_draw_watts=224.0,
                 power_files=("input",), temps_millic=(80000, 104000, 90000)),
    ])
    for minor, bdf in enumerate((CARD_A, CARD_B)):
        add_debugfs_card(root, bdf, minor, render_mes_event_log(mes_ring(3 + minor)))
    config = base / "ops.yaml"
    config.write_text(OPS_CONFIG)
    state = base / "state"
    record_kernel_log(root, state, base / "kern-1.log", [
        f"[  100.000001] amdgpu {CARD_B}: amdgpu: GPU reset begin!. Source:  3",
        f"[  101.000001] amdgpu {CARD_B}: amdgpu: GPU reset(1) succeeded!",
    ])
    return root, state, config


def record_kernel_log(host_root, state_dir, log_path, lines: list[str]) -> None:
    """Feed dmesg lines through the real ops watcher into the state dir (counts, health)."""
    from pathlib import Path

    from r9k.ops.watch import Watcher, open_source

    Path(log_path).write_text("".join(line + "\n" for line in lines))
    source = open_source(str(log_path), host_root, state_dir, follow=False)
    try:
        Watcher(source, state_dir, host_root).poll(final=True)
    finally:
        source.close()


class TokenCountingReplica(FakeReplica):
    """FakeReplica plus vLLM's generated-token counter (what ReplicaHung and the energy rules
    read); each /metrics read adds `tokens_per_read` (0: a replica that makes no progress)."""

    generation_tokens = 12

    def __init__(self, *args, tokens_per_read: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tokens_per_read = tokens_per_read

    def respond(self, path: str):
        found = super().respond(path)
        if path == "/metrics" and found is not None:
            self.generation_tokens += self.tokens_per_read
            body, content_type = found
            extra = ("# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
                     "# TYPE vllm:generation_tokens_total counter\n"
                     f'vllm:generation_tokens_total{{engine="0",model_name="{self.model_name}"}} '
                     f"{float(self.generation_tokens)}\n")
            return body + extra.encode(), content_type
        return found
