"""The one-page page layout and what it can serve: the one home the plugin's layer, the kernels,
the planner (r9k.core.capacity) and the policy read.

A one-page GDN page is the stock page's two tensors (conv window, SSM state) followed by the
record of last step's candidate rows and its flag words. Nothing here imports torch or vLLM.
"""
from __future__ import annotations

# One-page page: the stock tensors, then the record and its flag word. This order is the
# layer's `kv_cache` tuple and the model class's state shapes and dtypes.
PAGE_CONV, PAGE_SSM, PAGE_RECORD, PAGE_FLAG = 0, 1, 2, 3
# Record: two slots (a step reads one, writes the other) of S = 1 + k candidate rows.
RECORD_SLOTS = 2
# Flag words per page: a head of FLAG_WORDS (live row count, live slot (parity), the measured
# count-in protocols' done counter (0 between launches), one spare word), then one (count, slot)
# pair per program of the fused GPU kernel (value head x value block): each program reads and
# flips its own pair, so no program waits on another and none counts in. Every writer keeps
# the pairs equal to the head.
FLAG_WORDS = 4
FLAG_COUNT, FLAG_SLOT, FLAG_DONE = 0, 1, 2
FLAG_DTYPE, FLAG_WORD_BYTES = "int32", 4
FLAG_PAIR_WORDS = 2
# the fused kernel's value block: the stock kernel's tiling, BV = min(next power of two of V, 32)
KERNEL_V_BLOCK_MAX = 32
# The one-page kernel keeps the stock kernel's key block (BK = K, one block per head): a key
# head dim that is not a power of two, or more than fits one block, is not served.
MAX_HEAD_K_DIM = 256


def head_dims_reason(head_k_dim: int, head_v_dim: int) -> str | None:
    """Why one-page cannot serve GDN heads of these per-head dims, or None. The one rule: the
    policy keeps stock pages for it, the kernel launch refuses it, the planner notes it. Any
    value dim is served (the value blocks are the stock kernel's, masked)."""
    if head_k_dim < 1 or head_v_dim < 1:
        return f"GDN head dims {head_k_dim}/{head_v_dim}: expected positive key and value dims"
    if head_k_dim & (head_k_dim - 1):
        return (f"GDN key head dim {head_k_dim} is not a power of two (the one-page kernel keeps "
                "the stock kernel's key block, BK = K)")
    if head_k_dim > MAX_HEAD_K_DIM:
        return f"GDN key head dim {head_k_dim} exceeds {MAX_HEAD_K_DIM} (one key block per head)"
    return None


def mamba_groups_reason(num_ple_layers: int, prefix_caching: bool) -> str | None:
    """Why one-page cannot serve a model whose other mamba layers keep stock's speculative
    pages, or None. The one rule: the policy keeps stock pages for it, the planner notes it.

    Qwen4Exp's PLE short conv is vLLM's layer and keeps 1 + k pages; one-page GDN groups keep 1.
    Under prefix caching vLLM's V1 and V2 runners stop at start unless every mamba group keeps
    the same speculative pages ("all mamba groups must share cache scheduling parameters", seen
    on the CUDA engine); without it they run (and were token-identical to stock).

    Giving the PLE layer no speculative pages instead is not bit-identical: vLLM's short conv
    passes the width of its state-index rows (1 + speculative pages) to `causal_conv1d_update` as
    max_query_len, which sizes the conv window the kernel rewrites (NP2_STATELEN), so one column
    would write back next_power_of_2(width - 1) of the width - 1 + k rows the next step reads."""
    if num_ple_layers > 0 and prefix_caching:
        return ("Qwen4Exp's PLE layers with prefix caching: vLLM's runners need every mamba "
                "group to keep the same speculative pages and the PLE short conv keeps stock's "
                "(one-page serves it with --no-enable-prefix-caching)")
    return None


def record_row_elements(num_k_heads: int, num_v_heads: int, head_k_dim: int,
                        head_v_dim: int) -> int:
    """Elements per record row (per TP rank): the post-conv k and v rows plus the a and b gate
    inputs; q is not needed to rebuild the state."""
    return num_k_heads * head_k_dim + num_v_heads * head_v_dim + 2 * num_v_heads


def kernel_programs_per_page(num_v_heads: int, head_v_dim: int) -> int:
    """Programs of the fused GPU kernel per page and step (per TP rank): value heads x value
    blocks of min(next power of two of V, KERNEL_V_BLOCK_MAX)."""
    block = min(1 << max(head_v_dim - 1, 0).bit_length(), KERNEL_V_BLOCK_MAX)
    return num_v_heads * -(-head_v_dim // block)


def flag_words(num_v_heads: int, head_v_dim: int) -> int:
    """int32 flag words per page (per TP rank): the head and one pair per kernel program."""
    return FLAG_WORDS + FLAG_PAIR_WORDS * kernel_programs_per_page(num_v_heads, head_v_dim)


def onepage_extra_dtypes(model_dtype: str) -> tuple[str, str]:
    """(record, flag word) dtypes: the record keeps the layer's rows bit-exactly, so it is
    stored in the model dtype the layer computes them in."""
    return model_dtype, FLAG_DTYPE
