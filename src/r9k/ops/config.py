"""Ops configuration (YAML), validated strictly: numbers must be YAML numbers, units are in names.

The original fleet's boot service read ``210 # safe`` as its cap and failed silently; here any
value that is not exactly what the field expects is refused with a message naming the field.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
from pathlib import Path
from typing import Literal, Union

from pydantic import (Field, BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator)

from r9k.core.config_errors import decode_config_text, parse_yaml_model, read_config_bytes
from r9k.ops.state import BDF_RE, DEFAULT_FAULT_EVENTS, EVENT_TYPES

DEFAULT_CONFIG_PATH = "/etc/r9k/ops.yaml"


class ConfigError(ValueError):
    """Configuration refused: the message names the file, the field and what was expected."""


class PowerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    power_cap_watts: Union[StrictInt, None] = None  # the kernel keeps whole watts
    voltage_offset_mv: Union[StrictInt, None] = None

    @field_validator("power_cap_watts")
    @classmethod
    def _cap_positive(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"expected a positive number of watts, got {value}")
        return value

    @field_validator("voltage_offset_mv")
    @classmethod
    def _offset_not_positive(cls, value: int | None) -> int | None:
        if value is not None and value > 0:
            raise ValueError(f"expected an undervolt (0 or negative millivolts), got +{value}")
        return value


class OpsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    backend: Literal["auto", "lact", "sysfs"] = "auto"
    lact_socket: StrictStr = "/run/lactd.sock"
    defaults: PowerSettings = PowerSettings()
    cards: dict[StrictStr, PowerSettings] = {}
    hooks: list[Union[StrictStr, list[StrictStr]]] = []
    hook_timeout_s: Union[StrictInt, StrictFloat] = 60
    fault_events: list[StrictStr] = list(DEFAULT_FAULT_EVENTS)
    # An int: at least that many amdgpu cards; a list: these PCI addresses must all be present.
    expected_cards: Union[StrictInt, list[StrictStr]] = 1
    # A cap that reads back is not always enforced (LACT issue 506): drawing more than the cap
    # plus this margin for this long is drift, and reconcile writes the cap again.
    cap_draw_margin_watts: StrictInt = Field(default=15, ge=1, le=200)
    cap_draw_window_s: Union[StrictInt, StrictFloat] = 60
    # A syslog file's `kernel:` tag is all that says a line is the kernel's, and any local user
    # can write it (logger -t kernel): the watcher acts on such lines only when this is true.
    trust_syslog_kernel_tag: StrictBool = False

    @field_validator("hook_timeout_s", "cap_draw_window_s")
    @classmethod
    def _seconds_in_range(cls, value: float) -> float:
        if not 0 < value <= 3600:
            raise ValueError(f"expected seconds in (0, 3600], got {value}")
        return value

    @field_validator("expected_cards")
    @classmethod
    def _expected_cards(cls, value: int | list[str]) -> int | list[str]:
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"expected a card count >= 0 or a list of PCI addresses, got {value}")
            return value
        for bdf in value:
            if not BDF_RE.match(bdf):
                raise ValueError(f"{bdf!r}: expected a full lowercase PCI address like 0000:03:00.0")
        if len(set(value)) != len(value):
            raise ValueError("a PCI address is listed twice")
        return value

    @field_validator("cards")
    @classmethod
    def _bdf_keys(cls, cards: dict[str, PowerSettings]) -> dict[str, PowerSettings]:
        for key in cards:
            if not BDF_RE.match(key):
                raise ValueError(f"card key {key!r}: expected a full lowercase PCI address like 0000:03:00.0")
        return cards

    @field_validator("hooks")
    @classmethod
    def _hooks_nonempty(cls, hooks: list) -> list:
        for hook in hooks:
            argv = shlex.split(hook) if isinstance(hook, str) else hook
            if not argv:
                raise ValueError("empty hook command")
        return hooks

    @field_validator("fault_events")
    @classmethod
    def _known_events(cls, events: list[str]) -> list[str]:
        for name in events:
            if name not in EVENT_TYPES:
                raise ValueError(f"unknown event {name!r}, expected one of {', '.join(EVENT_TYPES)}")
        if "mes_timeout" not in events:  # `[]` would silently turn fencing off
            raise ValueError("expected a list that includes mes_timeout (the fault R9700 hosts "
                             f"hang on); the default is {', '.join(DEFAULT_FAULT_EVENTS)}")
        return events

    def hook_argvs(self) -> list[list[str]]:
        return [shlex.split(h) if isinstance(h, str) else list(h) for h in self.hooks]

    def wanted(self, bdf: str) -> PowerSettings:
        """Per-card override over defaults, field by field; None = leave that setting alone."""
        override = self.cards.get(bdf, PowerSettings())
        return PowerSettings(
            power_cap_watts=override.power_cap_watts if override.power_cap_watts is not None
            else self.defaults.power_cap_watts,
            voltage_offset_mv=override.voltage_offset_mv if override.voltage_offset_mv is not None
            else self.defaults.voltage_offset_mv,
        )


_EXPECTED = {
    "power_cap_watts": "a YAML integer of watts such as 210 (no quotes, no unit)",
    "voltage_offset_mv": "a YAML integer of millivolts such as -42 (no quotes, no unit)",
    "backend": "one of auto, lact, sysfs",
    "hook_timeout_s": "a YAML number of seconds such as 30",
    "cap_draw_window_s": "a YAML number of seconds such as 60",
    "cap_draw_margin_watts": "a YAML integer of watts such as 15",
    "expected_cards": "a card count such as 4, or a list of PCI addresses",
    "trust_syslog_kernel_tag": "true or false (YAML booleans, no quotes)",
}


def _allowed_fields(loc: tuple) -> list[str]:
    nested = len(loc) > 1 and (loc[-2] == "defaults" or (len(loc) > 2 and loc[0] == "cards"))
    return list((PowerSettings if nested else OpsConfig).model_fields)


def parse_config(text: str, source: str = "<config>") -> OpsConfig:
    return parse_yaml_model(text, OpsConfig, source, ConfigError, empty={},
                            expected=_EXPECTED, allowed_fields=_allowed_fields)


def load_config(path: str | os.PathLike) -> OpsConfig:
    path = Path(path)
    try:
        raw = read_config_bytes(path)
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found (expected YAML, see src/r9k/ops/README.md)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        text = decode_config_text(raw, path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config = parse_config(text, str(path))
    if config.hooks:
        # Hooks run as root: a config anyone but root can edit or replace is a privilege escalation.
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"{path}: defines hooks but is writable by someone other than root "
                f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); expected root-owned, "
                "not group/world-writable"
            )
        problem = _replaceable_dirs(path, f"{path}: defines hooks but its")
        if problem:
            raise ConfigError(problem)
        for argv in config.hook_argvs():
            problem = hook_problem(argv)
            if problem:
                raise ConfigError(f"{path}: {problem}")
    return config


def _writable_by_others(st: os.stat_result) -> bool:
    return st.st_uid != 0 or bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _replaceable(path: Path, label: str) -> str | None:
    """Why someone other than root could change or replace ``path``, or None: the file and every
    directory above it (as written and resolved) root-owned and writable only by root; a
    root-owned sticky directory such as /tmp is fine (others cannot replace what root owns)."""
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"{label} {real} is not there ({exc.strerror})"
    if _writable_by_others(st):
        return (f"{label} {real} is writable by group or others or not root-owned (owner uid {st.st_uid}, "
                f"mode {stat.filemode(st.st_mode)}); expected root-owned, writable only by root")
    return _replaceable_dirs(path, label)


def _replaceable_dirs(path: Path, label: str) -> str | None:
    """The directories above ``path`` (as written and resolved) that someone other than root could
    use to replace it, as a reason, or None."""
    paths = [path]
    real = Path(os.path.realpath(path))
    if real != path:
        paths.append(real)
    for p in paths:
        for directory in p.absolute().parents:
            try:
                dst = os.stat(directory)
            except OSError as exc:
                return f"{label} directory {directory}: {exc.strerror}"
            if dst.st_mode & stat.S_ISVTX and dst.st_uid == 0:
                continue
            if _writable_by_others(dst):
                return (f"{label} directory {directory} is writable by group or others or not root-owned "
                        f"(owner uid {dst.st_uid}, mode {stat.filemode(dst.st_mode)}); anyone who can write "
                        f"it can replace {p.name}")
    return None


# A word no program can take for a file: letters, digits and a few marks, no '/', no blanks, no
# shell syntax (and it names nothing under /, the hooks' working directory; checked separately).
_PLAIN_WORD = re.compile(r"^[A-Za-z0-9_@%+,.:=-]+$")
# The fleet's drain hook takes its entry point's URL (`--url http://HEAD:8000`): a URL, not a path.
_HTTP_URL = re.compile(r"^https?://[A-Za-z0-9_.:@\[\]-]+(?:/[A-Za-z0-9_.~%+=&?,:@-]*)*$")
# Programs that take code as an argument (-c, -e, ...): what that code opens no checker can see.
_INTERPRETERS = re.compile(r"^(?:(?:ba|da|z|k|mk|c|tc|fi|a)?sh|busybox|env|python[\d.]*|pypy[\d.]*|perl[\d.]*"
                           r"|ruby[\d.]*|node(?:js)?|php[\d.]*|lua[\d.]*|[gnm]?awk|tclsh[\d.]*|osascript)$")
# Working directory the hooks run in (run_hooks): relative words are judged against it.
HOOK_CWD = "/"


def _argument_problem(program: str, arg: str, label: str) -> str | None:
    """Why one hook argument cannot be proved safe to hand a root hook, or None. Allowed: a
    plain word that names nothing (see _PLAIN_WORD), an http(s) URL, or a path that exists and
    that only root can change or replace (``_replaceable``). Everything else is refused."""
    name = os.path.basename(program)
    shown = arg if len(arg) <= 80 else arg[:77] + "..."
    if name == "env" and arg.startswith("-"):
        return (f"{label} argument {shown!r}: env's options (--chdir, -S, -u, ...) change what runs and "
                "where, unseen by this check; expected env with NAME=value words and a command only")
    if _INTERPRETERS.match(name) and re.fullmatch(r"-[A-Za-z]*[ceEpxS][A-Za-z]*", arg):
        return (f"{label} argument {shown!r}: {name} would run code given as a string, which this check "
                "cannot see into; expected the path of a root-owned script instead")
    relative = os.path.join(HOOK_CWD, arg)
    if _PLAIN_WORD.match(arg) and not os.path.lexists(relative) and arg not in (".", ".."):
        return None
    if _HTTP_URL.match(arg):
        return None
    if os.path.isabs(arg) and os.path.lexists(arg):
        return _replaceable(Path(arg), f"{label} argument")
    if _PLAIN_WORD.match(arg) or arg in (".", ".."):  # exists under the working directory
        return _replaceable(Path(os.path.normpath(relative)), f"{label} argument")
    if os.path.isabs(arg):
        return (f"{label} argument {shown} is not there (a path a hook reads must exist, root-owned, "
                "when the config is loaded)")
    if arg.startswith("-") and "=" in arg:
        return (f"{label} argument {shown!r}: an option with a value this check cannot prove is not a "
                "path; expected the option and its value as two arguments (an absolute root-owned path "
                "or a plain word)")
    return (f"{label} argument {shown!r} cannot be proved safe; expected a plain word (letters, digits, "
            "_@%+,.:=-), an http(s) URL or the absolute path of a root-owned file (no blanks, no "
            "shell commands, no relative paths)")


def hook_problem(argv: list[str]) -> str | None:
    """Why a hook must not run as root, or None. An allow-rule: its executable is a root-owned
    file in directories only root can write (`_replaceable`), and every argument is either a
    word that provably names no file or a path that passes the same check; shell strings
    (`sh -c ...`), options that carry a path (`--opt=/path`), words with blanks, env's options and
    relative paths are refused, since what they make the hook open cannot be checked."""
    command = argv[0]
    found = command if os.path.isabs(command) else shutil.which(command)
    if found is None:
        return f"hook {command}: not found (expected an absolute path or a command on PATH)"
    real = Path(os.path.realpath(found))
    if not real.exists():
        return f"hook {command}: {found} not found"
    if not real.is_file() or not os.access(real, os.X_OK):
        return f"hook {command}: {real} is not an executable file"
    problem = _replaceable(Path(found), f"hook {command}:")
    if problem:
        return problem
    for arg in argv[1:]:
        problem = _argument_problem(str(real), arg, f"hook {command}:")
        if problem:
            return problem
    return None
