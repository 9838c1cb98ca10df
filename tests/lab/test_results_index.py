"""lab/results/README.md lists every result file, and only those
(`lab/scripts/index_results.py` writes it)."""
from lab.scripts import index_results


def _index_module():
    return index_results


def test_the_index_lists_every_result_file():
    ix = _index_module()
    missing, gone = ix.stale()
    assert (missing, gone) == ([], []), (
        f"not listed: {missing}; listed but gone: {gone}; run python -m lab.scripts.index_results")
    assert len(ix.listed(ix.INDEX.read_text())) >= 100


def test_a_new_file_makes_it_stale(tmp_path, monkeypatch):
    ix = _index_module()
    results = tmp_path / "results"
    results.mkdir()
    for name in ("gpu_perf_x.json", "gdn_kernel_y.md"):
        (results / name).write_text('{"meta": {"command": "python run"}}' if name.endswith(
            ".json") else "# a result\n")
    monkeypatch.setattr(ix, "RESULTS", results)
    monkeypatch.setattr(ix, "INDEX", results / "README.md")
    assert ix.stale() == (["gdn_kernel_y.md", "gpu_perf_x.json"], [])
    ix.INDEX.write_text(ix.render())
    assert ix.stale() == ([], [])
    text = ix.INDEX.read_text()
    assert "| `gpu_perf_x.json` | command: `python run` |" in text
    assert "| `gdn_kernel_y.md` | a result |" in text
    (results / "gpu_perf_x.json").unlink()
    assert ix.stale() == ([], ["gpu_perf_x.json"])


def test_the_index_speaks_to_users():
    """No internal run, round, item or issue number in the index a regeneration writes (titles,
    sources and commands come from the result files themselves) or in a result file's name;
    another project's issue (vLLM's, LACT's) may be cited."""
    import re

    ix = _index_module()
    text = ix.render()
    internal = re.findall(r"(?i)\b(?:stop \d+|round ?\d+|item ?\d+)\b", text)
    issues = [m.group(0) for m in re.finditer(r"(?i)\bissue \d+", text)
              if not text[:m.start()].lower().endswith(("vllm ", "lact ", "github "))]
    assert not internal and not issues, internal + issues
    names = [p.name for p in ix.RESULTS.iterdir()]
    assert not [n for n in names if re.search(r"(?i)stop\d|round\d|review|_item\d", n)]
