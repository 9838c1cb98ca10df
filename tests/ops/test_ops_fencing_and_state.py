"""Host ops against fixture host trees and the real CLI: reconcile with a card that refuses a
setting, with LACT down or without get_gpu_config, a card behind VMD, a cap that reads back but is
not enforced; the watcher's fencing and state: state dirs that take no writes, faults that name
no card, an unusable journal cursor, forged syslog kernel lines, bounded writes per event, idle
polls, the last kmsg record, record ids across crashes; hook arguments, children and a planted
lock symlink."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from doubles.ops_host import CardSpec, FakeKernel, build_host_tree, read_cap_watts, read_od_offset_mv
from r9k.cli import main
from r9k.ops.config import ConfigError, load_config

A, B = "0000:03:00.0", "0000:04:00.0"
CONFIG = "backend: sysfs\ndefaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n"


def _ops(tmp_path, host, *args):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text(CONFIG)
    cfg.chmod(0o644)
    return CliRunner().invoke(main, ["ops", *args, "--config", str(cfg), "--host-root", str(host),
                                     "--state-dir", str(tmp_path / "state")])


def test_one_odd_card_does_not_stop_reconcile_repairing_the_others(tmp_path):
    """A card declaring 250-350 W: reconcile keeps going every round (exit 1 at the end, not 2
    at the first), repairs the card that drifted and names the odd one with its range."""
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B, cap_min_watts=250,
                                                                      cap_max_watts=350)])
    with FakeKernel(host):
        result = _ops(tmp_path, host, "reconcile", "--interval", "0.01", "--count", "2",
                      "--settle-seconds", "1", "--json")
    assert result.exit_code == 1, result.output
    rounds = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    last = {c["bdf"]: c for c in rounds[-1]["cards"]}
    assert last[A]["ok"] and (read_cap_watts(host, A), read_od_offset_mv(host, A)) == (210.0, -42)
    assert "refused: 0000:04:00.0: power_cap_watts 210 is outside the card's range 250-350 W" in \
        last[B]["drift"]
    assert (read_cap_watts(host, B), read_od_offset_mv(host, B)) == (300.0, -42)


def _script(path, mode=0o755):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(path, mode)
    return path


def _config(path, text, mode=0o644):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _marking_hook(tmp_path, echo: str):
    """A drain hook (hooks/drain.sh, run by /bin/sh) appending `echo` to the file it returns."""
    marks = tmp_path / "hook-ran"
    script = tmp_path / "hooks" / "drain.sh"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "{echo}" >> {marks}\n')
    os.chmod(script, 0o755)
    return script, marks


def _watch_once(log, cfg, host, state):
    """`r9k ops watch --once --record --json` over a log file: the result and its events."""
    result = CliRunner().invoke(main, ["ops", "watch", "--source", str(log), "--once", "--record",
                                       "--config", str(cfg), "--host-root", str(host),
                                       "--state-dir", str(state), "--json"])
    return result, [json.loads(line) for line in result.stdout.splitlines() if '"type"' in line]


@pytest.mark.skipif(os.geteuid() != 0, reason="hook checks need root-owned files")
def test_hook_arguments_and_the_config_directory_are_checked_too(tmp_path):
    """A 0666 script in a 0777 directory handed to /bin/sh or python3 (list or string form), or
    a config in a 0777 directory: refused at load (exit 2), so never run as root."""
    safe_dir = tmp_path / "safe"
    ok_script = _script(safe_dir / "hook.sh")
    good = _config(safe_dir / "ops.yaml", f"hooks: [[/bin/sh, {ok_script}], 'python3 {ok_script}']\n")
    assert load_config(good).hook_argvs()[0] == ["/bin/sh", str(ok_script)]

    open_dir = tmp_path / "open"
    script = _script(open_dir / "hook.sh", 0o666)
    os.chmod(open_dir, 0o777)
    for hooks in (f"[[/bin/sh, {script}]]", f"['python3 {script}']"):
        cfg = _config(safe_dir / "bad.yaml", f"hooks: {hooks}\n")
        with pytest.raises(ConfigError, match=r"argument .*hook.sh is writable by group or others"):
            load_config(cfg)
        result = CliRunner().invoke(main, ["ops", "check-config", "--config", str(cfg)])
        assert result.exit_code == 2 and "hook.sh" in result.output
    os.chmod(script, 0o644)  # the script is safe now, its directory is not
    with pytest.raises(ConfigError, match=r"argument directory .*open is writable by group or others"):
        load_config(_config(safe_dir / "bad.yaml", f"hooks: [[/bin/sh, {script}]]\n"))
    with pytest.raises(ConfigError, match=r"argument .*absent.sh is not there"):
        load_config(_config(safe_dir / "bad.yaml", f"hooks: [[/bin/sh, {safe_dir / 'absent.sh'}]]\n"))

    in_open_dir = _config(open_dir / "ops.yaml", f"hooks: [{ok_script}]\n")
    with pytest.raises(ConfigError, match=r"defines hooks but its directory .*open is writable"):
        load_config(in_open_dir)
    # a watcher re-checks before each run: a script made writable after load is not run
    from r9k.ops.kernlog import KernelEvent
    from r9k.ops.watch import run_hooks

    os.chmod(script, 0o666)
    event = KernelEvent(type="mes_timeout", bdf=A, message="MES failed", stream="file", ordinal=1,
                        attribution="prefix")
    runs = run_hooks([["/bin/sh", str(script)]], event, timeout_s=5)
    assert runs[0].returncode is None and "not run" in runs[0].error and "hook.sh" in runs[0].error


MES = "amdgpu {}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE"


@pytest.mark.parametrize("state_dir", ["/proc/self", "/sys/fs/r9k-state"])
def test_a_state_dir_that_takes_no_write_is_refused_at_start(tmp_path, state_dir):
    """Read-only filesystems (procfs, sysfs: root cannot write there either): every command that
    records refuses at start, exit 2, before touching a card or reading the log."""
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    log = tmp_path / "kern.log"
    log.write_text(f"[  1.0] {MES.format(A)}\n")
    cfg = _config(tmp_path / "ops.yaml", CONFIG)
    common = ["--config", str(cfg), "--host-root", str(host), "--state-dir", state_dir]
    for args in (["watch", "--source", str(log), "--once", "--record"], ["apply"],
                 ["reconcile", "--interval", "1", "--count", "1"]):
        result = CliRunner().invoke(main, ["ops", *args, *common])
        assert result.exit_code == 2, (args, result.output)
        assert f"--state-dir {state_dir}: cannot write there" in result.output
        assert "Traceback" not in result.output
    assert read_cap_watts(host, A) == 300.0


def test_a_write_failing_later_still_contains_the_fault(tmp_path, monkeypatch):
    """The state dir fills up after start: the MES fault is still fenced (hooks run once per
    card), printed with what was not saved, and the process does not crash."""
    import errno

    import r9k.ops.state as state_mod
    import r9k.ops.watch as watch_mod

    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    script, marks = _marking_hook(tmp_path, "$R9K_BDF $R9K_EVENT")
    cfg = _config(tmp_path / "ops.yaml", CONFIG + f"hooks: [[/bin/sh, {script}]]\n")
    log = tmp_path / "kern.log"
    log.write_text(f"[  1.0] {MES.format(A)}\n[  2.0] {MES.format(A)}\n"
                   "[ 30.0] [drm] *ERROR* ring gfx_0.0.0 timeout\n")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_mod, "atomic_write_json", full)
    monkeypatch.setattr(watch_mod, "atomic_write_json", full)
    result, events = _watch_once(log, cfg, host, tmp_path / "state")
    assert result.exit_code == 0, result.output
    assert [(e["bdf"], e["new"], e["fenced_now"]) for e in events] == [
        (A, True, True), (A, True, False), (None, True, False)]
    assert all("not saved to" in e["unsaved"] and "No space left" in e["unsaved"] for e in events)
    assert marks.read_text().splitlines() == [f"{A} mes_timeout"]  # the drain hook ran once
    assert "warning: log position not saved" in result.output


def test_an_unaddressed_fault_after_two_cards_lines_is_a_host_event(tmp_path):
    """Lines of two cards interleaved, then a ring timeout naming no card: no evidence for
    either card (the old rule gave it to whichever logged last, which was then fenced and
    drained); a host event. After one card's lines alone, context still attributes it."""
    from r9k.ops.kernlog import Classifier
    from r9k.ops.watch import FileSource

    log = tmp_path / "kern.log"
    log.write_text(f"[ 10.00] amdgpu {A}: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:3)\n"
                   f"[ 10.01] amdgpu {B}: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:5)\n"
                   "[ 10.02] [drm] *ERROR* ring gfx_0.0.0 timeout, signaled seq=10, emitted seq=12\n"
                   f"[ 20.00] amdgpu {B}: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:5)\n"
                   "[ 20.01] [drm] *ERROR* ring gfx_0.0.0 timeout, signaled seq=20, emitted seq=22\n")
    classifier = Classifier()
    events = [e for e in map(classifier.classify, FileSource(log).read(final=True)) if e]
    assert [(e.type, e.bdf, e.attribution) for e in events] == [
        ("ring_timeout", None, "none"), ("ring_timeout", B, "context")]
    # through the CLI: the first timeout is a host event, only the second fences card B
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    cfg = _config(tmp_path / "ops.yaml", CONFIG)
    result, seen = _watch_once(log, cfg, host, tmp_path / "state")
    assert result.exit_code == 0, result.output
    assert [(e["bdf"], e["host"], e["fenced_now"]) for e in seen] == [(None, True, False), (B, False, True)]


