"""benchmarks/gsm8k_variants.py: the per-variant summary of a GSM8K run's metrics and its
problem-by-problem comparison against the base run."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gsm8k_variants  # noqa: E402


def _write(d, rows, scores):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(d, "val_scores.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "index": list(range(len(v))), "scores": {"reward": v}}) + "\n"
                     for s, v in scores)


def _step(s, t, **kw):
    return {"step": s, "timing_s/step": t, "timing_s/gen": t / 2, **kw}


def test_summary_leaves_out_first_and_resumed_steps_and_pairs_problems(tmp_path):
    key = "val-core/gsm8k/reward/mean@1"
    base = [{"step": 0, key: 0.5}, _step(1, 30.0), _step(2, 4.0), _step(3, 6.0),
            _step(4, 5.0, **{"perf/max_memory_allocated_gb": 40.0}), {"step": 4, key: 0.75}]
    # the variant resumed after step 2: step 3 is its first step in a new process (compile, capture)
    var = [{"step": 0, key: 0.5}, _step(1, 30.0), _step(2, 8.0, **{"rollout_corr/kl": 0.01}),
           _step(3, 40.0, **{"rollout_corr/kl": 0.03}), _step(4, 10.0, **{"rollout_corr/kl": 0.02}),
           {"step": 4, key: 0.25}]
    # the restart shows as a step logged again: 3 was logged, the run stopped, 3 logged anew
    var.insert(4, _step(3, 9.0))
    _write(tmp_path / "base", base, [(0, [1, 0, 1, 0]), (4, [1, 1, 1, 0])])
    _write(tmp_path / "fp8", var, [(0, [1, 0, 1, 0]), (4, [0, 0, 1, 0])])
    out = gsm8k_variants.main(["--runs", str(tmp_path), "--out", str(tmp_path / "o.json")])
    b, v = out["variants"]["base"], out["variants"]["fp8"]
    assert b["steps"] == 4 and b["step_s"] == 5.0 and b["steps_timed"] == 3  # median of 4, 6, 5
    assert b["stages_s"]["gen"] == 2.5 and b["peak_gb"] == 40.0
    assert b["val_accuracy"] == [(0, 0.5), (4, 0.75)]
    assert v["steps_timed"] == 2 and v["step_s"] == 9.0  # steps 2 and 4; the re-logged 3 is out
    assert v["mismatch_median"]["rollout_corr/kl"] == 0.015
    pair = {p["step"]: p for p in v["vs_base_problem_by_problem"]}
    assert pair[4]["only_a"] == 0 and pair[4]["only_b"] == 2 and pair[4]["accuracy_b"] == 0.75
    assert "vs_base_problem_by_problem" not in b
    assert json.load(open(tmp_path / "o.json"))["variants"]["fp8"]["steps"] == 4


def test_tools_report_splits_the_step_and_compares_at_common_steps(tmp_path):
    import gsm8k_tools_report

    key = "val-core/gsm8k/reward/mean@1"
    tool = lambda s, t, calls: _step(s, t, **{  # noqa: E731
        "timing_s/multi_turn_decode": t * 0.5, "timing_s/tool_prefill": t * 0.25,
        "timing_s/tool_wait": 0.1, "tool_calls/mean": calls, "num_turns/mean": 1 + calls})
    tools = [{"step": 0, key: 0.25}, tool(1, 60.0, 0.5), tool(2, 12.0, 0.25), tool(3, 8.0, 0.75),
             {"step": 3, key: 0.75}]
    single = [{"step": 0, key: 0.5}, _step(1, 20.0), _step(2, 4.0), _step(3, 4.0), {"step": 3, key: 0.5},
              _step(4, 4.0), {"step": 4, key: 0.5}]
    _write(tmp_path / "tools", tools, [(0, [1, 0, 0, 0]), (3, [1, 1, 1, 0])])
    _write(tmp_path / "single", single, [(0, [1, 1, 0, 0]), (3, [1, 0, 1, 0]), (4, [1, 0, 1, 0])])
    out = gsm8k_tools_report.main(["--tools", str(tmp_path / "tools"), "--single-turn",
                                   str(tmp_path / "single"), "--out", str(tmp_path / "o.json")])
    assert out["step_s"] == 10.0 and out["single_turn_step_s"] == 4.0 and out["step_ratio"] == 2.5
    assert out["step_split_median_s"]["decode"] == 5.0  # median over steps 2 and 3 of t / 2
    assert out["step_split_median_s"]["tool_prefill"] == 2.5
    assert out["tool_calls_per_trajectory"] == [[1, 0.5], [2, 0.25], [3, 0.75]]
    assert out["single_turn_val_accuracy"] == [[0, 0.5], [3, 0.5]]  # the tool run's steps only
    assert out["goal"] == {"last_common_step": 3, "val_above_single_turn": True,
                           "step_ratio_at_most": 1.5, "step_ratio_met": False, "steps_wanted": 60,
                           "steps_met": False}
    pair = {p["step"]: p for p in out["vs_single_turn_problem_by_problem"]}
    assert pair[3]["only_a"] == 1 and pair[3]["only_b"] == 0


def test_speed_file_medians_mfu_and_peers(tmp_path):
    """benchmarks/gsm8k_speed.py: medians of steps 2.. of a step run, each pass's MFU from its
    steps' own tokens (FLOPs over seconds, median over steps), TRL and the cost model beside."""
    import gsm8k_speed

    rows = [dict(_step(s, t, **{"timing_s/update_actor": u, "timing_s/ref": u / 3,
                                "perf/total_num_tokens": 512 * 400, "response_length/mean": 300.0,
                                "perf/max_memory_allocated_gb": 40.0 + s}))
            for s, t, u in ((1, 60.0, 9.0), (2, 4.0, 1.5), (3, 5.0, 1.5), (4, 4.5, 1.5))]
    _write(tmp_path / "step", rows, [])
    json.dump({"workloads": {"gsm8k": {"trl_step_s": 90.0}}}, open(tmp_path / "trl.json", "w"))
    json.dump({"step_seconds": 4.95}, open(tmp_path / "cost.json", "w"))
    out = gsm8k_speed.main(["--step", str(tmp_path / "step" / "metrics.jsonl"),
                            "--trl", str(tmp_path / "trl.json"), "--cost", str(tmp_path / "cost.json"),
                            "--out", str(tmp_path / "o.json")])
    assert out["ours_step_s"] == 4.5 and out["steps_timed"] == 3 and out["peak_memory_gb"] == 44.0
    assert out["stages"]["update_actor"] == 1.5 and "note" in out  # fewer than 20 steps
    assert out["speedup_vs_trl"] == 20.0 and abs(out["cost_model_error"] - 0.1) < 1e-9
    # the same tokens each step: the ref pass is a third of the update's FLOPs in a third of its
    # time, so both run at the same MFU, a plausible one for 0.5B at ~200k tokens in 1.5 s
    assert abs(out["mfu"]["update"] - out["mfu"]["ref"]) < 1e-9 and 0.2 < out["mfu"]["update"] < 0.6
    assert "gpu_clocks" not in out  # none recorded beside the run
    # the card's clocks recorded beside the run: their summary goes into the file
    (tmp_path / "step" / "gpu_clocks.csv").write_text(
        "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active\n"
        "t0, 1980, 2619, 500.0, 60, 0x0000000000000000\nt1, 1700, 2619, 700.0, 70, 0x0000000000000004\n")
    out = gsm8k_speed.main(["--step", str(tmp_path / "step" / "metrics.jsonl"),
                            "--out", str(tmp_path / "o.json")])
    assert out["gpu_clocks"]["samples"] == 2 and out["gpu_clocks"]["sm_mhz_min"] == 1700
    assert out["gpu_clocks"]["reasons_busy_share"] == {"sw_power_cap": 0.5}
    assert "gpu_monitor" not in out  # the trainer logged no perf/gpu_* metrics
    for r in rows:
        r["perf/gpu_sm_mhz/update_actor"] = 1700.0 + r["step"]
    _write(tmp_path / "step", rows, [])
    out = gsm8k_speed.main(["--step", str(tmp_path / "step" / "metrics.jsonl"),
                            "--out", str(tmp_path / "o.json")])
    assert out["gpu_monitor"] == {"sm_mhz/update_actor": 1703.0}  # median of steps 2-4
    # --step names any metrics file: the record comes from that file, not a metrics.jsonl beside it
    os.makedirs(tmp_path / "other")
    with open(tmp_path / "other" / "dapo_metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = gsm8k_speed.main(["--step", str(tmp_path / "other" / "dapo_metrics.jsonl"),
                            "--out", str(tmp_path / "o.json")])
    assert out["gpu_monitor"] == {"sm_mhz/update_actor": 1703.0}


