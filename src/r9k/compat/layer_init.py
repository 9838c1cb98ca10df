"""Touch point: the GDN layer's constructor and its prefill checkpoints.

Changes: the one-page layer takes exactly the release's constructor keywords, and from 0.33
sets the layer's private `_checkpoint_alignment = None` (no prefill checkpoints).
Why no extension route: the constructor decides whether a layer exports checkpoints, and
one-page pages have no checkpoint slot.
Contract: test_layer_keywords_are_the_release_constructor,
test_prefill_checkpoint_opt_out_sets_what_the_release_reads.

Differences between releases:
- Constructor keywords past 0.32's (config, vllm_config, prefix, gqa_interleaved_layout,
  reduce_results): 0.34 adds `overlap_ba_proj` and `fused_gdn_gated_rms_norm` (its new NVIDIA
  Qwen3.5 model passes both). The one-page layer takes exactly the release's keywords and
  hands them to vLLM's constructor; one-page's own work stays in `_forward_core`, which both
  leave alone.
- FlashInfer prefill checkpoints (0.33+: CUDA, FlashInfer prefill, prefix caching): vLLM's
  exporter writes conv and SSM states into prefix-cache pages with plain stores, leaving a
  one-page page's flag and record words as they were, and counts one more page per group.
  A one-page layer opts out (`_checkpoint_alignment = None`, what vLLM's own non-exporting
  layers report); one layer without it turns checkpoints off for the model, so vLLM should
  split prefills at block boundaries as 0.32 did and keep the planner's pages. Intended, not
  yet run on a 0.33 engine."""
from __future__ import annotations

KWARGS_032: tuple[str, ...] = ()
KWARGS_034: tuple[str, ...] = ("overlap_ba_proj", "fused_gdn_gated_rms_norm")


def no_prefill_checkpoints_032(layer) -> None:
    """0.32: vLLM has no prefill checkpoints."""
    del layer


def no_prefill_checkpoints_033(layer) -> None:
    """0.33 and 0.34: the layer reports no checkpoint alignment (read by
    `get_prefill_checkpoint_alignment` and `_exports_checkpoints`)."""
    layer._checkpoint_alignment = None