def test_a_card_behind_vmd_is_managed_and_fenced(tmp_path):
    """A card on PCI domain 10000 (Intel VMD): apply writes, verifies and records it without a
    traceback; its MES timeout is its own (fenced), not a host event."""
    vmd = "10000:e1:00.0"
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(vmd)])
    with FakeKernel(host):
        result = _ops(tmp_path, host, "apply", "--settle-seconds", "1", "--json")
    assert result.exit_code == 0, result.output
    cards = {c["bdf"]: c for c in json.loads(result.stdout)["cards"]}
    assert cards[vmd]["ok"] and (read_cap_watts(host, vmd), read_od_offset_mv(host, vmd)) == (210.0, -42)
    log = tmp_path / "kern.log"
    log.write_text(f"[  5.0] {MES.format(vmd)}\n")
    watched = _ops(tmp_path, host, "watch", "--source", str(log), "--once", "--record", "--json")
    assert watched.exit_code == 0, watched.output
    seen = [json.loads(line) for line in watched.stdout.splitlines() if '"type"' in line]
    assert [(e["bdf"], e["host"], e["fenced_now"]) for e in seen] == [(vmd, False, True)]


def test_auto_falls_back_to_sysfs_from_a_lact_without_get_gpu_config(tmp_path):
    """An older lactd answers ping and list_devices but not get_gpu_config ("unknown variant"):
    auto picks sysfs and says why; `backend: lact` refuses (exit 2, nothing written)."""
    from doubles.lact_double import LactDouble

    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    sock = str(tmp_path / "lactd.sock")
    cfg = _config(tmp_path / "ops.yaml", f"backend: auto\nlact_socket: {sock}\n"
                  "defaults: {power_cap_watts: 210, voltage_offset_mv: -42}\n")
    common = ["--config", str(cfg), "--host-root", str(host), "--state-dir", str(tmp_path / "state")]
    with LactDouble(sock, host, fail_commands={"get_gpu_config": "unknown variant `GetGpuConfig`"}), \
            FakeKernel(host):
        auto = CliRunner().invoke(main, ["ops", "apply", "--settle-seconds", "1", "--json", *common])
        forced = CliRunner().invoke(main, ["ops", "apply", "--backend", "lact", *common])
    assert auto.exit_code == 0, auto.output
    backend = json.loads(auto.stdout)["backend"]
    assert backend.startswith("sysfs (LACT not available") and "unknown variant" in backend
    assert read_cap_watts(host, A) == read_cap_watts(host, B) == 210.0
    assert forced.exit_code == 2 and "unknown variant" in forced.output


