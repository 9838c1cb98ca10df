"""Admission by the planner (no more requests running than the pool holds whole, so none is
preempted): a model's `max_num_seqs: planner` launches each replica with `--max-num-seqs` = the
whole requests of max_model_len its pool holds in its own page mode
(`capacity.PoolPlan.whole_requests`); counts and vLLM's default stay as they were; bad values
and a second spelling are refused."""
from __future__ import annotations

import json

import pytest

from r9k.core import capacity
from r9k.deploy.config import FleetConfig, FleetConfigError, load_fleet, parse_fleet, planned_pool
from r9k.deploy.engine import engine_argv

from test_deploy_config import fleet_text, refused

MODEL = {"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30}


def _seqs(argv: list[str]) -> int | None:
    hits = [i for i, a in enumerate(argv) if a == "--max-num-seqs"]
    assert len(hits) <= 1, argv
    return int(argv[hits[0] + 1]) if hits else None


def _tiny_fleet(tmp_path, **model) -> FleetConfig:
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny")
    doc = {"platform": "cpu", "entry": {"port": 8000}, "exporter": None,
           "hosts": [{"name": "local", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"},
                                                 {"bdf": "0000:c2:00.0", "cpu_bind": "1"}]}],
           "models": [{"name": "tiny", "path": str(tmp_path / "tiny"), "max_model_len": 4096,
                       "kv_cache_memory_bytes": 64 << 20, "state_dtype": "float32", **model}]}
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps(doc))
    return load_fleet(path)


def test_the_planner_admits_each_page_modes_whole_requests(tmp_path):
    cfg = _tiny_fleet(tmp_path, replicas=2, max_num_seqs="planner",
                      gdn_state_per_replica=["stock", "onepage"])
    m = cfg.models[0]
    plan = planned_pool(m, cfg)
    # the pool's free blocks (less the null block) over the blocks one request of max_model_len
    # takes, per mode: one-page admits more because its requests pin fewer GDN pages
    for pool in (plan.stock, plan.onepage):
        assert pool.whole_requests == (pool.num_blocks - 1) // pool.blocks_per_request
    assert plan.onepage.whole_requests > plan.stock.whole_requests >= 1
    stock = engine_argv(m.for_replica("tiny-0"), cfg, "127.0.0.1", 8100)
    onepage = engine_argv(m.for_replica("tiny-1"), cfg, "127.0.0.1", 8101)
    assert (_seqs(stock), _seqs(onepage)) == (plan.stock.whole_requests,
                                              plan.onepage.whole_requests)


def test_a_count_is_passed_and_none_keeps_vllms_default(tmp_path):
    cfg = _tiny_fleet(tmp_path / "a", max_num_seqs=5)
    assert _seqs(engine_argv(cfg.models[0], cfg, "127.0.0.1", 8100)) == 5
    cfg = _tiny_fleet(tmp_path / "b")
    assert _seqs(engine_argv(cfg.models[0], cfg, "127.0.0.1", 8100)) is None
    cfg = _tiny_fleet(tmp_path / "c", extra_args=["--max-num-seqs 6"])  # as before: still passes
    assert _seqs(engine_argv(cfg.models[0], cfg, "127.0.0.1", 8100)) == 6


@pytest.mark.parametrize("value, needle", [
    (0, "models.0.max_num_seqs: expected a count >= 1 or \"planner\" (got 0)"),
    (-3, "models.0.max_num_seqs: expected a count >= 1 or \"planner\" (got -3)"),
    ("auto", "models.0.max_num_seqs"),
    (2.5, "models.0.max_num_seqs"),
    ("8", "models.0.max_num_seqs"),
])
def test_bad_values_are_refused_naming_the_field(value, needle):
    assert needle in refused(fleet_text(models=[dict(MODEL, max_num_seqs=value)]))


@pytest.mark.parametrize("extra", [["--max-num-seqs 8"], ["--max-num-seqs=8"],
                                   ["--seed 0 --max-num-seqs 8"], ["--max_num_seqs", "8"]])
def test_the_field_and_the_flag_together_are_refused(extra):
    msg = refused(fleet_text(models=[dict(MODEL, max_num_seqs="planner", extra_args=extra)]))
    assert "set vLLM's max_num_seqs" in msg


def test_a_pool_without_one_whole_request_is_refused_at_load(tmp_path):
    # 4096-token requests: stock needs more blocks per request than one-page, so a pool sized
    # between the two holds a one-page request but no stock one
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny")
    shape = capacity.HybridModelShape.from_path(tmp_path / "tiny")
    kw = dict(tp=1, num_spec=3, max_model_len=4096, platform="cpu", state_dtype="float32",
              prefix_caching=True)
    mem = next(mib << 20 for mib in range(1, 512)
               if capacity.plan(shape, kv_bytes_per_rank=mib << 20, **kw).onepage.whole_requests
               >= 1)
    plan = capacity.plan(shape, kv_bytes_per_rank=mem, **kw)
    assert plan.stock.whole_requests == 0 and plan.onepage.whole_requests >= 1
    ok = _tiny_fleet(tmp_path / "ok", kv_cache_memory_bytes=mem, max_num_seqs="planner")
    assert _seqs(engine_argv(ok.models[0], ok, "127.0.0.1", 8100)) == plan.onepage.whole_requests
    with pytest.raises(FleetConfigError) as exc:
        _tiny_fleet(tmp_path / "bad", kv_cache_memory_bytes=mem, max_num_seqs="planner",
                    gdn_state="stock")
    assert ("models.tiny.max_num_seqs planner: the stock pool of "
            f"{mem} B per rank holds no whole request of 4096 tokens") in str(exc.value)
    # without planner admission the same file loads (vLLM itself then says it does not fit)
    _tiny_fleet(tmp_path / "plain", kv_cache_memory_bytes=mem, gdn_state="stock")


