"""`r9k fleet`: up, status, drain, restart --rolling, down, check, ray-head, install-units.

Commands other than `up` and `check` talk to the running controller over its entry point
(`--url`, else the controller file in the run directory).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from r9k.cli_errors import BadInput
from r9k.core.http_client import HttpUnreachable, http_request

RUN_DIR_HELP = "controller file and logs [env R9K_FLEET_RUN_DIR; default ~/.local/state/r9k/fleet]"


def _load(config: str):
    from r9k.deploy.config import FleetConfigError, load_fleet
    from r9k.deploy.placement import check_fits, unusable_cards

    try:
        cfg = load_fleet(config)
        if cfg.hosts:  # the inventory is in the file: refuse what cannot fit before Ray starts
            # (the avoid list only: each host's fences are read there, by the controller's agents)
            check_fits(cfg, cfg.hosts, unusable_cards(cfg, cfg.hosts))
    except FleetConfigError as exc:
        raise BadInput(str(exc)) from None
    return cfg


def _controller_url(url: str | None, run_dir: str | None) -> str:
    if url:
        return url.rstrip("/")
    from r9k.deploy.controller import CONTROLLER_FILE, default_run_dir

    path = Path(run_dir or default_run_dir()) / CONTROLLER_FILE
    try:
        return json.loads(path.read_text())["url"]
    except (OSError, ValueError, KeyError):
        raise BadInput(f"no running fleet: {path} is missing; pass --url or --run-dir") from None


def _call(url: str, path: str, body: dict | None = None, timeout: float = 30) -> dict:
    headers = {}
    key = os.environ.get("R9K_FLEET_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        resp = http_request(url + path, method="POST" if body is not None else "GET",
                            json_body=body, headers=headers, timeout_s=timeout)
    except HttpUnreachable as exc:
        raise click.ClickException(f"fleet controller at {url} does not answer: {exc}") from None
    if resp.status != 200:
        raise BadInput(f"{url}{path}: HTTP {resp.status}: {resp.text[:300]}")
    try:
        return resp.json()
    except ValueError:
        raise click.ClickException(f"{url}{path}: answered HTTP 200 with no JSON: "
                                   f"{resp.text[:200]!r}") from None


EXIT_FLEET_DOWN = 3  # `r9k fleet down` stopped the controller (r9k-fleet.service: RestartPreventExitStatus)

url_option = click.option("--url", help="the fleet entry point, e.g. http://127.0.0.1:8000")
run_dir_option = click.option("--run-dir", help=RUN_DIR_HELP)


@click.group()
def fleet() -> None:
    """The Ray fleet: replicas with the one-page plugin, placed on cards, watched, drained."""


@fleet.command()
@click.option("--config", "config", required=True, help="fleet file (YAML)")
@click.option("--json", "as_json", is_flag=True, help="print the validated fleet as JSON")
def check(config: str, as_json: bool) -> None:
    """Validate a fleet file (schema, model paths, ports, cards in the file's inventory)."""
    from r9k.deploy.config import replica_max_num_seqs

    cfg = _load(config)
    replicas = sum(m.replicas for m in cfg.models)
    cards = sum(m.replicas * m.tp for m in cfg.models)
    # what each page mode's replicas are launched with (--max-num-seqs; None: vLLM's default)
    seqs = {m.name: {mode: replica_max_num_seqs(m, cfg, mode) for mode in m.page_modes}
            for m in cfg.models}
    if as_json:
        click.echo(json.dumps({"ok": True, "config": config, "replicas": replicas, "cards": cards,
                               "max_num_seqs": seqs, "fleet": cfg.model_dump(mode="json")},
                              indent=1))
        return
    click.echo(f"{config}: ok ({replicas} replicas, {cards} cards)")
    for m in cfg.models:
        if m.max_num_seqs is not None:
            counts = ", ".join(f"{mode} {n}" for mode, n in seqs[m.name].items())
            click.echo(f"  {m.name}: max_num_seqs {counts}"
                       + (" (the planner's whole requests of max_model_len)"
                          if m.max_num_seqs == "planner" else ""))


@fleet.command()
@click.option("--config", "config", required=True, help="fleet file (YAML)")
@click.option("--detach", is_flag=True, help="run the controller in the background and return when placed")
@run_dir_option
def up(config: str, detach: bool, run_dir: str | None) -> None:
    """Start or join Ray, place the replicas, serve the entry point (Ctrl-C stops the fleet).

    Exit status 3 after `r9k fleet down` stopped it (its systemd unit does not restart on 3)."""
    from r9k.deploy.config import FleetConfigError
    from r9k.deploy.controller import CONTROLLER_FILE, FleetController, default_run_dir

    cfg = _load(config)
    try:
        key = cfg.api_key()  # before anything starts: a configured key that cannot be read stops here
    except FleetConfigError as exc:
        raise BadInput(f"{config}: {exc}") from None
    if key is None and not cfg.entry.loopback:
        click.echo(f"warning: entry point on {cfg.entry.host}:{cfg.entry.port} without an API key "
                   "(entry.allow_unauthenticated): anyone who reaches it can drain or stop the fleet", err=True)
    run = Path(run_dir or cfg.run_dir or default_run_dir())
    if detach:
        run.mkdir(parents=True, exist_ok=True)
        (run / CONTROLLER_FILE).unlink(missing_ok=True)
        argv = [sys.executable, "-c", "from r9k.cli import main; main()", "fleet", "up", "--config", config,
                "--run-dir", str(run)]
        with open(run / "controller.log", "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        deadline = time.monotonic() + 300
        while not (run / CONTROLLER_FILE).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (run / "controller.log").read_text(errors="replace")[-1500:]
                raise click.ClickException(f"the fleet controller did not start:\n{tail}")
            time.sleep(0.5)
        click.echo(f"fleet controller pid {proc.pid}; entry point {json.loads((run / CONTROLLER_FILE).read_text())['url']}")
        return
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    controller = FleetController(cfg, run, config_path=str(Path(config).resolve()))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, controller.stopping.set)
        from r9k.deploy.placement import PlacementError

        try:
            await controller.start()
        except PlacementError as exc:
            await controller.stop()
            raise BadInput(str(exc)) from None
        click.echo(f"entry point {controller.url}  (status: r9k fleet status --url {controller.url})")
        await controller.stopping.wait()
        await controller.stop()

    asyncio.run(main())
    if controller.down_requested:
        # stopped by `r9k fleet down`: a status of its own, so the unit (Restart=always, for
        # exits nobody asked for) does not start the fleet again (RestartPreventExitStatus)
        sys.exit(EXIT_FLEET_DOWN)


def _kv(d: dict) -> str:
    kv = d.get("kv") or {}
    if kv.get("num_blocks") is None:
        return "-"
    tokens = (kv.get("planned_tokens") or {}).get(kv.get("page_mode"), 0)
    return f"{kv['num_blocks']} blk / {tokens:,} tok"


@fleet.command()
@url_option
@run_dir_option
@click.option("--json", "as_json", is_flag=True)
def status(url: str | None, run_dir: str | None, as_json: bool) -> None:
    """Replicas, cards, states, page mode and why, KV capacity."""
    data = _call(_controller_url(url, run_dir), "/fleet/status")
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"{'replica':14}{'state':11}{'host':8}{'cards':30}{'pages':10}{'KV pool':26}{'restarts':>8}  why")
    for d in data["replicas"] + data["stopped"]:
        click.echo(f"{d['name']:14}{d['state'] or 'stopped':11}{d['host'] or '-':8}{','.join(d['cards']) or '-':30}"
                   f"{d['page_mode'] or '-':10}{_kv(d):26}{d['restarts']:>8}  {d['reason'] or ''}")
    for name, p in data["capacity"].items():
        click.echo(f"{name}: planner per replica stock {p['stock_tokens']:,} tokens ({p['stock_blocks']} blocks), "
                   f"one-page {p['onepage_tokens']:,} tokens ({p['onepage_blocks']} blocks)")
    for c in data["cards"]:
        if not c["usable"]:
            click.echo(f"card {c['bdf']} on {c['host']}: not used ({c['reason']})")