def test_reconcile_with_lact_down_reports_and_keeps_going(tmp_path):
    """`backend: lact` with lactd not running: each round reports the drift it could not repair
    (exit 1 at the end, not exit 2 at the first round); the rounds go on."""
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    cfg = _config(tmp_path / "ops.yaml", f"backend: lact\nlact_socket: {tmp_path / 'absent.sock'}\n"
                  "defaults: {power_cap_watts: 210}\n")
    result = CliRunner().invoke(main, ["ops", "reconcile", "--interval", "0.01", "--count", "3",
                                       "--settle-seconds", "0.1", "--json", "--config", str(cfg),
                                       "--host-root", str(host), "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 1, result.output
    rounds = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["cards"][0]["drift"][0].startswith("not re-applied: backend lact:") for r in rounds)
    assert read_cap_watts(host, A) == 300.0


def test_an_unusable_journal_cursor_falls_back_and_says_so(tmp_path, monkeypatch):
    """A saved cursor journalctl cannot seek to: read this boot from its start with a warning
    (before: exit 1 on every restart). journalctl is asked for kernel records by transport, not
    -k, so a cursor from the previous boot reads that boot's unread tail."""
    from r9k.ops.watch import CURSOR_FILE

    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state = tmp_path / "state"
    state.mkdir()
    (state / CURSOR_FILE).write_text(json.dumps({"journal": {"cursor": "s=gone;i=1"}}))
    calls = tmp_path / "journalctl-calls"
    line = json.dumps({"MESSAGE": MES.format(A), "_TRANSPORT": "kernel", "__SEQNUM": 9,
                       "__SEQNUM_ID": "s", "_BOOT_ID": "b", "__CURSOR": "s=new;i=9"})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "journalctl"
    script.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                      'case "$*" in *--after-cursor*) echo "Failed to seek to cursor: Invalid argument" >&2; exit 1;; esac\n'
                      f"cat <<'EOF'\n{line}\nEOF\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cfg = _config(tmp_path / "ops.yaml", CONFIG)
    result = CliRunner().invoke(main, ["ops", "watch", "--source", "journal", "--once", "--record",
                                       "--config", str(cfg), "--host-root", str(host),
                                       "--state-dir", str(state), "--json"])
    assert result.exit_code == 0, result.output
    assert "warning: journal: saved cursor unusable (Failed to seek to cursor: Invalid argument); " \
           "read this boot from its start" in result.output
    assert json.loads(result.stdout.splitlines()[0])["fenced_now"] is True
    first, second = calls.read_text().splitlines()
    assert first.startswith("_TRANSPORT=kernel -o json") and "--after-cursor=s=gone;i=1" in first
    assert second.endswith("-b") and "-k" not in second.split()
    assert json.loads((state / CURSOR_FILE).read_text())["journal"]["cursor"] == "s=new;i=9"


def test_a_cap_that_reads_back_but_is_not_enforced_is_written_again(tmp_path):
    """LACT issue 506: power1_cap reads 210 W but the card draws 262 W. Drawing more than cap +
    cap_draw_margin_watts for cap_draw_window_s is drift: reconcile writes the cap again and
    says why; a card under its cap is left alone."""
    host = build_host_tree(tmp_path / "host", [
        CardSpec(A, cap_watts=210, voltage_offset_mv=-42, power_draw_watts=262.0),
        CardSpec(B, cap_watts=210, voltage_offset_mv=-42, power_draw_watts=200.0)])
    cfg = _config(tmp_path / "ops.yaml", CONFIG + "cap_draw_margin_watts: 15\ncap_draw_window_s: 0.05\n")
    result = CliRunner().invoke(main, ["ops", "reconcile", "--interval", "0.03", "--count", "6",
                                       "--settle-seconds", "0.2", "--json", "--config", str(cfg),
                                       "--host-root", str(host), "--state-dir", str(tmp_path / "state")])
    rounds = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rounds) == 6, result.output
    forced = [r for r in rounds if A in r["reapplied"]]
    assert forced and B not in {b for r in rounds for b in r["reapplied"]}
    card = next(c for c in forced[0]["cards"] if c["bdf"] == A)
    assert card["drift"][0] == ("drew 262 W, over its 210 W cap by more than 15 W for 0.05 s: "
                                "cap written again")
    assert "sysfs power1_cap=210000000" in card["actions"]
    assert rounds[0]["reapplied"] == []  # one round over the cap is not yet the window


