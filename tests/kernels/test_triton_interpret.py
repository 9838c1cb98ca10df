"""CI coverage without a GPU: the fused one-page Triton kernel and the composed stock-kernel path
run under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors at tiny shapes, bit-identical
to stock per-slot decoding over multi-step simulations (fp32 and bf16 state, k = 3 and 7, row
maps, null pages, several layers, lockstep copies), the kernel's measured variants (prefetch
modes, late count-in, record rows from the verify loop, loads beside the flag read, record
tiles stored last, the count-in protocols and the own flag pairs on each state dtype) and through
the step API with K != V, and the GPU benchmark's configuration runner (variants, bits check).

The interpreter is picked when a kernel is decorated, so the cases run in a fresh process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_fused_and_composed_match_stock_under_interpreter():
    script = Path(__file__).with_name("triton_interpret_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "ok 21 cases", res.stdout
    assert res.stdout.count("sim {") == 17