def test_fleet_check_shows_what_each_page_mode_is_launched_with(tmp_path):
    from click.testing import CliRunner

    from r9k.cli import main

    cfg = _tiny_fleet(tmp_path, replicas=2, max_num_seqs="planner",
                      gdn_state_per_replica=["stock", "onepage"])
    plan = planned_pool(cfg.models[0], cfg)
    want = {"stock": plan.stock.whole_requests, "onepage": plan.onepage.whole_requests}
    res = CliRunner().invoke(main, ["fleet", "check", "--config", str(tmp_path / "fleet.yaml"),
                                    "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["max_num_seqs"] == {"tiny": want}
    res = CliRunner().invoke(main, ["fleet", "check", "--config", str(tmp_path / "fleet.yaml")])
    assert (f"tiny: max_num_seqs stock {want['stock']}, onepage {want['onepage']} (the planner's "
            "whole requests of max_model_len)") in res.output


def test_planner_admission_plans_the_pool_the_replica_is_launched_with(tmp_path):
    """Prefix caching off plans mamba_cache_mode none (1 + k stock pages, 1 one-page), as
    engine_argv launches it; TP 2 plans per-rank pages."""
    off = _tiny_fleet(tmp_path / "off", max_num_seqs="planner", prefix_caching=False)
    on = _tiny_fleet(tmp_path / "on", max_num_seqs="planner")
    p_off, p_on = planned_pool(off.models[0], off), planned_pool(on.models[0], on)
    assert (p_off.onepage.cache_mode, p_on.onepage.cache_mode) == ("none", "align")
    argv = engine_argv(off.models[0], off, "127.0.0.1", 8100)
    assert "--no-enable-prefix-caching" in argv and _seqs(argv) == p_off.onepage.whole_requests
    assert _seqs(engine_argv(on.models[0], on, "127.0.0.1", 8100)) == p_on.onepage.whole_requests
    tp2 = parse_fleet(fleet_text(models=[dict(MODEL, path=str(tmp_path / "off" / "tiny"), tp=2,
                                              replicas=1, max_num_seqs="planner")]))
    p2 = planned_pool(tp2.models[0], tp2)
    assert p2.tp == 2 and _seqs(engine_argv(tp2.models[0], tp2, "127.0.0.1", 8100)) \
        == p2.onepage.whole_requests


def test_whole_requests_leave_out_vllms_null_block():
    """A pool of exactly n requests' blocks runs n - 1 of them: block 0 is vLLM's null block (stop
    32's H200 planner run capped stock at 72 // 18 = 4 where 3 fit, and preempted 8 a repeat)."""
    from r9k.devtools.tiny_model import build_config

    shape = capacity.HybridModelShape.from_config(build_config())
    p = capacity.plan(shape, tp=1, num_spec=3, kv_bytes_per_rank=6 << 20, max_model_len=1024,
                      platform="cpu", state_dtype="float32")
    assert (p.stock.num_blocks, p.stock.blocks_per_request, p.stock.whole_requests) == (24, 12, 1)
    assert (p.onepage.num_blocks, p.onepage.blocks_per_request, p.onepage.whole_requests) \
        == (24, 6, 3)
    assert p.stock.starts and p.onepage.starts


def test_a_onepage_replica_on_heads_one_page_cannot_serve_is_admitted_by_the_stock_pool(tmp_path):
    """The plugin keeps stock pages for a key head dim that is not a power of two (page_layout's
    rule); planner admission then counts the stock pool the replica really runs."""
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "odd", overrides={"linear_key_head_dim": 48})
    doc = {"platform": "cpu", "entry": {"port": 8000}, "exporter": None,
           "hosts": [{"name": "local", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"}]}],
           "models": [{"name": "odd", "path": str(tmp_path / "odd"), "max_model_len": 1024,
                       "kv_cache_memory_bytes": 12 << 20, "state_dtype": "float32",
                       "max_num_seqs": "planner"}]}
    (tmp_path / "fleet.yaml").write_text(json.dumps(doc))
    cfg = load_fleet(tmp_path / "fleet.yaml")
    plan = planned_pool(cfg.models[0], cfg)
    assert plan.onepage_unservable and plan.onepage.whole_requests > plan.stock.whole_requests
    assert _seqs(engine_argv(cfg.models[0], cfg, "127.0.0.1", 8100)) == plan.stock.whole_requests
