"""Local vLLM CPU replicas of the tiny model for the benchmark scripts and `r9k bench compare`."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

from r9k.devtools.local_server import LocalServer


def tiny_model(workdir: Path, seed: int = 0) -> Path:
    from r9k.devtools.tiny_model import make_tiny
    model = workdir / "tiny"
    if not (model / "model.safetensors").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        make_tiny(model, seed=seed)
    return model


@contextlib.contextmanager
def local_replica(model: Path, mode: str, workdir: Path, *, num_spec: int = 3,
                  kv_bytes: int = 64 << 20, max_model_len: int = 4096, max_num_seqs: int = 8,
                  cpu_bind: str | None = None, tag: str = "",
                  env: dict[str, str] | None = None, prefix_caching: bool = False,
                  extra_args: tuple[str, ...] = ()) -> Iterator[LocalServer]:
    """A started replica (stock or one-page pages; prefix caching off unless asked, vLLM's
    mamba_cache_mode "align" when on); stopped on exit, however the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = LocalServer(model, mode, num_spec, kv_bytes, max_model_len,
                    workdir / f"vllm-{mode}{tag}.log", max_num_seqs=max_num_seqs,
                    cpu_bind=cpu_bind, extra_env=env, prefix_caching=prefix_caching,
                    extra_args=extra_args)
    t0 = time.monotonic()
    try:
        server.wait_ready()
        server.ready_s = round(time.monotonic() - t0, 1)
        yield server
    finally:
        server.stop()


def run_recorded(cmd: list[str], out: Path, server: LocalServer, **replica: object) -> int:
    """Run an `r9k bench` command line against `server`, then add the replica (mode, cpus, its
    logged KV capacity) and the command, as a user would type it, to the JSON it wrote."""
    import json
    import shlex
    import subprocess

    print("$", shlex.join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if out.exists():
        data = json.loads(out.read_text())
        data["replica"] = {**replica, "max_num_seqs": server.max_num_seqs,
                           "kv_cache_tokens": server.kv_tokens(),
                           "ready_s": getattr(server, "ready_s", None)}
        data["command"] = shlex.join(["r9k", *cmd[1:]])
        out.write_text(json.dumps(data, indent=1) + "\n")
    return rc