def test_speed_file_names_its_machine_status_and_dapo_error(tmp_path):
    """gsm8k_speed.py --machine-from / --status / --dapo-step + --dapo-cost: the file carries the
    GPU report's machine and versions, the status line, and the DAPO prediction's error."""
    import gsm8k_speed

    rows = [dict(_step(s, t, **{"timing_s/update_actor": 1.5, "timing_s/ref": 0.5,
                                "perf/total_num_tokens": 512 * 400, "response_length/mean": 300.0}))
            for s, t in ((1, 30.0), (2, 3.5), (3, 3.6))]
    _write(tmp_path / "step", rows, [])
    dapo = [dict(_step(s, t)) for s, t in ((1, 20.0), (2, 5.0), (3, 5.2))]
    _write(tmp_path / "dapo", dapo, [])
    json.dump({"step_seconds": 4.6}, open(tmp_path / "dapo_cost.json", "w"))
    report = {"machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 1},
              "versions": {"torch": "2.11.0+cu130"}, "ours_step_s": 5.1}
    json.dump(report, open(tmp_path / "report.json", "w"))
    out = gsm8k_speed.main(["--step", str(tmp_path / "step" / "metrics.jsonl"),
                            "--dapo-step", str(tmp_path / "dapo" / "metrics.jsonl"),
                            "--dapo-cost", str(tmp_path / "dapo_cost.json"),
                            "--machine-from", str(tmp_path / "report.json"),
                            "--status", "incomplete: one H100", "--out", str(tmp_path / "o.json")])
    assert out["machine"] == report["machine"] and out["versions"] == report["versions"]
    assert out["ours_step_s"] == 3.55  # the step run's median, not the report's own step
    assert out["status"] == "incomplete: one H100"
    assert out["dapo"]["step_s"] == 5.1
    assert abs(out["dapo"]["cost_model_error"] - (4.6 / 5.1 - 1)) < 1e-12
    assert json.load(open(tmp_path / "o.json"))["status"] == "incomplete: one H100"
    # the DAPO step as `gsm8k_h200.sh step` reported it, and where its prediction came from
    json.dump({"ours_step_s": 4.3, "ours_steps_timed": 9}, open(tmp_path / "dapo_step.json", "w"))
    json.dump({"step_seconds": 4.73, "source": "after the run"},
              open(tmp_path / "dapo_cost.json", "w"))
    out = gsm8k_speed.main(["--step", str(tmp_path / "step" / "metrics.jsonl"),
                            "--dapo-step", str(tmp_path / "dapo_step.json"),
                            "--dapo-cost", str(tmp_path / "dapo_cost.json"),
                            "--out", str(tmp_path / "o.json")])
    assert out["dapo"]["step_s"] == 4.3 and out["dapo"]["steps_timed"] == 9
    assert out["dapo"]["cost_model_source"] == "after the run"
    assert abs(out["dapo"]["cost_model_error"] - 0.1) < 1e-12
    json.dump({"step_seconds": 4.73}, open(tmp_path / "not_a_step.json", "w"))
    with pytest.raises(SystemExit, match="no ours_step_s"):
        gsm8k_speed.main(["--step", str(tmp_path / "step" / "metrics.jsonl"),
                          "--dapo-step", str(tmp_path / "not_a_step.json"),
                          "--out", str(tmp_path / "o.json")])


