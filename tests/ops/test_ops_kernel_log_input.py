"""Hostile and broken input to host ops, against real parts (fixture host trees, the LACT double
on a real Unix socket, real files, real subprocesses): spoofed, repeated and truncated kernel
logs, faults that name no card, a failing journalctl, slow and unsafe hooks, cards missing from
the bus, a LACT daemon that stalls or never stops replying, huge logs, and configs and state dirs
that are not what they should be."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from doubles import ops_host as fixtures
from doubles.lact_double import LactDouble
from doubles.ops_host import CardSpec, FakeKernel, build_host_tree, kmsg_record, read_cap_watts
from r9k.cli import main
from r9k.ops.config import ConfigError, load_config, parse_config
from r9k.ops.lact import LactClient, LactError
from r9k.ops.power import apply_power
from r9k.ops.state import (
    MAX_MESSAGE_CHARS, CardPresence, card_presence, read_card_state, read_card_states, read_host_events,
    update_card_state,
)
from r9k.ops.watch import FileSource, Watcher

A, B, C = "0000:03:00.0", "0000:04:00.0", "0000:0a:00.0"
CONFIG = "backend: sysfs\ndefaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n"
MES = "amdgpu {}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE"


def _cfg(tmp_path, text, name="ops.yaml"):
    cfg = tmp_path / name
    cfg.write_text(text)
    os.chmod(cfg, 0o644)
    return cfg


def _ops(*args, env=None):
    return CliRunner().invoke(main, ["ops", *args], env=env)


def _one_line_error(result) -> str:
    text = result.output.strip()
    assert text.count("\n") == 0, text
    assert "Traceback" not in text
    return text


# -- only kernel-transport records are kernel events --------------------------------------------
def test_spoofed_process_lines_are_not_kernel_events(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    log = tmp_path / "mixed.log"
    log.write_text(
        f"Nov 30 05:24:01 gpuhost python3[4242]: {MES.format(A)}\n"
        f"Nov 30 05:24:02 gpuhost sshd[901]: Invalid user amdgpu {A}: amdgpu: GPU reset begin! from 10.0.0.9 port 50022\n"
        f"2026-11-30T05:24:03.000000+00:00 gpuhost logger: amdgpu {A}: amdgpu: device lost from bus!\n"
        + json.dumps({"MESSAGE": MES.format(A), "_TRANSPORT": "stdout", "__SEQNUM": 5, "__SEQNUM_ID": "s",
                      "_BOOT_ID": "b"}) + "\n"
        + json.dumps({"MESSAGE": MES.format(A), "__SEQNUM": 6, "__SEQNUM_ID": "s", "_BOOT_ID": "b"}) + "\n"
        # a process writing to /dev/kmsg gets the LOG_USER facility (priority 8 and up)
        + kmsg_record(77, MES.format(A), priority=12)
        + f"Nov 30 05:24:05 gpuhost kernel: [  13.0] {MES.format(B)}\n"
    )
    state = tmp_path / "state"
    result = _ops("watch", "--source", str(log), "--once", "--record", "--json", "--host-root", str(host),
                  "--state-dir", str(state), "--config", str(_cfg(tmp_path, "")))
    assert result.exit_code == 0, result.output
    events = [json.loads(x) for x in result.stdout.splitlines() if '"summary"' not in x]
    assert [(e["type"], e["bdf"]) for e in events] == [("mes_timeout", B)]
    assert read_card_state(state, A) is None or read_card_state(state, A).healthy
    # listed, but a `kernel:` tag proves nothing either (logger -t kernel): not acted on
    assert events[0]["unauthenticated"] and read_card_state(state, B) is None


def test_journal_records_need_kernel_transport(tmp_path):
    from r9k.ops.kernlog import parse_journal_json

    base = {"MESSAGE": MES.format(A), "__SEQNUM": 5, "__SEQNUM_ID": "s", "_BOOT_ID": "b"}
    assert parse_journal_json(json.dumps({**base, "_TRANSPORT": "kernel"})) is not None
    for transport in ("stdout", "syslog", "journal", None):
        entry = dict(base) if transport is None else {**base, "_TRANSPORT": transport}
        assert parse_journal_json(json.dumps(entry)) is None, transport


# -- hooks in places others can write are refused -----------------------------------------------
def _hook(path: Path, mode=0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(path, mode)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="hook checks need root-owned files")
def test_world_writable_hook_or_parent_is_refused(tmp_path):
    safe = _hook(tmp_path / "safe/drain.sh")
    assert load_config(_cfg(tmp_path, f"hooks: [{safe}]\n")).hook_argvs() == [[str(safe)]]

    writable_hook = _hook(tmp_path / "ww/drain.sh", 0o777)
    with pytest.raises(ConfigError, match=r"drain.sh.*writable by group or others"):
        load_config(_cfg(tmp_path, f"hooks: [{writable_hook}]\n"))

    open_dir = tmp_path / "opendir"
    hook = _hook(open_dir / "drain.sh")
    os.chmod(open_dir, 0o777)  # anyone can replace the hook
    with pytest.raises(ConfigError, match=r"opendir.*writable by group or others"):
        load_config(_cfg(tmp_path, f"hooks: [[{hook}, --now]]\n"))

    result = _ops("check-config", "--config", str(_cfg(tmp_path, f"hooks: [{hook}]\n")))
    assert result.exit_code == 2 and "opendir" in _one_line_error(result)
    with pytest.raises(ConfigError, match="not found"):
        load_config(_cfg(tmp_path, f"hooks: [{tmp_path / 'absent.sh'}]\n"))


# -- a card missing from the bus does not stop the others ----------------------------------------
def test_a_missing_card_is_reported_and_the_others_are_applied(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    cfg = _cfg(tmp_path, CONFIG + f'cards: {{"{C}": {{power_cap_watts: 200}}}}\n')
    common = ["--config", str(cfg), "--host-root", str(host), "--state-dir", str(tmp_path / "state")]
    with FakeKernel(host):
        applied = _ops("apply", "--settle-seconds", "1", "--json", *common)
        assert applied.exit_code == 1, applied.output
        cards = {c["bdf"]: c for c in json.loads(applied.stdout)["cards"]}
        assert cards[C]["drift"] == ["card not found on this host"]
        assert cards[A]["ok"] and cards[B]["ok"]
        assert read_cap_watts(host, A) == 210.0 and read_cap_watts(host, B) == 210.0
        fixtures.simulate_reset(host, B)
        loop = _ops("reconcile", "--interval", "0.05", "--count", "1", "--settle-seconds", "1", *common)
    assert loop.exit_code == 1, loop.output
    assert f"re-applied {B}" in loop.output and f"drift on {C}" in loop.output
    assert read_cap_watts(host, B) == 210.0


# -- expected cards -----------------------------------------------------------------------------
def test_card_presence_is_pure():
    assert card_presence(parse_config(""), []) == CardPresence(expected=1, present=0, missing=[])
    assert not card_presence(parse_config(""), []).ok
    assert card_presence(parse_config("expected_cards: 2\n"), [A, B]).ok
    listed = parse_config(f'expected_cards: ["{A}", "{B}"]\n')
    assert card_presence(listed, [A, C]) == CardPresence(expected=2, present=1, missing=[B])
    with pytest.raises(ConfigError, match="expected_cards"):
        parse_config("expected_cards: -1\n")
    with pytest.raises(ConfigError, match="expected_cards"):
        parse_config('expected_cards: ["03:00.0"]\n')


def test_no_cards_or_a_vanished_card_exits_1(tmp_path):
    empty = build_host_tree(tmp_path / "empty", [])
    cfg = _cfg(tmp_path, CONFIG)
    for command in ("apply", "status"):
        result = _ops(command, "--config", str(cfg), "--host-root", str(empty), "--state-dir", str(tmp_path / "s"))
        assert result.exit_code == 1, (command, result.output)
        assert "fewer cards than expected: 0 amdgpu card(s) present, expected at least 1" in result.output
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    listed = _cfg(tmp_path, CONFIG + f'expected_cards: ["{A}", "{B}"]\n', "listed.yaml")
    with FakeKernel(host):
        result = _ops("apply", "--json", "--settle-seconds", "1", "--config", str(listed), "--host-root", str(host),
                      "--state-dir", str(tmp_path / "s"))
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["cards_expected"] == 2 and report["cards_present"] == 1 and report["cards_missing"] == [B]
    assert read_cap_watts(host, A) == 210.0  # the card that is there is still managed
    status = _ops("status", "--config", str(listed), "--host-root", str(host), "--state-dir", str(tmp_path / "s"))
    assert status.exit_code == 1 and f"fewer cards than expected: {B} missing" in status.output


# -- exactly-once keyed on record identity, truncation detected ----------------------------------
BOOT_LINE = "[    0.000000] Linux version 6.14.0-36-generic (buildd@lcy02) #36-Ubuntu SMP PREEMPT_DYNAMIC\n"


def _dmesg(*lines):
    return BOOT_LINE + "".join(lines)


def test_two_boots_of_the_same_kernel_both_count(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state = tmp_path / "state"
    boot1, boot2 = tmp_path / "boot1.dmesg", tmp_path / "boot2.dmesg"
    boot1.write_text(_dmesg("[    3.100000] usb 1-1: new device\n",
                            f"[  812.345678] amdgpu {A}: amdgpu: GPU reset begin!. Source:  3\n"))
    boot2.write_text(_dmesg(f"[  402.000001] amdgpu {A}: amdgpu: GPU reset begin!. Source:  3\n"))
    for log in (boot1, boot2):
        result = _ops("watch", "--source", str(log), "--once", "--record", "--host-root", str(host),
                      "--state-dir", str(state), "--config", str(_cfg(tmp_path, "")))
        assert result.exit_code == 0, result.output
        assert "already counted" not in result.output
    assert read_card_state(state, A).counts["reset_begin"] == 2
    # The same file again (its cursor lost), and a longer save of the same boot: nothing is counted twice.
    (state / "watch-cursor.json").unlink()
    again = _ops("watch", "--source", str(boot1), "--once", "--record", "--host-root", str(host),
                 "--state-dir", str(state), "--config", str(_cfg(tmp_path, "")))
    assert "already counted" in again.output
    longer = tmp_path / "boot2-later.dmesg"
    longer.write_text(boot2.read_text() + f"[  900.000000] amdgpu {A}: amdgpu: GPU reset(1) succeeded!\n")
    _ops("watch", "--source", str(longer), "--once", "--record", "--host-root", str(host),
         "--state-dir", str(state), "--config", str(_cfg(tmp_path, "")))
    counts = read_card_state(state, A).counts
    assert (counts["reset_begin"], counts["reset_succeeded"]) == (2, 1)


def test_copytruncate_then_regrowth_past_the_offset_loses_nothing(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state, log = tmp_path / "state", tmp_path / "kern.log"
    log.write_text(_dmesg(f"[  100.000000] amdgpu {A}: amdgpu: GPU reset begin!. Source:  3\n"))
    watcher = Watcher(FileSource(log), state, host)
    assert [i.new for i in watcher.poll()] == [True]
    # logrotate copytruncate: the file is emptied in place, then grows past the old offset before
    # the next poll (same first line: the kernel's boot banner is logged again after a reboot).
    with open(log, "r+") as fh:
        fh.truncate(0)
    log.write_text(_dmesg(f"[   50.000000] amdgpu {A}: amdgpu: GPU reset begin!. Source:  1\n",
                          "[   60.000000] " + "padding " * 40 + "\n"))
    seen = watcher.poll()
    assert [(i.event.type, i.new) for i in seen] == [("reset_begin", True)]
    assert read_card_state(state, A).counts["reset_begin"] == 2
    assert any("truncated" in g or "replaced" in g for g in watcher.source.gaps)


# -- attribution by evidence only; unattributed faults are host events ----------------------------
def test_a_line_without_address_is_not_given_to_the_last_card(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    state, log = tmp_path / "state", tmp_path / "kern.log"
    log.write_text(
        f"[   10.000000] amdgpu {A}: amdgpu: SMU is initialized successfully!\n"
        "[   11.000000] usb 1-1: new high-speed USB device\n"
        "[  900.000000] [drm] *ERROR* ring gfx_0.0.0 timeout, signaled seq=10, emitted seq=12\n"
        f"[  950.000000] amdgpu {B}: amdgpu: MES failed to respond to msg=SUSPEND\n"
        "[  950.000100] [drm] *ERROR* ring comp_1.0.0 timeout, signaled seq=3, emitted seq=5\n"
    )
    result = _ops("watch", "--source", str(log), "--once", "--record", "--host-root", str(host),
                  "--state-dir", str(state), "--config", str(_cfg(tmp_path, "")))
    assert result.exit_code == 0, result.output
    assert "already counted" not in result.output and "no card" in result.output
    assert read_card_state(state, A) is None or read_card_state(state, A).healthy
    b = read_card_state(state, B)
    assert (b.counts["mes_timeout"], b.counts["ring_timeout"]) == (1, 1)  # the next line, 0.1 ms later
    events = read_host_events(state)
    assert [(e.type, e.count) for e in events] == [("ring_timeout", 1)]
    assert "ring gfx_0.0.0 timeout" in events[0].message and events[0].first_seen > 0
    # Exactly once for host events too.
    _ops("watch", "--source", str(log), "--once", "--record", "--host-root", str(host),
         "--state-dir", str(state), "--config", str(_cfg(tmp_path, "")))
    assert [(e.type, e.count) for e in read_host_events(state)] == [("ring_timeout", 1)]


# -- the journal source reports failures ----------------------------------------------------------
def _stand_in_journalctl(bin_dir: Path, body: str) -> dict:
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "journalctl"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_journalctl_failure_exits_nonzero_with_its_message(tmp_path, monkeypatch):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    env = _stand_in_journalctl(tmp_path / "bin", 'echo "Failed to open journal: Permission denied" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", env["PATH"])
    result = _ops("watch", "--source", "journal", "--once", "--host-root", str(host),
                  "--config", str(tmp_path / "absent.yaml"))
    assert result.exit_code == 1, result.output
    assert "journalctl exited with status 1: Failed to open journal: Permission denied" in result.output
    # Following: journalctl dying is reported too, and the watcher stops non-zero (systemd restarts it).
    follow = _ops("watch", "--source", "journal", "--no-record", "--interval", "0.05", "--host-root", str(host),
                  "--config", str(tmp_path / "absent.yaml"))
    assert follow.exit_code == 1 and "Permission denied" in follow.output


def test_journalctl_lines_are_read(tmp_path, monkeypatch):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    line = json.dumps({"MESSAGE": MES.format(A), "_TRANSPORT": "kernel", "__SEQNUM": 9, "__SEQNUM_ID": "s",
                       "_BOOT_ID": "b", "__CURSOR": "s=1;i=9"})
    env = _stand_in_journalctl(tmp_path / "bin", f"cat <<'EOF'\n{line}\nEOF\n")
    monkeypatch.setenv("PATH", env["PATH"])
    result = _ops("watch", "--source", "journal", "--once", "--json", "--host-root", str(host),
                  "--config", str(tmp_path / "absent.yaml"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0])["type"] == "mes_timeout"


# -- fence first, hooks off the loop, once per state change, configured timeout -------------------
def test_slow_hooks_do_not_delay_fencing_another_card(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    state, log, calls = tmp_path / "state", tmp_path / "kern.log", tmp_path / "calls"
    hook = tmp_path / "slow-drain.sh"
    hook.write_text(f'#!/bin/sh\necho "$R9K_EVENT $R9K_BDF" >> {calls}\nsleep 1\n')
    hook.chmod(0o755)
    log.write_text("".join(f"[  {10 + i}.0] {MES.format(A)}\n" for i in range(3)) + f"[  20.0] {MES.format(B)}\n")
    watcher = Watcher(FileSource(log), state, host, hooks=[[str(hook)]], hook_timeout_s=5)
    started = time.monotonic()
    seen = watcher.poll()
    fenced_after_s = time.monotonic() - started
    assert read_card_state(state, B).healthy is False
    assert fenced_after_s < 0.8, f"fencing B waited {fenced_after_s:.2f} s for A's hooks"
    assert [i.new for i in seen] == [True] * 4
    runs = watcher.wait_for_hooks(timeout_s=5)
    assert sorted(calls.read_text().splitlines()) == [f"mes_timeout {A}", f"mes_timeout {B}"]  # once per card
    assert sorted(r.bdf for r in runs) == [A, B] and all(r.returncode == 0 for r in runs)
    assert time.monotonic() - started < 2.5  # A's and B's hooks ran side by side


def test_hook_timeout_comes_from_the_config(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    hook = tmp_path / "hang.sh"
    hook.write_text("#!/bin/sh\nsleep 30\n")
    hook.chmod(0o755)
    log = tmp_path / "kern.log"
    log.write_text(f"[  10.0] {MES.format(A)}\n")
    config = parse_config(f"hooks: [{hook}]\nhook_timeout_s: 0.3\n")
    watcher = Watcher(FileSource(log), tmp_path / "state", host, hooks=config.hook_argvs(),
                      hook_timeout_s=config.hook_timeout_s)
    started = time.monotonic()
    watcher.poll()
    runs = watcher.wait_for_hooks(timeout_s=5)
    assert time.monotonic() - started < 2
    assert runs[0].returncode is None and "timed out after 0.3" in runs[0].error


# -- one deadline per LACT request, a reply size cap ----------------------------------------------
def _bounded(call, limit_s):
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still waiting after {limit_s} s"
    return outcome, time.monotonic() - started


def test_a_trickling_daemon_hits_the_request_deadline(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    sock = str(tmp_path / "lactd.sock")
    with LactDouble(sock, host, reply_mode="trickle"):
        outcome, took = _bounded(lambda: LactClient(sock, timeout_s=0.5).request("ping"), 3)
    assert isinstance(outcome.get("error"), LactError) and "no complete reply within 0.5 s" in str(outcome["error"])
    assert took < 1.5


def test_an_endless_reply_hits_the_size_cap_and_apply_changes_nothing(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    sock = str(tmp_path / "lactd.sock")
    with LactDouble(sock, host, reply_mode="endless"):
        outcome, _ = _bounded(lambda: LactClient(sock, timeout_s=30).request("list_devices"), 10)
        assert isinstance(outcome.get("error"), LactError) and "reply larger than" in str(outcome["error"])
        cfg = _cfg(tmp_path, f"backend: lact\nlact_socket: {sock}\ndefaults: {{power_cap_watts: 210}}\n")
        result = _ops("apply", "--config", str(cfg), "--host-root", str(host), "--state-dir", str(tmp_path / "s"))
    assert result.exit_code == 2 and "nothing was changed" in result.output
    assert read_cap_watts(host, A) == 300.0


# -- stream the file, cap stored message length ---------------------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="hooks need a root-owned config")
def test_a_huge_line_is_capped_in_state_and_hook_env(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state, log, seen_env = tmp_path / "state", tmp_path / "kern.log", tmp_path / "env-length"
    hook = tmp_path / "hook.sh"
    hook.write_text(f'#!/bin/sh\nprintf "%s" "$R9K_MESSAGE" | wc -c > {seen_env}\n')
    hook.chmod(0o755)
    cfg = _cfg(tmp_path, f"hooks: [{hook}]\n")
    log.write_text(f"[  10.0] {MES.format(A)} " + "x" * (3 << 20) + "\n" + f"[  11.0] amdgpu {A}: amdgpu: GPU reset begin!\n")
    result = _ops("watch", "--source", str(log), "--once", "--record", "--config", str(cfg), "--host-root", str(host),
                  "--state-dir", str(state))
    assert result.exit_code == 0, result.output[-500:]
    st = read_card_state(state, A)
    assert st.counts["mes_timeout"] == 1 and st.counts["reset_begin"] == 1
    assert len(st.unhealthy_reason) <= MAX_MESSAGE_CHARS + 20
    assert (state / "cards" / f"{A}.json").stat().st_size < 64 * 1024
    assert int(seen_env.read_text()) <= MAX_MESSAGE_CHARS


def _peak_rss_kib(args) -> int:
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_a_big_log_is_streamed_in_bounded_memory(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    r9k = str(Path(sys.executable).parent / "r9k")
    small, big = tmp_path / "small.log", tmp_path / "big.log"
    small.write_text(f"[  1.0] {MES.format(A)}\n")
    noise = "".join(f"[{i:>8}.000000] usb 1-1: new high-speed USB device number {i} using xhci_hcd\n"
                    for i in range(1000))
    with open(big, "w") as fh:
        for _ in range(300):  # about 25 MB
            fh.write(noise)
        fh.write(f"[  99.0] {MES.format(A)}\n")
    args = ["ops", "watch", "--once", "--json", "--host-root", str(host), "--config", str(tmp_path / "absent.yaml")]
    baseline = _peak_rss_kib([r9k, *args, "--source", str(small)])
    peak = _peak_rss_kib([r9k, *args, "--source", str(big)])
    assert big.stat().st_size > 20 << 20
    assert peak - baseline < 12 * 1024, f"peak RSS grew by {(peak - baseline) / 1024:.0f} MiB for a 25 MB log"


# -- bad input keeps the exit-code contract ------------------------------------------------------
def test_non_utf8_and_duplicate_key_configs_are_bad_input(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes(b"defaults: {power_cap_watts: 210}  # caf\xe9\n")
    result = _ops("status", "--config", str(latin), "--host-root", str(host))
    assert result.exit_code == 2 and "not UTF-8" in _one_line_error(result)
    dup = _cfg(tmp_path, "defaults: {power_cap_watts: 210}\ndefaults: {power_cap_watts: 300}\n", "dup.yaml")
    result = _ops("apply", "--config", str(dup), "--host-root", str(host), "--state-dir", str(tmp_path / "s"))
    assert result.exit_code == 2 and "duplicate key 'defaults'" in _one_line_error(result)
    assert read_cap_watts(host, A) == 300.0
    with pytest.raises(ConfigError, match="duplicate key 'power_cap_watts'"):
        parse_config("defaults:\n  power_cap_watts: 210\n  power_cap_watts: 225\n")


def test_state_dir_that_is_a_file_or_absent_is_bad_input(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    cfg = _cfg(tmp_path, CONFIG)
    not_dir = tmp_path / "state-file"
    not_dir.write_text("x")
    log = tmp_path / "kern.log"
    log.write_text(f"[  1.0] {MES.format(A)}\n")
    for args in (["apply", "--config", str(cfg), "--host-root", str(host)],
                 ["status", "--config", str(cfg), "--host-root", str(host)],
                 ["watch", "--source", str(log), "--once", "--record", "--config", str(_cfg(tmp_path, "", "e.yaml")),
                  "--host-root", str(host)],
                 ["health"], ["clear", A]):
        result = _ops(*args, "--state-dir", str(not_dir))
        assert result.exit_code == 2, (args, result.output)
        assert "--state-dir" in _one_line_error(result) and "not a directory" in result.output
    assert read_cap_watts(host, A) == 300.0
    result = _ops("health", "--state-dir", str(tmp_path / "nonexistent"))
    assert result.exit_code == 2 and "no ops state" in _one_line_error(result)


def test_a_corrupt_card_state_file_is_reported_not_hidden(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    state = tmp_path / "state"
    update_card_state(state, B, lambda s: None)
    (state / "cards" / f"{A}.json").write_text('{"bdf": "0000:03:00.0", "healthy": fal')
    states = read_card_states(state)
    assert list(states) == [B] and A in states.corrupt and A in states.unhealthy()
    health = _ops("health", "--state-dir", str(state))
    assert health.exit_code == 1 and f"{A}.json" in health.output and "unreadable" in health.output
    # Fail closed: power management does not touch a card whose state it cannot read.
    with FakeKernel(host):
        report = apply_power(parse_config(CONFIG), host, state, settle_s=1)
    by = {c.bdf: c for c in report.cards}
    assert by[A].fenced and not by[A].ok and read_cap_watts(host, A) == 300.0
    assert by[B].ok and read_cap_watts(host, B) == 210.0
    # `ops clear` is the operator's way out: the bad file is kept aside, the card is healthy again.
    cleared = _ops("clear", A, "--state-dir", str(state))
    assert cleared.exit_code == 0, cleared.output
    assert read_card_state(state, A).healthy and list((state / "cards").glob(f"{A}.json.corrupt-*"))


@pytest.mark.parametrize("interval", ["0", "-1", "nan"])
def test_watch_interval_must_be_positive(tmp_path, interval):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    log = tmp_path / "kern.log"
    log.write_text("")
    result = _bounded(lambda: _ops("watch", "--source", str(log), "--no-record", "--interval", interval,
                                   "--host-root", str(host), "--config", str(tmp_path / "absent.yaml")), 5)[0]["value"]
    assert result.exit_code == 2 and "--interval" in result.output
