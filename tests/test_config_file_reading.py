"""Config files (ops config, fleet file, exporter web config) are read by one bounded reader:
what is not a regular file, or is far too big to be a config, is bad input named in one line,
and the read never blocks (a FIFO) or grows without bound (/dev/zero)."""
from __future__ import annotations

import os
import threading

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from r9k.cli import main
from r9k.core.config_errors import CONFIG_MAX_BYTES, read_config_bytes


def _r9k(*args):
    return CliRunner().invoke(main, list(args))


def _run_bounded(fn, timeout_s=20.0):
    """Run fn in a thread; fail (not hang) if it has not returned in timeout_s."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the config read blocked"
    if "error" in out:
        raise out["error"]
    return out["value"]


COMMANDS = [
    ("fleet", "check", "--config"),
    ("ops", "check-config", "--config"),
]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_fifo_config_is_refused_without_blocking(tmp_path, command):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    result = _run_bounded(lambda: _r9k(*command, str(fifo)))
    assert result.exit_code == 2
    assert "is a FIFO; expected a regular file" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_dev_zero_as_config_is_refused_without_reading_it_all(command):
    result = _run_bounded(lambda: _r9k(*command, "/dev/zero"))
    assert result.exit_code == 2
    assert "/dev/zero: is a device; expected a regular file" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_a_config_over_the_size_cap_is_refused(tmp_path, command):
    big = tmp_path / "config.yaml"
    big.write_bytes(b"# padding\n" * (CONFIG_MAX_BYTES // 10 + 1))
    result = _r9k(*command, str(big))
    assert result.exit_code == 2
    assert f"larger than {CONFIG_MAX_BYTES} bytes" in result.output


def test_the_web_config_reader_refuses_a_fifo(tmp_path):
    from r9k.monitoring.web_config import WebConfigError, load_web_config

    fifo = tmp_path / "web.yaml"
    os.mkfifo(fifo)
    with pytest.raises(WebConfigError, match="is a FIFO"):
        _run_bounded(lambda: load_web_config(fifo))


@settings(max_examples=60, deadline=None)
@given(size=st.integers(min_value=0, max_value=4096), cap=st.integers(min_value=0, max_value=4096))
def test_read_config_bytes_returns_the_file_exactly_or_refuses_it(tmp_path_factory, size, cap):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    data = os.urandom(size)
    path.write_bytes(data)
    if size <= cap:
        assert read_config_bytes(path, max_bytes=cap) == data
    else:
        with pytest.raises(ValueError, match=f"larger than {cap} bytes"):
            read_config_bytes(path, max_bytes=cap)
