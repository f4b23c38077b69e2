"""benchmarks/gsm8k_report.py on a synthetic run: the rise of val accuracy read three ways (best,
mean of the last validations, first step at +10 points), the step-time ratio to TRL, and the
Markdown table of the val curve with the training curves between validations and the stages."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gsm8k_report  # noqa: E402

CORE, STRICT = gsm8k_report.CORE, gsm8k_report.STRICT


def _run(tmp_path):
    rows = [{"step": 0, CORE: 0.20, STRICT: 0.0}]
    for s in range(1, 11):
        rows.append({"step": s, "timing_s/step": 8.0 + s % 2, "timing_s/gen": 4.0,
                     "timing_s/update_actor": 3.0, "critic/score/mean": 0.1 * s,
                     "response_length/mean": 300.0 + s, "actor/entropy": 0.5 - 0.01 * s,
                     "perf/max_memory_allocated_gb": 60.0 + s})
    rows[5].update({CORE: 0.28, STRICT: 0.0})
    rows[10].update({CORE: 0.31, STRICT: 0.02})
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "hf.json").write_text(json.dumps({"accuracy": {"math_exact": 0.19}, "n": 319,
                                                  "machine": {"gpu": "cpu"}, "versions": {}}))
    trl = {"step_s": [140.0, 90.0, 96.0], "step_s_median": 93.0, "val_accuracy": [],
           "config": {}, "command": "trl", "versions": {}}
    (tmp_path / "trl.json").write_text(json.dumps(trl))


def test_report_reads_the_rise_three_ways_and_writes_the_table(tmp_path, monkeypatch):
    _run(tmp_path)
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    monkeypatch.setattr(sys, "argv", ["gsm8k_report.py", "--metrics", str(tmp_path / "m.jsonl"),
                                      "--hf-eval", str(tmp_path / "hf.json"), "--trl",
                                      str(tmp_path / "trl.json"), "--out", str(out),
                                      "--table", str(md)])
    gsm8k_report.main()
    s = json.loads(out.read_text())
    v = s["val_summary"]
    assert v["step0"] == 0.20 and v["best"] == [10, 0.31]
    assert v["mean_last_2"] == pytest.approx(0.295)  # the validations after step 0
    assert v["rise_best_points"] == pytest.approx(11.0)
    assert v["rise_mean_last_2_points"] == pytest.approx(9.5)
    assert v["first_step_plus_10_points"] == 10
    assert s["ours_step_s"] == 8.0  # steps 2..10 (step 1 left out): five of 8 s, four of 9 s
    assert s["ours_vs_trl_step_ratio"] == pytest.approx(93.0 / 8.0)
    rows = md.read_text().splitlines()
    assert rows[2].startswith("| 0 | 20.0 | 0.0 |")
    # step 5: the training columns average steps 1..5 (reward 0.1..0.5, lengths 301..305)
    assert rows[3] == "| 5 | 28.0 | 0.0 | 0.300 | 303 | 0.470 |"
    assert rows[4] == "| 10 | 31.0 | 2.0 | 0.800 | 308 | 0.420 |"
    assert "| gen | 4.000 |" in rows and "| update_actor | 3.000 |" in rows
