"""The install split (pyproject: core vs the fleet / bench / dev / plot extras): a subcommand
whose extra is missing says which extra to install, and the core commands work without any
extra. The packages are hidden from a fresh interpreter by a meta-path finder that refuses them,
as an install without the extras would."""
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIDE = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Hide())
from click.testing import CliRunner
from r9k.cli import main
res = CliRunner().invoke(main, {args!r})
print(res.exit_code)
print(res.output)
"""


def _run(hidden, args):
    code = HIDE.format(hidden=set(hidden), args=list(args))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    exit_code, _, output = res.stdout.partition("\n")
    return int(exit_code), output


@pytest.mark.parametrize("command,package,extra", [
    (["bench", "sanity", "--endpoint", "http://127.0.0.1:9"], "aiohttp", "bench"),
    (["model", "make-tiny", "/nonexistent/r9k-tiny"], "safetensors", "dev"),
    (["capacity", "--preset", "tiny", "--num-spec", "3", "--kv-gib-per-rank", "1",
      "--max-model-len", "4096", "--plot", "/nonexistent/p.png"], "matplotlib", "plot")])
def test_a_missing_extra_is_named(command, package, extra):
    code, out = _run(["ray", "aiohttp", "psutil", "tqdm", "matplotlib", "safetensors",
                      "transformers", "tokenizers"], command)
    assert code == 2, out
    assert f"needs {package}" in out and f"pip install 'r9700-stack[{extra}]'" in out, out


def test_core_commands_run_without_any_extra():
    code, out = _run(["ray", "aiohttp", "psutil", "tqdm", "matplotlib", "safetensors",
                      "transformers", "tokenizers"],
                     ["capacity", "--preset", "qwen3.5-27b", "--tp", "2", "--num-spec", "3",
                      "--kv-gib-per-rank", "8", "--max-model-len", "4096", "--json"])
    assert code == 0, out
    assert json.loads(out)["onepage"]["tokens"] > json.loads(out)["stock"]["tokens"]


def test_core_dependencies_leave_the_extras_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("[")[0] for d in project["dependencies"]}
    assert core == {"torch", "prometheus-client", "pyyaml", "click", "pydantic", "einops"}
    extras = project["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["gpu"])
    assert any(d.startswith("ray") for d in extras["fleet"])
    assert "r9700-stack[fleet,bench,dev,plot]" in extras["test"]
