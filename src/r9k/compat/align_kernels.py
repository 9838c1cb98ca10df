"""Difference: the two align copy kernels' signatures (`v1/worker/mamba_utils.py`), which
the stand-ins of `r9k.compat.align_globals` launch them by.

The plugin's ports and GPU stand-ins bind vLLM's launches by these; a parameter a release adds
and the stand-in lacks fails the launch (`TypeError`), one bound to the wrong name copies the
wrong bytes. 0.32 and 0.33: `r9k.kernels.cpu_align.PRECOPY` / `BOUNDARY`. 0.34 adds a
constexpr flag to each for its ReplaySSM Mamba2 layers, always passed by keyword:
`ZERO_TEMPORAL_TOKEN_BIAS` (pre-copy) and `SKIP_TEMPORAL_STATE_COPY` (boundary copy), before
`TEMPORAL_TILES`. The CPU ports honour both; the one-page ports refuse them when a one-page
layer shares the launch (they are never set for GDN)."""
from __future__ import annotations

import dataclasses
import inspect

from r9k.kernels.cpu_align import BOUNDARY, PRECOPY, with_constexpr


@dataclasses.dataclass(frozen=True)
class AlignSignatures:
    precopy: inspect.Signature
    boundary: inspect.Signature


V032 = AlignSignatures(PRECOPY, BOUNDARY)
V034 = AlignSignatures(
    with_constexpr(PRECOPY, "ZERO_TEMPORAL_TOKEN_BIAS", False, before="TEMPORAL_TILES"),
    with_constexpr(BOUNDARY, "SKIP_TEMPORAL_STATE_COPY", False, before="TEMPORAL_TILES"))
