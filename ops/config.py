"""Ops configuration (YAML), validated strictly: numbers must be YAML numbers, units are in names.

The original fleet's boot service read ``210 # safe`` as its cap and failed silently; here any
value that is not exactly what the field expects is refused with a message naming the field.
"""
from __future__ import annotations

import os
import shlex
import shutil
import stat
from pathlib import Path
from typing import Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator

from r9k.config_errors import (YamlKeyError, decode_config_text, load_yaml_strict,
                                validation_message)
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

    @field_validator("hook_timeout_s")
    @classmethod
    def _timeout_positive(cls, value: float) -> float:
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
    "expected_cards": "a card count such as 4, or a list of PCI addresses",
}


def _allowed_fields(loc: tuple) -> list[str]:
    nested = len(loc) > 1 and (loc[-2] == "defaults" or (len(loc) > 2 and loc[0] == "cards"))
    return list((PowerSettings if nested else OpsConfig).model_fields)


def parse_config(text: str, source: str = "<config>") -> OpsConfig:
    try:
        data = load_yaml_strict(text)
    except YamlKeyError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return OpsConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, source, expected=_EXPECTED,
                                             allowed_fields=_allowed_fields)) from None


def load_config(path: str | os.PathLike) -> OpsConfig:
    path = Path(path)
    try:
        raw = path.read_bytes()
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found (expected YAML, see ops/README.md)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        text = decode_config_text(raw, path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config = parse_config(text, str(path))
    if config.hooks:
        # Hooks run as root: a file anyone but root can edit is a privilege escalation.
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"{path}: defines hooks but is writable by someone other than root "
                f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); expected root-owned, "
                "not group/world-writable"
            )
        for argv in config.hook_argvs():
            problem = hook_problem(argv[0])
            if problem:
                raise ConfigError(f"{path}: {problem}")
    return config


def _writable_by_others(st: os.stat_result) -> bool:
    return st.st_uid != 0 or bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def hook_problem(command: str) -> str | None:
    """Why a hook must not run as root, or None. The executable and every directory above it (as
    written and resolved) must be root-owned and writable only by root; a sticky directory such as
    /tmp is fine (others cannot replace what root owns there)."""
    found = command if os.path.isabs(command) else shutil.which(command)
    if found is None:
        return f"hook {command}: not found (expected an absolute path or a command on PATH)"
    paths = [Path(found)]
    real = Path(os.path.realpath(found))
    if real != paths[0]:
        paths.append(real)
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"hook {command}: {found} not found ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode) or not os.access(real, os.X_OK):
        return f"hook {command}: {real} is not an executable file"
    if _writable_by_others(st):
        return (f"hook {command}: {real} is writable by group or others or not root-owned (owner uid {st.st_uid}, "
                f"mode {stat.filemode(st.st_mode)}); expected root-owned, writable only by root")
    for path in paths:
        for directory in path.parents:
            try:
                dst = os.stat(directory)
            except OSError as exc:
                return f"hook {command}: directory {directory}: {exc.strerror}"
            if dst.st_mode & stat.S_ISVTX and dst.st_uid == 0:
                continue
            if _writable_by_others(dst):
                return (f"hook {command}: directory {directory} is writable by group or others or not root-owned "
                        f"(owner uid {dst.st_uid}, mode {stat.filemode(dst.st_mode)}); anyone who can write it "
                        "can replace the hook")
    return None
