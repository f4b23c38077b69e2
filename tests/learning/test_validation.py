"""Validation during training, end to end on CPU (tiny model, the demo's arithmetic task).

A short supervised warm-up gives the tiny model a non-zero greedy accuracy; then validation runs
before training and every 2 steps. Checked: the metric names (verl's), the steps they appear at,
that the reported accuracy is the mean of the per-prompt scores written to val_generations.jsonl
(every val row is logged here) and to val_scores.jsonl, the strict extra rule beside the training
rule, and that the same validation at DP=2 (each replica scores half of the prompts) reports exactly
what DP=1 reports, problem by problem;
`trainer.val_only` on the run's checkpoint reproduces its last validation.
"""

import json
import os
import subprocess
import sys

import pytest

from hybridflow.data.synthetic import make_task
from tests.dist.launcher import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_VAL = 12


def _run(args, *, world_size=1):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "hybridflow.train", "experiment=demo", *args]
    if world_size > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
               "--master_port", str(free_port()), "-m", "hybridflow.train", "experiment=demo", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("val") / "val.jsonl"
    with open(path, "w") as f:  # held-out problems of the same task (another seed)
        for rec in make_task("arith", size=NUM_VAL, seed=12345):
            f.write(json.dumps(rec) + "\n")
    return path


def _args(out, val_file):
    return ["data.synthetic=arith", f"data.val_files={val_file}", "algo=grpo", "rollout.n=2",
            "data.prompts_per_step=8", "algo.ppo_mini_batch_size=16",
            "algo.micro_batch_size_per_gpu=8", "trainer.sft_warmup_steps=30",
            "trainer.total_steps=4", "trainer.val_every=2", "trainer.val_before_train=true",
            f"trainer.val_log_generations={NUM_VAL}", "reward.fn=math_exact",
            "reward.val_fns=[math_with_format]", "trainer.save_final=true", "trainer.tensorboard=false",
            "trainer.progress_bar=false", f"trainer.output_dir={out}"]


def _val_rows(out):
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return {r["step"]: r for r in rows if any(k.startswith("val-core/") for k in r)}


def test_validation_metrics_generations_and_dp2(tmp_path, val_file):
    out1 = tmp_path / "dp1"
    proc = _run(_args(out1, val_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    val = _val_rows(out1)
    assert sorted(val) == [0, 2, 4]
    key = "val-core/synthetic_arith/reward/mean@1"
    for step, row in val.items():
        assert 0.0 <= row[key] <= 1.0
        assert "val-aux/synthetic_arith/math_with_format/mean@1" in row
        assert row["val-aux/response_length/mean"] > 0 and "timing_s/val" in row
    # the metric is the mean of the logged per-prompt scores (all NUM_VAL prompts are logged)
    gens = [json.loads(line) for line in open(out1 / "val_generations.jsonl")]
    for step in (0, 2, 4):
        mine = [g for g in gens if g["step"] == step]
        assert len(mine) == NUM_VAL and len({g["index"] for g in mine}) == NUM_VAL
        mean = sum(g["score/reward"] for g in mine) / NUM_VAL
        assert val[step][key] == pytest.approx(mean)
    assert val[0][key] > 0  # the warm-up taught something: a real accuracy was measured
    # every prompt's score, in index order, one line per validation: the metrics are their means
    scores = [json.loads(line) for line in open(out1 / "val_scores.jsonl")]
    assert [r["step"] for r in scores] == [0, 2, 4]
    for r in scores:
        assert r["index"] == sorted(g["index"] for g in gens if g["step"] == r["step"])
        assert set(r["scores"]) == {"reward", "math_with_format"}
        assert sum(r["scores"]["reward"]) / NUM_VAL == pytest.approx(val[r["step"]][key])

    # trainer.val_only on the finished run's checkpoint scores its weights exactly as the step-4
    # validation did, trains nothing and saves nothing
    ckpts = sorted(os.listdir(out1 / "checkpoints"))
    proc = _run([*_args(out1, val_file), "trainer.val_only=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(open(out1 / "metrics.jsonl").readlines()[-1])
    assert last["step"] == 4 and last[key] == val[4][key] and "timing_s/update_actor" not in last
    assert sorted(os.listdir(out1 / "checkpoints")) == ckpts

    out2 = tmp_path / "dp2"  # the warm-up and the step-0 validation (what is compared), one step
    proc = _run([*_args(out2, val_file), "trainer.total_steps=1", "trainer.val_every=0",
                 "trainer.save_final=false"], world_size=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    val2 = _val_rows(out2)
    assert val2[0][key] == pytest.approx(val[0][key])
    # each replica scored half of the prompts; gathered, the step-0 line is DP=1's, problem by problem
    assert json.loads(open(out2 / "val_scores.jsonl").readline()) == scores[0]
    assert val2[0]["val-aux/synthetic_arith/math_with_format/mean@1"] == pytest.approx(val[0]["val-aux/synthetic_arith/math_with_format/mean@1"])