def _card_body(card: str, host: str | None) -> dict:
    from r9k.ops.state import BDF_RE

    if not BDF_RE.match(card):
        raise BadInput(f"--card {card!r}: expected a full PCI address like 0000:03:00.0")
    if host is not None and not host.strip():
        raise BadInput("--host is empty; expected the host's name (its Ray label r9k.host)")
    return {"card": card, "host": host}


host_option = click.option(
    "--host", envvar="R9K_FLEET_HOST",
    help="the card's host (its r9k.host label; env R9K_FLEET_HOST): needed where hosts share "
    "PCI addresses")


@fleet.command()
@click.argument("replica", required=False)
@click.option("--card", envvar="R9K_BDF", help="drain every replica on this card (PCI address); "
              "env R9K_BDF, so it works as an ops hook")
@host_option
@url_option
@run_dir_option
def drain(replica: str | None, card: str | None, host: str | None, url: str | None,
          run_dir: str | None) -> None:
    """Finish in-flight requests, stop routing, stop the replica (REPLICA or every one on --card).

    A card drained by an operator stays out of use (across controller restarts) until
    `r9k fleet undrain --card`; one drained by the ops hook (R9K_EVENT set) returns when
    `r9k ops clear` clears it on its host."""
    if bool(replica) == bool(card):
        raise BadInput("give a REPLICA name or --card BDF (one of them)")
    if card:
        body = _card_body(card, host)
        event = os.environ.get("R9K_EVENT")
        if event:
            body["event"] = event
    else:
        body = {"replica": replica}
    out = _call(_controller_url(url, run_dir), "/fleet/drain", body)
    click.echo(f"draining {', '.join(out['drained']) or 'nothing'}"
               + (f" (card {out.get('card', card)})" if card else ""))


