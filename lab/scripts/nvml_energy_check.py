"""Does the engine harness's energy reading agree with the card's own power readings?

`lab.engine_runs.GpuEnergy` reads NVML's total energy counter around each load (the
joules per output token of `gpu_perf.py`). This check loads the GPU with matmuls for
`--seconds`, reads the counter before and after through `GpuEnergy`, and integrates NVML's power
readings (`nvmlDeviceGetPowerUsage`, sampled every 50 ms) over the same time, then does the same
over an idle stretch right after. Writes JSON: both energies per stretch and over both, their
ratio, mean watts.

    # GPU machine, with the stack importable (e.g. PYTHONPATH=<gpu_perf.py's workdir>/site)
    python3 -m lab.scripts.nvml_energy_check --out DIR/nvml_energy_check.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()

    import torch

    from lab.engine_runs import GpuEnergy

    energy = GpuEnergy()
    if energy.handle is None:
        raise SystemExit(f"no NVML energy counter: {energy.why}")
    nvml = energy.nvml

    def power_w() -> float:
        mw = ctypes.c_uint()
        if nvml.nvmlDeviceGetPowerUsage(energy.handle, ctypes.byref(mw)) != 0:
            raise RuntimeError("nvmlDeviceGetPowerUsage failed")
        return mw.value / 1000.0

    def stretch(busy: bool) -> dict:
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic(), power_w()))
                time.sleep(0.05)

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        th = threading.Thread(target=sample)
        j0, t0 = energy.read_j(), time.monotonic()
        th.start()
        while time.monotonic() - t0 < args.seconds:
            if busy:
                for _ in range(20):
                    a = (a @ a).clamp_(-1, 1)
                torch.cuda.synchronize()
            else:
                time.sleep(0.05)
        j1, t1 = energy.read_j(), time.monotonic()
        stop.set()
        th.join()
        # trapezoids over the samples, held flat to the ends of the stretch
        pts = [(t0, samples[0][1])] + samples + [(t1, samples[-1][1])]
        integral = sum((tb - ta) * (pa + pb) / 2 for (ta, pa), (tb, pb) in zip(pts, pts[1:]))
        counter = j1 - j0
        return {"seconds": t1 - t0, "counter_j": counter, "power_integral_j": integral,
                "counter_over_integral": counter / integral if integral else None,
                "counter_mean_w": counter / (t1 - t0), "power_samples": len(samples)}

    busy, idle = stretch(True), stretch(False)
    # NVML's power reading is an average over its last second or so: it lags a step in load,
    # reading low at the start of the busy stretch and high at the start of the idle one that
    # follows. Over both (back to back) the lag cancels but for the two ends
    counter = busy["counter_j"] + idle["counter_j"]
    integral = busy["power_integral_j"] + idle["power_integral_j"]
    result = {"device": torch.cuda.get_device_name(), "busy": busy, "idle": idle,
              "busy_then_idle": {"counter_j": counter, "power_integral_j": integral,
                                 "counter_over_integral": counter / integral},
              "date": time.strftime("%Y-%m-%d")}
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
