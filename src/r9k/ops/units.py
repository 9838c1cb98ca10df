"""systemd units for ops (boot-time apply, the reconcile loop, the kernel-log watcher) and for the
fleet (its Ray head, the controller)."""
from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from pathlib import Path
from urllib.parse import quote

UNIT_DIR = Path(__file__).parent / "systemd"
UNIT_NAMES = ("r9k-ops-apply.service", "r9k-ops-reconcile.service", "r9k-ops-watch.service")
FLEET_UNIT_NAMES = ("r9k-ray-head.service", "r9k-fleet.service")
# a host that joins the head's cluster: its Ray node and its own entry point
FLEET_WORKER_UNIT_NAMES = ("r9k-ray-worker.service", "r9k-fleet-entry.service")


def default_r9k_bin() -> str:
    """The r9k next to this interpreter (a venv's bin/), else the one on PATH."""
    candidate = Path(sys.executable).parent / "r9k"
    if candidate.exists():
        return str(candidate.absolute())
    return shutil.which("r9k") or "/usr/local/bin/r9k"


class UnitValueError(ValueError):
    """A value that no systemd unit line can carry (a control character, e.g. a newline that
    would start a directive of its own); the message names it and what was expected."""


def _no_control_chars(value: str, what: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UnitValueError(f"{what} {value!r} holds a control character; expected a path "
                             "without newlines or tabs (a unit file line cannot carry it)")
    return value


def exec_arg(value: str, what: str = "path", program: bool = False) -> str:
    """One ExecStart= word as systemd reads it (systemd.service(5), "Command lines"): `%` is a
    specifier unless doubled, and so is `$` (an environment variable) in the arguments; the
    program itself gets no variable substitution (systemd-analyze verify: `$$` stays two);
    blanks, quotes and backslashes need a double-quoted word with C escapes."""
    text = _no_control_chars(value, what).replace("%", "%%")
    if not program:
        text = text.replace("$", "$$")
    if re.search(r"""[\s"'\\;]""", text) or not text:
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def setting_path(value: str, what: str = "path") -> str:
    """A path as the whole value of a setting such as EnvironmentFile= (specifiers resolved)."""
    return _no_control_chars(value, what).replace("%", "%%")


def _render(name: str, replacements: dict[str, str]) -> str:
    doc = str((UNIT_DIR.parent / "README.md").absolute())
    text = (UNIT_DIR / name).read_text()
    for key, value in {"@DOC@": setting_path(quote(_no_control_chars(doc, "README path"))),
                       **replacements}.items():
        text = text.replace(key, value)
    return text


def env_line(env_file: str | None, why: str) -> str:
    """The unit's EnvironmentFile= line (secrets such as the fleet's API key stay out of units)."""
    if not env_file:
        return f"# no EnvironmentFile: {why}"
    return f"EnvironmentFile={setting_path(os.path.abspath(env_file), '--env-file')}"


def env_file_problem(path: str, names: list[str]) -> str | None:
    """Why systemd's EnvironmentFile ``path`` cannot give a service ``names``, or None: it must
    exist, be root-owned and readable by root alone (it holds a secret), set each name, and be
    in directories only root can write, as written and through links (anyone who can write one
    could replace it with a file of their own, read by root units)."""
    from r9k.ops.config import _replaceable

    problem = _replaceable(Path(path), "EnvironmentFile")
    if problem and os.path.exists(path):
        return f"{path}: {problem}"
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
    return _render(name, {"@R9K_BIN@": exec_arg(r9k_bin, "--r9k-bin", program=True),
                          "@CONFIG@": exec_arg(os.path.abspath(config_path), "--config"),
                          "@STATE_DIR@": exec_arg(os.path.abspath(state_dir), "--state-dir"),
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
                        run_dir: str, env_file: str | None = None, host: str | None = None,
                        head: str | None = None, controller: str | None = None) -> list[Path]:
    """The head host's Ray head and fleet controller; with ``head`` (HOST:PORT), a worker
    host's Ray node and entry point (routing from ``controller``). ``host`` names which of the
    fleet file's hosts this is (several hosts). `ray` is the one beside `r9k` (same venv)."""
    ray_bin = str(Path(r9k_bin).parent / "ray")
    values = {"@R9K_BIN@": exec_arg(r9k_bin, "--r9k-bin", program=True), "@RAY_BIN@": exec_arg(ray_bin, "ray", program=True),
              "@CONFIG@": exec_arg(os.path.abspath(config_path), "--config"),
              "@RUN_DIR@": exec_arg(os.path.abspath(run_dir), "run dir"),
              "@HOST_ARGS@": f"--host {exec_arg(host, '--host')}" if host else "",
              "@HEAD@": exec_arg(head or "", "--head"),
              "@CONTROLLER@": exec_arg(controller or "", "--controller"),
              "@ENV_LINE@": env_line(env_file, "entry.api_key_env is not set")}
    names = FLEET_WORKER_UNIT_NAMES if head else FLEET_UNIT_NAMES
    return _write(dest, {name: _render(name, values) for name in names})
