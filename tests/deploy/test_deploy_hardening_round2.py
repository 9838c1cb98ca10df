"""Issue 25 (hardening round two), fleet file half: flags and environment the fleet owns cannot
be overridden in any spelling; prefix caching is a typed field."""
from __future__ import annotations

import pytest

from r9k.deploy.config import parse_fleet
from r9k.deploy.engine import engine_argv, planned_pool

from test_deploy_config import fleet_text, refused

MODEL = {"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30}


@pytest.mark.parametrize("extra, flag", [
    (["--host 0.0.0.0"], "--host"),
    (["--port 9999"], "--port"),
    (["--max-num-seqs 8 --port=9999"], "--port"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    (["--tensor-parallel-size", "4"], "--tensor-parallel-size"),
])
def test_item6_owned_flags_are_refused_in_every_spelling(extra, flag):
    needle = f"models.0.extra_args: {flag} is set by the fleet"
    assert needle in refused(fleet_text(models=[dict(MODEL, extra_args=extra)]))


@pytest.mark.parametrize("key", ["HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                                 "R9K_GDN_STATE", "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"])
def test_item6_env_cannot_override_card_placement_or_page_mode(key):
    msg = refused(fleet_text(models=[dict(MODEL, env={key: "0"})]))
    assert f"{key} is set by the fleet" in msg


def test_item6_other_flags_and_env_still_pass():
    cfg = parse_fleet(fleet_text(models=[dict(MODEL, extra_args=["--max-num-seqs 8"],
                                              env={"NCCL_P2P_DISABLE": "1"})]))
    assert cfg.models[0].extra_args == ["--max-num-seqs 8"]


def test_item14_prefix_caching_off_from_the_fleet_file(monkeypatch, tmp_path):
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny")
    on = parse_fleet(fleet_text(models=[dict(MODEL, path=str(tmp_path / "tiny"), tp=1)]))
    off = parse_fleet(fleet_text(models=[dict(MODEL, path=str(tmp_path / "tiny"), tp=1,
                                              prefix_caching=False)]))
    argv_on = engine_argv(on.models[0], on, "127.0.0.1", 8100)
    argv_off = engine_argv(off.models[0], off, "127.0.0.1", 8100)
    assert not any("prefix-caching" in a for a in argv_on)  # vLLM's default: on
    assert "--no-enable-prefix-caching" in argv_off
    # the page proof plans the pool the replica runs: align on, none off
    assert planned_pool(on.models[0], on).onepage.cache_mode == "align"
    assert planned_pool(off.models[0], off).onepage.cache_mode == "none"
    assert "prefix_caching" in refused(fleet_text(models=[dict(MODEL, prefix_caching="no")]))
