"""CI coverage without a GPU for the GPU path's prefix-caching copies (`r9k.kernels.triton_align`):
under Triton's interpreter on CPU tensors, the multi-layer `ReplayPlan` (one word-copy launch
over every layer's pages, the fused kernel per layer, one flag-clear launch) equals per-layer
replays, and the replay equals stock's slot copies over random align simulations (boundary
copies, in place, pre-copies, prefix hits; fp32 k = 3 and bf16 k = 7).

The interpreter is picked when a kernel is decorated, so the cases run in a fresh process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_replay_plan_and_align_copies_under_interpreter():
    script = Path(__file__).with_name("align_replay_interpret_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "ok 3 cases", res.stdout
    assert res.stdout.count("simulation torch.") == 2, res.stdout
