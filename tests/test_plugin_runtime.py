"""The plugin's process-wide state is one object (`r9k.plugin.runtime`), and the two holders
below the plugin (the kernels' launch caches, the release adapter) and the memo of the stock
kernel's module are the only other module-level state the plugin, kernels and release adapters
change at run time (found by reading their source: `doubles.module_state`)."""
from __future__ import annotations

from pathlib import Path

import torch

from doubles.module_state import mutated_names, package_state
from r9k.kernels.launch_cache import CACHES
from r9k.plugin import align_graphs, runtime

SRC = Path(__file__).resolve().parents[1] / "src"
HOLDERS = {
    ("r9k.plugin.runtime", "_runtime"),        # the plugin's Runtime
    ("r9k.kernels.launch_cache", "CACHES"),    # the kernels' launch caches (Runtime.kernel_caches)
    ("r9k.compat", "_current"),                # the release adapter registration chose
    # the stock Triton GDN kernel's module, loaded once (an import's result, not run-time state)
    ("r9k.kernels._stock_loader", "stock_module"),
}


def test_the_only_module_state_is_the_runtime_and_the_holders_below_it():
    assert package_state(SRC, ("r9k.plugin", "r9k.kernels", "r9k.compat")) == HOLDERS


def test_the_finder_sees_each_way_of_keeping_state():
    """What the finder counts, so the test above cannot pass by not looking."""
    source = '''
import functools
from r9k.kernels.launch_cache import CACHES
import os
_flag = False
_seen = set()
_table = {}
_obj = object()
_fine = {"constant": 1}
_local = []
_shadowed = []
_ordered = []

@functools.lru_cache(maxsize=1)
def _memo():
    return 1

def g(_local):
    _local.append(1)  # its own parameter

def h():
    _shadowed.append(1)  # the module's, though a later function has a local of that name
    _ordered.sort()

def k(_shadowed):
    return _shadowed

def f(x):
    global _flag
    _flag = True
    _seen.add(x)
    _table[x] = 1
    _obj.count = 2
    CACHES.configs.clear()
    os.environ.pop("X", None)
    _local = [x]
    _local.append(x)
    return _fine["constant"]
'''
    assert mutated_names(source, "m") == {("m", "_flag"), ("m", "_seen"), ("m", "_table"),
                                          ("m", "_obj"), ("m", "_shadowed"), ("m", "_ordered"),
                                          ("m", "_memo"),
                                          ("r9k.kernels.launch_cache", "CACHES")}


def test_reset_keeps_what_cannot_be_undone_and_forgets_the_rest(monkeypatch):
    monkeypatch.setenv("R9K_ALIGN_GRAPHS", "0")
    rt = runtime.current()
    rt.registered.add("test-registration")
    rt.track_group(["model.layers.0.linear_attn"])
    assert rt.once("said") and not rt.once("said")
    align_graphs.run(lambda args, onepage: None, ("k",), {"num_reqs": 1}, {})
    assert align_graphs.stats()["eager"] == 1
    CACHES.row_positions[(3, "cpu")] = torch.arange(3)
    try:
        fresh = runtime.reset()
        assert fresh is runtime.current() and fresh is not rt
        assert "test-registration" in fresh.registered  # the registrations stay
        assert fresh.align.groups == [] and fresh.once("said")
        assert align_graphs.stats() == {"graphs": 0, "captures": 0, "replays": 0, "eager": 0}
        assert CACHES.sizes() == dict.fromkeys(CACHES.sizes(), 0)
        assert fresh.kernel_caches is CACHES
    finally:
        runtime.current().registered.discard("test-registration")
        runtime.reset()