def test_speed_file_takes_trl_gsm8k_json_against_a_same_machine_step(tmp_path):
    """gsm8k_speed.py --trl with trl_gsm8k.py's own JSON (its median of the steps after the first,
    every step and its batch kept) and --trl-ours-step: the speed-up against our step run on TRL's
    machine, not against --step's; a TRL run of one step is refused by name."""
    import gsm8k_speed

    def steps(name, times):
        _write(tmp_path / name, [dict(_step(s, t, **{"timing_s/update_actor": 1.5, "timing_s/ref": 0.5,
                                                     "perf/total_num_tokens": 512 * 400,
                                                     "response_length/mean": 300.0}))
                                 for s, t in enumerate(times, 1)], [])
        return str(tmp_path / name / "metrics.jsonl")

    trl = {"benchmark": "trl_gsm8k", "step_s": [160.0, 111.0, 108.0], "step_s_median": 109.5,
           "config": {"micro_batch": 64, "gradient_checkpointing": True, "lr": 1e-6}}
    json.dump(trl, open(tmp_path / "trl.json", "w"))
    out = gsm8k_speed.main(["--step", steps("run", [30.0, 3.5, 3.6]), "--trl", str(tmp_path / "trl.json"),
                            "--trl-ours-step", steps("beside", [20.0, 3.0, 3.1, 3.2]),
                            "--out", str(tmp_path / "o.json")])
    assert out["ours_step_s"] == 3.55 and out["trl_ours_step_s"] == 3.1
    assert out["trl_step_s"] == 109.5 and out["trl_step_s_all"] == trl["step_s"]
    assert out["speedup_vs_trl"] == 109.5 / 3.1
    assert out["trl_config"]["gradient_checkpointing"] is True and "lr" not in out["trl_config"]
    json.dump(dict(trl, step_s=[160.0], step_s_median=None), open(tmp_path / "one.json", "w"))
    with pytest.raises(SystemExit, match="one.json: no step_s_median"):
        gsm8k_speed.main(["--step", steps("run2", [30.0, 3.5]), "--trl", str(tmp_path / "one.json"),
                          "--out", str(tmp_path / "o2.json")])


