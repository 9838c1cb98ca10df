"""Touch point: the GDN metadata builder's internals, on the one-page builder.

Changes: after vLLM's constructor, `OnePageGDNMetadataBuilder` (`r9k.plugin.gdn_layer`)
replaces `spec_state_indices_tensor` with a one-column buffer of `decode_cudagraph_max_bs`
rows (`one_column_spec_indices`), and where the release shares GDN metadata across kv-cache
groups, sets `supports_update_block_table` and opts into `mamba_aligned_state_indices` on the
terms vLLM grants its own class (`share`).
Why no extension route: the model runner passes accepted counts only to
`GDNAttentionMetadataBuilder` instances, so the builder must stay a subclass; the stock
[max_bs, k+1] buffer would silently broadcast one-page's [n, 1] indices into every column; and
vLLM grants sharing (building the metadata once per step, re-gathering only the other groups'
state indices) to `type(self) is GDNAttentionMetadataBuilder` only. The one-page builder adds
no per-group metadata, so it takes the same terms.
Contract: test_metadata_sharing_is_the_releases_rule,
test_the_builders_buffers_the_one_page_builder_replaces.
"""
from __future__ import annotations

import torch


def v032(vllm_config, device) -> bool:
    """0.32 and 0.33 (`gdn_attn.py:134` / `:185`): the V2 model runner on a CUDA-alike
    device."""
    return bool(vllm_config.use_v2_model_runner) and device.type == "cuda"


def v034(vllm_config, device) -> bool:
    """0.34 (`gdn_attn.py:202`): V2 is the only runner; CUDA-alike or XPU."""
    del vllm_config
    return device.type in ("cuda", "xpu")


def one_column_spec_indices(builder, device) -> None:
    builder.spec_state_indices_tensor = torch.empty(
        (builder.decode_cudagraph_max_bs, 1), dtype=torch.int32, device=device)


def share(builder) -> None:
    """Build once per step and share across the one-page groups, as vLLM's own class does."""
    builder.supports_update_block_table = True
    if not hasattr(builder, "mamba_aligned_state_indices"):
        builder.mamba_aligned_state_indices = None  # opts into V2's aligned-index precompute
