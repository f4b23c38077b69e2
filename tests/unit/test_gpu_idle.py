"""benchmarks/profile_decode.gpu_idle: the GPU's idle time of a traced generate call, from the
device's kernel intervals and the host's ranges (the generator's phase labels, ops)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from profile_decode import gpu_idle  # noqa: E402

from hybridflow.profiling import idle_by_launcher  # noqa: E402

# the host: setup 0-100, prefill 100-300 (a sync op 250-300 inside), decode 300-900, finish 900-1000
HOST = [(0, 100, "generate.setup"), (100, 300, "generate.prefill"), (250, 300, "cudaStreamSynchronize"),
        (300, 900, "generate.decode"), (900, 1000, "generate.finish"), (920, 950, "aten::item")]


def test_idle_is_the_window_less_the_union_of_kernels_split_by_phase():
    # overlapping kernels (two streams) count once; gaps: 0-120 (setup 100 + prefill 20),
    # 240-330 (prefill 60 + decode 30), 600-610 (below min_gap: idle but not attributed), 880-1000
    kernels = [(120, 200), (150, 240), (330, 600), (610, 880)]
    r = gpu_idle(kernels, HOST, min_gap_us=20)
    assert r["window_us"] == 1000 and r["busy_us"] == 120 + 270 + 270
    assert r["idle_us"] == 1000 - r["busy_us"] == 120 + 90 + 10 + 120
    assert r["idle_by_phase_us"] == {"generate.setup": 100, "generate.prefill": 80,
                                     "generate.decode": 50, "generate.finish": 100}
    assert r["phase_us"] == {"generate.setup": 100, "generate.prefill": 200, "generate.decode": 600,
                             "generate.finish": 100}
    # the longest first, with the phase and the innermost host range at their start
    assert [(g["at_us"], g["us"], g["phase"], g["host"]) for g in r["gaps"]] == [
        (0, 120, "generate.setup", "generate.setup"), (880, 120, "generate.decode", "generate.decode"),
        (240, 90, "generate.prefill", "generate.prefill")]


def test_window_ends_with_the_last_kernel_and_time_outside_labels_is_none():
    kernels = [(0, 50), (1000, 1100)]  # the device still busy after the host's last label
    r = gpu_idle(kernels, HOST, min_gap_us=0, top=1)
    assert r["window_us"] == 1100 and r["idle_us"] == 950
    assert r["idle_by_phase_us"]["generate.setup"] == 50 and "none" not in r["idle_by_phase_us"]
    assert r["gaps"] == [{"at_us": 50, "us": 950, "phase": "generate.setup", "host": "generate.setup"}]
    gapped = gpu_idle([(0, 50), (1200, 1300)], HOST, min_gap_us=0)
    assert gapped["idle_by_phase_us"]["none"] == pytest.approx(200)  # 1000-1200: no label


def test_no_labels_no_window():
    r = gpu_idle([(0, 10)], [(0, 10, "aten::mm")])
    assert r == {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "idle_by_phase_us": {},
                 "phase_us": {}, "gaps": []}


def test_a_nested_label_takes_its_share_of_a_gap():
    """generate.spec_tail runs inside generate.decode: a gap over both counts once, the nested
    label's part to it, the rest to decode."""
    host = HOST + [(500, 700, "generate.spec_tail")]
    r = gpu_idle([(0, 100), (300, 450), (900, 1000)], host, min_gap_us=0)
    assert r["idle_by_phase_us"] == {"generate.prefill": 200, "generate.decode": 250,
                                     "generate.spec_tail": 200}
    assert r["idle_us"] == sum(r["idle_by_phase_us"].values())


def test_a_training_pass_labels_its_own_stages():
    host = [(0, 100, "engine.micro_batches"), (100, 400, "engine.schedule"), (120, 300, "engine.forward")]
    r = gpu_idle([(150, 200), (350, 400)], host, min_gap_us=0, prefix="engine.")
    assert r["idle_by_phase_us"] == {"engine.micro_batches": 100, "engine.forward": 130,
                                     "engine.schedule": 70}


def test_each_gap_goes_to_the_launcher_of_the_kernel_that_ends_it():
    # gaps: 100-130 (30, ended by an mm), 140-150 (10, below min_gap), 200-260 (60, an item's copy),
    # 300-330 (30, another mm); the kernel under the first (50-100) leaves no gap
    kernels = [(0, 100, "aten::mm"), (50, 100, "aten::add"), (130, 140, "aten::mm"),
               (150, 200, "aten::silu"), (260, 300, "aten::item < engine.loss"), (330, 400, "aten::mm")]
    r = idle_by_launcher(kernels, min_gap_us=20)
    assert r["idle_us"] == 120 and r["gaps"] == 3
    assert r["by_launcher"] == {"aten::item < engine.loss": {"us": 60, "gaps": 1},
                                "aten::mm": {"us": 60, "gaps": 2}}
    assert idle_by_launcher([]) == {"idle_us": 0.0, "gaps": 0, "by_launcher": {}}


def test_traced_takes_the_launch_records_with_their_phase(monkeypatch):
    # kernel_launches' records are (start, end, name, chain, phase): traced keeps (start, end, chain)
    # and counts the matching launches; on CPU the profiler has no kernels, so they are given here
    import torch

    import profile_decode

    recs = [(0.0, 5.0, "Memcpy DtoH (Device -> Pageable)", "aten::item", "engine.forward"),
            (6.0, 9.0, "gemm_kernel", "aten::mm", "engine.backward")]
    monkeypatch.setattr(profile_decode, "kernel_launches", lambda prof, frames=None: recs)
    t = profile_decode.traced(lambda: torch.ones(4).sum(), torch.device("cpu"))
    assert t["kernels"] == [(0.0, 5.0, "aten::item"), (6.0, 9.0, "aten::mm")]
    assert t["launched"](("Memcpy DtoH",)) == {"Memcpy DtoH (Device -> Pageable) <- aten::item": 1}
    assert idle_by_launcher(t["kernels"], min_gap_us=0)["by_launcher"] == {
        "aten::mm": {"us": 1.0, "gaps": 1}}
