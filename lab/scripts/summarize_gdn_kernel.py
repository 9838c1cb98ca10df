"""Markdown from a gdn_kernel.py JSON: per configuration the time of stock and of each kernel
as a ratio to stock, and per variant the verdict the issue asks for: never slower than stock
over every N (the worst ratio per state dtype), and bit-identical to the shipped kernel.

    python -m lab.scripts.summarize_gdn_kernel lab/results/gdn_kernel_h200_flashnext_variants_k3.json \
        --out lab/results/gdn_kernel_h200_flashnext_variants_k3.md

A variant whose `bit_identical_to_fused` is false anywhere is marked and never offered as a
candidate; the timing probes (no_record, verify_only, replay_only) are shown but not candidates.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (fused_* : the names of runs before the variants table)
PROBES = ("no_record", "verify_only", "replay_only", "fused_no_record", "fused_verify_only",
          "fused_replay_only", "rows_only", "flag_only", "late_rows_only", "late_flag_only",
          "dep_no_prep", "no_record_no_prep", "dep_count_w0", "dep_count_none", "dep_rows_only",
          "dep_flag_only", "dep_w8_no_prep", "no_record_w8", "own_no_prep",
          "own_no_barrier")
NOT_KERNELS = ("stock", "stock_eager_host", "fused_eager_host", "composed_kernels",
               "composed_step_eager")


def kernels_of(results: list) -> list[str]:
    names: list[str] = []
    for r in results:
        for k in r["ratio_to_stock"]:
            if k not in NOT_KERNELS and k not in names:
                names.append(k)
    return names


def verdicts(results: list) -> list[dict]:
    """Per kernel and state dtype: worst and best ratio to stock over every shape and N, and
    whether every one-step bit check passed."""
    out = []
    for name in kernels_of(results):
        for dtype in sorted({r["state_dtype"] for r in results}):
            rows = [r for r in results if r["state_dtype"] == dtype and name in r["ratio_to_stock"]]
            if not rows:
                continue
            ratios = [r["ratio_to_stock"][name] for r in rows]
            worst = max(rows, key=lambda r: r["ratio_to_stock"][name])
            checks = [r.get("bit_identical_to_fused", {}).get(name) for r in rows]
            bits = (None if name == "fused" or name in PROBES or all(c is None for c in checks)
                    else all(c is True for c in checks))
            out.append({"kernel": name, "state_dtype": dtype, "worst_ratio": max(ratios),
                        "worst_at": f"{worst['shape']} N={worst['num_seqs']}",
                        "best_ratio": min(ratios), "configs": len(rows),
                        "bit_identical_to_fused": bits,
                        "never_slower": max(ratios) <= 1.0,
                        "candidate": name not in PROBES and bits is not False})
    return out


def markdown(doc: dict, source: str) -> str:
    results = doc["results"]
    names = kernels_of(results)
    lines = [f"From `{source}` ({doc.get('device', '?')}, torch {doc.get('torch', '?')}, "
             f"Triton {doc.get('triton', '?')}). Command:", "", f"    {doc.get('command', '?')}",
             "", doc.get("method", ""), "", "## Verdict per kernel and state dtype", "",
             "| kernel | state | worst ratio (where) | best ratio | never slower | bits vs shipped |",
             "|---|---|---|---|---|---|"]
    for v in verdicts(results):
        bits = {True: "equal", False: "**differ**", None: "-"}[v["bit_identical_to_fused"]]
        never = "yes" if v["never_slower"] else "no"
        if not v["candidate"]:
            never += " (probe)" if v["kernel"] in PROBES else " (not a candidate)"
        lines.append(f"| {v['kernel']} | {v['state_dtype']} | {v['worst_ratio']:.3f} "
                     f"({v['worst_at']}) | {v['best_ratio']:.3f} | {never} | {bits} |")
    lines += ["", "## Ratio to stock per configuration (stock in microseconds)", "",
              "| shape | state | N | stock us | " + " | ".join(names) + " |",
              "|---|---|---|---|" + "---|" * len(names)]
    for r in results:
        cells = []
        for n in names:
            ratio = r["ratio_to_stock"].get(n)
            bad = r.get("bit_identical_to_fused", {}).get(n) is False
            cells.append("-" if ratio is None else f"{ratio:.3f}" + (" (bits differ)" if bad else ""))
        lines.append(f"| {r['shape']} | {r['state_dtype']} | {r['num_seqs']} | "
                     f"{r['time_us']['stock']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a lab/scripts/gdn_kernel.py result")
    ap.add_argument("--out", default="", help="write the Markdown here (default: print it)")
    args = ap.parse_args(argv)
    path = Path(args.json)
    try:
        doc = json.loads(path.read_text())
        if not doc.get("results"):
            raise ValueError("no results")
    except (OSError, ValueError) as exc:
        print(f"{path}: expected a gdn_kernel.py result JSON ({exc})", file=sys.stderr)
        return 2
    text = markdown(doc, path.name)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
