"""Finds the module-level names a package's code changes at run time, by reading its source.

A name counts when some function of its module rebinds it (`global`), or writes into it:
an item or attribute stored or deleted through it (`NAME[k] = v`, `NAME.x[k] = v`,
`NAME.x = v`) or a mutating method called on it (`NAME.add(...)`, `NAME.x.clear()`); and a
module-level function that memoizes (`functools.lru_cache` / `cache`) counts as its own state.
Not seen: aliases (`import a.b as x`, `y = NAME` then `y.add(...)`).
A name imported from the package (`from r9k.kernels.launch_cache import CACHES`) and written
into counts for the module that defines it. Names bound by other imports are not state
(`os.environ.pop` is the os module's business).
"""
from __future__ import annotations

import ast
from pathlib import Path

MUTATORS = frozenset({"append", "extend", "insert", "add", "update", "clear", "pop", "popitem",
                      "setdefault", "discard", "remove", "__setitem__", "__delitem__", "sort",
                      "reverse", "appendleft", "extendleft", "popleft", "move_to_end",
                      "difference_update", "intersection_update",
                      "symmetric_difference_update"})
MEMOIZERS = frozenset({"lru_cache", "cache"})


def _root(node: ast.AST) -> str | None:
    """The name an attribute / item chain starts from (`a.b[c].d` -> `a`)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _decorator_name(node: ast.expr) -> str | None:
    """`lru_cache` for @lru_cache, @lru_cache(maxsize=1) and @functools.lru_cache."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _module_names(tree: ast.Module, package: str) -> tuple[set[str], dict]:
    """(names the module binds at its top level, not by import; {local name: (module, name)}
    for names imported from `package`)."""
    bound, imported, ours = set(), set(), {}
    for node in ast.walk(tree):  # imports inside functions too
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
            ours |= {a.asname or a.name: (node.module, a.name) for a in node.names}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                bound |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound - imported, ours


def _locals(fn: ast.AST) -> set[str]:
    """Names a function binds itself (parameters, assignments), unless declared global."""
    args = fn.args
    names = {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    declared = {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}
    return names - declared


def mutated_names(source: str, module: str = "", package: str = "r9k") -> set[tuple[str, str]]:
    """{(defining module, name)} of the module-level names `source` (module `module`)
    changes."""
    tree = ast.parse(source)
    bound, ours = _module_names(tree, package)
    found: set[str] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                             ast.Lambda))]
    for fn in functions:
        if isinstance(fn, ast.Lambda):
            local = {a.arg for a in fn.args.args}
        else:
            local = _locals(fn)
        hits: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                hits |= set(node.names) & bound
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for t in targets:
                if isinstance(t, (ast.Attribute, ast.Subscript)):
                    hits.add(_root(t))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATORS):
                hits.add(_root(node.func.value))
        found |= hits - local  # a name the function binds itself is its own
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _decorator_name(d) in MEMOIZERS for d in node.decorator_list):
            found.add(node.name)
    # module-level statements that mutate (outside functions) run once at import: not state
    return ({(module, n) for n in found if n in bound}
            | {ours[n] for n in found if n in ours})


def package_state(root: Path, packages: tuple[str, ...]) -> set[tuple[str, str]]:
    """{(module, name)} over the .py files of `packages` under `root` (a `src` folder)."""
    out = set()
    for package in packages:
        for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(
                ".__init__")
            out |= mutated_names(path.read_text(), module, packages[0].split(".")[0])
    return out
