"""The energy counter through the real `r9k exporter` process on a fixture host: a card drawing a
constant 210 W, scraped over HTTP 60 s apart at the default 1 Hz sampling; the counter's error
against 210 W x the time between scrapes stays within 2 %."""
from __future__ import annotations

import re
import subprocess
import sys
import time

from doubles.ops_host import CardSpec, build_host_tree
from r9k.core.http_client import http_get

A, B = "0000:03:00.0", "0000:04:00.0"


def _energy(url: str) -> tuple[dict[str, float], str]:
    text = http_get(url, timeout_s=10).decode()
    values = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^r9k_gpu_energy_joules_total\{bdf="([^"]+)",host="fixture-host"\} (\S+)$', text, re.M)}
    return values, text


def test_the_exporters_energy_counter_is_within_2_percent_of_a_constant_210_w_card_over_60_s(tmp_path):
    root = build_host_tree(tmp_path / "host", [CardSpec(A, power_draw_watts=210),
                                               CardSpec(B, power_files=("input",), power_draw_watts=95)])
    proc = subprocess.Popen(
        [sys.executable, "-c", "from r9k.cli import main; main()", "exporter", "--port", "0",
         "--host-root", str(root), "--state-dir", str(tmp_path / "state"),
         "--config", str(tmp_path / "absent.yaml"), "--host-name", "fixture-host"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"(http://\S+/metrics)", line).group(1)
        time.sleep(3)   # a few samples in
        e0, _ = _energy(url)
        t0 = time.monotonic()
        time.sleep(60)
        e1, text = _energy(url)
        t1 = time.monotonic()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    for bdf, watts in ((A, 210.0), (B, 95.0)):
        expected = watts * (t1 - t0)
        error = abs((e1[bdf] - e0[bdf]) - expected) / expected
        print(f"{bdf}: {e1[bdf] - e0[bdf]:.1f} J counted over {t1 - t0:.2f} s at {watts:g} W "
              f"({expected:.1f} J): error {error:.3%}")
        assert error < 0.02, f"{bdf}: {e1[bdf] - e0[bdf]:.1f} J against {expected:.1f} J ({error:.2%})"
    assert f'r9k_gpu_energy_source_info{{bdf="{A}",host="fixture-host",source="power1_average"}} 1.0' in text
    assert f'r9k_gpu_energy_source_info{{bdf="{B}",host="fixture-host",source="power1_input"}} 1.0' in text
    assert "r9k_gpu_energy_sample_rate_hz 1.0" in text
    assert f'r9k_gpu_energy_gap_seconds_total{{bdf="{A}",host="fixture-host"}} 0.0' in text
    print("\n".join(ln for ln in text.splitlines() if "energy" in ln))