def test_hook_children_die_with_it_fencing_stays_on_and_a_planted_lock_symlink_is_refused(tmp_path):
    """A hook killed on timeout takes its children with it (process group); `fault_events: []`
    (fencing silently off) is refused; a `.lock` symlink planted in the state dir does not make
    root create a file where it points."""
    import time

    from r9k.ops.config import parse_config
    from r9k.ops.kernlog import KernelEvent
    from r9k.ops.state import cards_dir, update_card_state
    from r9k.ops.watch import run_hooks

    child_pid = tmp_path / "child.pid"
    script = tmp_path / "hooks" / "spawner.sh"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {child_pid}\nwait\n")
    os.chmod(script, 0o755)
    event = KernelEvent(type="mes_timeout", bdf=A, message="MES failed", stream="file", ordinal=1,
                        attribution="prefix")
    runs = run_hooks([[str(script)]], event, timeout_s=0.5)
    assert "timed out after 0.5 s (killed with its process group)" in runs[0].error
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        status = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}/stat") else "X"
        if status == "Z":  # reaped by init later: dead already
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the hook's child {pid} outlived the timeout")

    with pytest.raises(ValueError, match="fault_events: expected a list that includes mes_timeout"):
        parse_config("fault_events: []\n")

    state = tmp_path / "state"
    cards_dir(state).mkdir(parents=True)
    target = tmp_path / "elsewhere"
    os.symlink(target, cards_dir(state) / ".lock")
    with pytest.raises(OSError):
        update_card_state(state, A, lambda s: None)
    assert not target.exists()