@fleet.command()
@click.option("--card", required=True, help="the card an operator drained (PCI address)")
@host_option
@url_option
@run_dir_option
def undrain(card: str, host: str | None, url: str | None, run_dir: str | None) -> None:
    """Return a card an operator drained (`fleet drain --card`) to service."""
    out = _call(_controller_url(url, run_dir), "/fleet/undrain", _card_body(card, host))
    click.echo(f"card {out['card']} returned to service")


@fleet.command()
@click.option("--rolling", is_flag=True, required=True, help="one replica at a time on its own cards")
@url_option
@run_dir_option
def restart(rolling: bool, url: str | None, run_dir: str | None) -> None:
    """Restart every ready replica, one at a time, without extra cards."""
    out = _call(_controller_url(url, run_dir), "/fleet/restart", {}, timeout=3600)
    click.echo("\n".join(out["restarted"]) or "no ready replica")


@fleet.command()
@url_option
@run_dir_option
def down(url: str | None, run_dir: str | None) -> None:
    """Stop every replica and the controller."""
    _call(_controller_url(url, run_dir), "/fleet/down", {})
    click.echo("fleet stopping")


def this_host(cfg, host: str | None, command: str):
    """The fleet file's host this machine is: the only one, or the one `--host` names."""
    if not cfg.hosts:
        raise BadInput(f"fleet {command} needs the file's hosts inventory (hosts: ...) to "
                       "advertise this host's cards")
    if host is None:
        if len(cfg.hosts) != 1:
            raise BadInput(f"the fleet file lists {len(cfg.hosts)} hosts "
                           f"({', '.join(h.name for h in cfg.hosts)}); expected --host NAME: "
                           "which one this machine is")
        return cfg.hosts[0]
    for h in cfg.hosts:
        if h.name == host:
            return h
    raise BadInput(f"--host {host!r} is not in the fleet file's hosts; expected one of "
                   f"{', '.join(h.name for h in cfg.hosts)}")


