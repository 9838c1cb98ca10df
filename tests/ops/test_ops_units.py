"""systemd units: install-units writes them; systemd-analyze verify accepts them where available."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from r9k.cli import main
from r9k.ops.units import UNIT_NAMES


def _install(tmp_path):
    r9k_bin = shutil.which("r9k") or str(__import__("pathlib").Path(sys.executable).parent / "r9k")
    dest = tmp_path / "system"
    result = CliRunner().invoke(main, ["ops", "install-units", "--dest", str(dest), "--r9k-bin", r9k_bin,
                                       "--config", "/etc/r9k/ops.yaml", "--state-dir", "/var/lib/r9k/ops",
                                       "--interval", "30"])
    assert result.exit_code == 0, result.output
    return dest, r9k_bin


def test_install_units_writes_three_units_with_real_paths(tmp_path):
    dest, r9k_bin = _install(tmp_path)
    assert sorted(p.name for p in dest.iterdir()) == sorted(UNIT_NAMES)
    apply_unit = (dest / "r9k-ops-apply.service").read_text()
    assert "Type=oneshot" in apply_unit and "After=lactd.service" in apply_unit
    assert f"ExecStart={r9k_bin} ops apply --config /etc/r9k/ops.yaml --state-dir /var/lib/r9k/ops" in apply_unit
    assert "--wait-seconds" in apply_unit and "ExecStart=-" not in apply_unit  # failures are not ignored
    assert "--interval 30" in (dest / "r9k-ops-reconcile.service").read_text()
    assert "ops watch" in (dest / "r9k-ops-watch.service").read_text()
    assert not any("@" in line for p in dest.iterdir() for line in p.read_text().splitlines()
                   if not line.startswith("#"))


def test_install_units_refuses_a_relative_binary(tmp_path):
    result = CliRunner().invoke(main, ["ops", "install-units", "--dest", str(tmp_path), "--r9k-bin", "r9k"])
    assert result.exit_code == 2 and "absolute path" in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    dest, _ = _install(tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(dest / n) for n in UNIT_NAMES)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # Warnings (unknown keys, bad values) come on stderr even with rc 0; our units have none that
    # concern them (lactd.service may be absent on a build machine).
    problems = [ln for ln in proc.stderr.splitlines() if "r9k-ops" in ln]
    assert problems == []


def test_import_stays_light():
    code = ("import sys, r9k.ops, r9k.ops.cli, r9k.ops.power, r9k.ops.watch, r9k.ops.state; "
            "print(sorted(m for m in ('vllm', 'torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def _systemd_words(line: str) -> list[str]:
    """An ExecStart= value split as systemd.service(5) "Command lines" documents it: blanks
    separate words, a double-quoted word takes C escapes, `%%` is `%`, and in the arguments
    `$$` is `$` (the program gets no variable substitution) (a test-side reader of the rules)."""
    words, i = [], 0
    while i < len(line):
        if line[i].isspace():
            i += 1
            continue
        if line[i] == '"':
            i, word = i + 1, ""
            while line[i] != '"':
                if line[i] == "\\":
                    i += 1
                word += line[i]
                i += 1
            i += 1
        else:
            j = i
            while j < len(line) and not line[j].isspace():
                j += 1
            word, i = line[i:j], j
        word = word.replace("%%", "%")
        words.append(word.replace("$$", "$") if words else word)
    return words


def test_unit_paths_with_blanks_specifiers_and_dollars_survive_systemd(tmp_path):
    """Paths go into ExecStart= quoted and escaped: written as they are, a blank would split
    them, `%b` become the boot id and `$HOME` the service's home."""
    odd = tmp_path / "r9k tools 100%b $HOME"
    odd.mkdir()
    r9k_bin = odd / "r9k"
    shutil.copy("/bin/true", r9k_bin)
    config = odd / 'ops "main".yaml'
    state = tmp_path / "state dir"
    dest = tmp_path / "system"
    result = CliRunner().invoke(main, ["ops", "install-units", "--dest", str(dest), "--r9k-bin",
                                       str(r9k_bin), "--config", str(config), "--state-dir",
                                       str(state)])
    assert result.exit_code == 0, result.output
    for name in UNIT_NAMES:
        line = next(ln for ln in (dest / name).read_text().splitlines() if ln.startswith("ExecStart="))
        words = _systemd_words(line[len("ExecStart="):])
        assert words[0] == str(r9k_bin) and words[words.index("--config") + 1] == str(config)
        assert words[words.index("--state-dir") + 1] == str(state)
    if shutil.which("systemd-analyze"):  # systemd's own reader: argv[0] executable, specifiers valid
        proc = subprocess.run(["systemd-analyze", "verify", "--man=no",
                               *(str(dest / n) for n in UNIT_NAMES)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert [ln for ln in proc.stderr.splitlines() if "r9k-ops" in ln] == [], proc.stderr
    # a newline would start a directive of its own: refused, nothing written
    bad_dest = tmp_path / "bad"
    result = CliRunner().invoke(main, ["ops", "install-units", "--dest", str(bad_dest), "--r9k-bin",
                                       str(r9k_bin), "--config", "/etc/r9k/ops.yaml\nExecStartPre=/bin/x"])
    assert result.exit_code == 2 and "holds a control character" in result.output
    assert not bad_dest.exists()


def test_fleet_units_quote_their_paths_too(tmp_path):
    from r9k.ops.units import install_fleet_units

    odd = tmp_path / "fleet 50%"
    odd.mkdir()
    r9k_bin = odd / "r9k"
    shutil.copy("/bin/true", r9k_bin)
    shutil.copy("/bin/true", odd / "ray")
    written = install_fleet_units(tmp_path / "system", str(r9k_bin), str(odd / "fleet.yaml"),
                                  str(odd / "run"))
    for path in written:
        for line in path.read_text().splitlines():
            if line.startswith(("ExecStart=", "ExecStop=")):
                words = _systemd_words(line.split("=", 1)[1])
                assert words[0] in (str(r9k_bin), str(odd / "ray")), words
                if "--config" in words:
                    assert words[words.index("--config") + 1] == str(odd / "fleet.yaml")
    if shutil.which("systemd-analyze"):
        proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, written)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "r9k-" not in proc.stderr, proc.stderr
