"""lab/scripts/summarize_gdn_kernel.py on the committed H200 result and on a result with a
variant whose bits differ: the verdict the issue asks for (never slower than stock at any N)
per kernel and state dtype, and no candidate that changes the bits."""
from __future__ import annotations

import copy
import json

from pathlib import Path

from lab.scripts import summarize_gdn_kernel

RESULT = Path(__file__).resolve().parents[2] / "lab" / "results" / "gdn_kernel_h200_flashnext_tp2_tp4_k3.json"


def _tool():
    return summarize_gdn_kernel


def test_verdict_on_the_committed_h200_run():
    tool = _tool()
    doc = json.loads(RESULT.read_text())
    got = {(v["kernel"], v["state_dtype"]): v for v in tool.verdicts(doc["results"])}
    bf16, fp32 = got[("fused", "bfloat16")], got[("fused", "float32")]
    # the README's figures: bf16 worst 1.133 at TP4 N = 16, fp32 at most 0.875 of stock
    assert (bf16["worst_ratio"], bf16["worst_at"]) == (1.133, "flash-next-tp4 N=16")
    assert not bf16["never_slower"] and bf16["configs"] == 10
    assert fp32["never_slower"] and fp32["worst_ratio"] == 0.875 and fp32["best_ratio"] == 0.705
    probe = got[("fused_no_record", "bfloat16")]
    assert not probe["candidate"] and probe["worst_ratio"] == 1.025
    text = tool.markdown(doc, RESULT.name)
    assert "| fused | bfloat16 | 1.133 (flash-next-tp4 N=16) | 0.886 | no | - |" in text
    assert text.count("| flash-next-tp") == 20


def test_a_variant_with_other_bits_is_never_a_candidate(tmp_path):
    tool = _tool()
    doc = json.loads(RESULT.read_text())
    fast = copy.deepcopy(doc)
    for r in fast["results"]:
        r["ratio_to_stock"]["late"] = 0.5  # faster everywhere
        r["bit_identical_to_fused"] = {"late": r["num_seqs"] != 16}  # but not at N = 16
    late = {v["state_dtype"]: v for v in tool.verdicts(fast["results"]) if v["kernel"] == "late"}
    assert all(v["never_slower"] and v["bit_identical_to_fused"] is False
               and not v["candidate"] for v in late.values())
    path = tmp_path / "r.json"
    path.write_text(json.dumps(fast))
    out = tmp_path / "r.md"
    assert tool.main([str(path), "--out", str(out)]) == 0
    assert "0.500 (bits differ)" in out.read_text() and "(not a candidate)" in out.read_text()
    (tmp_path / "bad.json").write_text("{}")
    assert tool.main([str(tmp_path / "bad.json")]) == 2