def ray_node_argv(cfg, ray_bin: str, host: str | None = None, head: str | None = None) -> list[str]:
    """`ray start --block` advertising one host of the fleet file: its cards as the card
    resource, its name as the host label (what `ray.address: local` would set up in-process);
    `--head`, or a worker joining `head` (HOST:PORT of the head's GCS)."""
    from r9k.deploy.config import HOST_LABEL

    spec = this_host(cfg, host, "ray-worker" if head else "ray-head")
    argv = [ray_bin, "start"] + (["--address", head] if head else ["--head"]) + [
        "--block", "--include-dashboard=false",
        "--resources", json.dumps({cfg.placement.card_resource: len(spec.cards)}),
        "--labels", f"{HOST_LABEL}={spec.name}"]
    if cfg.ray.num_cpus is not None:
        argv += ["--num-cpus", str(cfg.ray.num_cpus)]
    return argv


def _head_address(head: str) -> str:
    hostpart, sep, port = head.rpartition(":")
    if not (sep and hostpart and port.isdigit() and 1 <= int(port) <= 65535):
        raise BadInput(f"--head {head!r}: expected the Ray head's HOST:PORT, e.g. 10.0.0.1:6379")
    return head


@fleet.command("ray-head")
@click.option("--config", "config", required=True, help="fleet file (YAML)")
@click.option("--host", default=None, help="which of the file's hosts this is (several hosts)")
@click.option("--dry-run", is_flag=True, help="print the ray command instead of running it")
def ray_head(config: str, host: str | None, dry_run: bool) -> None:
    """Run this host's Ray head for the fleet (in the foreground; systemd: r9k-ray-head.service)."""
    _run_ray_node(config, host, None, dry_run)


def _run_ray_node(config: str, host: str | None, head: str | None, dry_run: bool) -> None:
    cfg = _load(config)
    argv = ray_node_argv(cfg, str(Path(sys.executable).parent / "ray"), host,
                         _head_address(head) if head is not None else None)
    if dry_run:
        click.echo(" ".join(argv))
        return
    os.execv(argv[0], argv)


@fleet.command("ray-worker")
@click.option("--config", "config", required=True, help="fleet file (YAML)")
@click.option("--host", required=True, help="which of the file's hosts this is")
@click.option("--head", required=True, help="the Ray head's HOST:PORT (its GCS, port 6379 by default)")
@click.option("--dry-run", is_flag=True, help="print the ray command instead of running it")
def ray_worker(config: str, host: str, head: str, dry_run: bool) -> None:
    """Run this host's Ray node, joining the head (foreground; systemd: r9k-ray-worker.service)."""
    _run_ray_node(config, host, head, dry_run)


@fleet.command("entry")
@click.option("--config", "config", required=True, help="fleet file (YAML): entry settings and key")
@click.option("--controller", "controller_url", required=True,
              help="the controller's entry point, e.g. http://HEAD:8000")
@click.option("--listen", default=None, help="address to serve on [default: entry.host]")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="[default: entry.port]")
def entry_cmd(config: str, controller_url: str, listen: str | None, port: int | None) -> None:
    """Serve the fleet's OpenAI endpoint on this host, routing from the controller's state
    (any host may run one; the last state is served `entry.state_stale_s` while the
    controller is away)."""
    from r9k.deploy.config import FleetConfigError
    from r9k.deploy.entry import EntryPoint, entry_limits, serve
    from r9k.deploy.remote_entry import RemoteBackend
    from r9k.core.http_client import is_loopback

    cfg = _load(config)
    if not controller_url.startswith(("http://", "https://")):
        raise BadInput(f"--controller {controller_url!r}: expected an http(s)://HOST:PORT URL")
    try:
        key = cfg.api_key()
    except FleetConfigError as exc:
        raise BadInput(f"{config}: {exc}") from None
    host = listen or cfg.entry.host
    if key is None and not is_loopback(host) and not cfg.entry.allow_unauthenticated:
        raise BadInput(f"--listen {host} serves beyond loopback without entry.api_key_env; "
                       "expected api_key_env (or entry.allow_unauthenticated: true)")
    port = port or cfg.entry.port
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    async def main() -> None:
        backend = RemoteBackend(controller_url, key, cfg.entry.state_stale_s)
        entry = EntryPoint(backend, api_key=key, routing=cfg.entry.routing,
                           prefix_chars=cfg.entry.prefix_chars,
                           connect_timeout_s=cfg.entry.connect_timeout_s,
                           first_byte_timeout_s=cfg.entry.first_byte_timeout_s,
                           chunk_timeout_s=cfg.entry.chunk_timeout_s)
        await backend.start()
        if backend.last is None:
            click.echo(f"warning: the controller at {controller_url} does not answer yet "
                       f"({backend.last_error}); serving 503 until it does", err=True)
        runner = await serve(entry, host, port, **entry_limits(cfg.entry))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        click.echo(f"entry point http://{host}:{port} routing from {controller_url}")
        await stop.wait()
        await backend.stop()
        await runner.cleanup()

    asyncio.run(main())


