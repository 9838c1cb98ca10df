"""`r9k exporter`: the Prometheus exporter of cards (sysfs + ops) and replicas (vLLM + capacity).

Exit codes: 0 ok (or stopped by SIGTERM/SIGINT), 2 bad input.
"""
from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import click

from r9k.cli_errors import BadInput, FiniteFloat
from r9k.ops.config import DEFAULT_CONFIG_PATH
from r9k.ops.state import DEFAULT_STATE_DIR

DEFAULT_PORT = 9700


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="HTTP port (0: any free port).")
@click.option("--listen", default="127.0.0.1", show_default=True,
              help="Address to listen on; loopback by default: give the host's address (or 0.0.0.0) for a "
                   "Prometheus elsewhere, ideally with --web-config-file.")
@click.option("--web-config-file", type=click.Path(dir_okay=False, path_type=Path),
              help="TLS and basic auth, node_exporter's web config format (see src/r9k/monitoring/README.md).")
@click.option("--host-root", default="/", show_default=True, envvar="R9K_HOST_ROOT",
              help="Resolve /sys and /proc under this root.")
@click.option("--state-dir", default=DEFAULT_STATE_DIR, show_default=True, envvar="R9K_OPS_STATE_DIR",
              help="Ops state directory (event counts and health per card).")
@click.option("--config", "config_path", default=DEFAULT_CONFIG_PATH, show_default=True,
              envvar="R9K_OPS_CONFIG", help="Ops config with the wanted power cap and offset.")
@click.option("--replica", "replica_specs", multiple=True, metavar="URL[,key=value...]",
              help="A vLLM replica to scrape; keys: name, model, model_config, tp, num_spec, page_mode, "
                   "platform, max_model_len, metrics_path, cards (BDFs joined by '|'). Repeatable.")
@click.option("--replica-file", type=click.Path(dir_okay=False, path_type=Path),
              help='JSON file of replicas in the fleet status format {"replicas": [...]}.')
@click.option("--fleet", "fleet_url", metavar="URL",
              help="Fleet status URL returning {\"replicas\": [...]} (replica list and states).")
@click.option("--timeout", "timeout_s", type=FiniteFloat(0, 300, min_open=True), default=2.0, show_default=True,
              help="Seconds to wait for one replica or the fleet status.")
@click.option("--replica-budget", "replica_budget_s", type=FiniteFloat(0, 300, min_open=True), default=5.0, show_default=True,
              help="Seconds for the whole replica phase of a scrape (fleet status and every replica); "
                   "replicas unanswered by then read r9k_replica_up 0. Keep it under the scrape_timeout.")
@click.option("--cards/--no-cards", default=True, show_default=True,
              help="Collect this host's cards; --no-cards: replicas only (what `r9k fleet up` runs, next to "
                   "each host's own exporter).")
@click.option("--debugfs", metavar="DIR", envvar="R9K_DEBUGFS",
              help="debugfs mount point under --host-root (normally /sys/kernel/debug): turns on the MES "
                   "event-log liveness collector (needs amdgpu.mes_log_enable=1 and root); off when not given.")
@click.option("--energy-sample-hz", type=FiniteFloat(0, 100), default=1.0, show_default=True,
              envvar="R9K_ENERGY_SAMPLE_HZ",
              help="Power samples per second per card for r9k_gpu_energy_joules_total (0: off).")
@click.option("--host-name", default=None, envvar="R9K_HOST_NAME",
              help="This host's name in the fleet (the `host` label energy is joined on; default: hostname).")
