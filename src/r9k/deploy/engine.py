"""One replica's vLLM engine: its command line and environment (pure), and the proof that the
plugin runs in the page mode asked for, from the replica's own /metrics.

Proof: the plugin's `r9k_plugin_info` series (computed in the API server from the engine config,
`r9k.plugin.metrics`) says which pages and why, AND the pool vLLM reports
(`vllm:cache_config_info` num_gpu_blocks, the minimum over ranks, and block_size) equals the
capacity planner's pool for that mode. A rank that sized other pages (an engine without the
plugin, say) shows as a pool of another size or attention block, whatever the series says.
"""
from __future__ import annotations

import hashlib
import json

from r9k.core import capacity
from r9k.core.fleet_status import PageProof  # the proof's type (the fleet status carries it)
from r9k.deploy.config import (RAY_EXTRA_COPY, RCCL_DEFAULTS, RCCL_TP4_DEFAULTS, FleetConfig, HostSpec,
                               ModelSpec, replica_max_num_seqs, split_args)
from r9k.deploy.placement import Assignment
from r9k.deploy.server import api_server_argv
from r9k.plugin.policy import GDN_STATE_ENV
from r9k.core.vllm_metrics import PLUGIN_INFO_METRIC, parse_vllm_metrics


def engine_argv(model: ModelSpec, cfg: FleetConfig, host: str, port: int | str) -> list[str]:
    spec = model.speculative
    seqs = replica_max_num_seqs(model, cfg, model.gdn_state)  # a replica's model: for_replica
    return api_server_argv(
        model.resolved_path(cfg.base_dir), model.name, host, port, tp=model.tp,
        max_model_len=model.max_model_len, kv_cache_memory_bytes=model.kv_cache_memory_bytes,
        num_spec=spec.k if spec else 0, spec_method=spec.method if spec else None,
        # None: vLLM's default for hybrids, on (one-page serves it: align)
        prefix_caching=None if model.prefix_caching else False,
        state_dtype=model.state_dtype,
        extra_args=(["--max-num-seqs", str(seqs)] if seqs is not None else [])
        + split_args(model.extra_args))


def rccl_env(model: ModelSpec, cfg: FleetConfig) -> dict[str, str]:
    """The RCCL settings a replica of ``model`` runs with: the fleet's defaults for its TP size
    (`RCCL_DEFAULTS`, `RCCL_TP4_DEFAULTS`) under the model's own NCCL_* env."""
    if cfg.platform != "gpu":
        return {}
    env = dict(RCCL_DEFAULTS)
    if model.tp == 4:
        env.update(RCCL_TP4_DEFAULTS)
    env.update({k: v for k, v in model.env.items() if k.startswith(("NCCL_", "RCCL_"))})
    return env


def engine_env(model: ModelSpec, cfg: FleetConfig, assignment: Assignment,
               host_cards: list[str]) -> dict[str, str]:
    """The replica's runtime_env.env_vars: reaches the supervisor, the engine and its workers."""
    from r9k.deploy.placement import hip_visible_devices

    env: dict[str, str] = {}
    if cfg.platform == "gpu":
        env.update(rccl_env(model, cfg))
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


def launch_spec(model: ModelSpec, cfg: FleetConfig, assignment: Assignment, hosts: list[HostSpec],
                api_key: str | None) -> tuple[list[str], dict[str, str], dict]:
    """argv and env of a replica's engine on its cards, and what its supervisor keeps of them
    (host, cards and a digest of the launch) for a later controller to compare: a running
    engine is adopted only if this fleet file would launch it the same way."""
    host_cards = [c.bdf for h in hosts if h.name == assignment.host for c in h.cards]
    env = engine_env(model, cfg, assignment, host_cards)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    argv = engine_argv(model, cfg, "{host}", "{port}")
    digest = hashlib.sha256(json.dumps([argv, sorted(env.items())]).encode()).hexdigest()
    return argv, env, {"host": assignment.host, "cards": list(assignment.cards),
                       "cpu_bind": assignment.cpu_bind, "model": model.name, "launch": digest,
                       "model_path": str(model.resolved_path(cfg.base_dir))}


def prove_pages(metrics_text: str, plan: capacity.CapacityPlan, wanted: str) -> PageProof:
    """The page mode a replica runs, from its /metrics text, checked against the planner."""
    try:
        m = parse_vllm_metrics(metrics_text)
    except ValueError as exc:
        m, why = None, f"/metrics is not Prometheus text ({exc})"
    blocks = {"stock": plan.stock.num_blocks, "onepage": plan.onepage.num_blocks}
    tokens = {"stock": plan.stock.tokens, "onepage": plan.onepage.tokens}
    mode, reason = "unknown", None
    if m is None:
        reason = why
    elif m.page_mode is None:
        reason = (f"the replica's /metrics has no {PLUGIN_INFO_METRIC} series: the r9k plugin is "
                  "not installed or not enabled (VLLM_PLUGINS) in this vLLM")
    elif m.num_blocks is None:
        reason = "the replica's /metrics has no vllm:cache_config_info num_gpu_blocks"
    elif capacity.known_series((m.plugin or {}).get("vllm_version")) not in (None, plan.vllm):
        # a release the planner knows, but not the fleet's: its blocks differ (0.34: 64-token).
        # An unknown one keeps stock pages and the plugin says why (the branch below)
        reason = (f"the replica runs vLLM {m.plugin['vllm_version']} but the fleet plans for "
                  f"{plan.vllm} (set the fleet key vllm to its series)")
    else:
        mode, reason = m.page_mode, (m.plugin or {}).get("reason") or None
        pool = plan.onepage if mode == "onepage" else plan.stock
        if m.num_blocks != pool.num_blocks or (
                m.block_size is not None and m.block_size != pool.attention_block_size):
            reason = (f"engine pool is {m.num_blocks} blocks of {m.block_size} tokens but the "
                      f"planner's {mode} pool is {pool.num_blocks} blocks of "
                      f"{pool.attention_block_size}: a rank runs other pages")
            mode = "unknown"
    ok = mode == wanted
    if not ok and reason is None:
        reason = f"asked for {wanted} pages, the engine runs {mode}"
    return PageProof(page_mode=mode, reason=reason, ok=ok,
                     num_blocks=m.num_blocks if m else None,
                     block_size=m.block_size if m else None,
                     cache_mode=m.cache_mode if m else None, planned_blocks=blocks,
                     planned_tokens=tokens, plugin=m.plugin if m else None)

