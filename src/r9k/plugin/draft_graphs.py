"""Capture the draft model's later steps as CUDA graphs up to max_num_seqs (GPU engines).

vLLM sizes its CUDA graphs when it builds its config (`VllmConfig._set_cudagraph_sizes`, in the
front-end process, after the plugin is loaded); the draft model's one-token steps take only the
sizes up to max_num_seqs, which vLLM's defaults skip for 5-7 and 9-15 requests
(`r9k.plugin.policy.draft_capture_sizes` says why it matters). This wraps that method to add
max_num_seqs where vLLM computed the sizes itself; sizes a user gave are left as given, and
`R9K_DRAFT_GRAPHS=0` leaves vLLM's. Engines without CUDA graphs (CPU, eager) have no sizes:
nothing changes there.
"""
from __future__ import annotations

import logging
from typing import Any

from r9k.compat import cudagraph_sizes
from r9k.plugin.policy import draft_capture_sizes, draft_graphs

logger = logging.getLogger("vllm.r9k")


def add_max_num_seqs(vllm_config: Any) -> list[int] | None:
    """The sizes set on `vllm_config` (a VllmConfig whose sizes vLLM just computed), or None."""
    cc = vllm_config.compilation_config
    spec = vllm_config.speculative_config
    sizes = draft_capture_sizes(list(cc.cudagraph_capture_sizes or []),
                                vllm_config.scheduler_config.max_num_seqs,
                                (spec.num_speculative_tokens or 0) if spec is not None else 0,
                                cc.max_cudagraph_capture_size or 0)
    if sizes is not None:
        seqs = vllm_config.scheduler_config.max_num_seqs
        logger.info("r9k: CUDA graphs also at max_num_seqs %d for the draft model's later steps "
                    "(vLLM's sizes below it: %s)", seqs,
                    [s for s in cc.cudagraph_capture_sizes if s < seqs])
        cc.cudagraph_capture_sizes = sizes
    return sizes


def _added_sizes(vllm_config: Any) -> list[int] | None:
    return add_max_num_seqs(vllm_config) if draft_graphs() else None


def install(config_cls: Any) -> bool:
    """Wrap `config_cls._set_cudagraph_sizes` (`r9k.compat.cudagraph_sizes`; once); False where
    the release has no such method."""
    return cudagraph_sizes.wrap(config_cls, _added_sizes)