# -- the watcher: forged syslog kernel lines, per-event writes, idle fsyncs, the last kmsg
# record --------------------------------------------------------------------------------------
SYSLOG_MES = "Nov 30 05:24:01 gpuhost kernel: " + MES


def test_a_syslog_kernel_tag_is_reported_not_acted_on(tmp_path):
    """`logger -t kernel '<MES line>'` lands in a syslog file byte for byte like the kernel's own
    line (rsyslog's default template, no [pid] without logger --id): reported with why it was not
    acted on, never counted, fenced or handed to the hooks, and the watcher says which sources
    prove a kernel record. Trusting the tag is an explicit choice (trust_syslog_kernel_tag)."""
    from r9k.ops.config import parse_config
    from r9k.ops.state import read_card_state
    from r9k.ops.watch import FileSource, Watcher

    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    script, marks = _marking_hook(tmp_path, "$R9K_BDF")
    cfg = _config(tmp_path / "ops.yaml", CONFIG + f"hooks: [[/bin/sh, {script}]]\n")
    log = tmp_path / "syslog"
    log.write_text("Nov 30 05:24:00 gpuhost systemd[1]: Started session 4.\n" + SYSLOG_MES.format(A) + "\n")
    state = tmp_path / "state"
    result, events = _watch_once(log, cfg, host, state)
    assert result.exit_code == 0, result.output
    assert [(e["type"], e["bdf"], e["new"], e["fenced_now"]) for e in events] == [
        ("mes_timeout", A, False, False)]
    assert "logger -t kernel" in events[0]["unauthenticated"]
    assert read_card_state(state, A) is None and not marks.exists()
    warning = next(x for x in result.output.splitlines() if x.startswith("warning:") and "syslog" in x)
    assert "/dev/kmsg" in warning and "_TRANSPORT=kernel" in warning
    # the same line, trusted by choice: counted and fenced as before
    assert parse_config("trust_syslog_kernel_tag: true\n").trust_syslog_kernel_tag is True
    seen = Watcher(FileSource(log), state, host, trust_syslog_kernel_tag=True).poll(final=True)
    assert [(s.new, s.fenced_now, s.unauthenticated) for s in seen] == [(True, True, None)]
    assert read_card_state(state, A).healthy is False
    # and through `r9k ops watch` with the config field set: the hook runs
    trusted = _config(tmp_path / "trusted.yaml", CONFIG + f"hooks: [[/bin/sh, {script}]]\n"
                      "trust_syslog_kernel_tag: true\n")
    state2 = tmp_path / "state2"
    result, events = _watch_once(log, trusted, host, state2)
    assert result.exit_code == 0, result.output
    assert [(e["type"], e["new"], e["fenced_now"]) for e in events] == [("mes_timeout", True, True)]
    assert read_card_state(state2, A).healthy is False and marks.read_text().split() == [A]


