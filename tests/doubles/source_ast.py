"""Reading a release's (or the plugin's) Python source as syntax, for the per-release contract
tests (tests/test_compat.py, tests/test_vllm_touch_points.py): no import, so a staged release's
files need none of its compiled parts."""
from __future__ import annotations

import ast
from pathlib import Path

GDN = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"  # the GDN layer's module


def parse(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text())


def class_def(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def function_def(body, name: str) -> ast.FunctionDef:
    """The function `name` among `body`'s statements (a module's or a class's body)."""
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


def self_attrs(fn: ast.AST, ctx) -> set[str]:
    """The `self.X` names `fn` stores (ctx ast.Store) or reads (ast.Load)."""
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ctx)}
