"""bench_vs_trl.py's gsm8k entry from runs of one session (`--gsm8k-ours` metrics.jsonl of our
trainer, `--gsm8k-trl` trl_gsm8k.py's JSON): medians over our steps 2.. and TRL's steps after the
first of each process, refused when the two are not the same workload or a side timed < 3 steps."""
import json
import os
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # one benchmarks/bench_vs_trl.py process per test

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)
OVERRIDES = "trainer.total_steps=6 trainer.val_every=0"


def _inputs(tmp_path, *, trl_steps, lr=None):
    from hybridflow.config import load_config

    cfg = load_config(["experiment=gsm8k_qwen_coder_0_5b", *OVERRIDES.split()])
    metrics = tmp_path / "metrics.jsonl"
    steps = [9.0, 7.2, 7.0, 7.4, 6.9, 7.1]  # step 1 captures graphs: left out
    metrics.write_text("".join(json.dumps({"step": i, "timing_s/step": s, "timing_s/gen": s / 2,
                                           "perf/max_memory_allocated_gb": 50.0 + i,
                                           "response_length/mean": 300.0}) + "\n"
                               for i, s in enumerate(steps, start=1)))
    trl = tmp_path / "trl.json"
    config = {"prompts_per_step": cfg.data.prompts_per_step, "samples": cfg.rollout.n,
              "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
              "lr": cfg.actor_optim.lr if lr is None else lr,
              "weight_decay": cfg.actor_optim.weight_decay, "beta": cfg.algo.kl_loss_coef}
    # two processes (a resumed call): steps 1 and 3 are their warm-ups
    trl.write_text(json.dumps({"config": config, "step_s": trl_steps, "first_steps": [1, 3],
                               "peak_memory_gb": 31.0, "command": "trl_gsm8k.py ...", "calls": 2}))
    return metrics, trl, steps


def _run(tmp_path, metrics, trl):
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_vs_trl.py", "--workloads", "", "--device", "cpu",
                           "--gsm8k-ours", str(metrics), "--gsm8k-trl", str(trl),
                           "--gsm8k-ours-overrides", OVERRIDES, "--out", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)
    return proc, out


def test_entry_from_same_session_runs(tmp_path):
    trl_steps = [160.0, 90.0, 150.0, 88.0, 95.0]
    metrics, trl, steps = _inputs(tmp_path, trl_steps=trl_steps)
    proc, out = _run(tmp_path, metrics, trl)
    assert proc.returncode == 0, proc.stderr[-2000:]
    g = json.loads(out.read_text())["workloads"]["gsm8k"]
    assert g["ours_step_s"] == statistics.median(steps[1:])
    assert g["trl_step_s"] == statistics.median([90.0, 88.0, 95.0]) and g["trl_first_steps"] == [1, 3]
    assert g["ratio"] == g["trl_step_s"] / g["ours_step_s"]
    assert g["ours_peak_memory_gb"] == 56.0 and g["config"]["ours"]["overrides"] == OVERRIDES.split()
    assert "copied" not in g["note"]


@pytest.mark.parametrize("lr,trl_steps,match", [
    (1e-3, [160.0, 90.0, 150.0, 88.0, 95.0], "not the same workload: TRL lr=0.001 vs ours actor_optim.lr"),
    (None, [160.0, 90.0, 150.0, 88.0], "2 of TRL"),
])
def test_refused(tmp_path, lr, trl_steps, match):
    metrics, trl, _ = _inputs(tmp_path, trl_steps=trl_steps, lr=lr)
    proc, out = _run(tmp_path, metrics, trl)
    assert proc.returncode != 0 and match in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_append_keeps_the_earlier_record(tmp_path):
    """--append adds the gsm8k entry beside the workloads already measured and keeps their machine,
    versions, note and command (the assembling call runs on CPU: its own machine is not theirs)."""
    metrics, trl, _ = _inputs(tmp_path, trl_steps=[160.0, 90.0, 150.0, 88.0, 95.0])
    out = tmp_path / "v.json"
    earlier = {"benchmark": "b", "command": "python benchmarks/bench_vs_trl.py --workloads w1_0_5b",
               "peak_tflops": 790.0, "machine": {"gpu": "NVIDIA H200"}, "versions": {"trl": "1.16.0"},
               "note": "measured in one call",
               "workloads": {"w1_0_5b": {"ours_step_s": 0.6, "trl_step_s": 7.2, "ratio": 12.0}}}
    out.write_text(json.dumps(earlier))
    proc = subprocess.run([sys.executable, "benchmarks/bench_vs_trl.py", "--workloads", "", "--device", "cpu",
                           "--append", "--gsm8k-ours", str(metrics), "--gsm8k-trl", str(trl),
                           "--gsm8k-ours-overrides", OVERRIDES, "--out", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert {k: r[k] for k in ("machine", "versions", "note")} == {k: earlier[k] for k in ("machine", "versions", "note")}
    assert r["earlier_commands"] == [earlier["command"]] and "--append" in r["command"]
    assert r["workloads"]["w1_0_5b"] == earlier["workloads"]["w1_0_5b"]
    assert "--gsm8k-ours" in r["workloads"]["gsm8k"]["config"]["assembled_by"]
