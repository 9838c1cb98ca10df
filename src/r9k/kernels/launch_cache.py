"""The kernels' launch caches: what a launch computes or allocates once per layout and reuses.

Each entry is a function of its key (a layout: shapes, strides, dtypes, device, addresses), so
whichever call fills it, every later call reads the same thing; the scratch buffers' contents
are written before each read. They are kept because the work is host time every layer pays per
step outside CUDA graphs, or because a CUDA graph capture must not allocate or copy from the
host. One object per process (`CACHES`), so a test or a tool can see and clear them all; the
plugin's runtime (`r9k.plugin.runtime`) holds it with the rest of the process's state.
"""
from __future__ import annotations


class LaunchCaches:
    def __init__(self) -> None:
        self.scratch: dict = {}        # cpu: verify's scratch states, per state shape
        self.index_rows: dict = {}     # cpu: [n, width] index rows and ones, per width
        self.row_positions: dict = {}  # cpu: arange(S), per S
        self.single_plans: dict = {}   # triton_align: one layer's ReplayPlan, per its tensors
        self.configs: dict = {}        # triton_fused: (S, constexprs, options), per layout

    def sizes(self) -> dict[str, int]:
        return {name: len(cache) for name, cache in vars(self).items()}

    def clear(self) -> None:
        for cache in vars(self).values():
            cache.clear()


CACHES = LaunchCaches()
