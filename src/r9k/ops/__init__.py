"""r9k.ops: host management (LACT/sysfs power and undervolt, kernel-log watcher, containment).

Other components import the module they need (imports stay light: no vllm, torch or ray):
:mod:`r9k.ops.power` (``power_status``, ``apply_power``, ``CardStatus``), :mod:`r9k.ops.config`
(``load_config``, ``OpsConfig``), :mod:`r9k.ops.state` (card states, presence, host events),
:mod:`r9k.ops.sysfs` (``discover_cards``).
"""
