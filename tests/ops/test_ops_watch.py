"""Kernel-log watcher: every format in ops-facts.md, garbage, restarts, exactly-once, containment."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from click.testing import CliRunner

from r9k.cli import main
from doubles.ops_host import CardSpec, build_host_tree, kmsg_record
from r9k.ops.kernlog import Classifier, parse_text_line
from r9k.ops.state import EVENT_TYPES, read_card_state, read_card_states
from r9k.ops.watch import CURSOR_FILE, FileSource, KmsgSource, Watcher, journal_argv

A, B, C = "0000:03:00.0", "0000:04:00.0", "0000:0a:00.0"


def _classify(message, context=None):
    """Classify ``message``; with ``context``, right after an addressed line of that card."""
    classifier = Classifier()
    if context:
        classifier.classify(parse_text_line(f"amdgpu {context}: amdgpu: SMU is initialized successfully!", "t", 0))
    return classifier.classify(parse_text_line(message, "t", 1))


@pytest.mark.parametrize(
    "message, expected_type, bdf, detail",
    [
        (f"amdgpu {A}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE", "mes_timeout", A, {"msg": "REMOVE_QUEUE"}),
        (f"amdgpu {A}: amdgpu: MES failed to respond to msg=SUSPEND", "mes_timeout", A, {"msg": "SUSPEND"}),
        (f"amdgpu {B}: amdgpu: MES(1) failed to respond to msg=MISC (WAIT_REG_MEM)", "mes_timeout", B,
         {"msg": "MISC (WAIT_REG_MEM)", "mes_pipe": 1}),
        (f"amdgpu {B}: amdgpu: MES failed to response msg=14", "mes_timeout", B, {"msg": "14"}),
        (f"amdgpu {A}: [drm] *ERROR* ring gfx_0.0.0 timeout, signaled seq=1234, emitted seq=1236", "ring_timeout",
         A, {"ring": "gfx_0.0.0", "soft_recovered": False}),
        (f"amdgpu {A}: [drm] *ERROR* ring sdma0 timeout, but soft recovered", "ring_timeout", A,
         {"ring": "sdma0", "soft_recovered": True}),
        (f"amdgpu {A}: amdgpu: GPU reset begin!. Source:  3", "reset_begin", A, {"source": 3, "source_name": "mes"}),
        (f"amdgpu {A}: amdgpu: GPU reset begin!. Source:  1", "reset_begin", A, {"source": 1, "source_name": "job"}),
        (f"amdgpu {A}: amdgpu: GPU reset begin!", "reset_begin", A, {}),
        (f"amdgpu {A}: amdgpu: GPU reset(2) succeeded!", "reset_succeeded", A, {"n": 2}),
        (f"amdgpu {C}: amdgpu: GPU reset(3) failed", "reset_failed", C, {"n": 3}),
        (f"amdgpu {C}: amdgpu: GPU Recovery Failed: -110", "reset_failed", C, {"ret": -110}),
        (f"amdgpu {C}: amdgpu: device lost from bus!", "device_lost", C, {}),
        ("[drm] GPU recovery disabled.", "recovery_disabled", B, {}),  # no BDF: the context card
    ],
)
def test_every_message_format(message, expected_type, bdf, detail):
    event = _classify(message, context=B)
    assert (event.type, event.bdf, event.detail) == (expected_type, bdf, detail)
    assert event.type in EVENT_TYPES


@pytest.mark.parametrize("message", [
    f"amdgpu {A}: amdgpu: failed to remove hardware queue from MES, doorbell=0x1202",
    f"amdgpu {A}: amdgpu: MES might be in unrecoverable state, issue a GPU reset",
    f"amdgpu {A}: amdgpu: failed to suspend all gangs",
    f"amdgpu {A}: [drm] *ERROR* Process information: process python3 pid 4242 thread python3 pid 4242",
    f"amdgpu {A}: amdgpu: GPU reset end with ret = -19",
    "[drm] VRAM is lost due to GPU reset!",
    f"amdgpu {C}: amdgpu: SMU: response:0xFFFFFFFF for index:18 param:0x00000005 message:GetSmuVersion?",
    "amdgpu: HW Exception by GPU node-1 (agent ID: 0x0) reason :GPU Hang",
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
])
def test_follow_ups_and_unrelated_lines_are_not_events(message):
    assert _classify(message) is None


def _mixed_log() -> tuple[list[bytes], dict[str, dict[str, int]]]:
    """A log in every format with garbage; returns its chunks and the counts it must produce."""
    text = [
        f"[   12.100001] amdgpu {A}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE\n",
        f"[   12.100002] amdgpu {A}: amdgpu: failed to remove hardware queue from MES, doorbell=0x1202\n",
        "[   12.2] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n",
        f"Nov 30 05:24:01 gpuhost kernel: amdgpu {B}: amdgpu: MES(1) failed to respond to msg=MISC (WAIT_REG_MEM)\n",
        f"Nov 30 05:24:02 gpuhost kernel: [  13.0] amdgpu {B}: amdgpu: MES failed to response msg=3\n",
        "\n",
        "\x00\x07garbage \ufffd{not json\n",
        f"amdgpu {A}: amdgpu: MES might be in unrecoverable state, issue a GPU reset\n",
        f"amdgpu {A}: amdgpu: GPU reset begin!. Source:  3\n",
        "[drm] VRAM is lost due to GPU reset!\n",
        f"amdgpu {A}: amdgpu: GPU reset(1) succeeded!\n",
        "12,34;half a kmsg header\n",
    ]
    kmsg = [
        kmsg_record(1001, f"amdgpu {B}: amdgpu: MES failed to respond to msg=SUSPEND", bdf=B),
        kmsg_record(1002, "[drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring comp_1.0.0 timeout, signaled seq=5, "
                          "emitted seq=7", bdf=C),
        kmsg_record(1003, "EXT4-fs (sda1): mounted filesystem with ordered data mode"),
        kmsg_record(1004, f"amdgpu {C}: amdgpu: GPU reset begin!. Source:  1", bdf=C),
        kmsg_record(1005, f"amdgpu {C}: amdgpu: GPU reset(2) failed", bdf=C),
        kmsg_record(1006, f"amdgpu {C}: amdgpu: GPU reset end with ret = -110", bdf=C),
        kmsg_record(1007, f"amdgpu {C}: amdgpu: GPU Recovery Failed: -110", bdf=C),
    ]
    journal = [
        json.dumps({"MESSAGE": f"amdgpu {A}: amdgpu: MES failed to respond to msg=INVALIDATE_TLBS",
                    "__SEQNUM": 77, "__SEQNUM_ID": "s", "_BOOT_ID": "b", "_TRANSPORT": "kernel", "__REALTIME_TIMESTAMP": "1700000000000000",
                    "_KERNEL_DEVICE": f"+pci:{A}"}) + "\n",
        json.dumps({"MESSAGE": list(f"amdgpu {C}: amdgpu: device lost from bus!\xff".encode("latin-1")),
                    "__SEQNUM": 78, "__SEQNUM_ID": "s", "_BOOT_ID": "b", "_TRANSPORT": "kernel"}) + "\n",
        '{"MESSAGE": 5}\n',
        "usb 1-1: USB disconnect, device number 2\n",  # card A's line leaves the context window
        "usb 1-1: new high-speed USB device number 3 using xhci_hcd\n",
        "[drm] GPU recovery disabled.\n",  # context: the addressed lines before name card C only
    ]
    chunks = [("".join(text[:6])).encode(), ("".join(text[6:]) + "".join(kmsg[:3])).encode(),
              ("".join(kmsg[3:]) + "".join(journal)).encode() + b"\xff\xfe raw bytes\n"]
    expected = {
        A: {"mes_timeout": 2, "reset_begin": 1, "reset_succeeded": 1},
        B: {"mes_timeout": 3},
        C: {"ring_timeout": 1, "reset_begin": 1, "reset_failed": 1, "device_lost": 1, "recovery_disabled": 1},
    }
    return chunks, expected


def _counts(state_dir):
    return {bdf: {k: v for k, v in s.counts.items() if v} for bdf, s in read_card_states(state_dir).items()}


def _watcher(log, state, host):
    # the mixed log has syslog `kernel:` lines (every format counts here): trusted by choice
    return Watcher(FileSource(log, _cursor(state, log)), state, host, trust_syslog_kernel_tag=True)


def _cursor(state, log):
    try:
        return json.loads((state / CURSOR_FILE).read_text()).get(f"file:{log.resolve()}")
    except FileNotFoundError:
        return None


def test_restarts_count_every_event_exactly_once(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B), CardSpec(C)])
    state, log = tmp_path / "state", tmp_path / "kern.log"
    chunks, expected = _mixed_log()
    new_total = 0
    for chunk in chunks:  # the log grows; the watcher is restarted after each read
        with open(log, "ab") as fh:
            fh.write(chunk)
        new_total += sum(item.new for item in _watcher(log, state, host).poll())
    assert _counts(state) == expected
    assert new_total == sum(sum(v.values()) for v in expected.values())
    # A restart with nothing new counts nothing; a crash that lost the cursor file replays the
    # whole log but the per-card positions stop any double count.
    assert _watcher(log, state, host).poll() == []
    (state / CURSOR_FILE).unlink()
    replayed = _watcher(log, state, host).poll(final=True)
    assert replayed and not any(item.new for item in replayed)
    assert _counts(state) == expected


def test_one_pass_equals_incremental(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    chunks, expected = _mixed_log()
    log = tmp_path / "all.log"
    log.write_bytes(b"".join(chunks))
    _watcher(log, tmp_path / "state", host).poll(final=True)
    assert _counts(tmp_path / "state") == expected


def test_kmsg_sequence_numbers_survive_restart_and_reveal_gaps(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    kmsg, state = host / "dev/kmsg", tmp_path / "state"
    kmsg.write_text(kmsg_record(1, f"amdgpu {A}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE", bdf=A)
                    + kmsg_record(2, "random: crng init done"))

    def run():
        cursor = json.loads((state / CURSOR_FILE).read_text()).get("kmsg") if (state / CURSOR_FILE).exists() else None
        source = KmsgSource(kmsg, "boot-1", cursor)
        try:
            return Watcher(source, state, host).poll(final=True), source.gaps
        finally:
            source.close()

    assert [i.event.type for i in run()[0]] == ["mes_timeout"]
    with open(kmsg, "a") as fh:  # records 3-4 were overwritten before the watcher came back
        fh.write(kmsg_record(5, f"amdgpu {A}: amdgpu: GPU reset begin!. Source:  3", bdf=A))
    events, gaps = run()
    assert [i.event.type for i in events] == ["reset_begin"]
    assert gaps == ["kmsg: 2 records lost after seq 2"]
    assert run()[0] == []
    assert read_card_state(state, A).counts["mes_timeout"] == 1


def _root_config(tmp_path, hooks):
    cfg = tmp_path / "ops.yaml"
    cfg.write_text("hooks:\n" + "".join(f"  - {json.dumps(h)}\n" for h in hooks))
    os.chmod(cfg, 0o644)
    return cfg


@pytest.mark.skipif(os.geteuid() != 0, reason="hooks need a root-owned config")
def test_containment_marks_unhealthy_runs_hooks_until_cleared(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A), CardSpec(B)])
    state, log, calls = tmp_path / "state", tmp_path / "kern.log", tmp_path / "calls"
    hook = tmp_path / "drain.sh"
    hook.write_text(f'#!/bin/sh\necho "$R9K_EVENT $R9K_BDF" >> {calls}\n')
    hook.chmod(0o755)
    cfg = _root_config(tmp_path, [str(hook), [str(hook)]])
    log.write_text(f"amdgpu {B}: [drm] *ERROR* ring sdma0 timeout, but soft recovered\n"
                   f"amdgpu {A}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE\n"
                   "[drm] GPU recovery disabled.\n")
    args = ["ops", "watch", "--source", str(log), "--once", "--record", "--config", str(cfg),
            "--host-root", str(host), "--state-dir", str(state), "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert [(x.get("type"), x.get("fault")) for x in lines if "type" in x] == [
        ("ring_timeout", False), ("mes_timeout", True), ("recovery_disabled", False)]
    assert lines[-1]["new"] == 3 and lines[-1]["recovery"]["recovery_disabled"] is False
    hooks = [x for x in lines if "hook" in x]  # hooks run once for the card's change to unhealthy
    assert [(x["bdf"], x["event"], x["returncode"]) for x in hooks] == [(A, "mes_timeout", 0)] * 2
    assert calls.read_text().splitlines() == [f"mes_timeout {A}", f"mes_timeout {A}"]
    a, b = read_card_state(state, A), read_card_state(state, B)
    assert (a.healthy, b.healthy) == (False, True)
    assert a.unhealthy_reason == f"mes_timeout: amdgpu {A}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE"
    # Seen again (restart): no new counts, no hook.
    CliRunner().invoke(main, args)
    assert len(calls.read_text().splitlines()) == 2 and read_card_state(state, A).counts["mes_timeout"] == 1
    runner = CliRunner()
    assert runner.invoke(main, ["ops", "health", "--state-dir", str(state)]).exit_code == 1
    assert runner.invoke(main, ["ops", "clear", "00:03.0", "--state-dir", str(state)]).exit_code == 2
    assert runner.invoke(main, ["ops", "clear", "0000:09:00.0", "--state-dir", str(state)]).exit_code == 2
    cleared = runner.invoke(main, ["ops", "clear", A, "--state-dir", str(state)])
    assert cleared.exit_code == 0 and "mes_timeout=1" in cleared.output
    assert read_card_state(state, A).healthy and read_card_state(state, A).counts["mes_timeout"] == 1
    assert runner.invoke(main, ["ops", "health", "--state-dir", str(state)]).exit_code == 0


def test_post_mortem_once_prints_and_writes_nothing(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    log = tmp_path / "saved.log"
    chunks, expected = _mixed_log()
    log.write_bytes(b"".join(chunks))
    result = CliRunner().invoke(main, ["ops", "watch", "--source", str(log), "--once", "--json",
                                       "--host-root", str(host), "--state-dir", str(tmp_path / "state"),
                                       "--config", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 0, result.output
    events = [json.loads(x) for x in result.stdout.splitlines()][:-1]
    assert len(events) == sum(sum(v.values()) for v in expected.values())
    assert not (tmp_path / "state").exists()
    text = CliRunner().invoke(main, ["ops", "watch", "--source", str(log), "--once", "--host-root", str(host),
                                     "--config", str(tmp_path / "absent.yaml")])
    assert f"{C}  device_lost" in text.output and "warning: amdgpu GPU recovery is enabled" in text.output


def test_missing_source_is_bad_input(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    result = CliRunner().invoke(main, ["ops", "watch", "--source", str(tmp_path / "nope.log"), "--once",
                                       "--host-root", str(host), "--config", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2 and "not a readable file" in result.output


def test_following_a_growing_log(tmp_path):
    host = build_host_tree(tmp_path / "host", [CardSpec(A)])
    state, log = tmp_path / "state", tmp_path / "kern.log"
    log.write_text("[    1.0] Linux version 6.14\n")
    watcher = Watcher(FileSource(log), state, host)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop, 0.02))
    thread.start()
    try:
        with open(log, "a") as fh:
            fh.write(f"[  50.0] amdgpu {A}: amdgpu: GPU reset begin!. Source:  3\n")
            fh.write(f"[  50.1] amdgpu {A}: amdgpu: device lost from bus!\n")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            st = read_card_state(state, A)
            if st and st.counts["device_lost"]:
                break
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join()
    st = read_card_state(state, A)
    assert (st.counts["reset_begin"], st.counts["device_lost"], st.healthy) == (1, 1, False)
    assert st.last_event.type == "device_lost"


def test_journal_resumes_after_its_cursor(tmp_path):
    # no -k: it implies -b, which would skip the previous boot's unread tail
    assert journal_argv("/", True, "s=abc;i=1") == ["journalctl", "_TRANSPORT=kernel", "-o", "json",
                                                     "--no-pager", "--after-cursor=s=abc;i=1", "-f"]
    assert journal_argv(tmp_path, False, None)[-3:] == ["--root", str(tmp_path), "-b"]
