"""Host ops against a hostile or careless operator: real parts (fixture host trees, the LACT double
on a real Unix socket, real files, real subprocesses and stand-in programs on PATH), each test
named for the behaviour it pins."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from doubles import ops_host as fixtures
from doubles.lact_double import LactDouble
from doubles.ops_host import CardSpec, FakeKernel, build_host_tree, kmsg_record, read_cap_watts
from r9k.cli import main
from r9k.ops.config import ConfigError, hook_problem, load_config
from r9k.ops.kernlog import Classifier, KernelEvent, LogLine
from r9k.ops.state import (
    HEARTBEAT_FILE, HOST_EVENTS_FILE, cards_dir, clean_stale_temp_files, read_card_state, read_card_states,
    read_host_events, update_card_state,
)
from r9k.ops.watch import CURSOR_FILE, FileSource, JournalSource, Watcher, run_hooks

A, B, OTHER = "0000:03:00.0", "0000:04:00.0", "0000:0b:00.0"
CONFIG = "backend: sysfs\ndefaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n"
MES = "amdgpu {}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root-owned files (the checks are root's)")


def _cfg(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, 0o644)
    return path


def _ops(*args, env=None):
    return CliRunner().invoke(main, ["ops", *args], env=env)


def _one_line(text: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _script(path: Path, body: str, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    os.chmod(path, mode)
    return path


def _events(stdout: str) -> list[dict]:
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{") and '"summary"' not in x]


# -- kernel-log rules apply to amdgpu/drm messages only ---------------------------------------------
def test_a_process_named_like_a_ring_timeout_is_not_a_gpu_fault(tmp_path):
    """The kernel prints a crashing process's name raw, at facility 0: `ring x timeout[4242]:
    segfault ...` right after an addressed amdgpu line used to fence that card (context
    attribution) and run the root hooks."""
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    log = tmp_path / "kmsg.log"
    log.write_text(
        kmsg_record(1, f"amdgpu {A}: amdgpu: SMU is initialized successfully!")
        + kmsg_record(2, "ring x timeout[4242]: segfault at 0 ip 0000000000401000 sp 00007ffc error 4 in a.out")
        + kmsg_record(3, f"amdgpu {A}: amdgpu:  Process information: process ring x timeout pid 4242")
        + kmsg_record(4, "python3[77]: GPU reset begin! in libfoo.so")
        + kmsg_record(5, f"pci {A}: MES failed to respond to msg=REMOVE_QUEUE")
        + kmsg_record(6, f"[drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx_0.0.0 timeout, signaled seq=9, "
                         "emitted seq=10")
    )
    state = tmp_path / "state"
    result = _ops("watch", "--source", str(log), "--once", "--record", "--json", "--host-root", str(host),
                  "--state-dir", str(state), "--config", str(_cfg(tmp_path / "ops.yaml", "")))
    assert result.exit_code == 0, result.output
    # the drm line alone is an event; the segfault, the process name inside an amdgpu line, a
    # rule phrase after a process name and a PCI-core line are none
    assert [(e["type"], e["message"][:5]) for e in _events(result.stdout)] == [("ring_timeout", "[drm:")]


_BODIES = {
    "MES failed to respond to msg=REMOVE_QUEUE": "mes_timeout",
    "MES(1) failed to respond to msg=SUSPEND": "mes_timeout",
    "ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2": "ring_timeout",
    "GPU reset begin!": "reset_begin",
    "GPU reset(2) succeeded!": "reset_succeeded",
    "device lost from bus!": "device_lost",
    "GPU recovery disabled.": "recovery_disabled",
}
_PREFIXES = [f"amdgpu {A}: amdgpu: ", f"amdgpu {A}: ", "amdgpu: ", "[drm] ", "[drm] *ERROR* ",
             "[drm:amdgpu_job_timedout [amdgpu]] *ERROR* ", f"amdgpu {A}: [drm] *ERROR* "]
_GPU_STARTS = ("amdgpu", "[drm", "pci ")
_RULE_STARTS = ("MES", "ring ", "GPU", "device lost")


@settings(max_examples=300, deadline=None)
@given(head=st.text(min_size=1, max_size=40), body=st.sampled_from(sorted(_BODIES)))
def test_rule_text_without_an_amdgpu_or_drm_prefix_is_never_an_event(head, body):
    """Property: whatever comes first in a record (a process name, another driver's text), a rule
    phrase after it is no event unless the record starts with an amdgpu/drm prefix."""
    message = head + body
    if message.lstrip().startswith(_GPU_STARTS):
        return  # the other property covers prefixed messages
    assert Classifier().classify(LogLine(message, "s", 1, device_bdf=A)) is None


@settings(max_examples=300, deadline=None)
@given(prefix=st.sampled_from(_PREFIXES), body=st.sampled_from(sorted(_BODIES)),
       junk=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 ()=", min_size=1, max_size=30))
def test_rules_apply_right_after_the_prefix_and_not_later_in_the_message(prefix, body, junk):
    """Property: `prefix + rule phrase` is that event; `prefix + other text + rule phrase` is none
    (a process name printed inside an amdgpu line is not the message)."""
    assert Classifier().classify(LogLine(prefix + body, "s", 1)).type == _BODIES[body]
    later = junk + " " + body
    if later.lstrip().startswith(_RULE_STARTS + ("amdgpu", "[drm", "*")):
        return
    assert Classifier().classify(LogLine(prefix + later, "s", 1)) is None


# -- a corrupt host-events.json ---------------------------------------------------------------------
def test_a_corrupt_host_events_file_is_kept_aside_and_later_faults_are_still_handled(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    state = tmp_path / "state"
    state.mkdir()
    (state / HOST_EVENTS_FILE).write_text('{"events": {"mes_timeout": {"ty')  # a torn write
    log = tmp_path / "kern.log"
    log.write_text("[  10.0] [drm] *ERROR* ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2\n"
                   f"[  20.0] {MES.format(B)}\n")
    result = _ops("watch", "--source", str(log), "--once", "--record", "--json", "--host-root", str(host),
                  "--state-dir", str(state), "--config", str(_cfg(tmp_path / "ops.yaml", "")))
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    events = _events(result.stdout)
    assert [(e["type"], e["host"], e["new"]) for e in events] == [("ring_timeout", True, True),
                                                                   ("mes_timeout", False, True)]
    assert not read_card_state(state, B).healthy
    assert [(e.type, e.count) for e in read_host_events(state)] == [("ring_timeout", 1)]
    kept = list(state.glob(f"{HOST_EVENTS_FILE}.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_text().startswith('{"events"')
    assert f"kept as {kept[0].name}" in result.output


# -- the log position never passes an event the state dir did not take ------------------------------
def test_the_log_position_never_passes_an_event_that_was_not_saved(tmp_path, monkeypatch):
    import r9k.ops.watch as watch_mod

    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    state = tmp_path / "state"
    log = tmp_path / "kern.log"
    first = "[  1.0] usb 1-1: new high-speed USB device number 2\n"
    log.write_text(first + f"[  2.0] {MES.format(A)}\n" + "[  3.0] usb 1-1: disconnect\n")
    real_update = watch_mod.update_card_state
    failing = {A}

    def card_write(state_dir, bdf, *args, **kwargs):
        if bdf in failing:
            raise OSError(errno.EIO, "Input/output error")
        return real_update(state_dir, bdf, *args, **kwargs)

    monkeypatch.setattr(watch_mod, "update_card_state", card_write)
    watcher = Watcher(FileSource(log), state, host)
    seen = watcher.poll()
    assert seen[0].unsaved and seen[0].fenced_now  # contained from memory all the same
    saved = json.loads((state / CURSOR_FILE).read_text())[f"file:{log.resolve()}"]
    assert saved["offset"] == len(first)  # before the unsaved record, not past the file's end

    # a restart (the failure gone) reads it again: counted, card fenced
    failing.clear()
    restarted = Watcher(FileSource(log, saved), state, host)
    assert [(s.event.type, s.new, s.fenced_now) for s in restarted.poll()] == [("mes_timeout", True, True)]
    assert not read_card_state(state, A).healthy

    # in one process: the next poll saves what was not saved, then the position moves on
    state2 = tmp_path / "state2"
    failing.add(A)
    watcher = Watcher(FileSource(log), state2, host)
    watcher.poll()
    failing.clear()
    watcher.poll()
    assert not read_card_state(state2, A).healthy
    assert json.loads((state2 / CURSOR_FILE).read_text())[f"file:{log.resolve()}"]["offset"] == log.stat().st_size


# -- hook arguments: an allow-rule ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hook_dirs():
    """A root-only directory and a 0777 one, each with a root-owned 0755 script."""
    base = Path(tempfile.mkdtemp(prefix="r9k-hooks-"))
    safe, open_ = base / "safe", base / "open"
    safe_script = _script(safe / "hook.sh", "exit 0\n")
    open_script = _script(open_ / "hook.sh", "exit 0\n")
    os.chmod(open_, 0o777)
    yield {"safe": safe, "open": open_, "safe_script": safe_script, "open_script": open_script}
    shutil.rmtree(base)


@as_root
def test_hook_arguments_that_cannot_be_proved_safe_are_refused_in_one_line(tmp_path, hook_dirs):
    open_, script = hook_dirs["open"], hook_dirs["open_script"]
    refused = {
        "shell string": ["/bin/sh", "-c", f"sh {script}"],
        "env chdir": ["/usr/bin/env", f"--chdir={open_}", "/bin/sh", "hook.sh"],
        "env -C": ["/usr/bin/env", "-C", str(open_), "/bin/sh", "hook.sh"],
        "env -S": ["/usr/bin/env", "-S", "sh hook.sh"],
        "option path": ["/bin/true", f"--config={script}"],
        "blank words": ["/bin/true", f"run {script} now"],
        "relative path": ["/bin/sh", "open/hook.sh"],
        "python -c": ["/usr/bin/python3", "-c", "import os"],
        "shell syntax": ["/bin/true", "$(id)"],
    }
    for why, argv in refused.items():
        problem = hook_problem(argv)
        assert problem and "\n" not in problem, (why, argv)
    assert "run code given as a string" in hook_problem(refused["shell string"])
    assert "env's options" in hook_problem(refused["env chdir"])
    assert "option and its value as two arguments" in hook_problem(refused["option path"])
    # the documented drain hook and a root-only script pass
    assert hook_problem(["/bin/true", "fleet", "drain", "--url", "http://HEAD:8000", "--host", "node-1"]) is None
    assert hook_problem(["/bin/sh", str(hook_dirs["safe_script"]), "--now"]) is None
    # through the config and the CLI: exit 2, one line naming the argument
    cfg = _cfg(tmp_path / "ops.yaml", f"hooks: [[/bin/sh, -c, 'sh {script}']]\n")
    with pytest.raises(ConfigError, match="run code given as a string"):
        load_config(cfg)
    result = _ops("check-config", "--config", str(cfg))
    assert result.exit_code == 2 and "-c" in _one_line(result.output)


def _path_forms(hook_dirs):
    safe, open_ = hook_dirs["safe"], hook_dirs["open"]
    paths = st.sampled_from([str(hook_dirs["safe_script"]), str(hook_dirs["open_script"]), str(safe),
                             str(open_), str(open_ / "absent.sh")])
    words = st.sampled_from(["--now", "drain", "-v", "node-1", "http://HEAD:8000", "x=1", "-c", "-e", "-C", "-S"])
    wrapped = st.tuples(st.sampled_from(["--opt={}", "sh {}", "{} now", "{};id", "./{}", "{}/..", "file://{}"]),
                        paths).map(lambda t: t[0].format(t[1]))
    relative = st.sampled_from(["open/hook.sh", "hook.sh", "../open/hook.sh"])
    return st.one_of(paths, words, wrapped, relative)


@as_root
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_accepted_hook_names_no_path_outside_root_only_places(hook_dirs, data):
    """Property: for argvs mixing safe and unsafe directories and forms, an argv is accepted only
    if every path in it is in a root-only place, and never hands code to an interpreter."""
    program = data.draw(st.sampled_from(["/bin/sh", "/usr/bin/env", "/bin/true", "/usr/bin/python3"]))
    args = data.draw(st.lists(_path_forms(hook_dirs), max_size=4))
    argv = [program, *args]
    problem = hook_problem(argv)
    if problem is None:
        text = " ".join(args)
        assert str(hook_dirs["open"]) not in text, argv
        assert "-c" not in args or program == "/bin/true", argv
        assert not (program == "/usr/bin/env" and any(a.startswith("-") for a in args)), argv
        assert not any(" " in a or ";" in a for a in args), argv
    else:
        assert "\n" not in problem
    # liveness: plain words and root-only paths alone are accepted
    safe_args = [a for a in args if a in ("--now", "drain", "node-1", "http://HEAD:8000", "x=1",
                                          str(hook_dirs["safe_script"]))]
    assert hook_problem(["/bin/true", *safe_args]) is None


# -- the env file of root units ---------------------------------------------------------------------
@as_root
def test_an_env_file_others_could_replace_is_refused_as_written_and_through_links(tmp_path):
    open_dir, safe_dir = tmp_path / "open", tmp_path / "safe"
    open_dir.mkdir()
    safe_dir.mkdir()
    os.chmod(open_dir, 0o777)
    in_open = open_dir / "fleet.env"
    in_open.write_text("R9K_FLEET_API_KEY=k\n")
    os.chmod(in_open, 0o600)
    link = safe_dir / "link.env"
    link.symlink_to(in_open)
    good = safe_dir / "fleet.env"
    good.write_text("R9K_FLEET_API_KEY=k\n")
    os.chmod(good, 0o600)
    r9k = shutil.which("true")
    for env_file in (in_open, link):
        dest = tmp_path / f"units-{env_file.name}"
        result = _ops("install-units", "--dest", str(dest), "--r9k-bin", r9k, "--env-file", str(env_file))
        assert result.exit_code == 2, result.output
        assert f"directory {open_dir} is writable by group or others" in _one_line(result.output)
        assert not dest.exists()  # nothing written
    ok = _ops("install-units", "--dest", str(tmp_path / "units"), "--r9k-bin", r9k, "--env-file", str(good))
    assert ok.exit_code == 0, ok.output


# -- backend auto and a LACT that does not list the cards ---------------------------------------------
def _lact_view(root: Path, host: Path, bdfs: list[str]) -> Path:
    """A tree through which the LACT double sees only ``bdfs`` of ``host`` (the same device files)."""
    for card_link in (host / "sys/class/drm").iterdir():
        bdf = card_link.resolve().parent.parent.name
        if bdf in bdfs:
            (root / "sys/class/drm").mkdir(parents=True, exist_ok=True)
            (root / "sys/class/drm" / card_link.name).symlink_to(card_link.resolve())
            dev = fixtures.device_dir(host, bdf)
            view = fixtures.device_dir(root, bdf)
            view.parent.mkdir(parents=True, exist_ok=True)
            view.symlink_to(dev)
            (root / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
            (root / "sys/bus/pci/devices" / bdf).symlink_to(dev)
    return root


def test_auto_backend_uses_lact_for_the_cards_it_lists_and_sysfs_for_the_others(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    other = build_host_tree(tmp_path / "other", [CardSpec(OTHER)])  # a LACT that knows another GPU
    sock = str(tmp_path / "lactd.sock")
    cfg = _cfg(tmp_path / "ops.yaml", CONFIG.replace("sysfs", "auto") + f"lact_socket: {sock}\n")
    common = ["--config", str(cfg), "--host-root", str(host), "--state-dir", str(tmp_path / "state"),
              "--settle-seconds", "1", "--json"]
    with LactDouble(sock, other), FakeKernel(host):
        result = _ops("apply", *common)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["backend"].startswith("sysfs (LACT answers on") and "lists none of these cards" in report["backend"]
    assert read_cap_watts(host, A) == 210.0 and read_cap_watts(host, B) == 210.0

    fixtures.write_cap_watts(host, A, 300)
    fixtures.write_cap_watts(host, B, 300)
    view = _lact_view(tmp_path / "view", host, [A])  # LACT lists A, not B
    with LactDouble(sock, view) as lact, FakeKernel(host):
        result = _ops("apply", *common)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert f"sysfs for {B} (LACT does not list them)" in report["backend"]
    cards = {c["bdf"]: c for c in report["cards"]}
    assert any(a.startswith("lact set_gpu_config") for a in cards[A]["actions"])
    assert cards[B]["actions"][0] == "backend sysfs: LACT does not list this card (list_devices)"
    assert "set_gpu_config" in [r["command"] for r in lact.requests]
    assert read_cap_watts(host, A) == 210.0 and read_cap_watts(host, B) == 210.0


# -- a hook's child that keeps stderr open ----------------------------------------------------------
def test_a_hook_child_that_leaves_the_group_and_keeps_stderr_open_does_not_block_the_next_hook(tmp_path):
    escaped_pid, marker = tmp_path / "escaped.pid", tmp_path / "drained"
    first = _script(tmp_path / "hooks/spawn.sh", f"setsid sleep 30 &\necho $! > {escaped_pid}\nexit 3\n")
    second = _script(tmp_path / "hooks/drain.sh", f"touch {marker}\n")
    event = KernelEvent("mes_timeout", A, MES.format(A), "s", 1, "prefix")
    started = time.monotonic()
    try:
        runs = run_hooks([[str(first)], [str(second)]], event, timeout_s=2)
        elapsed = time.monotonic() - started
    finally:
        if escaped_pid.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):  # ours, by its pid
                os.kill(int(escaped_pid.read_text()), signal.SIGKILL)
    assert elapsed < 4, f"run_hooks took {elapsed:.1f} s: the escaped child's stderr held the reader"
    assert [r.returncode for r in runs] == [3, 0] and marker.exists()


# -- the journal rejecting the saved cursor, however late ---------------------------------------------
def test_a_journal_that_rejects_the_saved_cursor_late_falls_back_every_time(tmp_path, monkeypatch):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state = tmp_path / "state"
    state.mkdir()
    (state / CURSOR_FILE).write_text(json.dumps({"journal": {"cursor": "s=gone;i=1"}}))
    line = json.dumps({"MESSAGE": MES.format(A), "_TRANSPORT": "kernel", "__SEQNUM": 9, "__SEQNUM_ID": "s",
                       "_BOOT_ID": "b", "__CURSOR": "s=new;i=9"})
    bin_dir = tmp_path / "bin"
    _script(bin_dir / "journalctl",
            'case "$*" in *--after-cursor*) sleep 1.5; echo "Failed to seek to cursor: Invalid argument" >&2; '
            "exit 1;; esac\n"
            f"cat <<'EOF'\n{line}\nEOF\n"
            'case "$*" in *-f*) sleep 30;; esac\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    result = _ops("watch", "--source", "journal", "--once", "--record", "--json", "--host-root", str(host),
                  "--state-dir", str(state), "--config", str(_cfg(tmp_path / "ops.yaml", "")))
    assert result.exit_code == 0, result.output
    assert "saved cursor unusable (Failed to seek to cursor: Invalid argument); read this boot" in result.output
    assert _events(result.stdout)[0]["fenced_now"] is True

    # following: the same, whenever journalctl gives up on the cursor
    source = JournalSource(host, follow=True, resume={"cursor": "s=gone;i=1"},
                           journalctl=str(bin_dir / "journalctl"))
    try:
        got, deadline = [], time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = list(source.read())
            time.sleep(0.05)
    finally:
        source.close()
    assert [g.ordinal for g in got] == [9] and "saved cursor unusable" in source.gaps[0]


# -- over-cap drift: one value everywhere ---------------------------------------------------------
def test_over_cap_drift_is_one_value_in_text_json_state_file_and_exporter(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from r9k.monitoring.exporter import build_collector, build_registry, render

    host = build_host_tree(tmp_path / "host", [CardSpec(A, cap_watts=210, voltage_offset_mv=-42,
                                                        power_draw_watts=262.0)])
    cfg = _cfg(tmp_path / "ops.yaml", CONFIG + "cap_draw_window_s: 0.05\n")
    state = tmp_path / "state"
    common = ["--config", str(cfg), "--host-root", str(host), "--state-dir", str(state)]
    text = _ops("reconcile", "--interval", "0.06", "--count", "4", "--settle-seconds", "0.2", *common)
    assert text.exit_code == 1, text.output
    drift = "drew 262 W, over its 210 W cap by more than 15 W for 0.05 s"
    assert f"    {A}: {drift}: cap written again" in text.output
    saved = read_card_state(state, A)
    assert saved.power_ok is False and saved.power_drift == [f"{drift}: cap written again"]
    status = _ops("status", "--json", *common)
    assert status.exit_code == 1 and json.loads(status.stdout)["cards"][0]["drift"] == [drift]
    metrics = render(build_registry(build_collector(host, state, cfg)))
    values = {(s.name, s.labels.get("bdf")): s.value
              for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert values[("r9k_gpu_config_drift", A)] == 1.0


def test_a_card_leaving_the_bus_during_the_over_cap_rewrite_is_reported_not_a_traceback(tmp_path, monkeypatch):
    import r9k.ops.power as power_mod
    from r9k.ops.config import parse_config

    host = build_host_tree(tmp_path / "host", [CardSpec(A, cap_watts=210, voltage_offset_mv=-42,
                                                        power_draw_watts=262.0)])
    config = parse_config(CONFIG + "cap_draw_window_s: 0.01\n")
    memory = power_mod.ReconcileState()
    power_mod.reconcile_once(config, host, None, memory)  # starts the window
    time.sleep(0.05)
    real_apply = power_mod.apply_power

    def apply_after_the_card_left(*args, **kwargs):
        for link in (host / "sys/class/drm").iterdir():
            link.unlink()
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(power_mod, "apply_power", apply_after_the_card_left)
    statuses, redone = power_mod.reconcile_once(config, host, None, memory)
    assert redone == [A]
    assert statuses[0].drift[0] == "not re-applied: card not found on this host (left the bus?)"


# -- the state dir: ownership, modes, links -----------------------------------------------------------
@as_root
def test_a_state_dir_others_can_write_is_refused_and_its_card_files_read_unhealthy(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state = tmp_path / "state"
    update_card_state(state, A, lambda s: setattr(s, "healthy", False))
    os.chmod(cards_dir(state), 0o777)
    forged = json.loads((cards_dir(state) / f"{A}.json").read_text()) | {"healthy": True}
    (cards_dir(state) / f"{A}.json").write_text(json.dumps(forged))
    states = read_card_states(state)
    assert A in states.unhealthy() and "writable by group or others" in states.corrupt[A]
    cfg = _cfg(tmp_path / "ops.yaml", CONFIG)
    for args in (["health"], ["status", "--config", str(cfg), "--host-root", str(host)],
                 ["watch", "--once", "--record", "--source", str(host / "dev/kmsg"), "--config", str(cfg),
                  "--host-root", str(host)],
                 ["clear", A]):
        result = _ops(*args, "--state-dir", str(state))
        assert result.exit_code == 2, (args, result.output)
        assert f"--state-dir {state}: ops state {cards_dir(state)} is writable" in _one_line(result.output)
    # one still to be created, in a directory anyone can write: refused, nothing created
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    result = _ops("apply", "--config", str(cfg), "--host-root", str(host), "--state-dir", str(open_parent / "s"))
    assert result.exit_code == 2 and f"ops state directory {open_parent} is writable" in _one_line(result.output)
    assert not (open_parent / "s").exists()


def test_a_planted_heartbeat_link_does_not_make_root_create_its_target(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state = tmp_path / "state"
    state.mkdir()
    target = tmp_path / "elsewhere" / "owned-by-root"
    target.parent.mkdir()
    (state / HEARTBEAT_FILE).symlink_to(target)
    Watcher(FileSource(host / "dev/kmsg"), state, host).poll()
    assert not target.exists() and (state / HEARTBEAT_FILE).is_symlink()
    (cards_dir(state)).mkdir(exist_ok=True)
    (cards_dir(state) / f"{A}.json").symlink_to(target)
    assert "symlink" in read_card_states(state).corrupt[A]


def test_a_one_shot_run_does_not_refresh_a_dead_watchers_heartbeat(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state = tmp_path / "state"
    state.mkdir()
    beat = state / HEARTBEAT_FILE
    beat.touch()
    os.utime(beat, (time.time() - 3600, time.time() - 3600))
    before = beat.stat().st_mtime
    log = tmp_path / "kern.log"
    log.write_text(f"[  2.0] {MES.format(A)}\n")
    result = _ops("watch", "--source", str(log), "--once", "--record", "--host-root", str(host),
                  "--state-dir", str(state), "--config", str(_cfg(tmp_path / "ops.yaml", "")))
    assert result.exit_code == 0, result.output
    assert not read_card_state(state, A).healthy and beat.stat().st_mtime == before


# -- kept-aside copies and temporary files --------------------------------------------------------
def test_corrupt_copies_never_overwrite_each_other_and_stale_temp_files_are_cleaned(tmp_path):
    state = tmp_path / "state"
    path = cards_dir(state) / f"{A}.json"
    for n in range(3):  # three torn files within one second
        cards_dir(state).mkdir(parents=True, exist_ok=True)
        path.write_text(f'{{"torn": {n}')
        update_card_state(state, A, lambda s: None, replace_corrupt=True)
    kept = sorted(p.read_text() for p in cards_dir(state).glob(f"{A}.json.corrupt-*"))
    assert kept == ['{"torn": 0', '{"torn": 1', '{"torn": 2']
    old = time.time() - 3600
    stale = [cards_dir(state) / f".{A}.json.ab_cd123", state / ".watch-cursor.json.x1y2z3w4",
             cards_dir(state) / f".{A}.seen.q1w2e3r4.r9k-tmp"]
    fresh = cards_dir(state) / f".{A}.json.fresh123.r9k-tmp"
    foreign = state / ".someone-elses.txt"
    for p in stale + [fresh, foreign]:
        p.write_text("partial")
    for p in stale + [foreign]:
        os.utime(p, (old, old))
    result = _ops("health", "--state-dir", str(state))  # reading commands leave them alone
    assert all(p.exists() for p in stale)
    assert sorted(clean_stale_temp_files(state)) == sorted(stale)
    assert fresh.exists() and foreign.exists() and result.exit_code == 1
    # apply/reconcile/watch/clear clean on start (through their write probe)
    for p in stale:
        p.write_text("partial")
        os.utime(p, (old, old))
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    _ops("status", "--config", str(_cfg(tmp_path / "ops.yaml", CONFIG)), "--host-root", str(host),
         "--state-dir", str(state))
    _ops("clear", A, "--state-dir", str(state))
    assert not any(p.exists() for p in stale)


# -- reconcile says when its record was not saved --------------------------------------------------
def test_reconcile_text_says_when_the_state_could_not_be_saved(tmp_path, monkeypatch):
    import r9k.ops.power as power_mod

    host = build_host_tree(tmp_path / "host", [CardSpec(A, cap_watts=210, voltage_offset_mv=-42)])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(power_mod, "update_card_state", full)
    result = _ops("reconcile", "--interval", "0.05", "--count", "1", "--config",
                  str(_cfg(tmp_path / "ops.yaml", CONFIG)), "--host-root", str(host),
                  "--state-dir", str(tmp_path / "state"))
    assert result.exit_code == 0, result.output
    assert f"warning: {A}: power check not saved to {tmp_path / 'state'}: No space left on device" in result.output


# -- units restart on any exit ---------------------------------------------------------------------
def test_long_running_units_restart_on_any_exit(tmp_path):
    """vLLM has crashed with exit status 0: `on-failure` would leave the fleet down."""
    from r9k.ops.units import install_fleet_units, install_units

    r9k = shutil.which("true")
    written = (install_units(tmp_path / "ops", r9k, "/etc/r9k/ops.yaml", "/var/lib/r9k/ops")
               + install_fleet_units(tmp_path / "fleet", r9k, "/etc/r9k/fleet.yaml", "/run/r9k")
               + install_fleet_units(tmp_path / "worker", r9k, "/etc/r9k/fleet.yaml", "/run/r9k",
                                     head="head:6379", controller="http://head:8000"))
    long_running = [p for p in written if "Type=oneshot" not in p.read_text()]
    assert {p.name for p in long_running} == {"r9k-ops-reconcile.service", "r9k-ops-watch.service",
                                              "r9k-ray-head.service", "r9k-fleet.service",
                                              "r9k-ray-worker.service", "r9k-fleet-entry.service"}
    for unit in long_running:
        restart = [ln for ln in unit.read_text().splitlines() if ln.startswith("Restart=")]
        assert restart == ["Restart=always"], (unit.name, restart)
    if shutil.which("systemd-analyze"):
        proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, long_running)],
                              capture_output=True, text=True, timeout=60)
        assert "Restart" not in proc.stderr, proc.stderr
