"""One rule for the GDN head dims one-page serves (r9k.core.page_layout), read by the policy (stock
pages at start), the kernel launch (refused) and the planner (noted), checked to agree over a
grid. Where they disagree, the policy accepts a dim the kernel refuses at its first step (key
dim 192: an engine that starts one-page and fails serving) or refuses one the kernel and the
planner serve (value dim 16)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from r9k.core import capacity as cap
from r9k.core.page_layout import head_dims_reason
from r9k.plugin.policy import unservable_shape_reason

KEY_DIMS = (16, 32, 64, 96, 128, 192, 256, 512)
VALUE_DIMS = (16, 24, 48, 64, 128)
GRID = [(k, v) for k in KEY_DIMS for v in VALUE_DIMS]
# run through the interpreter (each a two-step simulation): every key-dim class, odd value dims
KERNEL_GRID = [(16, 16), (16, 24), (32, 48), (64, 16), (96, 16), (192, 16), (32, 128), (64, 64),
               (128, 48), (256, 24), (512, 16)]


def _policy(k, v):
    cfg = SimpleNamespace(linear_key_head_dim=k, linear_value_head_dim=v,
                          linear_num_key_heads=2, linear_num_value_heads=4)
    return unservable_shape_reason(cfg, tp_size=1)


def _planner(k, v):
    shape = cap.HybridModelShape.from_config(
        {**cap.TINY_SHAPE, "linear_key_head_dim": k, "linear_value_head_dim": v}, name="grid")
    return cap.plan(shape, tp=1, num_spec=3, kv_bytes_per_rank=256 << 20, max_model_len=4096,
                    platform="gpu", state_dtype="float32").onepage_unservable


def test_policy_and_planner_read_the_one_rule_over_the_grid():
    served = [(k, v) for k, v in GRID if head_dims_reason(k, v) is None]
    assert len(GRID) == 40 and len(served) == 25  # key dims 16..256 powers of two, any value dim
    for k, v in GRID:
        rule = head_dims_reason(k, v)
        assert _policy(k, v) == rule, (k, v)
        assert _planner(k, v) == rule, (k, v)
    assert "192 is not a power of two" in _policy(192, 128)
    assert _policy(128, 16) is None  # value dim 16: served (the policy refused it before)
    assert "exceeds 256" in _policy(512, 128)


@pytest.mark.timeout(600)
def test_the_kernel_launch_agrees_with_the_rule():
    pytest.importorskip("triton")
    script = Path(__file__).with_name("head_dims_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, str(script), *(f"{k}x{v}" for k, v in KERNEL_GRID)],
                         env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [(g["K"], g["V"]) for g in got] == KERNEL_GRID
    for g in got:
        rule = head_dims_reason(g["K"], g["V"])
        assert g["served"] == (rule is None), g
        if rule is None:
            assert g["rows"] > 0  # ran, bit-identical to the composed stock path every step
        else:
            assert g["error"] == rule
