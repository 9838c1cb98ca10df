"""The shipped fused kernel (`r9k.kernels.triton_fused`) against the research kernel it was cut
from (`lab.fused_variants`) at the shipped settings, compiled offline (no GPU) for the
H200 (PTX, sm_90) and the R9700 (AMDGCN, gfx1201): the same code, instruction for instruction.

Compared after removing what names the source rather than the code: debug line records,
sections and range labels, the kernel's name and the file and line in comments. Writes JSON (per configuration:
equal or the first differing lines) and exits 1 on any difference.

    python -m lab.scripts.kernel_compare --out lab/results/kernel_compare_shipped.json
"""
from __future__ import annotations

from lab import command_line

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

from triton.backends.compiler import GPUTarget

from lab.kernel_static import fused_compiled, shipped_compiled
from r9k.kernels.onepage import GdnHeads

TARGETS = {"ptx-sm90": (GPUTarget("cuda", 90, 32), "ptx"),
           "amdgcn-gfx1201": (GPUTarget("hip", "gfx1201", 32), "amdgcn")}
SHAPES = {"27b-tp2": GdnHeads(8, 24, 128, 128), "flash-next-tp4": GdnHeads(4, 8, 128, 128),
          "k64-v32": GdnHeads(2, 4, 64, 32)}
# debug records and the labels that only delimit debug ranges (`$L__tmp`, `.Ltmp`: an inlined
# helper's call site adds some); branch targets (`$L__BB`) stay
_DROP = re.compile(r"^\s*(\.loc|\.file|//|;|\.section\s+\.debug|\.debug_|\.Ldebug|\.Linfo|"
                   r"\.Lfunc_end|\.Ltmp|\$L__tmp\d+:)|^\s*\.(b8|b16|b32|b64)\s|"
                   r"^\s*\.(byte|short|long|quad)\s")


def normalized(asm: str, name: str) -> list[str]:
    """The assembly's code lines: debug records, comments and the debug sections' data out, the
    kernel's name replaced."""
    out, in_debug = [], False
    for line in asm.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") or stripped.startswith("@"):
            in_debug = ".debug" in stripped
        if in_debug or not stripped or _DROP.match(line):
            continue
        line = re.sub(r";.*$|//.*$", "", line).rstrip()
        out.append(line.replace(name, "KERNEL"))
    return out


def compare(heads, state: str, S: int, target_name: str, has_row_map: bool) -> dict:
    target, kind = TARGETS[target_name]
    shipped = shipped_compiled(heads, state, S, target, has_row_map)
    research = fused_compiled(heads, state, S, {}, target, has_row_map)
    a = normalized(shipped.asm[kind], shipped.metadata.name)
    b = normalized(research.asm[kind], research.metadata.name)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    equal = a == b
    row = {"lines": len(a), "equal": equal,
           "sha256": hashlib.sha256("\n".join(a).encode()).hexdigest()[:16]}
    if not equal:
        i = first if first is not None else min(len(a), len(b))
        row.update(first_difference=i, shipped=a[i:i + 3], research=b[i:i + 3],
                   lines_research=len(b))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--states", default="fp32,bf16")
    ap.add_argument("--S", default="4,8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    for target in args.targets.split(","):
        for shape in args.shapes.split(","):
            for state in args.states.split(","):
                for S in (int(x) for x in args.S.split(",")):
                    for row_map in (False, True):
                        r = compare(SHAPES[shape], state, S, target, row_map)
                        r.update(target=target, shape=shape, state=state, S=S, row_map=row_map)
                        rows.append(r)
                        print(f"{target:15s} {shape:15s} {state} S={S} row_map={row_map!s:5s} "
                              f"{'equal' if r['equal'] else 'DIFFERENT'} ({r['lines']} lines, "
                              f"{r['sha256']})", flush=True)
    doc = {"command": command_line("python"), "configurations": len(rows),
           "equal": sum(r["equal"] for r in rows), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{doc['equal']} of {doc['configurations']} configurations compile to the same code")
    return 0 if doc["equal"] == doc["configurations"] else 1


if __name__ == "__main__":
    sys.exit(main())
