"""Run a command that dies with the process that started it, even when that process is killed
with SIGKILL (Linux `prctl(PR_SET_PDEATHSIG)`, kept across exec). The fleet controller starts its
exporter this way, so a controller that crashed and was started again (systemd) can bind the
exporter's port for its own.

    python -m r9k.deploy.child PARENT_PID COMMAND [ARG...]
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when its parent exits; exit now if the parent already did."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(f"parent {parent_pid} is gone")


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m r9k.deploy.child PARENT_PID COMMAND [ARG...]")
    die_with_parent(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
