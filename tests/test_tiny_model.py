"""`r9k model make-tiny`: a deterministic, loadable checkpoint with MTP weights and a tokenizer."""
import hashlib
import json

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from r9k.cli import main
from r9k.devtools.tiny_model import SPECIAL_TOKENS, make_tiny


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_seeded_and_deterministic(tmp_path):
    make_tiny(tmp_path / "a", seed=3)
    make_tiny(tmp_path / "b", seed=3)
    make_tiny(tmp_path / "c", seed=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")


def test_checkpoint_has_main_and_mtp_weights(tmp_path):
    cfg = make_tiny(tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("mtp.fc.weight")
    h = cfg["hidden_size"]
    assert fc.shape == (h, 2 * h)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "mtp.pre_fc_norm_embedding.weight",
                 "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                 "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.0.up_proj.weight",
                 "model.layers.0.linear_attn.in_proj_qkvz.weight",
                 "model.layers.0.linear_attn.A_log", "model.layers.3.self_attn.o_proj.weight"):
        assert name in names, name
    assert cfg["layer_types"].count("linear_attention") == 3
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]


def test_tokenizer_round_trips_any_text(tmp_path):
    from transformers import AutoTokenizer

    make_tiny(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    text = "Replay the accepted rows: ÿ 字 🙂\n\ttabs"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < 512
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS[0]) == 256


def test_cli_set_overrides_and_json(tmp_path):
    res = CliRunner().invoke(main, ["model", "make-tiny", str(tmp_path / "m"), "--seed", "1",
                                    "--set", "num_hidden_layers=8", "--set",
                                    "mamba_ssm_dtype=float32", "--json"])
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.output)["config"]
    assert cfg["num_hidden_layers"] == 8 and cfg["layer_types"].count("full_attention") == 2
    assert json.loads((tmp_path / "m" / "config.json").read_text())["mamba_ssm_dtype"] == "float32"


@pytest.mark.parametrize("override, message", [
    ("num_hiden_layers=8", "unknown config field"),
    ("num_hidden_layers=two", "expected an integer"),
    ("num_hidden_layers", "expected key=value"),
    ("linear_value_head_dim=40", "multiple of 16"),
    ("linear_num_value_heads=3", "multiple of linear_num_key_heads"),
    ("full_attention_interval=9", "no attention layer"),
    ("vocab_size=100", "needs at least 259"),
    ("mamba_ssm_dtype=float16", "expected float32 or bfloat16"),
])
def test_cli_bad_overrides_exit_2_and_write_nothing(tmp_path, override, message):
    out = tmp_path / "m"
    res = CliRunner().invoke(main, ["model", "make-tiny", str(out), "--set", override])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not out.exists()


def test_gdn_projection_scales_follow_their_fan_in(tmp_path):
    """A GDN layer adds as much to the residual at the 27B's value heads (24 x 128) as at the
    default's (4 x 64): out_proj's std is 0.1 x sqrt(256 / value dim), the default's 0.1; at a
    wider hidden size its q, k, v and gates are as large: in_proj's std is 0.1 x
    sqrt(128 / hidden); past the default's 3 GDN layers out_proj shrinks by sqrt(3 / layers)."""
    import math

    from r9k.devtools.tiny_model import GDN_PROJ_STD

    stds = {}
    for name, over in (("default", {}), ("wide", {"linear_num_value_heads": 24,
                                                  "linear_value_head_dim": 128,
                                                  "linear_num_key_heads": 8,
                                                  "linear_key_head_dim": 128}),
                       ("hidden", {"hidden_size": 512}), ("deep", {"num_hidden_layers": 8})):
        make_tiny(tmp_path / name, seed=0, overrides=over)
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
            w = f.get_tensor("model.layers.0.linear_attn.out_proj.weight").float()
            qkvz = f.get_tensor("model.layers.0.linear_attn.in_proj_qkvz.weight").float()
            ba = f.get_tensor("model.layers.0.linear_attn.in_proj_ba.weight").float()
        stds[name] = (w.shape[1], w.std().item(), qkvz.std().item(), ba.std().item())
    assert stds["default"][0] == 256 and stds["wide"][0] == 3072
    assert abs(stds["default"][1] - GDN_PROJ_STD) < 0.005
    assert abs(stds["wide"][1] - GDN_PROJ_STD * math.sqrt(256 / 3072)) < 0.002
    assert abs(stds["hidden"][2] - GDN_PROJ_STD * math.sqrt(128 / 512)) < 0.003
    assert abs(stds["hidden"][3] - GDN_PROJ_STD * math.sqrt(128 / 512)) < 0.01
    assert abs(stds["hidden"][1] - GDN_PROJ_STD) < 0.005  # out_proj: the default's value dim
    # 6 GDN layers: out_proj by sqrt(3 / 6), so together they add as much as the default's 3
    assert abs(stds["deep"][1] - GDN_PROJ_STD * math.sqrt(3 / 6)) < 0.005
    assert abs(stds["deep"][2] - GDN_PROJ_STD) < 0.005
    assert abs(stds["wide"][2] - GDN_PROJ_STD) < 0.005  # in_proj keeps its scale
