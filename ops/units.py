"""systemd units for ops (boot-time apply, the reconcile loop, the kernel-log watcher) and for the
fleet (its Ray head, the controller)."""
from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

UNIT_DIR = Path(__file__).parent / "systemd"
UNIT_NAMES = ("r9k-ops-apply.service", "r9k-ops-reconcile.service", "r9k-ops-watch.service")
FLEET_UNIT_NAMES = ("r9k-ray-head.service", "r9k-fleet.service")


def default_r9k_bin() -> str:
    """The r9k next to this interpreter (a venv's bin/), else the one on PATH."""
    candidate = Path(sys.executable).parent / "r9k"
    if candidate.exists():
        return str(candidate.absolute())
    return shutil.which("r9k") or "/usr/local/bin/r9k"


def _render(name: str, replacements: dict[str, str]) -> str:
    text = (UNIT_DIR / name).read_text()
    for key, value in {"@DOC@": str((UNIT_DIR.parent / "README.md").absolute()),
                       **replacements}.items():
        text = text.replace(key, value)
    return text


def env_line(env_file: str | None, why: str) -> str:
    """The unit's EnvironmentFile= line (secrets such as the fleet's API key stay out of units)."""
    return f"EnvironmentFile={os.path.abspath(env_file)}" if env_file else f"# no EnvironmentFile: {why}"


def env_file_problem(path: str, names: list[str]) -> str | None:
    """Why systemd's EnvironmentFile ``path`` cannot give a service ``names``, or None: it must
    exist, be root-owned and readable by root alone (it holds a secret), and set each name."""
    try:
        st = os.stat(path)
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})"
    if st.st_uid != 0 or st.st_mode & 0o077:
        return (f"{path}: owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}; expected root-owned, "
                "mode 0600 (it holds the API key)")
    values = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith(("#", ";")):
            values[key.strip()] = value.strip().strip('"').strip("'")
    missing = [n for n in names if not values.get(n)]
    if missing:
        return f"{path}: sets no {', '.join(missing)}; expected a line {missing[0]}=<the key>"
    return None


def render_unit(name: str, r9k_bin: str, config_path: str, state_dir: str, interval_s: float,
                env_file: str | None = None) -> str:
    return _render(name, {"@R9K_BIN@": r9k_bin, "@CONFIG@": os.path.abspath(config_path),
                          "@STATE_DIR@": os.path.abspath(state_dir),
                          "@INTERVAL@": f"{interval_s:g}",
                          "@ENV_LINE@": env_line(env_file, "hooks get no fleet API key (--env-file)")})


def _write(dest: str | os.PathLike, units: dict[str, str]) -> list[Path]:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in units.items():
        path = dest / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        written.append(path)
    return written


def install_units(dest: str | os.PathLike, r9k_bin: str, config_path: str, state_dir: str,
                  interval_s: float = 60, env_file: str | None = None) -> list[Path]:
    return _write(dest, {name: render_unit(name, r9k_bin, config_path, state_dir, interval_s, env_file)
                         for name in UNIT_NAMES})


def install_fleet_units(dest: str | os.PathLike, r9k_bin: str, config_path: str,
                        run_dir: str, env_file: str | None = None) -> list[Path]:
    """The Ray head and the fleet controller. `ray` is the one beside `r9k` (same venv)."""
    ray_bin = str(Path(r9k_bin).parent / "ray")
    values = {"@R9K_BIN@": r9k_bin, "@RAY_BIN@": ray_bin,
              "@CONFIG@": os.path.abspath(config_path), "@RUN_DIR@": os.path.abspath(run_dir),
              "@ENV_LINE@": env_line(env_file, "entry.api_key_env is not set")}
    return _write(dest, {name: _render(name, values) for name in FLEET_UNIT_NAMES})