def test_pass_speed_per_200k_tokens_is_apart_from_the_step_tokens(tmp_path):
    """Two steps of one pass speed but different sampled tokens: the same seconds per 200k tokens;
    stages without a step token count (or not run) are left out."""
    rows = [_step(1, 30.0), _step(2, 4.0, **{"timing_s/ref": 0.4, "timing_s/update_actor": 1.4,
                                             "perf/total_num_tokens": 200000.0}),
            _step(3, 4.4, **{"timing_s/ref": 0.44, "timing_s/update_actor": 1.54,
                             "perf/total_num_tokens": 220000.0})]
    _write(tmp_path / "base", rows, [])
    s = gsm8k_variants.main(["--runs", str(tmp_path), "--out", str(tmp_path / "o.json")])
    rates = s["variants"]["base"]["pass_s_per_200k_tokens"]
    assert rates == pytest.approx({"ref": 0.4, "update_actor": 1.4})


def test_summary_takes_the_monitors_clocks_per_stage(tmp_path):
    """The trainer's perf/gpu_* metrics: medians over the timed steps (the first left out), each
    stage's clock apart; a run without them has an empty record."""
    mon = lambda u, capped: {"perf/gpu_sm_mhz/update_actor": u, "perf/gpu_sm_mhz/gen": 1980.0,  # noqa: E731
                             "perf/gpu_power_capped": capped}
    rows = [_step(1, 30.0, **mon(1200.0, 0.0)), _step(2, 4.0, **mon(1700.0, 0.5)),
            _step(3, 4.0, **mon(1740.0, 0.7)), _step(4, 4.0, **mon(1720.0, 0.6))]
    _write(tmp_path / "base", rows, [])
    _write(tmp_path / "nomonitor", [_step(1, 30.0), _step(2, 4.0)], [])
    out = gsm8k_variants.main(["--runs", str(tmp_path), "--out", str(tmp_path / "o.json")])
    m = out["variants"]["base"]["gpu_monitor"]
    assert m == pytest.approx({"sm_mhz/update_actor": 1720.0, "sm_mhz/gen": 1980.0,
                               "power_capped": 0.6})
    assert out["variants"]["nomonitor"]["gpu_monitor"] == {}
