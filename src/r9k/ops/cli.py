"""`r9k ops`: power cap / undervolt apply-verify-reconcile, kernel-log watcher, containment, units.

Exit codes: 0 ok, 1 a check failed (drift, fewer cards than expected, a card state file unreadable,
the log source failed), 2 bad input (nothing was changed).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import click

from r9k.cli_errors import BadInput, FiniteFloat
from r9k.ops.config import DEFAULT_CONFIG_PATH, ConfigError, OpsConfig, load_config
from r9k.ops.state import BDF_RE, DEFAULT_STATE_DIR, state_dir_problem, write_probe

_CONFIG_OPT = click.option("--config", "config_path", default=DEFAULT_CONFIG_PATH, show_default=True,
                           envvar="R9K_OPS_CONFIG", help="Ops YAML config.")
_ROOT_OPT = click.option("--host-root", default="/", show_default=True, envvar="R9K_HOST_ROOT",
                         type=click.Path(file_okay=False), help="Resolve /sys, /proc, /dev/kmsg under this root.")
_STATE_OPT = click.option("--state-dir", default=DEFAULT_STATE_DIR, show_default=True, envvar="R9K_OPS_STATE_DIR",
                          help="Ops state directory (one JSON file per card).")
_JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


class CheckFailed(click.ClickException):
    """A check failed (not bad input): one line, exit 1."""

    exit_code = 1


def _check_state_dir(state_dir: str, must_exist: bool = False, writable: bool = False) -> None:
    path = Path(state_dir)
    for part in (path, path / "cards"):
        if part.exists() and not part.is_dir():
            raise BadInput(f"--state-dir {state_dir}: {part} is not a directory (expected the ops state directory)")
    if must_exist and not path.is_dir():
        raise BadInput(f"--state-dir {state_dir}: no ops state there (expected the directory the watcher "
                       "writes, default /var/lib/r9k/ops)")
    # Run as root, state others can write is refused: a forged card file could un-fence a card,
    # a planted link make root write elsewhere.
    problem = state_dir_problem(path)
    if problem:
        raise BadInput(f"--state-dir {state_dir}: {problem}; nothing read or written there")
    if writable:
        # Commands that record (faults, power checks, clears) find out now, not at the first fault.
        try:
            write_probe(path)
        except OSError as exc:
            raise BadInput(f"--state-dir {state_dir}: cannot write there ({exc.strerror}); expected a "
                           "directory this user can write (fences and fault counts are kept there)") from None


def _report_presence(presence, as_json: bool) -> bool:
    """Say when fewer cards are present than the config expects; True when all are there."""
    if not presence.ok and not as_json:
        click.echo(f"error: {presence.message()}", err=True)
    return presence.ok


def _presence_json(presence) -> dict:
    return {"cards_expected": presence.expected, "cards_present": presence.present,
            "cards_missing": presence.missing, "cards_ok": presence.ok}


def _load(config_path: str) -> OpsConfig:
    try:
        return load_config(config_path)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def _check_root(host_root: str) -> None:
    if not (Path(host_root) / "sys").is_dir():
        raise BadInput(f"--host-root {host_root}: no sys/ directory under it (expected / or a host tree)")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def ops() -> None:
    """Host ops: power caps and undervolt that stay applied; MES-timeout / GPU-reset containment."""


@ops.command("discover")
@_ROOT_OPT
@_JSON_OPT
def discover_cmd(host_root: str, as_json: bool) -> None:
    """List amdgpu cards by PCI address with their hwmon, cap and offset ranges, runtime PM."""
    from r9k.ops.sysfs import discover_cards, recovery_status

    _check_root(host_root)
    cards = discover_cards(host_root)
    recovery = recovery_status(host_root)
    if as_json:
        click.echo(json.dumps({"cards": [c.to_json() for c in cards], "recovery": recovery.to_json()}, indent=1))
        return
    if not cards:
        click.echo("no amdgpu cards found")
    for c in cards:
        rng = f"{c.cap_min_watts:g}-{c.cap_max_watts:g} W" if c.cap_max_watts is not None else "?"
        orng = f"{c.offset_range_mv[0]}..{c.offset_range_mv[1]} mV" if c.offset_range_mv else "none (overdrive off)"
        cap = f"{c.cap_watts:g} W" if c.cap_watts is not None else "?"
        click.echo(f"{c.bdf} {c.card_name:<6} {'R9700' if c.is_r9700 else 'amdgpu'} "
                   f"hwmon={c.hwmon_dir.name if c.hwmon_dir else '-'} cap={cap} range={rng} "
                   f"offset={c.offset_mv} mV range={orng} power={c.power_watts} W ({c.power_source}) "
                   f"runtime={c.runtime_status}" + (f" errors={'; '.join(c.errors)}" if c.errors else ""))
    if recovery.warning:
        click.echo(f"warning: {recovery.warning}", err=True)


@ops.command("check-config")
@_CONFIG_OPT
@click.option("--json", "as_json", is_flag=True, help="print the validated config as JSON")
def check_config_cmd(config_path: str, as_json: bool) -> None:
    """Validate the config file only (exit 2 with the reason when it is refused)."""
    config = _load(config_path)
    if as_json:
        click.echo(json.dumps({"ok": True, "config": config_path,
                               "settings": config.model_dump(mode="json")}, indent=1))
        return
    click.echo(f"{config_path}: ok (backend {config.backend}, {len(config.cards)} card overrides, "
               f"{len(config.hooks)} hooks)")


def _print_statuses(statuses, as_json: bool, extra: dict | None = None, presence=None) -> None:
    if as_json:
        ok = all(s.ok for s in statuses if s.managed) and (presence is None or presence.ok)
        more = _presence_json(presence) if presence is not None else {}
        click.echo(json.dumps({**(extra or {}), **more, "ok": ok, "cards": [s.to_json() for s in statuses]},
                              indent=1))
        return
    for key, value in (extra or {}).items():
        if key != "recovery":
            click.echo(f"{key}: {value}")
    for s in statuses:
        if not s.managed:
            click.echo(f"{s.bdf} not managed (not an R9700 and not named in the config)")
            continue
        if s.card is None:
            click.echo(f"{s.bdf} MISSING: " + "; ".join(s.drift))
            continue
        cap = f"{s.actual_cap_watts:g}" if s.actual_cap_watts is not None else "?"
        state = "OK" if s.ok else "DRIFT: " + "; ".join(s.drift)
        health = "" if s.healthy else f" [UNHEALTHY: {s.unhealthy_reason}]"
        click.echo(f"{s.bdf} cap {cap}/{s.wanted_cap_watts} W offset {s.actual_offset_mv}/{s.wanted_offset_mv} mV "
                   f"{state}{health}")
        for action in s.actions:
            click.echo(f"    {action}")
        for error in s.errors:
            if "not saved" in error:
                click.echo(f"    warning: {error}", err=True)


def _exit_for(statuses, presence=None) -> None:
    if not all(s.ok for s in statuses if s.managed) or (presence is not None and not presence.ok):
        sys.exit(1)


@ops.command("apply")
@_CONFIG_OPT
@_ROOT_OPT
@_STATE_OPT
@click.option("--backend", type=click.Choice(["auto", "lact", "sysfs"]), default=None,
              help="Override the config's backend.")
@click.option("--wait-seconds", type=FiniteFloat(0, 3600), default=30.0, show_default=True,
              help="Retry this long while a card is in reset, suspended, or its hwmon is not there yet.")
@click.option("--settle-seconds", type=FiniteFloat(0, 600), default=2.0, show_default=True,
              help="How long a read-back may take to show the written value.")
@_JSON_OPT
def apply_cmd(config_path, host_root, state_dir, backend, wait_seconds, settle_seconds, as_json) -> None:
    """Apply the wanted cap and offset to every card, then verify from sysfs (exit 1 on drift)."""
    from r9k.ops.power import BackendError, apply_power

    config = _load(config_path)
    _check_root(host_root)
    _check_state_dir(state_dir, writable=True)
    try:
        report = apply_power(config, host_root, state_dir, backend, wait_seconds, settle_seconds)
    except BackendError as exc:
        raise BadInput(f"{exc}; nothing was changed") from None
    _print_statuses(report.cards, as_json, {"backend": f"{report.backend} ({report.backend_reason})",
                                            "recovery": report.recovery.to_json()}, report.presence)
    if report.recovery.warning and not as_json:
        click.echo(f"warning: {report.recovery.warning}", err=True)
    _report_presence(report.presence, as_json)
    _exit_for(report.cards, report.presence)


@ops.command("status")
@_CONFIG_OPT
@_ROOT_OPT
@_STATE_OPT
@_JSON_OPT
def status_cmd(config_path, host_root, state_dir, as_json) -> None:
    """Wanted vs actual per card, health from the state directory (exit 1 on drift)."""
    from r9k.ops.power import power_status, presence_of
    from r9k.ops.sysfs import recovery_status

    config = _load(config_path)
    _check_root(host_root)
    _check_state_dir(state_dir)
    statuses = power_status(config, host_root, state_dir)
    presence = presence_of(config, statuses)
    recovery = recovery_status(host_root)
    _print_statuses(statuses, as_json, {"recovery": recovery.to_json()}, presence)
    if recovery.warning and not as_json:
        click.echo(f"warning: {recovery.warning}", err=True)
    _report_presence(presence, as_json)
    _exit_for(statuses, presence)


@ops.command("reconcile")
@_CONFIG_OPT
@_ROOT_OPT
@_STATE_OPT
@click.option("--interval", type=FiniteFloat(min=0.01, max=86400), required=True, help="Seconds between rounds.")
@click.option("--count", type=click.IntRange(min=1), default=None, help="Stop after this many rounds.")
@click.option("--backend", type=click.Choice(["auto", "lact", "sysfs"]), default=None)
@click.option("--settle-seconds", type=FiniteFloat(0, 600), default=2.0, show_default=True)
@_JSON_OPT
def reconcile_cmd(config_path, host_root, state_dir, interval, count, backend, settle_seconds, as_json) -> None:
    """Re-verify every INTERVAL seconds; re-apply on drift and after a reset event."""
    from r9k.ops.power import BackendError, ReconcileState, presence_of, reconcile_once

    config = _load(config_path)
    _check_root(host_root)
    _check_state_dir(state_dir, writable=True)
    memory = ReconcileState()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rounds, last = 0, []
    while not stop.is_set():
        try:
            last, redone = reconcile_once(config, host_root, state_dir, memory, backend, settle_seconds)
        except BackendError as exc:
            raise BadInput(f"{exc}; nothing was changed") from None
        rounds += 1
        presence = presence_of(config, last)
        if as_json:
            click.echo(json.dumps({"round": rounds, "reapplied": redone, **_presence_json(presence),
                                   "ok": all(s.ok for s in last if s.managed) and presence.ok,
                                   "cards": [s.to_json() for s in last]}))
        else:
            drifted = [s for s in last if s.managed and not s.ok]
            click.echo(f"round {rounds}: re-applied {', '.join(redone) or 'none'}; "
                       f"{'drift on ' + ', '.join(s.bdf for s in drifted) if drifted else 'all cards match'}",
                       nl=True)
            for s in drifted:  # the same reasons --json and the state file carry
                click.echo(f"    {s.bdf}: {'; '.join(s.drift)}")
            for s in last:
                for error in s.errors:
                    if "not saved" in error:
                        click.echo(f"    warning: {s.bdf}: {error}", err=True)
            _report_presence(presence, as_json)
        if count is not None and rounds >= count:
            break
        stop.wait(interval)
    _exit_for(last, presence_of(config, last))


@ops.command("watch")
@_CONFIG_OPT
@_ROOT_OPT
@_STATE_OPT
@click.option("--source", default="auto", show_default=True,
              help="kmsg, journal, auto (kmsg when readable) or a log file (dmesg, kmsg or journal JSON lines).")
@click.option("--once", is_flag=True, help="Read what is there, print the classified events, exit.")
@click.option("--record/--no-record", default=None,
              help="Count events into the state dir and run containment (default: on, off with --once).")
@click.option("--interval", type=FiniteFloat(min=0.01, max=3600), default=0.5, show_default=True,
              help="Poll interval in seconds when following (0.01-3600).")
@_JSON_OPT
def watch_cmd(config_path, host_root, state_dir, source, once, record, interval, as_json) -> None:
    """Follow the kernel log, classify amdgpu events per card, contain faults (fence, then hooks)."""
    from r9k.ops.sysfs import recovery_status
    from r9k.ops.watch import SourceError, Watcher, open_source, print_event, print_hook

    record = (not once) if record is None else record
    config = _load(config_path) if (record or os.path.exists(config_path)) else OpsConfig()
    if record:
        _check_state_dir(state_dir, writable=True)
    recovery = recovery_status(host_root)
    if recovery.warning and not as_json:
        click.echo(f"warning: {recovery.warning}", err=True)
    try:
        src = open_source(source, host_root, state_dir if record else None, follow=not once)
    except (FileNotFoundError, PermissionError) as exc:
        raise BadInput(str(exc)) from None
    tally = {"events": 0, "new": 0, "host": 0}

    def on_event(item) -> None:
        tally["events"] += 1
        tally["new"] += item.new
        tally["host"] += item.host and item.new
        print_event(item, as_json)

    watcher = Watcher(src, state_dir if record else None, host_root, config.hook_argvs() if record else [],
                      config.fault_events, on_event=on_event, hook_timeout_s=config.hook_timeout_s,
                      on_hook=lambda run: print_hook(run, as_json),
                      trust_syslog_kernel_tag=config.trust_syslog_kernel_tag, heartbeat=not once)
    failure = None
    try:
        if once:
            watcher.poll(final=True)
        else:
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            signal.signal(signal.SIGINT, lambda *_: stop.set())
            watcher.run(stop, interval)
    except SourceError as exc:
        failure = str(exc)
    finally:
        src.close()
        # Hooks already started finish (each bounded by hook_timeout_s) before the process exits.
        watcher.wait_for_hooks(config.hook_timeout_s * max(1, len(config.hooks)) + 5)
    for gap in src.gaps:
        click.echo(f"warning: {gap}", err=True)
    if watcher.cursor_error:
        click.echo(f"warning: {watcher.cursor_error}", err=True)
    if as_json:
        click.echo(json.dumps({"summary": True, **tally, "recovery": recovery.to_json(), "gaps": src.gaps,
                               "source_error": failure}))
    if failure:
        raise CheckFailed(failure)


@ops.command("clear")
@click.argument("bdf")
@_STATE_OPT
def clear_cmd(bdf: str, state_dir: str) -> None:
    """Mark card BDF healthy again, after a reboot or reset has restored it."""
    from r9k.ops.state import clear_card, read_card_state

    from r9k.ops.state import StateFileError

    if not BDF_RE.match(bdf):
        raise BadInput(f"card {bdf!r}: expected a full lowercase PCI address like 0000:03:00.0")
    _check_state_dir(state_dir, must_exist=True, writable=True)
    try:
        known = read_card_state(state_dir, bdf) is not None
    except StateFileError as exc:
        known = True
        click.echo(f"warning: {exc}; it is kept aside and the card starts over (counts reset)", err=True)
    if not known:
        raise BadInput(f"card {bdf}: no state in {state_dir} (nothing to clear)")
    try:
        state = clear_card(state_dir, bdf)
    except OSError as exc:
        raise CheckFailed(f"card {bdf}: not cleared, {state_dir} took no write ({exc.strerror}); "
                          "it stays fenced") from None
    click.echo(f"{bdf}: healthy (event counts kept: "
               + ", ".join(f"{k}={v}" for k, v in state.counts.items() if v) + ")")


@ops.command("health")
@_STATE_OPT
@_JSON_OPT
def health_cmd(state_dir: str, as_json: bool) -> None:
    """Per-card health and event counts from the state directory, host-level (unattributed) events.
    Exit 1 if any card is unhealthy or its state file is unreadable."""
    import dataclasses

    from r9k.ops.state import StateFileError, card_state_path, read_card_states, read_host_events

    _check_state_dir(state_dir, must_exist=True)
    states = read_card_states(state_dir)
    try:
        host_events, host_error = read_host_events(state_dir), None
    except StateFileError as exc:
        host_events, host_error = [], str(exc)
    if as_json:
        click.echo(json.dumps({"cards": {bdf: s.to_json() for bdf, s in states.items()},
                               "unreadable": {bdf: why for bdf, why in states.corrupt.items()},
                               "host_events": [dataclasses.asdict(e) for e in host_events],
                               "host_events_error": host_error}, indent=1))
    else:
        for bdf, s in states.items():
            counts = ", ".join(f"{k}={v}" for k, v in s.counts.items() if v) or "no events"
            click.echo(f"{bdf} {'healthy' if s.healthy else 'UNHEALTHY: ' + (s.unhealthy_reason or '')} ({counts})")
        for bdf, why in states.corrupt.items():
            click.echo(f"{bdf} UNKNOWN: state file {card_state_path(state_dir, bdf)} unreadable ({why}); "
                       "treated as unhealthy, `r9k ops clear` starts it over")
        for event in host_events:
            click.echo(f"host (no card) {event.type}={event.count}: {event.message}")
        if host_error:
            click.echo(f"host events: {host_error}")
    if any(not s.healthy for s in states.values()) or states.corrupt or host_error:
        sys.exit(1)


@ops.command("install-units")
@click.option("--dest", default="/etc/systemd/system", show_default=True, type=click.Path(file_okay=False))
@click.option("--r9k-bin", default=None, help="Absolute path of the r9k executable (default: this one).")
@_CONFIG_OPT
@_STATE_OPT
@click.option("--interval", type=FiniteFloat(min=1, max=86400), default=60, show_default=True,
              help="Reconcile interval in seconds.")
@click.option("--env-file", default=None,
              help="systemd EnvironmentFile for the watcher's hooks (R9K_FLEET_API_KEY for the fleet's "
                   "drain hook): root-owned, 0600")
def install_units_cmd(dest, r9k_bin, config_path, state_dir, interval, env_file) -> None:
    """Write the boot-apply, reconcile and watch systemd units (then: systemctl daemon-reload, enable)."""
    from r9k.ops.units import UnitValueError, default_r9k_bin, env_file_problem, install_units

    r9k_bin = r9k_bin or default_r9k_bin()
    if not os.path.isabs(r9k_bin) or not os.access(r9k_bin, os.X_OK):
        raise BadInput(f"--r9k-bin {r9k_bin}: expected the absolute path of an executable r9k")
    if env_file:
        problem = env_file_problem(env_file, ["R9K_FLEET_API_KEY"])
        if problem:
            raise BadInput(f"--env-file {problem}")
    try:
        written = install_units(dest, r9k_bin, config_path, state_dir, interval, env_file)
    except UnitValueError as exc:  # every unit is rendered before the first is written
        raise BadInput(str(exc)) from None
    for path in written:
        click.echo(f"wrote {path}")
    click.echo("next: systemctl daemon-reload && systemctl enable --now "
               "r9k-ops-apply.service r9k-ops-reconcile.service r9k-ops-watch.service")
