"""The energy meter's totals as Prometheus metrics (`r9k.ops.energy` samples and integrates)."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from r9k.ops.energy import EnergyMeter


class EnergyCollector:
    def __init__(self, meter: EnergyMeter) -> None:
        self.meter = meter

    def collect(self) -> Iterator[Metric]:
        meter = self.meter
        labels = ["host", "bdf"]
        energy = CounterMetricFamily(
            "r9k_gpu_energy_joules", "Energy each card drew since the exporter started: its energy "
            "counter, else its package power integrated between samples.", labels=labels)
        samples = CounterMetricFamily("r9k_gpu_energy_samples", "Power or energy readings taken.",
                                      labels=labels)
        gaps = CounterMetricFamily(
            "r9k_gpu_energy_gap_seconds", "Time not integrated: intervals longer than the gap "
            "bound (failed or late reads) and energy counter restarts.", labels=labels)
        errors = CounterMetricFamily("r9k_gpu_energy_read_errors", "Failed power or energy reads.",
                                     labels=labels)
        source = GaugeMetricFamily("r9k_gpu_energy_source_info", "Which file the energy comes "
                                   "from (value 1): energy1_input, power1_average or power1_input.",
                                   labels=labels + ["source"])
        watts = GaugeMetricFamily("r9k_gpu_energy_sampled_watts", "The last power sample.",
                                  labels=labels)
        for c in meter.snapshot():
            key = [meter.host, c.bdf]
            energy.add_metric(key, c.joules)
            samples.add_metric(key, c.samples)
            gaps.add_metric(key, c.gap_seconds)
            errors.add_metric(key, c.read_errors)
            if c.source is not None:
                source.add_metric(key + [c.source], 1.0)
            if c.watts is not None:
                watts.add_metric(key, c.watts)
        yield from (energy, samples, gaps, errors, source, watts)
        yield GaugeMetricFamily("r9k_gpu_energy_sample_rate_hz", "Power samples per second per card "
                                "(the setting).", value=meter.sample_hz)
        yield CounterMetricFamily("r9k_gpu_energy_late_samples", "Samples taken more than one "
                                  "period late (the sampler fell behind).", value=meter.late_samples)
