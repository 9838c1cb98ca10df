"""r9k.ops: host management (LACT/sysfs power and undervolt, kernel-log watcher, containment).

API for other components (imports stay light: no vllm, torch or ray):

- ``power_status(config, host_root="/", state_dir=None)`` -> list of ``CardStatus``: wanted vs
  actual cap and offset per card, drift, health (from :mod:`r9k.ops.power`).
- ``load_config(path)`` -> ``OpsConfig`` (from :mod:`r9k.ops.config`).
- ``read_card_states(state_dir)`` -> ``CardStates`` ({BDF: ``CardState``} plus ``.corrupt``
  {BDF: reason} and ``.unhealthy()``), ``EVENT_TYPES`` (from :mod:`r9k.ops.state`).
- ``card_presence(config, present_bdfs)`` -> ``CardPresence(expected, present, missing)``;
  ``read_host_events(state_dir)`` -> list of ``HostEvent`` (unattributed faults).
- ``discover_cards(host_root)`` (from :mod:`r9k.ops.sysfs`).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "power_status": "r9k.ops.power",
    "apply_power": "r9k.ops.power",
    "CardStatus": "r9k.ops.power",
    "load_config": "r9k.ops.config",
    "OpsConfig": "r9k.ops.config",
    "read_card_states": "r9k.ops.state",
    "read_card_state": "r9k.ops.state",
    "CardState": "r9k.ops.state",
    "EVENT_TYPES": "r9k.ops.state",
    "CardStates": "r9k.ops.state",
    "StateFileError": "r9k.ops.state",
    "card_presence": "r9k.ops.state",
    "CardPresence": "r9k.ops.state",
    "read_host_events": "r9k.ops.state",
    "HostEvent": "r9k.ops.state",
    "DEFAULT_STATE_DIR": "r9k.ops.state",
    "discover_cards": "r9k.ops.sysfs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'r9k.ops' has no attribute {name!r}")
