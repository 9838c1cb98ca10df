"""Run a command that dies with the process that started it, even when that process is killed
with SIGKILL (Linux `prctl(PR_SET_PDEATHSIG)`, kept across exec). The fleet controller starts its
exporter this way, so a controller that crashed and was started again (systemd) can bind the
exporter's port for its own.

    python -m r9k.deploy.child PARENT_PID COMMAND [ARG...]

`--guard` is for a command that starts children of its own (vLLM's api_server, its engine core
and workers): this process stays, as the leader of the command's process group, and SIGKILLs the
whole group when PARENT_PID (the replica supervisor) is gone; the command itself dies with this
process. The exit status is the command's (a signal as the same signal).

    python -m r9k.deploy.child --guard PARENT_PID COMMAND [ARG...]
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
GUARD_POLL_S = 0.2


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """``sig`` to this process when its parent exits; exit now if the parent already did."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(f"parent {parent_pid} is gone")


def guard(parent_pid: int, argv: list[str]) -> int:
    """Run ``argv`` as a child that dies with this (single-threaded) process; kill the process
    group when ``parent_pid`` goes. Returns the command's exit status."""
    if os.getppid() != parent_pid:
        sys.exit(f"parent {parent_pid} is gone")
    me = os.getpid()
    proc = subprocess.Popen(argv, preexec_fn=lambda: die_with_parent(me, signal.SIGKILL))

    def forward(sig, _frame):  # a signal for this process is meant for the command
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            rc = proc.wait(timeout=GUARD_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent_pid:  # the supervisor is gone: nothing may keep the cards
            os.killpg(os.getpgrp(), signal.SIGKILL)
    if rc < 0:  # report a signal as the same signal (a SIGKILLed engine reads as -9)
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(me, -rc)
        time.sleep(1)
    return rc


def main(argv: list[str]) -> None:
    if argv[:1] == ["--guard"]:
        if len(argv) < 3 or not argv[1].isdigit():
            sys.exit("usage: python -m r9k.deploy.child --guard PARENT_PID COMMAND [ARG...]")
        sys.exit(guard(int(argv[1]), argv[2:]))
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m r9k.deploy.child [--guard] PARENT_PID COMMAND [ARG...]")
    die_with_parent(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
