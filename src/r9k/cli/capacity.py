"""`r9k capacity`: how much KV cache one-page pages buy, from the capacity module."""
from __future__ import annotations

import json
from pathlib import Path

import click

from r9k.core import capacity as cap
from r9k.cli_errors import BadInput, FiniteFloat

GIB = 1 << 30


@click.command()
@click.option("--preset", type=str, help=f"model preset: {', '.join(sorted(cap.PRESETS))}")
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="a model's config.json (or its directory)")
@click.option("--tp", type=int, default=1, show_default=True, help="tensor-parallel size")
@click.option("--num-spec", type=int, required=True,
              help="speculative tokens k per step (0: no speculative decoding)")
@click.option("--kv-gib-per-rank", type=FiniteFloat(), help="KV cache memory per rank in GiB")
@click.option("--kv-bytes-per-rank", type=int, help="KV cache memory per rank in bytes")
@click.option("--max-model-len", type=int, required=True, help="tokens per request")
@click.option("--state-dtype", type=click.Choice(["float32", "bfloat16"]),
              help="SSM state dtype [default: the config's mamba_ssm_dtype, else model dtype]")
@click.option("--platform", type=click.Choice(["gpu", "cpu"]), default="gpu", show_default=True,
              help="attention block alignment: gpu 16 tokens (64 on vLLM 0.34: see --vllm), "
                   "vllm-cpu 128")
@click.option("--vllm", "vllm_series", type=click.Choice(list(cap.VLLM_DEFAULT_BLOCK_TOKENS)),
              default=cap.VLLM_SERIES, show_default=True,
              help="the vLLM release series (0.34's default block is 64 tokens, not 16)")
@click.option("--running", type=int, default=8, show_default=True,
              help="running requests for the pinned share")
