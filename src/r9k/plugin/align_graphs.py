"""The one-page align copies as CUDA graphs (GPU path; `r9k.plugin.onepage_align` calls `run`).

vLLM launches its two align copy kernels every step outside its own CUDA graphs; stock is one
launch each, one-page a few dozen (the fused replay per one-page layer), most steps with nothing
to copy. Launched from Python that is host time per step (one-page's TPOT measured 6x stock's
on a 24-GDN-layer model); replayed as one graph it is one launch.

A launch is named by its key (which kernel, grid, batch size, the scalars, every tensor
argument's address, shape, stride and dtype): a graph replays the same kernels with the same
pointers, so it is only valid for the buffers it was captured with. vLLM's runners pass
persistent buffers, except the V2 runner's idx_mapping, which is a new tensor each step: its
values are copied into a buffer kept here (one small copy) and the launch reads that. The first
sighting of a key runs eagerly (it compiles the kernels and fills the caches the capture must
not touch); the second captures and replays; later ones replay. Keys that never repeat (a runner
that passes new tensors each step) keep running eagerly, and the count of keys seen once is
bounded. `R9K_ALIGN_GRAPHS=0` turns graphs off; a capture that fails turns them off for the
process, with one warning, and the launch runs eagerly.
"""
from __future__ import annotations

import logging
import os

import torch

from r9k.plugin import runtime

logger = logging.getLogger("vllm.r9k")

ALIGN_GRAPHS_ENV = "R9K_ALIGN_GRAPHS"
MAX_GRAPHS = 1024  # two kernels x batch sizes up to vLLM's max_num_seqs; beyond: eager
MAX_PENDING = 4096  # keys seen once, waiting for a second sighting
STATIC_ARGS = ("idx_mapping_ptr",)  # arguments whose values are copied into a kept buffer


def enabled() -> bool:
    g = runtime.current().graphs
    if g.disabled is None:
        raw = os.environ.get(ALIGN_GRAPHS_ENV, "1").strip().lower()
        if raw not in ("0", "1", "off", "on", "false", "true"):
            raise ValueError(f"{ALIGN_GRAPHS_ENV}={raw!r}: expected 1 (default) or 0")
        g.disabled = raw in ("0", "off", "false")
    return not g.disabled


def stats() -> dict[str, int]:
    """Captures, replays and eager runs so far (the harness and tests read them)."""
    g = runtime.current().graphs
    return {"graphs": len(g.graphs), "captures": g.captures, "replays": g.replays,
            "eager": g.eager}


def reset() -> None:
    """Forget every graph and buffer (tests; a process's buffers never change)."""
    runtime.current().graphs = runtime.GraphState()


def _describe(value) -> tuple | object:
    if isinstance(value, torch.Tensor):
        return ("T", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype,
                value.device)
    return value


def _with_static(args: dict, static: dict) -> tuple[dict, tuple]:
    """args with the per-step tensors swapped for kept buffers (in `static`) holding their
    values, and the key of the launch."""
    args = dict(args)
    for name in STATIC_ARGS:
        t = args.get(name)
        if isinstance(t, torch.Tensor):
            skey = (name, tuple(t.shape), t.dtype, t.device)
            buf = static.get(skey)
            if buf is None:
                buf = static[skey] = torch.empty_like(t, memory_format=torch.contiguous_format)
            buf.copy_(t)
            args[name] = buf
    key = tuple((name, _describe(value)) for name, value in sorted(args.items()))
    return args, key


def run(launches, launch_key: tuple, args: dict, onepage) -> None:
    """`launches(args, onepage)`, as a CUDA graph where the launch repeats."""
    g = runtime.current().graphs
    if not enabled() or torch.cuda.is_current_stream_capturing():
        g.eager += 1
        launches(args, onepage)  # inside vLLM's own capture: its graph holds these launches
        return
    args, key = _with_static(args, g.static)
    key = (launch_key, key)
    graph = g.graphs.get(key)
    if graph is not None:
        g.replays += 1
        graph.replay()
        return
    if key not in g.pending or len(g.graphs) >= MAX_GRAPHS:
        if len(g.pending) >= MAX_PENDING:
            g.pending.clear()
        g.pending.add(key)
        g.eager += 1
        launches(args, onepage)
        return
    g.pending.discard(key)
    try:
        graph = _capture(g, lambda: launches(args, onepage), args)
    except Exception as exc:  # noqa: BLE001 (any capture failure: eager from now on)
        g.disabled = True
        logger.warning("r9k one-page align copies: CUDA graph capture failed (%s: %s); the "
                       "copies run eagerly from now on (%s=0 does so from the start)",
                       type(exc).__name__, exc, ALIGN_GRAPHS_ENV)
        g.eager += 1
        launches(args, onepage)
        return
    g.graphs[key] = graph
    g.captures += 1
    if g.captures == 1:
        logger.info("r9k one-page align copies: repeated launches replay as CUDA graphs "
                    "(%s=0 turns this off)", ALIGN_GRAPHS_ENV)
    graph.replay()


def _capture(g: runtime.GraphState, body, args: dict) -> "torch.cuda.CUDAGraph":
    """Capture `body` on a side stream (ordered after the current one), without running it.

    Thread-local capture mode: vLLM's other threads keep working. Temporaries come from one
    memory pool shared by these graphs, which replay one at a time on one stream."""
    dev = next(v.device for v in args.values() if isinstance(v, torch.Tensor))
    if dev not in g.pools:
        g.pools[dev] = torch.cuda.graph_pool_handle()
    stream = g.streams.get(dev)
    if stream is None:
        stream = g.streams[dev] = torch.cuda.Stream(device=dev)
    current = torch.cuda.current_stream(dev)
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=g.pools[dev], capture_error_mode="thread_local")
        try:
            body()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph
