"""Qwen4Exp ("Flash-Next"): the plugin's page sizing equals what its one-page layer binds and
what the planner counts; the flash-next preset and its command line."""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from doubles.vllm_accounting import import_plugin_qwen4exp_classes, import_vllm_model_modules
from r9k.core import capacity as cap
from r9k.core import page_layout as pl
from r9k.cli import main as cli

GIB = 1 << 30


def _hf(**fields):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(eos_token_id=1, **fields)


def _vllm_config(hf, arch: str, tp: int, k: int, ssm_dtype: str):
    from vllm.config.cache import CacheConfig

    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.bfloat16, hf_text_config=hf, architecture=arch),
        cache_config=CacheConfig(mamba_cache_mode="none", mamba_ssm_cache_dtype=ssm_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        device_config=SimpleNamespace(device_type="cuda"))


def _one_page_layer(cfg, hf):
    """The plugin's one-page GDN layer with the attributes vLLM's GatedDeltaNetAttention.__init__
    sets from the config (building it for real needs TP groups and weights)."""
    from r9k.plugin.gdn_layer import OnePageGatedDeltaNetAttention

    layer = OnePageGatedDeltaNetAttention.__new__(OnePageGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    layer.onepage, layer._vllm_config = True, cfg
    layer.model_config, layer.cache_config = cfg.model_config, cfg.cache_config
    layer.tp_size = cfg.parallel_config.tensor_parallel_size
    layer.num_spec = cfg.speculative_config.num_speculative_tokens
    layer.num_k_heads, layer.num_v_heads = hf.linear_num_key_heads, hf.linear_num_value_heads
    layer.head_k_dim, layer.head_v_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
    layer.conv_kernel_size = hf.linear_conv_kernel_dim
    return layer


HEADS = [dict(), dict(linear_num_key_heads=16, linear_num_value_heads=48, hidden_size=5120,
                      num_attention_heads=24, num_key_value_heads=4),
         dict(linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
              linear_value_head_dim=64, hidden_size=1024, num_attention_heads=8)]


def test_onepage_classes_size_the_pages_their_layers_bind(monkeypatch):
    """Both registered Qwen4Exp classes: the pool's GDN page (the class's MambaSpec) is the page
    the one-page layer binds, with the capacity module's record, and the PLE page stays vLLM's."""
    from vllm.v1.kv_cache_interface import MambaSpec

    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    stock_cls = import_vllm_model_modules()["Qwen4ExpForCausalLM"]
    classes = dict(zip(("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"),
                       import_plugin_qwen4exp_classes()))
    checked = 0
    for heads, tp, k, ssm_dtype, (arch, cls) in itertools.product(
            HEADS, (2, 4), (1, 3, 7), ("bfloat16", "float32"), classes.items()):
        hf = _hf(num_hidden_layers=48, ple_layer_ids=[1], **heads)
        cfg = _vllm_config(hf, arch, tp, k, ssm_dtype)
        where = f"{cls.__name__} {heads or 'defaults'} tp={tp} k={k} state={ssm_dtype}"
        gdn, ple = cls.get_mamba_specs_from_config(cfg)
        layer = _one_page_layer(cfg, hf)
        bound = MambaSpec(shapes=layer.page_state_shapes(), dtypes=layer.page_state_dtypes(),
                          block_size=-1)
        assert (bound.shapes, bound.dtypes) == (gdn.shapes, gdn.dtypes), where
        shape = cap.HybridModelShape.from_config(dict(hf.to_dict(), model_type="qwen4_exp_text"))
        layout = cap.gdn_page_layout(shape, tp, k, onepage=True, state_dtype=ssm_dtype)
        assert bound.page_size_bytes == gdn.page_size_bytes == layout.page_bytes, where
        assert gdn.shapes[pl.PAGE_RECORD] == layout.record_shape, where
        assert gdn.shapes[pl.PAGE_FLAG] == (layout.flag_words,), where
        assert len(cls.get_mamba_state_shape_from_config(cfg)) == 4, where
        _, stock_ple = stock_cls.get_mamba_specs_from_config(cfg)
        assert ple == stock_ple and ple.tp_replicated, where
        assert ple.page_size_bytes == cap.ple_page_bytes(shape, k), where
        checked += 1
    assert checked == 72

    monkeypatch.setenv("R9K_GDN_STATE", "stock")
    for cls in classes.values():
        cfg = _vllm_config(_hf(num_hidden_layers=48), "Qwen4ExpForCausalLM", 4, 3, "bfloat16")
        assert cls.get_mamba_specs_from_config(cfg) == stock_cls.get_mamba_specs_from_config(cfg)


def test_flash_next_preset_shape():
    s = cap.preset("flash-next")
    assert (s.num_gdn_layers, s.num_attention_layers, s.num_ple_layers, s.num_mtp_layers) == \
        (36, 12, 1, 1)
    assert (s.linear_num_key_heads, s.linear_num_value_heads, s.num_key_value_heads,
            s.head_dim, s.hidden_size, s.hc_count) == (16, 32, 2, 256, 2048, 4)


def test_public_flash_next_preset_shape_and_grouping():
    """The public Qwen3.8-Flash-Next config: its differences from the defaults, and the packed
    grouping its QSA indexer brings (the numbers themselves are held to vLLM's own accounting
    in tests/test_capacity_crosscheck.py)."""
    s = cap.preset("qwen3.8-flash-next")
    assert (s.num_gdn_layers, s.num_attention_layers, s.num_ple_layers, s.num_mtp_layers) == \
        (30, 10, 1, 1)
    assert (s.linear_num_value_heads, s.num_attention_heads, s.num_key_value_heads,
            s.hidden_size) == (48, 24, 2, 2560)
    p = cap.plan(s, tp=4, num_spec=3, kv_bytes_per_rank=20 * GIB, max_model_len=65536,
                 prefix_caching=True, state_dtype="float32")
    assert (p.stock.num_gdn_groups, p.stock.num_ple_groups, p.stock.num_attention_groups,
            p.stock.num_indexer_ring_groups, p.stock.group_size) == (3, 1, 1, 1, 22)
    assert p.onepage.tokens > p.stock.tokens and \
        p.onepage.pinned_fraction < p.stock.pinned_fraction


def test_flash_next_tp2_tp4_exact_numbers():
    """The README's table: memory per rank solved from the seed's stock counts (inferred)."""
    got = {}
    for tp, gib in ((2, 2.48), (4, 3.63)):
        p = cap.plan(cap.preset("flash-next"), tp=tp, num_spec=3,
                     kv_bytes_per_rank=int(gib * GIB), max_model_len=23552)
        got[tp] = (p.stock.tokens, p.onepage.tokens, p.stock.pinned_blocks,
                   p.onepage.pinned_blocks, p.stock.num_blocks, p.onepage.num_blocks)
    assert got == {2: (154670, 183784, 1288, 424, 4643, 4167),
                   4: (256394, 279568, 1288, 424, 13216, 11894)}


def test_flash_next_pages_and_groups():
    p = cap.plan(cap.preset("flash-next"), tp=4, num_spec=3, kv_bytes_per_rank=20 * GIB,
                 max_model_len=65536, prefix_caching=True)
    # one PLE layer makes every KV cache group one layer (vLLM's smallest-type rule)
    assert (p.stock.group_size, p.stock.num_gdn_groups, p.stock.num_ple_groups,
            p.stock.num_attention_groups) == (1, 36, 1, 13)
    assert (p.stock.gdn_pages_per_request, p.onepage.gdn_pages_per_request) == (5, 2)
    assert p.stock.ple_pages_per_request == p.onepage.ple_pages_per_request == 5
    assert (p.stock.gdn_page_bytes, p.onepage.gdn_page_bytes, p.stock.ple_page_bytes) == \
        (286720, 311824, 196608)


def test_qsa_indexer_packs_pages_and_refuses_a_ring_vllm_refuses():
    cfg = dict(cap.PRESETS["flash-next"], indexer_n_heads=16, indexer_kv_heads=1,
               indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4)
    shape = cap.HybridModelShape.from_config(cfg)
    pool = cap.plan_pool(shape, tp=4, num_spec=3, kv_bytes_per_rank=20 * GIB,
                         max_model_len=65536, onepage=False)
    # 13 QSA layers with their compressed keys in one group, GDN split to fit that block
    assert (pool.num_gdn_groups, pool.num_attention_groups, pool.num_ple_groups,
            pool.num_indexer_ring_groups, pool.block_bytes, pool.num_blocks) == \
        (3, 1, 1, 1, 4073472, 5271)
    with pytest.raises(cap.CapacityInputError, match="QSA indexer ring of 12 tokens"):
        cap.plan_pool(shape, tp=2, num_spec=7, kv_bytes_per_rank=20 * GIB, max_model_len=65536,
                      onepage=False)


def test_cli_flash_next_tp4(capsys):
    r = CliRunner().invoke(cli, ["capacity", "--preset", "flash-next", "--tp", "4",
                                 "--num-spec", "3", "--kv-gib-per-rank", "3.63",
                                 "--max-model-len", "23552", "--no-prefix-caching"])
    assert r.exit_code == 0, r.output
    assert "PLE page, every rank (B)                     196608          196608" in r.output
    assert "KV cache tokens                             256,394         279,568" in r.output
    assert "one-page / stock tokens: x1.090" in r.output
    r = CliRunner().invoke(cli, ["capacity", "--preset", "flash-next", "--tp", "4",
                                 "--num-spec", "3", "--kv-gib-per-rank", "3.63",
                                 "--max-model-len", "23552", "--json"])
    d = json.loads(r.output)
    assert d["stock"]["num_ple_groups"] == 1 and d["onepage"]["ple_pages_per_request"] == 5


@pytest.mark.parametrize("cfg, message", [
    (dict(cap.PRESETS["flash-next"], ple_layer_ids=[4]),
     "ple_layer_ids [4]: expected one-indexed ids of linear_attention layers"),
    (dict(cap.PRESETS["flash-next"], ple_layer_ids=[49]),
     "ple_layer_ids [49]: expected one-indexed ids"),
    (dict(cap.PRESETS["flash-next"], indexer_n_heads=16, indexer_head_dim=128,
          indexer_compress_ratio=4), "the QSA indexer ring of 12 tokens does not divide"),
])
def test_cli_bad_qwen4exp_config_exit_2(tmp_path, cfg, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = CliRunner().invoke(cli, ["capacity", "--config", str(path), "--tp", "2",
                                 "--num-spec", "7", "--kv-gib-per-rank", "20",
                                 "--max-model-len", "65536"])
    assert r.exit_code == 2 and message in r.output, r.output


def test_cli_says_when_vllm_would_not_start():
    r = CliRunner().invoke(cli, ["capacity", "--preset", "flash-next", "--tp", "2",
                                 "--num-spec", "3", "--kv-gib-per-rank", "0.5",
                                 "--max-model-len", "131072"])
    assert r.exit_code == 0, r.output
    assert "note: stock: vLLM would not start: one request at max_model_len needs" in r.output


def test_readme_flash_next_section_is_the_planners_output():
    """README's Flash-Next command output and table come from the planner, not by hand."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    argv = ["capacity", "--preset", "flash-next", "--tp", "4", "--num-spec", "3",
            "--kv-gib-per-rank", "3.63", "--max-model-len", "45056", "--state-dtype",
            "float32", "--no-prefix-caching"]
    assert "$ r9k " + " ".join(argv) + "\n" + CliRunner().invoke(cli, argv).output in readme
    for tp, gib, seed_row in ((2, 2.48, "| KV tokens, TP2 | 154,641 -> 183,202 (+18%) |"),
                              (4, 3.63, "| KV tokens, TP4 | 256,682 -> 279,564 (+9%) |")):
        p = cap.plan(cap.preset("flash-next"), tp=tp, num_spec=3,
                     kv_bytes_per_rank=int(gib * GIB), max_model_len=45056,
                     state_dtype="float32")
        gain = round(100 * (p.ratio - 1))
        assert (f"{seed_row} {p.stock.tokens:,} -> {p.onepage.tokens:,} (+{gain}%) |"
                in readme), tp
        pinned = [round(q.pinned_fraction / q.running * q.tokens) for q in (p.stock, p.onepage)]
        assert f"request, TP{tp} (tokens) | " in readme
        assert f"| {pinned[0]:,} -> {pinned[1]:,} |" in readme, tp
        assert (f"{p.stock.pinned_fraction:.1%} -> {p.onepage.pinned_fraction:.1%} |"
                in readme), tp


def test_planner_and_policy_agree_on_ple_layers_with_prefix_caching():
    """One rule (page_layout.mamba_groups_reason): with prefix caching a Qwen4Exp model with
    PLE layers keeps stock pages (vLLM's runners stop at start on mixed mamba groups), and the
    planner says so, so a fleet sizes it by stock pages; without prefix caching one-page serves."""
    for preset in ("flash-next", "qwen3.8-flash-next"):
        on = cap.plan(cap.preset(preset), tp=4, num_spec=3, kv_bytes_per_rank=20 * GIB,
                      max_model_len=65536, prefix_caching=True)
        off = cap.plan(cap.preset(preset), tp=4, num_spec=3, kv_bytes_per_rank=20 * GIB,
                       max_model_len=65536, prefix_caching=False)
        assert "PLE layers with prefix caching" in on.onepage_unservable
        assert any("one-page cannot serve this engine" in n for n in on.notes)
        assert off.onepage_unservable is None
    qwen35 = cap.plan(cap.preset("qwen3.5-27b"), tp=2, num_spec=3, kv_bytes_per_rank=20 * GIB,
                      max_model_len=65536, prefix_caching=True)
    assert qwen35.onepage_unservable is None
