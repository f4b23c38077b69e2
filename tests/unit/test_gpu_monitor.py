"""trainer.gpu_monitor_interval_s (hybridflow/gpu_monitor.py): NVML samples of this rank's GPU
become each step's perf/gpu_* metrics, per stage by StageTimer's spans. NVML and the clock are
stood in for: a read function and a clock the test drives, a fake pynvml module."""
import sys
import time
import types

import pytest
import torch

from hybridflow.gpu_monitor import GpuMonitor
from hybridflow.metrics import StageTimer


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _monitor(samples):
    """A monitor whose samples are given (its thread stopped at once, nothing read)."""
    m = GpuMonitor(3600.0, read=lambda: (0, 0.0, 0, 0), clock=Clock())
    m.close()
    m.samples = list(samples)
    return m


def test_step_metrics_take_each_stage_its_own_samples():
    # (time, sm MHz, power W, temperature C, reasons): gen at 1980 MHz, the update held by the
    # power cap at 1755 / 1650 MHz (one also thermal), one idle sample between the stages
    m = _monitor([(0.5, 1980, 400.0, 50, 0x0), (1.0, 1980, 420.0, 52, 0x0),
                  (1.5, 1200, 90.0, 50, 0x1),
                  (2.0, 1755, 700.0, 60, 0x4), (2.5, 1650, 700.0, 83, 0x24),
                  (9.0, 1980, 100.0, 40, 0x0)])  # after the step: dropped
    spans = {"step": [(0.0, 3.0)], "gen": [(0.0, 1.2)], "update_actor": [(1.8, 3.0)]}
    out = m.step_metrics(spans)
    assert out["perf/gpu_sm_mhz/gen"] == 1980.0
    assert out["perf/gpu_sm_mhz/update_actor"] == (1755 + 1650) / 2
    assert out["perf/gpu_sm_mhz"] == 1755.0 and out["perf/gpu_sm_mhz_min"] == 1200.0
    assert out["perf/gpu_temperature_c"] == 83.0 and out["perf/gpu_power_w"] == 420.0
    # of the 4 busy samples 2 were power-capped, 1 thermally slowed; the idle one is not counted
    assert out["perf/gpu_power_capped"] == 0.5 and out["perf/gpu_thermal_slowdown"] == 0.25
    assert "perf/gpu_sm_mhz/step" not in out
    assert m.samples == [] and m.step_metrics(spans) == {}  # each sample counts once


def test_a_stage_run_twice_takes_both_spans_and_no_step_stage_spans_them_all():
    m = _monitor([(0.1, 1900, 1.0, 1, 0), (0.6, 1000, 1.0, 1, 0), (1.1, 1700, 1.0, 1, 0)])
    out = m.step_metrics({"ref": [(0.0, 0.2), (1.0, 1.2)], "adv": [(0.5, 0.7)]})
    assert out["perf/gpu_sm_mhz/ref"] == 1800.0 and out["perf/gpu_sm_mhz/adv"] == 1000.0
    assert out["perf/gpu_sm_mhz"] == 1700.0


def test_the_thread_samples_until_closed_and_skips_a_failed_read():
    reads = []

    def read():
        reads.append(1)
        if len(reads) == 2:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return (1980, 500.0, 55, 0)

    m = GpuMonitor(0.005, read=read)
    deadline = time.time() + 10
    while time.time() < deadline and len(m.samples) < 3:
        time.sleep(0.005)
    m.close()
    assert not m._thread.is_alive() and len(m.samples) >= 3 and len(reads) > len(m.samples)
    now = time.perf_counter()
    assert m.step_metrics({"step": [(0.0, now)]})["perf/gpu_sm_mhz"] == 1980.0


def test_stage_timer_records_each_span_on_the_monitor_clock():
    timer = StageTimer()
    t0 = time.perf_counter()
    with timer("step"):
        for _ in range(2):
            with timer("gen"):
                pass
    assert len(timer.spans["gen"]) == 2 and len(timer.spans["step"]) == 1
    (a, b), = timer.spans["step"]
    assert t0 <= a <= timer.spans["gen"][0][0] and timer.spans["gen"][1][1] <= b <= time.perf_counter()
    assert timer.metrics()["timing_s/gen"] == pytest.approx(sum(e - s for s, e in timer.spans["gen"]))


def test_off_without_cuda_or_at_zero(capsys):
    if not torch.cuda.is_available():
        assert GpuMonitor.for_device(0.2, 0, asked=True) is None
    assert GpuMonitor.for_device(0.0, 0, asked=True) is None
    assert capsys.readouterr().out == ""


def _fake_nvml(monkeypatch, *, fail_init=False):
    calls = {}

    def init():
        if fail_init:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    def by_uuid(uuid):
        calls["uuid"] = uuid
        return "handle"

    nvml = types.SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, NVMLError=RuntimeError, nvmlInit=init,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetHandleByIndex=lambda i: "by-index",
        nvmlDeviceGetClockInfo=lambda h, kind: 1755 if (h, kind) == ("handle", 1) else -1,
        nvmlDeviceGetPowerUsage=lambda h: 612_500,  # milliwatts
        nvmlDeviceGetTemperature=lambda h, s: 71,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="8d1c-uuid"))
    return calls


def test_nvml_reads_the_device_of_this_rank_by_uuid(monkeypatch):
    calls = _fake_nvml(monkeypatch)
    m = GpuMonitor.for_device(3600.0, 0, asked=False)
    try:
        assert calls["uuid"] == "GPU-8d1c-uuid"
        assert m.read() == (1755, 612.5, 71, 0x4)
    finally:
        m.close()


def test_without_nvml_it_is_off_and_says_so_when_asked(monkeypatch, capsys):
    _fake_nvml(monkeypatch, fail_init=True)
    assert GpuMonitor.for_device(0.2, 0, asked=False) is None
    assert capsys.readouterr().out == ""
    assert GpuMonitor.for_device(0.5, 0, asked=True) is None
    out = capsys.readouterr().out
    assert "trainer.gpu_monitor_interval_s: off, NVML is not available" in out
    assert "nvidia-ml-py" in out


def test_a_negative_interval_is_refused():
    import dataclasses

    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    cfg = load_config(["experiment=demo"])
    bad = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer,
                                                               gpu_monitor_interval_s=-1.0))
    with pytest.raises(ValueError, match=r"trainer.gpu_monitor_interval_s=-1.0 must be >= 0"):
        validate(bad, world_size=1)
