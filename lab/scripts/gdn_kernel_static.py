"""GDN kernels compiled offline (no GPU): registers, spills, occupancy and instruction mix of vLLM's
stock spec kernel and the fused one-page kernel's variants, per target and head shape.

Why: at small N the kernels are bound by each program's token chain and by how many programs an
SM (or CU) holds at once, and both are fixed at compile time. The GPU benchmark
(gdn_kernel.py) says which variant is faster; this says why, and it runs on any machine with
Triton, so a variant can be shaped before a GPU is lent. Use the Triton version the GPU machine
runs (its ptxas decides the registers): the JSON records it.

    python -m lab.scripts.gdn_kernel_static \
        --variants fenced,dep_ordered,late,p0_late_r80 \
        --out lab/results/gdn_kernel_static_flashnext.json

Per CUDA target (sm_90, the H200): registers and spilled bytes from the cubin, programs per SM
from the register file (NVIDIA's occupancy rules: 8-register steps per thread, 256-register
steps per warp, 65,536 registers and at most 64 warps per SM), waves at each N on 132 SMs, and
the SASS opcode counts. Equal counts of floating-point opcodes (FFMA, FMUL, FADD, MUFU) between a
variant and the shipped kernel are evidence (not proof: the H200 tests are) that ptxas made the
same arithmetic. Per HIP target (gfx1201, the R9700): VGPRs, spills and the compiler's own
occupancy (waves per SIMD).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lab.gdn_kernel import SHAPES, VARIANTS
from lab.kernel_static import (SM90, cuda_facts, fused_compiled, hip_facts,
                                     shipped_compiled, stock_compiled)
from r9k.kernels.triton_fused import STOCK_BV_MAX

STATE_DTYPES = ("fp32", "bf16")

def markdown(doc: dict) -> str:
    """The JSON as tables: one for CUDA targets, one for HIP targets."""
    lines = [f"Triton {doc['triton']}, k = {doc['num_spec']}. Command:", "",
             f"    {doc['command']}", ""]
    cuda = [r for r in doc["rows"] if r["target"].startswith("cuda")]
    if cuda:
        seqs = list(cuda[0]["waves"])
        lines += ["| target | shape | state | kernel | regs | spill B | programs/SM | "
                  "SASS instr | FFMA/FMUL/FADD/MUFU | waves at N = " + "/".join(map(str, seqs)) + " |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in cuda:
            fp = "/".join(str(r["sass_ops"][k]) for k in ("FFMA", "FMUL", "FADD", "MUFU"))
            lines.append(f"| {r['target']} | {r['shape']} | {r['state']} | {r['kernel']} | "
                         f"{r['regs']} | {r['spill_stack_bytes']} | {r['programs_per_sm']} | "
                         f"{r['sass_instructions']} | {fp} | "
                         + "/".join(str(r["waves"][n]) for n in seqs) + " |")
        lines.append("")
    hip = [r for r in doc["rows"] if r["target"].startswith("hip")]
    if hip:
        lines += ["| target | shape | state | kernel | VGPRs | VGPR spills | waves/SIMD |",
                  "|---|---|---|---|---|---|---|"]
        for r in hip:
            lines.append(f"| {r['target']} | {r['shape']} | {r['state']} | {r['kernel']} | "
                         f"{r['vgprs']} | {r['vgpr_spills']} | {r['waves_per_simd']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="cuda:90,hip:gfx1201")
    ap.add_argument("--shapes", default="flash-next-tp2,flash-next-tp4")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--seqs", default="1,4,16,64,256", help="N at which to count waves (CUDA)")
    ap.add_argument("--variants", default="", help=f"besides 'fused': {', '.join(VARIANTS)}")
    ap.add_argument("--out", default="lab/results/gdn_kernel_static.json")
    ap.add_argument("--md", default="", help="also write the tables as Markdown here")
    args = ap.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget

    variants = [v for v in args.variants.split(",") if v]
    for given, known, what in ((variants, VARIANTS, "variants"),
                               (args.dtypes.split(","), STATE_DTYPES, "dtypes"),
                               (args.shapes.split(","), SHAPES, "shapes")):
        unknown = [v for v in given if v not in known]
        if unknown:
            print(f"unknown {what} {unknown}; known: {', '.join(known)}", file=sys.stderr)
            return 2
    targets = []
    for spec in args.targets.split(","):
        backend, _, arch = spec.partition(":")
        if backend == "cuda" and arch.isdigit():
            targets.append(GPUTarget("cuda", int(arch), 32))
        elif backend == "hip" and arch.startswith("gfx"):
            targets.append(GPUTarget("hip", arch, 32))
        else:
            print(f"--targets: {spec!r} is not cuda:<sm> or hip:gfx<arch>", file=sys.stderr)
            return 2
    seqs = [int(x) for x in args.seqs.split(",")]
    S = 1 + args.num_spec
    rows = []
    for target in targets:
        facts = cuda_facts if target.backend == "cuda" else hip_facts
        for shape in args.shapes.split(","):
            heads = SHAPES[shape]
            nv = math.ceil(heads.head_v_dim / min(heads.head_v_dim, STOCK_BV_MAX))
            for dname in args.dtypes.split(","):
                kernels = {"stock": stock_compiled(heads, dname, S, target)}
                for name in ["fused"] + variants:
                    kernels[name] = (shipped_compiled(heads, dname, S, target) if name == "fused"
                                     else fused_compiled(heads, dname, S, VARIANTS[name], target))
                for name, ck in kernels.items():
                    row = {"target": f"{target.backend}:{target.arch}", "shape": shape,
                           "state": dname, "kernel": name, **facts(ck)}
                    if "programs_per_sm" in row:
                        per_wave = row["programs_per_sm"] * SM90["sms"]
                        row["waves"] = {n: math.ceil(nv * heads.num_v_heads * n / per_wave)
                                        for n in seqs}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    doc = {"triton": triton.__version__, "num_spec": args.num_spec, "variants":
           {n: VARIANTS[n] for n in variants}, "sm90": SM90,
           "command": "python -m lab.scripts.gdn_kernel_static "
                      + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {out}")
    if args.md:
        Path(args.md).write_text(markdown(doc))
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