@click.option("--once", is_flag=True, help="Collect once, print the metrics, exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the samples as JSON.")
def exporter(port: int, listen: str, web_config_file: Path | None, host_root: str, state_dir: str, config_path: str,
             replica_specs: tuple[str, ...], replica_file: Path | None, fleet_url: str | None,
             timeout_s: float, replica_budget_s: float, cards: bool, debugfs: str | None,
             energy_sample_hz: float, host_name: str | None, once: bool, as_json: bool) -> None:
    """Prometheus exporter: per card power/cap/undervolt/temps/VRAM/faults, per replica KV pool and pinning."""
    from r9k.monitoring.exporter import build_collector, build_registry, render, serve
    from r9k.core.http_client import host_url, is_loopback
    from r9k.monitoring.web_config import WebConfigError, load_web_config
    from r9k.monitoring.replicas import ReplicaDescription, ReplicaSpecError, load_replica_file, parse_replica_spec

    if not 0 <= port <= 65535:
        raise BadInput(f"--port {port}: expected 0-65535")
    if cards and not (Path(host_root) / "sys").is_dir():
        raise BadInput(f"--host-root {host_root}: no sys/ directory under it (expected / or a host tree)")
    if timeout_s <= 0:
        raise BadInput(f"--timeout {timeout_s}: expected seconds > 0")
    if replica_budget_s <= 0:
        raise BadInput(f"--replica-budget {replica_budget_s}: expected seconds > 0")
    if fleet_url is not None and not fleet_url.startswith(("http://", "https://")):
        raise BadInput(f"--fleet {fleet_url!r}: expected an http(s):// URL of the fleet status")
    if as_json and not once:
        raise BadInput("--json reports one collection: use it with --once")
    if debugfs is not None:
        if not cards:
            raise BadInput("--debugfs reads this host's cards: drop --no-cards")
        if not (Path(host_root) / debugfs.lstrip("/")).is_dir():
            raise BadInput(f"--debugfs {debugfs}: no such directory under --host-root {host_root}; "
                           "expected debugfs' mount point (mount -t debugfs none /sys/kernel/debug)")
    replicas: list[ReplicaDescription] = []
    try:
        replicas += [parse_replica_spec(s) for s in replica_specs]
        if replica_file is not None:
            replicas += load_replica_file(replica_file)
    except ReplicaSpecError as exc:
        raise BadInput(str(exc)) from None
    web = None
    if web_config_file is not None:
        try:
            web = load_web_config(web_config_file)
        except WebConfigError as exc:
            raise BadInput(str(exc)) from None
    names = [r.name for r in replicas]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BadInput(f"replica name {', '.join(dupes)} given twice; expected unique names (add name=...)")

    if energy_sample_hz and not 0.1 <= energy_sample_hz:
        raise BadInput(f"--energy-sample-hz {energy_sample_hz:g}: expected 0 (off) or 0.1 to 100")
    collector = build_collector(host_root, state_dir, config_path, replicas, fleet_url, timeout_s,
                                replica_budget_s, cards=cards, debugfs=debugfs,
                                energy_sample_hz=energy_sample_hz if cards and not once else 0.0,
                                host_name=host_name)
    mes_log = collector.parts.get("mes_log")
    debugfs_problem = mes_log.unreadable_reason() if mes_log is not None else None
    if debugfs_problem is not None:  # not fatal: exported as r9k_host_debugfs_readable 0, the rest is served
        click.echo(f"r9k exporter: warning: --debugfs: {debugfs_problem}", err=True)
    registry = build_registry(collector)
    if once:
        if as_json:
            click.echo(json.dumps({"samples": samples_json(registry)}, indent=1))
        else:
            click.echo(render(registry), nl=False)
        return
    try:
        server, _ = serve(registry, port, listen, web)
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise BadInput(f"--listen {listen} --port {port}: cannot listen ({why}); "
                       "expected a free port on a local address") from None
    bound = server.server_address[1]
    if web is None and not is_loopback(listen):
        click.echo(f"r9k exporter: warning: --listen {listen} serves card and replica metrics to the "
                   "network without TLS or auth (--web-config-file)", err=True)
    scheme = "https" if web is not None and web[1] is not None else "http"
    click.echo(f"r9k exporter: {host_url(listen, bound, scheme)}/metrics "
               f"({'host root ' + host_root if cards else 'no cards'}, "
               f"{len(replicas)} replicas{', fleet ' + fleet_url if fleet_url else ''})")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


def samples_json(registry) -> list[dict]:
    return [{"name": s.name, "labels": s.labels, "value": s.value}
            for family in registry.collect() for s in family.samples]
