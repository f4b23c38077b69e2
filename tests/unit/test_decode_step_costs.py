"""benchmarks/decode_step_costs.py on synthetic runs: each step's plain schedule rebuilt from its
lengths (the tail from the first poll with at most max_rows rows live), and the per-step costs
that made the generation times recovered by the fit; step 1 and validation steps left out."""

import json

import numpy as np
import pytest

from benchmarks.decode_step_costs import fit, plain_schedule, step_rows

COST = {"plain": 1.2e-3, "row": 3e-6, "tail16x4": 1.9e-3, "tail32x4": 2.2e-3,
        "tail16x4_advance": 1.6e-3, "const": 0.05}


def _run(tmp_path, name, max_rows, seed, tag=""):
    rng = np.random.default_rng(seed)
    metrics, lengths = [], []
    for step in range(1, 9):
        lens = np.minimum(rng.lognormal(5.5, 0.5, 512).astype(int) + 1, 1024).tolist()
        plain, row_steps = plain_schedule(lens, max_rows)
        tail = int(rng.integers(100, 200))
        gen = (COST["plain"] * plain + COST["row"] * row_steps
               + COST[f"tail{max_rows}x4" + (f"_{tag}" if tag else "")] * tail + COST["const"])
        metrics.append({"step": step, "timing_s/gen": gen, "rollout/spec_steps": tail})
        lengths.append({"step": step, "response_lengths": lens})
    metrics.append({"step": 9, "timing_s/gen": 99.0, "timing_s/val": 5.0, "rollout/spec_steps": 1})
    lengths.append({"step": 9, "response_lengths": [10] * 512})
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "rollout_lengths.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lengths))
    return f"{d}:{max_rows}:4" + (f":{tag}" if tag else "")


def test_plain_schedule_stops_where_the_tail_takes_over():
    lens = [1024] * 10 + [100] * 502   # 10 rows run on: the tail from the poll that sees them
    plain16, rows16 = plain_schedule(lens, 16)
    assert plain16 % 16 == 1 and 100 < plain16 < 150
    # no tail (max_rows 0): plain decoding to the cap, compacted down to the 16-row bucket
    plain0, rows0 = plain_schedule(lens, 0)
    assert plain0 == 1024 and rows0 > rows16 + 16 * (1024 - plain16) - 1


def test_fit_recovers_the_step_costs(tmp_path):
    runs = [_run(tmp_path, "a", 16, 0), _run(tmp_path, "b", 16, 1), _run(tmp_path, "c", 32, 2)]
    rows = [r for run in runs for r in step_rows(run)]
    assert len(rows) == 21 and {r["step"] for r in rows} == set(range(2, 9))
    res = fit(rows)
    c = res["coef_ms"]
    assert c["plain_step"] == pytest.approx(1.2, abs=1e-6)
    assert c["per_1000_bucket_row_steps"] == pytest.approx(3.0, abs=1e-6)
    assert c["tail16x4_step"] == pytest.approx(1.9, abs=1e-6)
    assert c["tail32x4_step"] == pytest.approx(2.2, abs=1e-6)
    assert res["rms_ms"] < 1e-6 and res["per_variant"]["tail32x4"]["steps"] == 7


def test_a_tag_gives_the_same_tail_its_own_coefficient(tmp_path):
    runs = [_run(tmp_path, "a", 16, 0), _run(tmp_path, "b", 16, 1, tag="advance"),
            _run(tmp_path, "c", 16, 2, tag="advance")]
    rows = [r for run in runs for r in step_rows(run)]
    c = fit(rows)["coef_ms"]
    assert c["tail16x4_step"] == pytest.approx(1.9, abs=1e-6)
    assert c["tail16x4_advance_step"] == pytest.approx(1.6, abs=1e-6)
    with pytest.raises(SystemExit, match="DIR:ROWS:DRAFTS"):
        step_rows(runs[0] + ":x:y")