@fleet.command("install-units")
@click.option("--config", "config", required=True, help="fleet file (YAML)")
@click.option("--dest", default="/etc/systemd/system", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--r9k-bin", default=None, help="absolute path of the r9k executable (default: this one)")
@click.option("--env-file", default="/etc/r9k/fleet.env", show_default=True,
              help="systemd EnvironmentFile with the API key (entry.api_key_env): root-owned, 0600")
@click.option("--host", default=None, help="which of the file's hosts this is (several hosts)")
@click.option("--head", default=None, help="a worker host: the Ray head's HOST:PORT to join")
@click.option("--controller", default=None, help="a worker host: the controller's entry point URL")
@run_dir_option
def install_units_cmd(config: str, dest: str, r9k_bin: str | None, env_file: str,
                      host: str | None, head: str | None, controller: str | None,
                      run_dir: str | None) -> None:
    """Write the fleet's systemd units for this host. The head host (one host, or --host NAME):
    r9k-ray-head.service and r9k-fleet.service (Ray as its own service, the controller restarted
    by systemd when it dies, re-adopting the running replicas). A worker host (--host NAME
    --head HOST:PORT --controller URL): r9k-ray-worker.service and r9k-fleet-entry.service
    (this host's entry point)."""
    from r9k.deploy.controller import default_run_dir
    from r9k.ops.units import UnitValueError, default_r9k_bin, env_file_problem, install_fleet_units

    cfg = _load(config)
    if cfg.ray.address == "local":
        raise BadInput(f"{config}: ray.address is local (Ray inside the controller, gone with "
                       "it); the units run Ray as its own service: set ray.address: auto")
    if controller is not None and not controller.startswith(("http://", "https://")):
        raise BadInput(f"--controller {controller!r}: expected an http(s)://HOST:PORT URL")
    if head is not None:
        _head_address(head)
        if controller is None:
            raise BadInput("--head (a worker host) needs --controller URL: the controller's entry "
                           "point, which this host's entry point routes from")
    ray_node_argv(cfg, "ray", host, head)  # a host of the file, or a clear error before writing
    r9k_bin = r9k_bin or default_r9k_bin()
    if not os.path.isabs(r9k_bin) or not os.access(r9k_bin, os.X_OK):
        raise BadInput(f"--r9k-bin {r9k_bin}: expected the absolute path of an executable r9k")
    run = run_dir or cfg.run_dir or str(default_run_dir())
    key_env = cfg.entry.api_key_env
    if key_env:  # the key reaches the controller from the file, never from the unit's text
        problem = env_file_problem(env_file, [key_env])
        if problem:
            raise BadInput(f"--env-file {problem}; entry.api_key_env is {key_env}, so the "
                           "controller's unit needs the key from there")
    try:
        written = install_fleet_units(dest, r9k_bin, config, str(run), env_file if key_env else None,
                                      host=host, head=head, controller=controller)
    except UnitValueError as exc:  # every unit is rendered before the first is written
        raise BadInput(str(exc)) from None
    for path in written:
        click.echo(f"wrote {path}")
    click.echo("next: systemctl daemon-reload && systemctl enable --now "
               + " ".join(p.name for p in written))
