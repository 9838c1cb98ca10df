"""systemd units for ops: boot-time apply (oneshot), the reconcile loop, the kernel-log watcher."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

UNIT_DIR = Path(__file__).parent / "systemd"
UNIT_NAMES = ("r9k-ops-apply.service", "r9k-ops-reconcile.service", "r9k-ops-watch.service")


def default_r9k_bin() -> str:
    """The r9k next to this interpreter (a venv's bin/), else the one on PATH."""
    candidate = Path(sys.executable).parent / "r9k"
    if candidate.exists():
        return str(candidate.absolute())
    return shutil.which("r9k") or "/usr/local/bin/r9k"


def render_unit(name: str, r9k_bin: str, config_path: str, state_dir: str, interval_s: float) -> str:
    text = (UNIT_DIR / name).read_text()
    replacements = {
        "@R9K_BIN@": r9k_bin,
        "@CONFIG@": os.path.abspath(config_path),
        "@STATE_DIR@": os.path.abspath(state_dir),
        "@INTERVAL@": f"{interval_s:g}",
        "@DOC@": str((UNIT_DIR.parent / "README.md").absolute()),
    }
    for key, value in replacements.items():
        text = text.replace(key, value)
    return text


def install_units(dest: str | os.PathLike, r9k_bin: str, config_path: str, state_dir: str,
                  interval_s: float = 60) -> list[Path]:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in UNIT_NAMES:
        path = dest / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(render_unit(name, r9k_bin, config_path, state_dir, interval_s))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        written.append(path)
    return written
