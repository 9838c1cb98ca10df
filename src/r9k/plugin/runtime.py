"""Everything the plugin keeps between calls in a process, in one object.

vLLM runs one engine, or one worker of it, per process, and reaches the plugin through names it
looks up (the entry point, the layer class, the align copy kernels in `mamba_utils`, a custom
op); none of those calls carries an object of the plugin's. So the state is the process's: one
`Runtime`, `current()`. The engine fills it as it builds: each one-page layer adds itself
(`track_layer`), each one-page metadata builder its kv-cache group (`track_group`, in group
order, the order the copy kernels list states in); prefix caching's copies then read it
(`r9k.plugin.onepage_align.onepage_states`). A test builds its own `Runtime` to run that check,
or `reset()`s the process's.

Below the plugin, two holders stay where their readers are, because the kernels and the
release adapter serve tools and tests without the plugin: the kernels' launch caches
(`r9k.kernels.launch_cache.CACHES`, held here as `kernel_caches`) and the release adapter
registration chose (`r9k.compat.current()`).
"""
from __future__ import annotations

import dataclasses
import weakref

from r9k.kernels.launch_cache import CACHES, LaunchCaches


@dataclasses.dataclass
class AlignState:
    """The one-page layers and groups prefix caching's copies replay, and what the copies
    compute once per state metadata (`r9k.plugin.onepage_align`)."""
    layers: "weakref.WeakValueDictionary[str, object]" = dataclasses.field(
        default_factory=weakref.WeakValueDictionary)  # prefix -> one-page GDN layer
    groups: list[tuple[str, ...]] = dataclasses.field(default_factory=list)  # in group order
    resolved: dict = dataclasses.field(default_factory=dict)    # metadata -> {state: (layer, g)}
    stock_meta: dict = dataclasses.field(default_factory=dict)  # metadata -> arrays w/o one-page
    plans: dict = dataclasses.field(default_factory=dict)       # metadata -> ReplayPlan


@dataclasses.dataclass
class GraphState:
    """The align copies' CUDA graphs (`r9k.plugin.align_graphs`)."""
    disabled: bool | None = None  # None: R9K_ALIGN_GRAPHS not read yet
    graphs: dict = dataclasses.field(default_factory=dict)    # launch key -> CUDAGraph
    pending: set = dataclasses.field(default_factory=set)     # keys seen once
    static: dict = dataclasses.field(default_factory=dict)    # kept copies of per-step tensors
    pools: dict = dataclasses.field(default_factory=dict)     # device -> graph memory pool
    streams: dict = dataclasses.field(default_factory=dict)   # device -> capture stream
    captures: int = 0
    replays: int = 0
    eager: int = 0


@dataclasses.dataclass
class Runtime:
    # what the plugin did to vLLM or torch that a process cannot undo ("plugin", "layer",
    # "cpu-op"): `reset` keeps it, so nothing is registered twice
    registered: set[str] = dataclasses.field(default_factory=set)
    said: set[str] = dataclasses.field(default_factory=set)  # log lines said once per process
    align: AlignState = dataclasses.field(default_factory=AlignState)
    graphs: GraphState = dataclasses.field(default_factory=GraphState)
    kernel_caches: LaunchCaches = CACHES

    def once(self, key: str) -> bool:
        """True the first time `key` is said in this process (log once)."""
        if key in self.said:
            return False
        self.said.add(key)
        return True

    def track_layer(self, layer) -> None:
        """A one-page GDN layer: its SSM state replays in the align copies."""
        self.align.layers[layer.prefix] = layer

    def track_group(self, layer_names) -> None:
        """A one-page GDN metadata builder's layers. vLLM builds the builders group by group in
        kv-cache-group order."""
        names = tuple(layer_names)
        if names not in self.align.groups:
            self.align.groups.append(names)


_runtime = Runtime()


def current() -> Runtime:
    return _runtime


def reset() -> Runtime:
    """A fresh runtime for the process, keeping what cannot be undone (`registered`), and the
    kernels' caches cleared (tests: one engine per process otherwise)."""
    global _runtime
    _runtime = Runtime(registered=_runtime.registered)
    CACHES.clear()
    return _runtime
