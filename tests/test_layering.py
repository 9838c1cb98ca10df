"""The one-way layering as import-linter contracts (pyproject.toml's [tool.importlinter]): the
plugin imports none of deploy/ops/monitoring/bench/devtools and neither click nor Ray; bench over
devtools over deploy and monitoring (which do not import each other) over ops. r9k's subpackages
live in folders of their own (pyproject's package-dir), which import-linter's graph builder does
not follow, so the test lays the package out as it installs: one `r9k` tree of links."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"kernels": "kernels", "deploy": "deploy", "ops": "ops", "monitoring": "monitoring",
               "bench": "bench", "devtools": "devtools"}


def _tree(dest: Path) -> Path:
    pkg = dest / "r9k"
    pkg.mkdir(parents=True)
    for f in (ROOT / "r9k_plugin").iterdir():
        if f.name != "__pycache__":
            (pkg / f.name).symlink_to(f)
    for name, folder in SUBPACKAGES.items():
        (pkg / name).symlink_to(ROOT / folder)
    return dest


def _lint(tmp_path: Path, tree: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return subprocess.run([str(exe), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tree)),
                          capture_output=True, text=True, timeout=300)


def test_the_layering_contracts_hold(tmp_path):
    res = _lint(tmp_path, _tree(tmp_path / "tree"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in res.stdout


def test_a_plugin_module_importing_the_fleet_breaks_a_contract(tmp_path):
    tree = _tree(tmp_path / "tree")
    policy = tree / "r9k" / "policy.py"
    policy.unlink()  # a copy, not the link: the checkout stays as it is
    shutil.copy(ROOT / "r9k_plugin" / "policy.py", policy)
    policy.write_text(policy.read_text() + "\nimport r9k.deploy.controller  # noqa\n")
    res = _lint(tmp_path, tree)
    assert res.returncode == 1 and "BROKEN" in res.stdout
    assert "r9k.policy -> r9k.deploy.controller" in res.stdout
