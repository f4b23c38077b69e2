"""trainer.gpu_monitor_interval_s: what this rank's GPU ran at during each stage of a step.

A card held below its boost clock by its power cap or its temperature runs the compute-bound
passes (the update's and the reference's GEMMs) slower and the memory-bound decode not; two
machines of one kind, or two hours of one run, then differ by more than a change under test. A
thread reads NVML (the `nvidia-ml-py` package, in the `gpu` extra) every interval: the SM clock,
the power draw, the temperature and the clock-event reasons. At the end of a step the samples
that fell in each stage's spans (StageTimer.spans, the same clock) become the step's metrics:

- `perf/gpu_sm_mhz/<stage>`: the median SM clock while the stage ran (gen, ref, update_actor, ...);
- `perf/gpu_sm_mhz`, `perf/gpu_sm_mhz_min`, `perf/gpu_power_w`: the step's median clock, its
  lowest and its median power draw; `perf/gpu_temperature_c`: the step's highest temperature;
- `perf/gpu_power_capped` and `perf/gpu_thermal_slowdown`: the share of the step's busy samples
  held by the power cap (software cap or hardware power brake) or by a thermal slowdown.

Off without a CUDA device or without nvidia-ml-py (a line says so when the option was asked for);
its cost is one NVML read of four values per interval on a thread that holds no GIL in NVML.
"""
from __future__ import annotations

import statistics
import threading
import time

# NVML's clock-event reason bits (nvmlClocksEventReason*; benchmarks/gpu_clocks.py reads them here)
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
           0x100: "display_clock"}
IDLE = 0x1
POWER = 0x4 | 0x80  # software power cap, hardware power brake
THERMAL = 0x20 | 0x40  # software / hardware thermal slowdown


def _nvml_handle(nvml, device_index: int):
    """NVML's handle of torch's device `device_index` (by UUID: NVML counts every GPU of the host,
    CUDA_VISIBLE_DEVICES does not reach it)."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except nvml.NVMLError:
        return nvml.nvmlDeviceGetHandleByIndex(device_index)


class GpuMonitor:
    """Samples (time, sm_mhz, power_w, temperature_c, reasons) on a daemon thread; `step_metrics`
    turns those of the last step into its metrics and drops them. `read` returns one sample and
    `clock` the time base (time.perf_counter, StageTimer's); both are replaceable for tests."""

    def __init__(self, interval_s: float, read, clock=time.perf_counter):
        self.interval_s, self.read, self.clock = interval_s, read, clock
        self.samples: list[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()

    @classmethod
    def for_device(cls, interval_s: float, device_index: int, *, asked: bool):
        """The monitor of torch's CUDA device `device_index`, or None where there is no CUDA
        device or no NVML (printed when `asked`: the option was set, not left at its default)."""
        import torch

        if interval_s <= 0 or not torch.cuda.is_available():
            return None
        try:
            import pynvml as nvml

            nvml.nvmlInit()
            handle = _nvml_handle(nvml, device_index)
        except Exception as e:  # not installed, no driver library
            if asked:
                print(f"trainer.gpu_monitor_interval_s: off, NVML is not available ({e}); "
                      "`pip install nvidia-ml-py` (the gpu extra has it)", flush=True)
            return None
        sm, reasons = nvml.NVML_CLOCK_SM, nvml.nvmlDeviceGetCurrentClocksEventReasons

        def read():
            return (nvml.nvmlDeviceGetClockInfo(handle, sm),
                    nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                    nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                    reasons(handle))

        return cls(interval_s, read)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sample = (self.clock(), *self.read())
            except Exception:  # a transient NVML error: skip the sample
                sample = None
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 1.0)

    def step_metrics(self, spans: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
        """The metrics of the samples taken in the step's spans ({stage: [(start, end)]}, the
        step itself as "step"); the samples up to the step's end are dropped."""
        with self._lock:
            samples, self.samples = self.samples, []
        step = spans.get("step")
        if not step:  # no "step" stage: from the first stage's start to the last one's end
            every = [span for v in spans.values() for span in v]
            step = [(min(a for a, _ in every), max(b for _, b in every))] if every else []

        def within(rows, ranges):
            return [r for r in rows if any(a <= r[0] <= b for a, b in ranges)]

        out: dict[str, float] = {}
        in_step = within(samples, step)
        if not in_step:
            return out
        clocks = [r[1] for r in in_step]
        out["perf/gpu_sm_mhz"] = float(statistics.median(clocks))
        out["perf/gpu_sm_mhz_min"] = float(min(clocks))
        out["perf/gpu_power_w"] = float(statistics.median(r[2] for r in in_step))
        out["perf/gpu_temperature_c"] = float(max(r[3] for r in in_step))
        busy = [r[4] for r in in_step if not r[4] & IDLE]
        if busy:
            out["perf/gpu_power_capped"] = sum(1 for m in busy if m & POWER) / len(busy)
            out["perf/gpu_thermal_slowdown"] = sum(1 for m in busy if m & THERMAL) / len(busy)
        for stage, ranges in spans.items():
            rows = within(in_step, ranges)
            if stage != "step" and rows:
                out[f"perf/gpu_sm_mhz/{stage}"] = float(statistics.median(r[1] for r in rows))
        return out
