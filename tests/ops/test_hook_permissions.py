"""Hooks run as root, so the ops config that names them, and each hook program, must be a file
only root can change: root-owned and writable by neither group nor others. Every permission
mode is tried (a property test), not only the world-writable one: a group-writable config is as
much a privilege escalation as a world-writable one."""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import given, settings, strategies as st

from r9k.ops.config import ConfigError, load_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files owned by root and by others")

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
modes = st.integers(min_value=0, max_value=0o7777).filter(lambda m: m & stat.S_IRUSR)  # root reads


@contextlib.contextmanager
def _root_only_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="r9k-hooks-"))  # root-owned, 0700
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _load_or_reason(path: Path) -> str | None:
    try:
        load_config(path)
    except ConfigError as exc:
        return str(exc)
    return None


@settings(max_examples=80, deadline=None)
@given(mode=modes, uid=st.sampled_from([0, 0, 1000]))
def test_a_config_with_hooks_loads_only_when_root_alone_can_write_it(mode, uid):
    with _root_only_dir() as d:
        cfg = d / "ops.yaml"
        cfg.write_text("hooks: [/bin/true]\n")
        os.chown(cfg, uid, 0)
        os.chmod(cfg, mode)
        reason = _load_or_reason(cfg)
    if uid == 0 and not mode & OTHERS_WRITE:
        assert reason is None
    else:
        assert reason is not None and "writable by someone other than root" in reason
        assert f"owner uid {uid}" in reason and stat.filemode(stat.S_IFREG | mode) in reason


@settings(max_examples=60, deadline=None)
@given(mode=modes.filter(lambda m: m & stat.S_IXUSR), uid=st.sampled_from([0, 0, 1000]))
def test_a_hook_program_is_accepted_only_when_root_alone_can_write_it(mode, uid):
    with _root_only_dir() as d:
        hook = d / "drain.sh"
        hook.write_text("#!/bin/sh\nexit 0\n")
        os.chown(hook, uid, 0)
        os.chmod(hook, mode)
        cfg = d / "ops.yaml"
        cfg.write_text(f"hooks: [{hook}]\n")
        os.chmod(cfg, 0o644)
        reason = _load_or_reason(cfg)
    if uid == 0 and not mode & OTHERS_WRITE:
        assert reason is None
    else:
        assert reason is not None and "drain.sh" in reason
        assert "writable by group or others or not root-owned" in reason


def test_a_group_writable_config_with_hooks_is_refused_and_without_hooks_is_read(tmp_path):
    """The case the property covers, named: 0664 (group-writable, root-owned)."""
    cfg = tmp_path / "ops.yaml"
    cfg.write_text("hooks: [/bin/true]\n")
    os.chmod(cfg, 0o664)
    with pytest.raises(ConfigError, match=r"writable by someone other than root .*-rw-rw-r--"):
        load_config(cfg)
    cfg.write_text("defaults: {power_cap_watts: 210}\n")  # no hooks: nothing runs as root from it
    assert load_config(cfg).defaults.power_cap_watts == 210
