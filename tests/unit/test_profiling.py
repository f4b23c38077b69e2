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


def _profiled_item(stage: str, n: int):
    """A finished torch.profiler (CPU, and CUDA where there is one) over an (n, n) matmul read back
    with `.item()` inside the range `stage`."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    x = torch.randn(n, n, device="cuda" if cuda else "cpu")
    with profile(activities=acts) as prof:
        with record_function(stage):
            (x @ x).sum().item()
    return prof


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


def test_idle_time_is_charged_to_the_launcher_of_the_kernel_that_ends_it():
    """Each stage's `idle_s` is its wall time with no kernel running; `waits` charges each gap to
    the host ops that launched the kernel ending it, and the tail after the last kernel to
    "(stage end)". Overlapping kernels (two streams) count once."""
    events = [_ev("stage/update_actor", 0, 1000), _ev("stage/gen", 2000, 2100)]
    launches = [(100, 200, "gemm", "aten::mm < aten::linear"),
                (150, 250, "copy", "aten::copy_"),  # overlaps the gemm: no gap before it
                (400, 500, "adam", "aten::_fused_adam_"),
                (600, 700, "gemm", "aten::mm < aten::linear")]
    s = stage_summary(events, launches=launches)
    u = s["update_actor"]
    assert u["kernels"] == 4 and abs(u["kernel_s"] - 400e-6) < 1e-12
    # busy 100-250, 400-500, 600-700: idle 100 + 150 + 100 + 300
    assert abs(u["idle_s"] - 650e-6) < 1e-12
    waits = {w["launcher"]: (round(w["s"] * 1e6), w["gaps"]) for w in u["waits"]}
    assert waits == {"aten::mm < aten::linear": (200, 2), "aten::_fused_adam_": (150, 1),
                     "(stage end)": (300, 1)}
    assert s["gen"]["kernels"] == 0 and abs(s["gen"]["idle_s"] - 100e-6) < 1e-12


def test_idle_time_is_split_by_the_engine_range_that_launched_the_kernel_ending_it():
    """`idle_by_phase`: the same gaps as `waits`, summed by the launch's engine range (the
    optimizer's launches after the backward, the stage's host work), the tail as "(stage end)"."""
    events = [_ev("stage/update_actor", 0, 1000)]
    launches = [(100, 200, "gemm", "aten::mm", "engine.forward"),
                (300, 400, "gemm", "aten::mm", "backward"),
                (450, 500, "norm", "aten::_foreach_norm", "engine.optimizer"),
                (600, 650, "copy", "aten::copy_", "host"),
                (700, 800, "adam", "aten::_fused_adam_", "engine.optimizer")]
    u = stage_summary(events, launches=launches)["update_actor"]
    phases = {k: round(v * 1e6) for k, v in u["idle_by_phase"].items()}
    assert phases == {"engine.forward": 100, "backward": 100, "engine.optimizer": 100,
                      "host": 100, "(stage end)": 200}
    assert abs(sum(u["idle_by_phase"].values()) - u["idle_s"]) < 1e-12


def test_launch_phase_names_the_innermost_engine_range_or_the_autograd_thread():
    from types import SimpleNamespace

    from hybridflow.profiling import launch_phase

    def chain(*names):  # outermost first -> the innermost event
        e = None
        for n in names:
            e = SimpleNamespace(name=n, cpu_parent=e)
        return e

    assert launch_phase(chain("stage/update_actor", "engine.schedule", "engine.forward",
                              "aten::linear", "aten::mm")) == "engine.forward"
    assert launch_phase(chain("autograd::engine::evaluate_function: MmBackward0",
                              "aten::mm")) == "backward"
    assert launch_phase(chain("stage/update_actor", "aten::index", "aten::copy_")) == "host"
    assert launch_phase(chain("aten::copy_")) == "?"


def test_a_saved_trace_charges_waits_to_the_op_of_its_external_id():
    from hybridflow.profiling import trace_summary

    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "stage/ref", "ts": 0, "dur": 100},
        {"cat": "cpu_op", "name": "aten::item", "ts": 5, "dur": 1, "args": {"External id": 7}},
        {"cat": "kernel", "name": "k", "ts": 40, "dur": 50, "args": {"External id": 7}},
        {"cat": "kernel", "name": "k2", "ts": 95, "dur": 5, "args": {"External id": 9}},
    ]}
    w = {x["launcher"]: round(x["s"] * 1e6) for x in trace_summary(trace)["ref"]["waits"]}
    assert w == {"aten::item": 40, "?": 5}

    # the runtime's synchronizations, charged to the op of their External id; launches are not
    trace["traceEvents"] += [
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 6, "dur": 30,
         "args": {"External id": 7}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 1,
         "args": {"External id": 7}}]
    assert trace_summary(trace)["ref"]["host_waits"] == [
        {"where": "aten::item", "s": 30e-6, "count": 1}]


def test_a_profiled_step_links_its_kernels_to_their_launchers():
    """kernel_launches on a real profiler: every device kernel of a CUDA run names its op (CPU
    runs have none; the summary still carries idle_s and waits)."""
    from hybridflow.profiling import kernel_launches

    cuda = torch.cuda.is_available()
    prof = _profiled_item("stage/update_actor", 64)
    launches = kernel_launches(prof)
    s = stage_summary(prof.events(), launches=launches)["update_actor"]
    assert s["wall_s"] > 0 and s["idle_s"] <= s["wall_s"] + 1e-9 and s["waits"]
    if cuda:
        assert launches and all(k[3] != "?" and k[4] == "host" for k in launches)
        assert any("aten::mm" in k[3] for k in launches)
    else:
        assert launches == [] and s["waits"][0]["launcher"] == "(stage end)"


def test_the_cli_prints_each_stage_with_its_waits(tmp_path, capsys):
    """python -m hybridflow.profiling TRACE: per stage its wall, kernels and idle time, then its
    top kernels and the launchers its idle gaps waited for."""
    import gzip
    import json

    from hybridflow.profiling import main

    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "stage/update_actor", "ts": 0, "dur": 1000},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2, "args": {"External id": 3}},
        {"cat": "kernel", "name": "gemm", "ts": 400, "dur": 500, "args": {"External id": 3}},
    ]}
    path = tmp_path / "step3_rank0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    main([str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("update_actor") and "idle 0.50 ms" in out[0]
    assert any("gemm" in line for line in out)
    waits = [line for line in out if "gaps before" in line]
    assert "0.40 ms" in waits[0] and "aten::mm" in waits[0]
    assert "0.10 ms" in waits[1] and "(stage end)" in waits[1]


def test_host_waits_are_charged_to_their_stage_with_their_op_chain():
    """host_waits: the runtime's synchronizations (not its launches) with the op chain that made
    them, summed per stage by where they were made."""
    from hybridflow.profiling import host_waits

    item = SimpleNamespace(name="aten::item", cpu_parent=_ev("stage/ref", 0, 100))
    item.cpu_parent.cpu_parent = None
    to = SimpleNamespace(name="aten::to", cpu_parent=None)

    def rt(name, start, end, parent, stack=()):
        e = _ev(name, start, end)
        e.cpu_parent, e.stack = parent, list(stack)
        return e

    events = [_ev("stage/ref", 0, 100), _ev("stage/update_actor", 200, 300),
              rt("cudaStreamSynchronize", 10, 30, item), rt("cudaStreamSynchronize", 40, 45, item),
              rt("cudaLaunchKernel", 50, 51, item),  # a launch: no wait
              rt("cudaMemcpy", 210, 260, to, ["hybridflow/engine.py(717): _from_last_stage",
                                               "torch/nn/modules/module.py(1): _call_impl"])]
    waits = host_waits(events)
    assert [w[:2] for w in waits] == [(10, 30), (40, 45), (210, 260)]
    s = stage_summary(events, waits=waits)
    assert s["ref"]["host_waits"] == [{"where": "aten::item < stage/ref", "s": 25e-6, "count": 2}]
    (w,) = s["update_actor"]["host_waits"]
    assert w["where"] == "aten::to @ hybridflow/engine.py(717): _from_last_stage"
    assert abs(w["s"] - 50e-6) < 1e-12 and w["count"] == 1


def test_a_real_item_is_a_host_wait():
    """On CUDA, `.item()` inside a stage shows as a host wait under aten::item; on CPU there are
    no runtime calls, so none."""
    from hybridflow.profiling import host_waits

    cuda = torch.cuda.is_available()
    prof = _profiled_item("stage/ref", 256)
    waits = host_waits(prof.events())
    s = stage_summary(prof.events(), waits=waits)["ref"]
    if cuda:
        assert any("aten::item" in w["where"] for w in s["host_waits"]), s["host_waits"]
    else:
        assert waits == [] and s["host_waits"] == []


def test_the_summary_lists_as_many_kernels_as_asked():
    """trainer.profile_top_kernels: the stage summary's `top` holds that many kernels (by device
    time) and the config refuses fewer than one."""
    import dataclasses

    import pytest

    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    events = [_ev("stage/update_actor", 0, 100)] + [
        _ev(f"kernel_{i}", 10 * i, 10 * i + 1 + i, CUDA) for i in range(6)]
    assert [k["kernel"] for k in stage_summary(events, top=3)["update_actor"]["top"]] == [
        "kernel_5", "kernel_4", "kernel_3"]
    cfg = load_config(["experiment=demo"])
    assert cfg.trainer.profile_top_kernels == 40
    bad = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, profile_top_kernels=0))
    with pytest.raises(ValueError, match=r"trainer.profile_top_kernels=0 must be >= 1"):
        validate(bad, world_size=1)
