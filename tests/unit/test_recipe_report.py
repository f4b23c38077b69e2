"""benchmarks/recipe_report.py on synthetic runs: the recipe's val curve against GRPO's at the common
steps, time to each validation, dynamic sampling grouped by (rounds, batches) with generation's
overhead over a like-for-like GRPO probe, and --keep of earlier notes."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import recipe_report  # noqa: E402

CORE = recipe_report.CORE
DS = recipe_report.DS


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _recipe():
    rows = [{"step": 0, CORE: 0.20}]
    kinds = [(1, 2, 5.0), (1, 3, 7.0), (2, 3, 9.0), (1, 2, 5.0)]  # rounds, batches, gen s
    for s in range(1, 9):
        rounds, batches, gen = kinds[s % 4]
        rows.append({"step": s, "timing_s/step": gen + 3.0, "timing_s/gen": gen,
                     "timing_s/update_actor": 2.0, DS + "rounds": rounds, DS + "batches": batches,
                     DS + "kept_fraction": 0.5, DS + "cap_hit": 0.0,
                     "perf/max_memory_allocated_gb": 50.0,
                     "training/rollout_probs_diff_mean": 0.003})
    rows[4][CORE] = 0.26
    rows[8][CORE] = 0.30
    rows.append({"step": 9, CORE: 0.5})  # a validation GRPO does not have at step 9
    return rows


def _grpo(step_s):
    rows = [{"step": 0, CORE: 0.20}]
    for s in range(1, 9):
        rows.append({"step": s, "timing_s/step": step_s, "timing_s/gen": step_s / 2,
                     "perf/max_memory_allocated_gb": 60.0})
    rows[4][CORE] = 0.25
    rows[8][CORE] = 0.32
    return rows


def test_compare_reads_curves_time_and_dynamic_sampling():
    out = recipe_report.compare(_recipe(), _grpo(7.0), _grpo(6.0))
    got = [[s, round(a, 4), round(g, 4), round(d, 4)] for s, a, g, d in out["val_vs_grpo_same_steps"]]
    assert got == [[0, 0.2, 0.2, 0.0], [4, 0.26, 0.25, 1.0], [8, 0.3, 0.32, -2.0]]
    assert out["mean_diff_points_after_step0"] == pytest.approx(-0.5)
    assert out["val_steps_without_grpo_counterpart"] == [9]
    # steps 1..4: kinds 1,2,3,0 -> gen 7, 9, 5, 5 + 3 each
    assert out["train_seconds_to_step"]["4"] == pytest.approx([38.0, 28.0])
    ds = out["dynamic_sampling"]
    # timed steps 2..8: kinds (2,3,0,1,2,3,0) -> (1,2) x4, (1,3) x1, (2,3) x2
    assert ds["gen_s_by_kind"] == {"rounds=1 batches=2": {"steps": 4, "gen_s_median": 5.0},
                                   "rounds=1 batches=3": {"steps": 1, "gen_s_median": 7.0},
                                   "rounds=2 batches=3": {"steps": 2, "gen_s_median": 9.0}}
    assert ds["steps_timed"] == 7 and ds["rounds_max"] == 2
    assert ds["prompts_generated_per_prompt_trained"] == pytest.approx(17 / 7)
    # the probe (6 s step, 3 s gen) is the like-for-like GRPO reference, not the baseline run's 7 s
    assert out["grpo_timing_source"].startswith("probe")
    assert ds["gen_s_median"] == 5.0
    assert ds["grpo_gen_s_median"] == 3.0 and ds["gen_overhead_x"] == pytest.approx(5.0 / 3.0)
    assert out["step_overhead_x"] == pytest.approx(8.0 / 6.0)
    assert out["grpo_baseline_run_step_s"] == 7.0
    assert out["peak_memory_gb"] == 50.0 and out["grpo_peak_memory_gb"] == 60.0


def test_main_writes_json_and_keeps_earlier_notes(tmp_path, monkeypatch, capsys):
    m = _write(tmp_path / "r.jsonl", _recipe())
    b = _write(tmp_path / "g.jsonl", _grpo(7.0))
    out = tmp_path / "o.json"
    out.write_text(json.dumps({"earlier_runs": ["the broken one"]}))
    argv = ["recipe_report.py", "--recipe", "dapo", "--metrics", m, "--baseline", b, "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv + ["--keep", "earlier_runs"])
    recipe_report.main()
    got = json.loads(out.read_text())
    assert got["earlier_runs"] == ["the broken one"] and got["recipe"] == "dapo"
    assert got["grpo_timing_source"] == "baseline run" and "grpo_baseline_run_step_s" not in got
    monkeypatch.setattr(sys, "argv", argv + ["--keep", "nope"])
    with pytest.raises(SystemExit, match="no key"):
        recipe_report.main()
