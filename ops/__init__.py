"""r9k.ops: host management (LACT/sysfs power and undervolt, kernel-log watcher, containment)."""