class _FsyncMeter:
    """os.fsync, counted (the real call still runs)."""

    def __init__(self):
        self.count = 0
        self._real = os.fsync

    def __call__(self, fd):
        self.count += 1
        return self._real(fd)


def _snapshot(directory):
    """{path: (inode, size, mtime_ns)} of every file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            st = os.stat(os.path.join(root, name))
            out[os.path.join(root, name)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _bytes_written(before, after) -> int:
    """Bytes a step wrote: whole files that were created or replaced, the growth of the others."""
    total = 0
    for path, (ino, size, mtime) in after.items():
        old = before.get(path)
        if old is None or old[0] != ino:
            total += size
        elif old[2] != mtime:
            total += max(size - old[1], 0) or size  # grown: the growth; rewritten in place: all
    return total


def test_bytes_written_per_event_stay_bounded(tmp_path, monkeypatch):
    """A card with history (8 boots of kmsg positions, 900 MES timeouts from saved text logs):
    each new event used to rewrite and fsync the whole card file with its 900+ record ids (about
    23 KB at 1,100). Now each event writes under 2 KiB and at most 2 fsyncs (the card file;
    the id appended to its record file), however long the history; nothing is counted twice."""
    from doubles.ops_host import kmsg_record
    from r9k.ops.state import read_card_state
    from r9k.ops.watch import CURSOR_FILE, FileSource, KmsgSource, Watcher

    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state, log = tmp_path / "state", tmp_path / "kern.log"
    for boot in range(8):
        kmsg = tmp_path / f"kmsg-{boot}"
        kmsg.write_text(kmsg_record(5, MES.format(A), bdf=A))
        source = KmsgSource(kmsg, f"boot-{boot}")
        Watcher(source, state, host).poll(final=True)
        source.close()
    log.write_text("".join(f"[{i:>7}.000000] {MES.format(A)}\n" for i in range(900)))
    Watcher(FileSource(log), state, host).poll(final=True)
    cursor = json.loads((state / CURSOR_FILE).read_text())[f"file:{log.resolve()}"]
    watcher = Watcher(FileSource(log, cursor), state, host)
    meter = _FsyncMeter()
    monkeypatch.setattr(os, "fsync", meter)
    events = written = 0
    for i in range(40):  # one event per poll, as a follower sees them
        with open(log, "a") as fh:
            fh.write(f"[{1000 + i:>7}.000000] {MES.format(A)}\n")
        before = _snapshot(state)
        events += sum(s.new for s in watcher.poll())
        written += _bytes_written(before, _snapshot(state))
    monkeypatch.undo()
    assert events == 40
    assert written / events < 2048, f"{written / events:.0f} bytes written per event"
    assert meter.count / events <= 2, f"{meter.count / events:.2f} fsyncs per event"
    # exactly once still: the log position lost, the whole file read again counts nothing and
    # rewrites no card file
    (state / CURSOR_FILE).unlink()
    before = _snapshot(state / "cards")
    assert not any(s.new for s in Watcher(FileSource(log), state, host).poll(final=True))
    assert _snapshot(state / "cards") == before
    assert read_card_state(state, A).counts["mes_timeout"] == 8 + 900 + 40


def test_idle_polls_write_nothing_durable(tmp_path, monkeypatch):
    """No new records: a poll used to rewrite and fsync the log position every time (twice a
    second by default, forever). Now an idle poll writes nothing but the heartbeat's mtime."""
    from doubles.ops_host import kmsg_record
    from r9k.ops.state import HEARTBEAT_FILE
    from r9k.ops.watch import FileSource, KmsgSource, Watcher

    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    log, kmsg = tmp_path / "kern.log", host / "dev/kmsg"
    log.write_text(f"[  1.0] {MES.format(A)}\n[  2.0] usb 1-1: new high-speed USB device\n")
    kmsg.write_text(kmsg_record(1, MES.format(A), bdf=A) + kmsg_record(2, "random: crng init done"))
    for name, source in (("file", FileSource(log)), ("kmsg", KmsgSource(kmsg, "boot-1"))):
        state = tmp_path / f"state-{name}"
        watcher = Watcher(source, state, host)
        assert [s.event.type for s in watcher.poll()] == ["mes_timeout"]
        before = _snapshot(state)
        meter = _FsyncMeter()
        monkeypatch.setattr(os, "fsync", meter)
        for _ in range(20):
            assert watcher.poll() == []
        monkeypatch.undo()
        source.close()
        after = _snapshot(state)
        beat = str(state / HEARTBEAT_FILE)
        assert meter.count == 0, f"{name}: {meter.count} fsyncs in 20 idle polls"
        assert {p: v for p, v in after.items() if p != beat} == {p: v for p, v in before.items() if p != beat}