@click.option("--prefix-caching/--no-prefix-caching", default=cap.VLLM_DEFAULT_PREFIX_CACHING,
              show_default=True,
              help="the engine's prefix caching (vLLM's default for hybrids: on, mamba cache "
                   "mode align: 2 + k stock / 2 one-page GDN pages; off: none, 1 + k / 1)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="draw tokens against max_model_len for both modes to this PNG")
def capacity(preset: str | None, config_path: Path | None, tp: int, num_spec: int,
             kv_gib_per_rank: float | None, kv_bytes_per_rank: int | None, max_model_len: int,
             state_dtype: str | None, platform: str, vllm_series: str, running: int,
             prefix_caching: bool,
             as_json: bool, plot_path: Path | None) -> None:
    """KV-cache capacity of stock vs one-page GDN pages, as vLLM accounts it (0.32 unless
    --vllm says)."""
    if (preset is None) == (config_path is None):
        raise BadInput("give exactly one of --preset NAME or --config PATH/config.json")
    if (kv_gib_per_rank is None) == (kv_bytes_per_rank is None):
        raise BadInput("give exactly one of --kv-gib-per-rank G or --kv-bytes-per-rank B")
    kv_bytes = kv_bytes_per_rank if kv_bytes_per_rank is not None else int(kv_gib_per_rank * GIB)
    try:
        shape = cap.preset(preset) if preset else cap.HybridModelShape.from_path(config_path)
        result = cap.plan(shape, tp=tp, num_spec=num_spec, kv_bytes_per_rank=kv_bytes,
                          max_model_len=max_model_len, platform=platform, vllm=vllm_series,
                          state_dtype=state_dtype, running=running,
                          prefix_caching=prefix_caching)
    except cap.CapacityInputError as exc:
        raise BadInput(str(exc)) from None
    if plot_path:
        draw_plot(shape, result, plot_path)
    if as_json:
        click.echo(json.dumps(result.public(), indent=2))
        return
    click.echo(format_table(result))


def format_table(r: cap.CapacityPlan) -> str:
    rows = [
        ("GDN page (B)", r.stock.gdn_page_bytes, r.onepage.gdn_page_bytes),
    ]
    if r.stock.ple_page_bytes:  # Qwen4Exp: the replicated PLE short-conv page
        rows.append(("PLE page, every rank (B)", r.stock.ple_page_bytes, r.onepage.ple_page_bytes))
    rows += [
        ("shared page (B)", r.stock.page_bytes, r.onepage.page_bytes),
        ("attention block (tokens)", r.stock.attention_block_size, r.onepage.attention_block_size),
        ("KV cache groups (GDN/PLE/attn/ring)",
         *(f"{p.num_gdn_groups}/{p.num_ple_groups}/{p.num_attention_groups}/"
           f"{p.num_indexer_ring_groups}" for p in (r.stock, r.onepage))),
        ("GDN pages per request per group", r.stock.gdn_pages_per_request,
         r.onepage.gdn_pages_per_request),
    ]
    if r.stock.num_ple_groups:
        rows.append(("PLE pages per request per group", r.stock.ple_pages_per_request,
                     r.onepage.ple_pages_per_request))
    rows += [
        ("bytes per pool block", r.stock.block_bytes, r.onepage.block_bytes),
        ("blocks in pool", r.stock.num_blocks, r.onepage.num_blocks),
        ("blocks per request", r.stock.blocks_per_request, r.onepage.blocks_per_request),
        ("KV cache tokens", f"{r.stock.tokens:,}", f"{r.onepage.tokens:,}"),
        ("max concurrency", f"{r.stock.max_concurrency:.2f}x", f"{r.onepage.max_concurrency:.2f}x"),
        ("whole requests at once", r.stock.whole_requests, r.onepage.whole_requests),
        (f"pool pinned by {r.stock.running} running", f"{r.stock.pinned_fraction:.1%}",
         f"{r.onepage.pinned_fraction:.1%}"),
    ]
    head = (f"{r.model}: TP {r.tp}, k = {r.num_spec}, {r.kv_bytes_per_rank / GIB:.2f} GiB KV per "
            f"rank, max_model_len {r.max_model_len:,}, {r.state_dtype} state, "
            f"{r.platform} (vLLM {r.vllm}), "
            f"prefix caching {'on' if r.prefix_caching else 'off'} "
            f"(mamba_cache_mode={r.cache_mode})")
    w = max(len(a) for a, _, _ in rows)
    lines = [head, f"{'':{w}}  {'stock':>14}  {'one-page':>14}"]
    lines += [f"{a:{w}}  {b!s:>14}  {c!s:>14}" for a, b, c in rows]
    lines.append(f"one-page / stock tokens: x{r.ratio:.3f}")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def draw_plot(shape: cap.HybridModelShape, r: cap.CapacityPlan, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--plot needs matplotlib (pip install 'r9700-stack[plot]')") from None
    lens = sorted({int(r.max_model_len * f) for f in (0.125, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8)}
                  | {r.max_model_len})
    series = {"stock": [], "onepage": []}
    for length in lens:
        p = cap.plan(shape, tp=r.tp, num_spec=r.num_spec, kv_bytes_per_rank=r.kv_bytes_per_rank,
                     max_model_len=length, platform=r.platform, vllm=r.vllm,
                     state_dtype=r.state_dtype,
                     running=r.stock.running, prefix_caching=r.prefix_caching)
        series["stock"].append(p.stock.tokens)
        series["onepage"].append(p.onepage.tokens)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(lens, series["stock"], marker="o",
            label=f"stock ({r.stock.gdn_pages_per_request} pages, {r.cache_mode})")
    ax.plot(lens, series["onepage"], marker="o",
            label=f"one-page ({r.onepage.gdn_pages_per_request} pages, {r.cache_mode})")
    ax.axvline(r.max_model_len, color="grey", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_model_len (tokens)")
    ax.set_ylabel("KV cache capacity (tokens)")
    ax.set_title(f"{r.model}, TP {r.tp}, k = {r.num_spec}, {r.kv_bytes_per_rank / GIB:.2f} GiB/rank")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
