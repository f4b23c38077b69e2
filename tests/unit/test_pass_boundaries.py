"""benchmarks/pass_boundaries.py on a synthetic run: the steps on each side of a multiple of a
pass's token budget, their median seconds per 200k tokens, validation steps and step 1 left out."""

import json

from benchmarks.pass_boundaries import main


def test_boundaries_split_steps_around_each_budget_multiple(tmp_path):
    rows = [{"step": 1, "perf/total_num_tokens": 200_000, "timing_s/ref": 9.0,
             "timing_s/update_actor": 9.0}]
    for i, tokens in enumerate([200_000, 202_000, 206_000, 208_000, 210_000]):
        above = tokens >= 204_800
        rows.append({"step": i + 2, "perf/total_num_tokens": tokens,
                     "timing_s/ref": (0.5 if above else 0.4) * tokens / 200_000,
                     "timing_s/update_actor": 1.4 * tokens / 200_000})
    rows.append({"step": 7, "perf/total_num_tokens": 206_000, "timing_s/ref": 5.0,
                 "timing_s/update_actor": 5.0, "timing_s/val": 3.0})  # a validation step
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = main(["--runs", str(run), "--out", str(tmp_path / "b.json")])
    r = out["runs"][str(run)]
    assert r["steps"] == 5
    ref = r["ref"]["204800"]
    assert ref["below"] == {"steps": 2, "s_per_200k": 0.4}
    assert ref["above"] == {"steps": 3, "s_per_200k": 0.5} and ref["above_over_below"] == 1.25
    assert r["update_actor"]["204800"]["above_over_below"] == 1.0
    assert json.loads((tmp_path / "b.json").read_text())["budgets"] == {
        "ref": 40960, "update_actor": 20480}