def test_the_last_kmsg_record_is_acted_on_before_another_arrives(tmp_path):
    """`r9k ops watch --source kmsg` following a kmsg-format file: one MES timeout record (with
    its DEVICE continuation line) and nothing after it, as before a hang. It used to wait for a
    following record (maybe never); now it is printed and its card fenced within a poll."""
    import queue
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    from doubles.ops_host import kmsg_record
    from r9k.ops.state import read_card_state

    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    kmsg = host / "dev/kmsg"
    kmsg.write_text(kmsg_record(1, "Linux version 6.14.0"))
    cfg = _config(tmp_path / "ops.yaml", CONFIG)
    state = tmp_path / "state"
    r9k = str(Path(sys.executable).parent / "r9k")
    proc = subprocess.Popen([r9k, "ops", "watch", "--source", "kmsg", "--interval", "0.05", "--json",
                             "--config", str(cfg), "--host-root", str(host), "--state-dir", str(state)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        time.sleep(1.0)  # the watcher has read the first record by now
        with open(kmsg, "a") as fh:
            fh.write(kmsg_record(2, MES.format(A), bdf=A))
        try:
            event = json.loads(lines.get(timeout=10))
        except queue.Empty:
            raise AssertionError("the MES record was not acted on within 10 s (no record after it)") from None
        assert (event["type"], event["bdf"], event["fenced_now"]) == ("mes_timeout", A, True)
        assert read_card_state(state, A).healthy is False
        assert kmsg.read_text().count(";") == 2  # nothing was written after the MES record
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_record_ids_survive_a_crash_an_older_card_file_and_compaction(tmp_path, monkeypatch):
    """The record ids moved out of the card file into `<BDF>.seen` (appended after the card
    file's write, which names the ids it counted): a crash between the two, a card file of the
    older format that still carries `seen_ids`, and the cut back to the last ids at twice the
    limit all keep every event counted exactly once."""
    import r9k.ops.state as state_mod
    from r9k.ops.state import card_state_path, read_card_state
    from r9k.ops.watch import FileSource, Watcher

    monkeypatch.setattr(state_mod, "_MAX_SEEN_IDS", 4)
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state, log = tmp_path / "state", tmp_path / "kern.log"
    log.write_text("".join(f"[{i:>5}.0] {MES.format(A)}\n" for i in range(3)))

    def read_all():
        return sum(s.new for s in Watcher(FileSource(log), state, host).poll(final=True))

    assert read_all() == 3
    seen = card_state_path(state, A).with_name(f"{A}.seen")
    ids = seen.read_text().splitlines()
    assert len(ids) == 3 and "seen_ids" not in json.loads(card_state_path(state, A).read_text())
    seen.write_text("\n".join(ids[:2]) + "\n" + ids[2][:5])  # a crash cut the last append short
    assert read_all() == 0 and seen.read_text().splitlines()[-1] == ids[2]
    # a card file written before the ids moved out: they are taken over, then dropped from it
    card = json.loads(card_state_path(state, A).read_text())
    card_state_path(state, A).write_text(json.dumps({**card, "seen_ids": ids, "last_seen_ids": []}))
    seen.unlink()
    assert read_all() == 0
    with open(log, "a") as fh:
        fh.write("".join(f"[{i:>5}.0] {MES.format(A)}\n" for i in range(3, 9)))
    assert read_all() == 6 and read_card_state(state, A).counts["mes_timeout"] == 9
    # 9 ids > 2 x 4: the file was cut back to the last 4 (the card file no longer carries any)
    assert seen.read_text().splitlines() == [line.record_id for line in FileSource(log).read(final=True)][-4:]
    assert "seen_ids" not in json.loads(card_state_path(state, A).read_text())
