"""The entry point end to end, as a user runs it (subprocesses, 1 rank, CPU).

- bad configs exit with code 2 and one line naming the problem (no traceback);
- a run from a Hugging Face checkpoint directory with a verl-format .jsonl dataset and a user reward
  function from a file: trains, checkpoints atomically, resumes where it stopped, and exports back to
  a Hugging Face directory that transformers loads;
- a probe run with a reward model writes probe.json, and trainer.profile_steps its step's profile.
"""

import gzip
import json
import os
import subprocess
import sys

import pytest

from tests.hf_models import make_checkpoint, write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, world_size=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    if world_size:
        env["WORLD_SIZE"] = str(world_size)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("overrides,expected", [
    (["parallel.foo=1"], "Key 'foo' not in 'ParallelConfig'"),
    (["parallel.tensor_parallel_size=3"], "world size 1 is not divisible by parallel.tensor_parallel_size=3"),
    (["model.num_attention_heads=3"], "model.num_query_groups=2 must divide model.num_attention_heads=3"),
    (["algo=nope"], "Could not find 'algo/nope'"),
    (["algo.adv_estimator=xyz"], "algo.adv_estimator='xyz' is not one of"),
    (["trainer.profile_steps=[0]"], "trainer.profile_steps=[0]: expected step numbers >= 1"),
])
def test_bad_config_is_one_line(overrides, expected):
    proc = _run("-m", "hybridflow.train", "experiment=demo", *overrides)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln
             and "warnings.warn" not in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hybridflow train: error:") and expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_tp_not_dividing_heads_names_the_keys():
    proc = _run("-m", "hybridflow.train", "experiment=demo", "parallel.tensor_parallel_size=4", world_size=4)
    assert proc.returncode == 2
    assert "parallel.tensor_parallel_size=4 must divide model.num_query_groups=2" in proc.stderr


@pytest.mark.slow  # three training runs and an export, in subprocesses
def test_hf_checkpoint_jsonl_train_resume_export(tmp_path):
    model_dir = make_checkpoint("qwen2", str(tmp_path / "hf"), seed=0)
    write_tokenizer(model_dir, 128)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"w{3 + i % 5} w{4 + i % 7}", "data_source": "toy",
                                "reward_model": {"ground_truth": "w9"},
                                "extra_info": {"i": i}}) + "\n")
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(prompt, response, ground_truth, extra_info):\n"
                      "    return float(ground_truth in response.split())\n")
    out = tmp_path / "run"
    common = ["-m", "hybridflow.train", "experiment=demo", f"model.hf_path={model_dir}", "data.synthetic=null",
              f"data.train_files={data}", f"reward.fn={reward}:score", "algo=grpo",
              "rollout.n=2", "rollout.max_new_tokens=4", "data.prompts_per_step=4",
              "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4",
              "trainer.sft_warmup_steps=0", "trainer.offload_ref=true",
              "trainer.progress_bar=false", f"trainer.output_dir={out}"]
    first = _run(*common, "trainer.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "2"
    second = _run(*common, "trainer.total_steps=3")  # resumes at step 2, runs one more
    assert second.returncode == 0, second.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    assert (out / "checkpoints" / "latest").read_text().strip() == "3"

    export = tmp_path / "export"
    proc = _run("-m", "hybridflow.export", str(out / "checkpoints"), str(export))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(export))
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, 128) and torch.isfinite(logits).all()


def _toy_run_args(tmp_path, model_dir, out):
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"w{3 + i} w{5 + i}", "data_source": "toy",
                                "reward_model": {"ground_truth": "w9"}}) + "\n")
    return ["-m", "hybridflow.train", "experiment=demo", f"model.hf_path={model_dir}", "data.synthetic=null",
            f"data.train_files={data}", "algo=grpo", "rollout.n=2", "rollout.max_new_tokens=4",
            "data.prompts_per_step=4", "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4",
            "trainer.sft_warmup_steps=0", "trainer.progress_bar=false", "trainer.save_final=false",
            f"trainer.output_dir={out}"]


def test_reward_model_scores_and_probe_forecast(tmp_path):
    """Scores from a *ForSequenceClassification reward model only; a probe run writes probe.json."""
    model_dir = make_checkpoint("qwen2", str(tmp_path / "hf"), seed=0)
    write_tokenizer(model_dir, 128)
    rm_dir = make_checkpoint("qwen2", str(tmp_path / "rm"), seed=1, sequence_classification=True)
    out = tmp_path / "run"
    proc = _run(*_toy_run_args(tmp_path, model_dir, out), "reward.fn=null",
                f"reward.model_path={rm_dir}", "trainer.total_steps=5", "trainer.probe_steps=2",
                "trainer.profile_steps=[2]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2  # the probe stops after 2 steps
    assert all(r["reward/model_score/mean"] != 0.0 for r in rows)
    assert all(abs(r["critic/score/mean"] - r["reward/model_score/mean"]) < 1e-6 for r in rows)
    probe = json.loads((out / "probe.json").read_text())
    assert probe["probe_steps"] == 2 and probe["full_run"]["total_steps"] == 5
    assert probe["measured"]["timing_s"]["timing_s/step"] > 0
    assert len(probe["measured"]["reward_trend"]) == 2
    assert "probe:" in proc.stdout and "full run: 5 steps" in proc.stdout
    # trainer.profile_steps=[2]: step 2's trace, per-stage summary and operator table, nothing else
    prof = out / "profile"
    assert sorted(os.listdir(prof)) == ["step2_rank0.json", "step2_rank0.trace.json.gz",
                                        "step2_rank0.txt"]
    summary = json.loads((prof / "step2_rank0.json").read_text())
    stages = summary["stages"]
    assert {"step", "gen", "reward", "update_actor"} <= set(stages), stages
    assert 0 < stages["update_actor"]["wall_s"] < stages["step"]["wall_s"]
    assert all(0 <= st["idle_s"] <= st["wall_s"] + 1e-9 and st["waits"] for st in stages.values())
    with gzip.open(prof / "step2_rank0.trace.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"stage/step", "stage/gen", "stage/update_actor"} <= names


def test_print_config():
    proc = _run("-m", "hybridflow.train", "experiment=demo", "--cfg", "algo=rloo")
    assert proc.returncode == 0
    cfg = json.loads(proc.stdout)
    assert cfg["algo"]["adv_estimator"] == "rloo" and cfg["algo"]["use_kl_in_reward"] is True
