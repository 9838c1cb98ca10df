"""The energy counter on fixture host trees: power integrated exactly on a controlled clock,
gaps not guessed, a card's own energy counter preferred, cards that reset or leave handled, and
the real sampling thread within 2% of a constant-power card."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings, strategies as st

from doubles.ops_host import CardSpec, build_host_tree, device_dir
from r9k.monitoring.energy import EnergyCollector
from r9k.ops.energy import EnergyMeter, EnergyWindow

A, B, C = "0000:03:00.0", "0000:04:00.0", "0000:05:00.0"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _hwmon(root, bdf):
    return next((device_dir(root, bdf) / "hwmon").glob("hwmon*"))


def _set_power(root, bdf, watts, name=None):
    hw = _hwmon(root, bdf)
    for f in ([name] if name else ["power1_average", "power1_input"]):
        if (hw / f).exists():
            (hw / f).write_text(f"{int(watts * 1e6)}\n")


def _by_bdf(meter):
    return {c.bdf: c for c in meter.snapshot()}


def test_power_is_integrated_by_the_trapezoid_rule_per_card_from_the_file_it_has(tmp_path):
    root = build_host_tree(tmp_path, [CardSpec(A, power_files=("average", "input"), power_draw_watts=200),
                                      CardSpec(B, power_files=("input",), power_draw_watts=100)])
    clock = Clock()
    meter = EnergyMeter(str(root), sample_hz=1.0, host="h1", clock=clock)
    for watts_a, watts_b in [(200, 100), (210, 100), (230, 50), (230, 50)]:
        _set_power(root, A, watts_a)
        _set_power(root, B, watts_b)
        meter.sample_once()
        clock.t += 1.0
    cards = _by_bdf(meter)
    assert cards[A].source == "power1_average" and cards[B].source == "power1_input"
    assert cards[A].joules == pytest.approx((200 + 210) / 2 + (210 + 230) / 2 + 230, abs=1e-9)
    assert cards[B].joules == pytest.approx(100 + 75 + 50, abs=1e-9)
    assert cards[A].samples == 4 and cards[A].gap_seconds == 0


def test_an_interval_past_the_gap_bound_is_counted_as_a_gap_not_guessed(tmp_path):
    root = build_host_tree(tmp_path, [CardSpec(A, power_draw_watts=100)])
    clock = Clock()
    meter = EnergyMeter(str(root), sample_hz=1.0, host="h1", clock=clock)
    meter.sample_once()
    clock.t += 1.0
    meter.sample_once()
    clock.t += 10.0            # a stalled sampler: 10 periods
    meter.sample_once()
    clock.t += 1.0
    meter.sample_once()
    card = _by_bdf(meter)[A]
    assert card.joules == pytest.approx(200.0) and card.gap_seconds == pytest.approx(10.0)


def test_a_cards_energy_counter_is_used_and_its_restart_is_a_gap(tmp_path):
    root = build_host_tree(tmp_path, [CardSpec(C)])
    energy = _hwmon(root, C) / "energy1_input"
    clock = Clock()
    meter = EnergyMeter(str(root), sample_hz=1.0, host="h1", clock=clock)
    for microjoules, step_s in [(5_000_000, 1), (7_500_000, 30), (9_000_000, 1), (1_000_000, 1),
                                (1_400_000, 1)]:
        energy.write_text(f"{microjoules}\n")
        meter.sample_once()
        clock.t += step_s
    card = _by_bdf(meter)[C]
    assert card.source == "energy1_input"
    # 2.5 J over a 30 s pause counts (the card integrated it); the restart is a gap
    assert card.joules == pytest.approx(2.5 + 1.5 + 0.4) and card.gap_seconds == pytest.approx(1.0)


def test_a_card_that_resets_gets_a_new_hwmon_and_goes_on_counting(tmp_path):
    root = build_host_tree(tmp_path, [CardSpec(A, power_draw_watts=100)])
    clock = Clock()
    meter = EnergyMeter(str(root), sample_hz=1.0, host="h1", clock=clock)
    meter.sample_once()
    clock.t += 1
    meter.sample_once()
    hw = _hwmon(root, A)
    hw.rename(hw.with_name("hwmon7"))   # amdgpu re-created its hwmon after a reset
    clock.t += 1
    meter.sample_once()                 # fails: rediscovered next time
    for _ in range(3):
        clock.t += 1
        meter.sample_once()
    card = _by_bdf(meter)[A]
    assert card.read_errors == 1 and card.hwmon_dir.name == "hwmon7"
    assert card.joules == pytest.approx(100 + 200)


def test_a_card_off_the_bus_keeps_its_count(tmp_path):
    root = build_host_tree(tmp_path, [CardSpec(A, power_draw_watts=100), CardSpec(B, power_draw_watts=50)])
    clock = Clock()
    meter = EnergyMeter(str(root), sample_hz=1.0, host="h1", clock=clock)
    meter.sample_once()
    clock.t += 1
    meter.sample_once()
    import shutil
    shutil.rmtree(device_dir(root, B))
    for _ in range(3):
        clock.t += 1
        meter.sample_once()
    cards = _by_bdf(meter)
    assert cards[B].joules == pytest.approx(50) and cards[A].joules == pytest.approx(400)


@pytest.mark.parametrize("hz", [0, -1, float("nan"), 1000])
def test_a_sample_rate_out_of_range_is_refused(hz, tmp_path):
    with pytest.raises(ValueError, match="energy sample rate"):
        EnergyMeter(str(tmp_path), sample_hz=hz)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 600), st.floats(0.05, 5.0)), min_size=2, max_size=30))
def test_the_integral_matches_the_trapezoid_sum_and_never_decreases(tmp_path_factory, steps):
    root = build_host_tree(tmp_path_factory.mktemp("host"), [CardSpec(A, power_files=("input",))])
    clock = Clock()
    meter = EnergyMeter(str(root), sample_hz=1.0, host="h1", clock=clock)
    expected = gaps = 0.0
    previous = None   # (watts, clock time) of the sample before
    last_joules = 0.0
    for watts, dt in steps:
        _set_power(root, A, watts)
        meter.sample_once()
        joules = _by_bdf(meter)[A].joules
        assert joules >= last_joules
        last_joules = joules
        if previous is not None:
            p_watts, p_t = previous
            span = clock.t - p_t   # as the meter sees it (float sums, not the drawn dt)
            if span <= 3.0:
                expected += (watts + p_watts) / 2 * span
            else:
                gaps += span
        previous = (watts, clock.t)
        clock.t += dt
    card = _by_bdf(meter)[A]
    assert card.joules == pytest.approx(expected, rel=1e-9, abs=1e-6)
    assert card.gap_seconds == pytest.approx(gaps, rel=1e-9, abs=1e-9)


def test_the_sampling_thread_is_within_2_percent_of_a_constant_power_card(tmp_path):
    root = build_host_tree(tmp_path, [CardSpec(A, power_draw_watts=210)])
    meter = EnergyMeter(str(root), sample_hz=20.0, host="h1").start()
    try:
        time.sleep(0.5)
        e0, t0 = _by_bdf(meter)[A].joules, time.monotonic()
        time.sleep(4.0)
        e1, t1 = _by_bdf(meter)[A].joules, time.monotonic()
    finally:
        meter.stop()
    assert abs((e1 - e0) - 210 * (t1 - t0)) / (210 * (t1 - t0)) < 0.02


def test_the_metrics_name_host_card_source_and_rate(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    root = build_host_tree(tmp_path, [CardSpec(A, power_draw_watts=100)])
    clock = Clock()
    meter = EnergyMeter(str(root), sample_hz=2.0, host="gpu-host-1", clock=clock)
    for _ in range(3):
        meter.sample_once()
        clock.t += 0.5
    registry = CollectorRegistry()
    registry.register(EnergyCollector(meter))
    text = generate_latest(registry).decode()
    assert f'r9k_gpu_energy_joules_total{{bdf="{A}",host="gpu-host-1"}} 100.0' in text
    assert f'r9k_gpu_energy_source_info{{bdf="{A}",host="gpu-host-1",source="power1_average"}} 1.0' in text
    assert "r9k_gpu_energy_sample_rate_hz 2.0" in text
    assert f'r9k_gpu_energy_gap_seconds_total{{bdf="{A}",host="gpu-host-1"}} 0.0' in text


def test_an_energy_window_measures_its_cards_or_says_not_measured(tmp_path):
    root = build_host_tree(tmp_path, [CardSpec(A, power_draw_watts=100),
                                      CardSpec(B, power_files=(), power_draw_watts=50)])
    meter = EnergyMeter(str(root), sample_hz=50.0, host="h1").start()
    try:
        with EnergyWindow(meter, [A]) as measured:
            time.sleep(1.0)
        with EnergyWindow(meter, [B]) as unreadable:
            time.sleep(0.2)
    finally:
        meter.stop()
    assert measured.measured and abs(measured.watts - 100) < 2
    assert not unreadable.measured and unreadable.watts is None
