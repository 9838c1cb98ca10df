"""What the wheel ships: the `r9k` package from src/ with its data files and entry points, and
nothing of the lab (research kernels, simulations, measurement programs, results)."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB_MODULES = {p.stem for p in (ROOT / "lab").rglob("*.py")} - {"__init__"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheel")
    # built from a copy, so setuptools' build/ and egg-info stay out of the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "lab", tree / "lab", ignore=shutil.ignore_patterns("__pycache__", "results"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(out), str(tree)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (whl,) = out.glob("r9700_stack-*.whl")
    return zipfile.ZipFile(whl)


def test_the_wheel_carries_the_r9k_package_and_no_lab(wheel):
    names = wheel.namelist()
    outside = [n for n in names if not n.startswith(("r9k/", "r9700_stack-"))]
    assert outside == []
    modules = {Path(n).stem for n in names if n.endswith(".py")}
    assert modules & LAB_MODULES == set()
    assert not any(n.startswith("r9k/lab") or "/results/" in n or "/scripts/" in n for n in names)
    # every package of src/r9k, as the folders lay it out
    packages = {str(p.parent.relative_to(ROOT / "src")) for p in (ROOT / "src" / "r9k").rglob("__init__.py")}
    assert {str(Path(n).parent) for n in names if n.endswith("/__init__.py")} == packages
    # and Python only in those packages: a data folder's script (the dashboards' generator) stays out
    assert {str(Path(n).parent) for n in names if n.endswith(".py")} == packages


def test_the_wheel_carries_the_data_files_and_entry_points(wheel):
    names = set(wheel.namelist())
    src = ROOT / "src"
    data = [p for pattern in ("r9k/ops/systemd/*.service", "r9k/ops/systemd/*.timer",
                              "r9k/monitoring/alerts/*.yml", "r9k/monitoring/runbooks/*.md",
                              "r9k/monitoring/grafana/*.json", "r9k/deploy/examples/*.yaml")
            for p in src.glob(pattern)]
    assert len(data) > 20
    assert {str(p.relative_to(src)) for p in data} <= names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    for line in ("r9k = r9k.cli:main", "r9k = r9k:register",
                 "r9k = r9k.plugin.metrics:PageModeInfoLogger"):
        assert line in text
