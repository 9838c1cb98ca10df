"""The plugin's GPU path glue (r9k.plugin.gdn_gpu) without a GPU: vLLM's `_forward_core` is bound once
per one-page layer with its two spec-path calls routed and vLLM's module left untouched; run on
a spec + non-spec decode batch, the spec recurrence runs the fused kernel under Triton's
interpreter exactly as a direct step call does, the conv update gets S from the configuration,
and a non-spec decode replays one live row first and clears the flag. (The interpreter is chosen
at kernel decoration, so the cases run in a fresh process.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("vllm")


def test_gpu_path_adapter_under_interpreter():
    script = Path(__file__).with_name("gpu_adapter_cases.py")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-6:] == ["bound once", "spec call routed", "forward core routed",
                          "spec-only step in place", "non-spec decode routed", "ok"]
