"""The one-way layering as import-linter contracts (pyproject.toml's [tool.importlinter]), run as a
user would: a plain `lint-imports` in the checkout, whose folders are the import paths (src/r9k).
The plugin, its kernels, the vLLM touch points and the ground floor import none of the tools above
them and neither click nor Ray; nothing that ships imports the lab; bench over devtools over
deploy and monitoring (which do not import each other) over ops."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint(cwd: Path, src: Path | None = None) -> subprocess.CompletedProcess:
    """`lint-imports` in cwd; with src, that copy of the package on the path."""
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_plain_lint_imports_in_the_checkout_keeps_every_contract():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in res.stdout


def _copy(tmp_path: Path) -> Path:
    """A copy of the checkout's config and package, to break on purpose (the checkout stays)."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "src", tmp_path / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return tmp_path / "src"


def test_a_plugin_module_importing_the_fleet_breaks_a_contract(tmp_path):
    src = _copy(tmp_path)
    policy = src / "r9k" / "plugin" / "policy.py"
    policy.write_text(policy.read_text() + "\nimport r9k.deploy.controller  # noqa\n")
    res = _lint(tmp_path, src)
    assert res.returncode == 1 and "BROKEN" in res.stdout
    assert "r9k.plugin.policy -> r9k.deploy.controller" in res.stdout


def test_a_shipped_module_importing_the_lab_breaks_a_contract(tmp_path):
    src = _copy(tmp_path)
    sweep = src / "r9k" / "bench" / "sweep.py"
    sweep.write_text(sweep.read_text() + "\nimport lab.engine_runs  # noqa\n")
    res = _lint(tmp_path, src)
    assert res.returncode == 1 and "what ships never imports the lab BROKEN" in res.stdout
    assert "r9k.bench.sweep -> lab (l." in res.stdout
