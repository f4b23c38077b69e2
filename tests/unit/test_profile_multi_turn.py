"""benchmarks/profile_multi_turn.py (profile_decode.py --multi-turn): the product's multi-turn
decode step profiled per kind. On CPU (aten op self times): the source-line tags attribute every
op of a step, the same ops a plain profile of one step sees, and the sampler's and log-prob's ops
are exactly those of sample() and _token_logprobs() called alone; graphed kernel names take the
eager profile's kinds; a whole run writes both modes, the floor and the isolated pieces."""
import argparse
import collections
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import profile_multi_turn as pmt  # noqa: E402
from profile_decode import per_step, profile_calls  # noqa: E402

from hybridflow.config import RolloutConfig  # noqa: E402
from hybridflow.rollout import decoder  # noqa: E402
from hybridflow.rollout.multi_turn_step import DecodeState  # noqa: E402
from hybridflow.rollout.sampling import _token_logprobs, sample  # noqa: E402
from tests.unit.test_multi_turn import CFG, V, make_gen  # noqa: E402

CPU = torch.device("cpu")


def ops_of(fn) -> collections.Counter:
    """aten op -> calls of one fn() (a plain CPU profile, no tags)."""
    return collections.Counter({k: n for k, (_, n) in profile_calls(fn, CPU, warm=False).items()})


def test_tags_attribute_every_op_of_the_step():
    steps, rows = 3, 2
    gen = make_gen()
    gen._ensure_cache(rows=rows, length=64)
    st = DecodeState(rows, 64, V, CPU)
    st.logits.normal_()
    rc = RolloutConfig(temperature=1.0, return_logprobs=True, max_batch_size=rows)
    with torch.no_grad():
        case = pmt.Case(gen, st, rc, columns=48, graphed=False, max_steps=2 * steps + 1)
        per = per_step(pmt.profile_tagged(case.run(steps), CPU),
                       pmt.profile_tagged(case.run(2 * steps), CPU), steps)
        case.reset()
        one_step = ops_of(case.step)
        forced = (st.ctrl[DecodeState.FORCED].bool(), st.ctrl[DecodeState.FORCED_TOKEN])
        alone = {"logprobs": ops_of(lambda: _token_logprobs(st.logits, st.col, 1.0)),
                 "sampling": ops_of(lambda: sample(  # the forced tokens' replacement too
                     st.logits, temperature=1.0, generator=gen._rng, replace=forced))}
    calls, lines = collections.defaultdict(collections.Counter), collections.defaultdict(set)
    for (name, kind, where), (_, n) in per.items():
        calls[kind][name] += n
        lines[kind].add(where)
    # the per-step difference holds the ops of one step, each once per call, every one tagged
    assert sum(calls.values(), collections.Counter()) == one_step
    assert set(calls) <= set(pmt.MT_KINDS)
    assert "?" not in set().union(*lines.values())
    for kind, ref in alone.items():
        assert calls[kind] == ref, kind
    # per layer: one attention call, two cache writes (K and V); the mask is built in extend
    assert calls["attention"]["aten::scaled_dot_product_attention"] == CFG.num_layers
    assert calls["kv_write"]["aten::index_put_"] == 2 * CFG.num_layers
    assert all("multi_turn_step.py" in w and " extend: " in w for w in lines["mask"])
    assert calls["mask"] and calls["gemm"] and calls["rope"] and calls["norm"]


def test_graphed_names_take_the_eager_kinds():
    eager = {("k1", "mask", "a"): (3.0, 1), ("k1", "rope", "b"): (1.0, 1),
             ("k2", "gemm", "c"): (5.0, 2), ("k3", "other", "d"): (0.0, 2),
             ("k3", "elementwise", "e"): (0.0, 1)}
    graphed = {"k1": (8.0, 2), "k2": (4.0, 2), "k3": (3.0, 3), "ampere_sgemm_128x64": (2.0, 1)}
    got = pmt.by_eager_names(graphed, eager)
    assert got == {("k1", "mask", "a"): (6.0, 1.5), ("k1", "rope", "b"): (2.0, 0.5),
                   ("k2", "gemm", "c"): (4.0, 2.0),
                   ("k3", "other", "d"): (2.0, 2.0), ("k3", "elementwise", "e"): (1.0, 1.0),
                   ("ampere_sgemm_128x64", "gemm", "? (not in the eager step)"): (2.0, 1)}


