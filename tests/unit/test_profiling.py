"""trainer.profile_steps' per-stage summary (hybridflow/profiling.py): a device kernel counts
toward every stage whose range holds it (stages nest: `step` holds the others), by its device
timestamps."""

from types import SimpleNamespace

import torch

from hybridflow.profiling import stage_summary

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _ev(name, start, end, dev=CPU, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=dev, is_user_annotation=annotation)


def test_kernels_are_attributed_to_the_stages_that_hold_them():
    events = [
        _ev("stage/step", 0, 1000), _ev("stage/gen", 10, 400), _ev("stage/update_actor", 500, 990),
        _ev("aten::mm", 20, 30),  # a CPU op: not a kernel
        _ev("gemm", 50, 150, CUDA), _ev("gemm", 200, 260, CUDA),  # in gen
        _ev("adam", 600, 900, CUDA),  # in update_actor
        _ev("late", 995, 1005, CUDA),  # ends after every stage: in none
        # the GPU-track copies of record_function ranges: neither stages nor kernels
        _ev("stage/gen", 12, 380, CUDA, annotation=True),
        _ev("Optimizer.step#AdamW.step", 600, 900, CUDA, annotation=True),
    ]
    s = stage_summary(events)
    assert s["gen"]["kernels"] == 2 and abs(s["gen"]["kernel_s"] - 160e-6) < 1e-12
    assert s["gen"]["top"] == [{"kernel": "gemm", "s": 160e-6, "calls": 2}]
    assert abs(s["gen"]["wall_s"] - 390e-6) < 1e-12
    assert s["update_actor"]["kernels"] == 1 and s["update_actor"]["top"][0]["kernel"] == "adam"
    assert s["step"]["kernels"] == 3 and abs(s["step"]["kernel_s"] - 460e-6) < 1e-12


def test_a_stage_entered_twice_sums():
    events = [_ev("stage/gen", 0, 100), _ev("stage/gen", 200, 250), _ev("k", 210, 220, CUDA)]
    s = stage_summary(events)
    assert abs(s["gen"]["wall_s"] - 150e-6) < 1e-12 and s["gen"]["kernels"] == 1


def test_a_saved_trace_gives_the_same_summary():
    """trace_summary reads the Chrome trace's stage ranges and device events (not the GPU-track
    copies of the ranges) as stage_summary reads the live events."""
    from hybridflow.profiling import trace_summary

    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "stage/gen", "ts": 10, "dur": 390},
        {"cat": "gpu_user_annotation", "name": "stage/gen", "ts": 12, "dur": 380},
        {"cat": "kernel", "name": "gemm", "ts": 50, "dur": 100},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 200, "dur": 10},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 20, "dur": 10},
        {"cat": "kernel", "name": "late", "ts": 395, "dur": 10},
    ]}
    s = trace_summary(trace)
    assert list(s) == ["gen"] and s["gen"]["kernels"] == 2
    assert abs(s["gen"]["kernel_s"] - 110e-6) < 1e-12 and abs(s["gen"]["wall_s"] - 390e-6) < 1e-12
