"""Touch point: `VllmConfig._set_cudagraph_sizes`, wrapped.

Changes: wraps the private method so that, after vLLM computed its CUDA-graph capture sizes
itself, the plugin may add sizes (`r9k.plugin.draft_graphs`: max_num_seqs, for the draft
model's later steps), also as compile sizes where vLLM compiles its capture sizes. Sizes a
user gave are left as given.
Why no extension route: no configuration hook runs after vLLM sizes its graphs.
Contract: test_the_cudagraph_sizes_method_the_draft_graphs_wrap.
"""
from __future__ import annotations

from typing import Any, Callable

METHOD = "_set_cudagraph_sizes"


def wrap(config_cls: Any, add_sizes: Callable[[Any], list[int] | None]) -> bool:
    """Wrap `config_cls._set_cudagraph_sizes` (once: a wrapped one stays as it is);
    `add_sizes(vllm_config)` sets and returns the new capture sizes, or None. False where the
    release has no such method."""
    original = getattr(config_cls, METHOD, None)
    if original is None:
        return False
    if getattr(original, "r9k_wrapped", False):
        return True

    def _set_cudagraph_sizes(self) -> None:
        given = self.compilation_config.cudagraph_capture_sizes is not None
        # vLLM expands this token into compile_sizes at the end of the original
        compiled = "cudagraph_capture_sizes" in (self.compilation_config.compile_sizes or [])
        original(self)
        if given:
            return
        before = set(self.compilation_config.cudagraph_capture_sizes or [])
        sizes = add_sizes(self)
        if sizes is not None and compiled:
            cc = self.compilation_config
            cc.compile_sizes = sorted(set(cc.compile_sizes) | (set(sizes) - before))

    _set_cudagraph_sizes.r9k_wrapped = True
    _set_cudagraph_sizes.__wrapped__ = original
    setattr(config_cls, METHOD, _set_cudagraph_sizes)
    return True