def test_run_writes_both_modes_and_the_pieces(tmp_path):
    out = tmp_path / "mt.json"
    args = argparse.Namespace(batches=[2], columns=[40, 64], steps=3, reps=2, temperature=1.0,
                              out=str(out))
    report = {}
    gen = make_gen()
    weight_bytes = sum(t.numel() * t.element_size() for t in decoder.weight_tensors(gen.w))
    pmt.run(args, report, cfg=CFG, gen=gen, weight_bytes=weight_bytes, device=CPU)
    saved = json.loads(out.read_text())
    cases = {(c["columns"], c["mode"]): c for c in saved["multi_turn"]}
    assert set(cases) == {(40, "eager"), (40, "graphed"), (64, "eager"), (64, "graphed")}
    for (L, mode), c in cases.items():
        assert "error" not in c, c.get("error")
        assert math.isclose(sum(c["us_per_step_by_kind"].values()), c["us_per_step"],
                            rel_tol=1e-9)
        assert c["wall_us_per_step"] > 0 and c["wall_us_per_step_host_io"] > 0
        hd = CFG.hidden_size // CFG.num_attention_heads
        assert c["kv_bytes"] == 2 * CFG.num_layers * 2 * CFG.num_query_groups * hd * L * 4
        assert math.isclose(c["floor_us_per_step"], (weight_bytes + c["kv_bytes"]) / 4.3e12 * 1e6)
    for L in (40, 64):  # the graph replays the eager step's ops
        assert math.isclose(cases[(L, "graphed")]["kernels_per_step"],
                            cases[(L, "eager")]["kernels_per_step"], rel_tol=1e-9)
    (pieces40, pieces64) = saved["multi_turn_pieces"]
    for p in (pieces40["pieces"], pieces64["pieces"]):
        for k in ("sample", "token_logprobs", "sample_rows", "extend_s1", "lm_head",
                  "logits_copy"):
            assert p[k] > 0, k
        for form in ("step_bias", "bool", "none"):
            assert p[f"sdpa/{form}"] > 0
            assert isinstance(p["sdpa_one_layer_forced"][f"{form}/math"], float)
        assert "graphed" not in p  # CPU: no graphs


@pytest.mark.slow
def test_cli_smoke(tmp_path):
    """The documented CPU smoke: profile_decode.py --multi-turn end to end (model load, cases)."""
    out = tmp_path / "mt.json"
    subprocess.run([sys.executable, "benchmarks/profile_decode.py", "--multi-turn", "--models",
                    "hybridflow/conf/model/tiny.yaml", "--device", "cpu", "--batches", "2",
                    "--columns", "64", "--steps", "4", "--reps", "2", "--out", str(out)],
                   check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                   capture_output=True)
    report = json.loads(out.read_text())
    assert [(c["mode"], c["batch"], c["columns"]) for c in report["multi_turn"]] == [
        ("eager", 2, 64), ("graphed", 2, 64)]
    assert report["columns"] == [64] and "hybridflow" in report["versions"]
    assert report["multi_turn_pieces"][0]["pieces"]["extend_s1"] > 0


def _reads_a_scalar():
    return (torch.ones(3) * 2).sum().item()


def test_python_frames_names_the_line_that_read_a_scalar():
    """profile_decode.python_frames: a host op's Python lines (the Python calls enclosing it, or
    its nearest enclosing op's stack), torch's frames left out, so a timeline can say which line
    synchronised the device."""
    from torch.profiler import ProfilerActivity, profile

    from profile_decode import python_frames

    from hybridflow.profiling import launch_chain

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        _reads_a_scalar()
    read = next(e for e in prof.events() if e.name == "aten::_local_scalar_dense")
    lines = python_frames(read)
    assert "test_profile_multi_turn.py" in lines and "_reads_a_scalar" in lines
    assert "torch/" not in lines
    # the op chain stays ops only (the Python calls' events hold addresses, one key per object)
    assert launch_chain(read) == "aten::_local_scalar_dense < aten::item"
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # no stacks recorded: empty
        _reads_a_scalar()
    assert python_frames(next(e for e in prof.events() if e.name == "aten::item")) == ""
