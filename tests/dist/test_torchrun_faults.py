"""Failures under torchrun (gloo, CPU) end with one line that says what and where, never in silence.

- Config errors: every rank prints the same `hybridflow train: error:` line before it exits (code
  2), so no exit ordering can swallow it (torchrun kills the others when the first exits; before,
  only rank 0 printed and about 1 launch in 6 showed nothing). 20 launches of 4 ranks, 4 at a time,
  over the three layout errors; each fails in validation, before any model is built. Orderings
  are forced, not left to chance: in 16 of them one rank (0, 1, 2 or 3) starts 2 s late, so the
  others have exited and torchrun has killed it before it gets to its error.
- A user error after start-up that every rank finds (no tokenizer): the same line, no rank; one
  that only rank 1 finds: `rank 1: ...`, and rank 0, waiting for it in a collective, its stage
  line when torchrun stops it.
- A peer SIGKILLed at a known stage: the survivor prints `rank 0: stage S: peer failure after T s`.
- A peer that hangs: the survivor's collective times out after trainer.collective_timeout_s and it
  prints `... timeout after T s`; torchrun's SIGTERM then gives the hung rank its line (the watcher
  thread, while its main thread sleeps).
Faults are injected by tests/dist/fault_entry.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.dist.launcher import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.1"]
TINY_RUN = ["experiment=demo", "data.synthetic_size=24", "data.prompts_per_step=8", "rollout.n=2",
            "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4",
            "trainer.sft_warmup_steps=0", "trainer.total_steps=2", "trainer.save_final=false",
            "trainer.progress_bar=false", "trainer.tensorboard=false"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _torchrun(nproc: int, target: list, *, env=None) -> subprocess.Popen:
    cmd = [*TORCHRUN, "--nproc_per_node", str(nproc), "--master_port", str(free_port()), *target]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("hybridflow train: error:")]


def _no_rank_traceback(output: str) -> bool:
    """torchrun prints its own ChildFailedError traceback; a rank's would run through hybridflow."""
    return re.search(r'File ".*hybridflow/', output) is None


CONFIG_ERRORS = [
    (["model.num_attention_heads=2", "model.num_query_groups=2"],
     "parallel.tensor_parallel_size=4 must divide model.num_attention_heads=2"),
    ([], "parallel.tensor_parallel_size=4 must divide model.num_query_groups=2"),
    (["model.num_query_groups=4", "rollout.tensor_parallel_size=3"],
     "rollout.tensor_parallel_size=3 must divide parallel.tensor_parallel_size=4"),
]


@pytest.mark.slow  # many torchrun launches; a killed peer and non-finite grads stay in the default tier
def test_config_errors_print_under_every_torchrun_ordering(tmp_path):
    entry = os.path.join(ROOT, "tests", "dist", "fault_entry.py")
    # (late rank or None, overrides, expected line)
    launches = [(None if i % 5 == 4 else i % 5, *CONFIG_ERRORS[i % 3]) for i in range(20)]
    results = []
    for start in range(0, len(launches), 4):  # 4 launches of 4 ranks at a time
        procs = []
        for late, overrides, expected in launches[start:start + 4]:
            target = ([entry] if late is not None else ["-m", "hybridflow.train"]) + ["experiment=demo"]
            env = _env(HYBRIDFLOW_TEST_FAULT=f"{late}:start:delay") if late is not None else None
            procs.append((_torchrun(4, [*target, "parallel.tensor_parallel_size=4",
                                        f"trainer.output_dir={tmp_path}", *overrides], env=env),
                          late, expected))
        results += [(p.communicate(timeout=300)[0], p.returncode, late, expected)
                    for p, late, expected in procs]
    for out, code, late, expected in results:
        lines = _error_lines(out)
        assert lines, f"no hybridflow line (rank {late} late) in:\n{out[-3000:]}"
        assert set(lines) == {f"hybridflow train: error: {expected}"}, lines  # same line, no rank
        assert code != 0 and re.search(r"exitcode\s*:\s*2 ", out), out[-3000:]
        assert _no_rank_traceback(out), out[-3000:]
    assert not os.listdir(tmp_path)  # validation fails before anything is written


@pytest.mark.slow
def test_user_errors_after_start_up_carry_the_rank_only_where_ranks_disagree(tmp_path):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n' * 8)
    proc = _torchrun(2, ["-m", "hybridflow.train", *TINY_RUN, "data.synthetic=null",
                         f"data.train_files={jsonl}", f"trainer.output_dir={tmp_path / 'a'}"])
    out = proc.communicate(timeout=300)[0]
    lines = _error_lines(out)
    assert lines and set(lines) == {"hybridflow train: error: data.tokenizer is not set and the model "
                                    "has no hf_path: point data.tokenizer at a tokenizer.json dir "
                                    "or a sentencepiece .model"}, out[-3000:]
    assert _no_rank_traceback(out), out[-3000:]

    out, _ = _fault_run("1:values:error", tmp_path / "b", "trainer.collective_timeout_s=120")
    lines = _error_lines(out)
    assert lines[0] == "hybridflow train: error: rank 1: injected error on rank 1 in stage values", lines
    assert len(lines) <= 2 and all(re.fullmatch(
        r"hybridflow train: error: rank 0: stage \w+: peer failure after [\d.]+ s \(.+\)", ln)
        for ln in lines[1:]), lines
    assert _no_rank_traceback(out), out[-3000:]


def _fault_run(fault: str, tmp_path, *overrides) -> tuple[str, float]:
    env = _env(HYBRIDFLOW_TEST_FAULT=fault)
    t0 = time.monotonic()
    proc = _torchrun(2, [os.path.join(ROOT, "tests", "dist", "fault_entry.py"), *TINY_RUN,
                         f"trainer.output_dir={tmp_path}", *overrides], env=env)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0, out[-3000:]
    return out, time.monotonic() - t0


def test_killed_peer_names_rank_and_stage(tmp_path):
    """TP=2: rank 1 dies entering old_log_prob; rank 0's next TP all-reduce there fails at once
    (or torchrun's SIGTERM reaches it first: the same line from the watcher thread)."""
    out, _ = _fault_run("1:old_log_prob:kill", tmp_path, "parallel.tensor_parallel_size=2",
                        "trainer.collective_timeout_s=120")
    lines = _error_lines(out)
    assert len(lines) == 1, out[-3000:]
    m = re.fullmatch(r"hybridflow train: error: rank 0: stage old_log_prob: peer failure after "
                     r"([\d.]+) s \((.+)\)", lines[0])
    assert m and float(m.group(1)) < 120, lines[0]  # not the timeout: the peer's death itself
    assert _no_rank_traceback(out), out[-3000:]


@pytest.mark.slow
def test_hung_peer_times_out_with_a_line_on_both_ranks(tmp_path):
    """DP=2: rank 1 hangs entering adv; rank 0's all-gather of the batch there times out."""
    timeout_s = 8  # above the start-up skew of a loaded CI machine (barriers while rank 0 works)
    out, wall = _fault_run("1:adv:hang", tmp_path, f"trainer.collective_timeout_s={timeout_s}")
    lines = _error_lines(out)
    m = re.fullmatch(r"hybridflow train: error: rank 0: stage adv: timeout after ([\d.]+) s \(.+\)",
                     lines[0]) if lines else None
    assert m and timeout_s <= float(m.group(1)) < timeout_s + 5, out[-3000:]
    assert any(re.fullmatch(r"hybridflow train: error: rank 1: stage adv: peer failure after [\d.]+ s "
                            r"\(SIGTERM: .+\)", ln) for ln in lines[1:]), lines
    assert len(lines) == 2 and _no_rank_traceback(out), out[-3000:]


def test_nonfinite_gradients_skip_the_update_then_stop_the_run(tmp_path):
    """Rank 1's actor gradient is NaN from step 2 on: both ranks skip those updates together (said
    once per update, the mini-batch saved per rank), and after trainer.max_skipped_steps=2 such steps
    the run ends with a line naming the cause (each rank that prints it), exit 1, no traceback."""
    out, _ = _fault_run("1:2:nan_grad", tmp_path, "trainer.total_steps=6",
                        "trainer.max_skipped_steps=2", "trainer.collective_timeout_s=120")
    assert re.search(r"exitcode\s*:\s*1 ", out), out[-3000:]
    warnings = [ln for ln in out.splitlines() if ln.startswith("hybridflow: warning:")]
    # 16 rows, mini-batches of 8: two updates per step
    assert [ln.split(":")[2].strip() for ln in warnings] == ["step 2"] * 2 + ["step 3"] * 2, \
        out[-3000:]
    assert [ln.split(":")[3].split(" skipped")[0].strip() for ln in warnings] == \
        ["actor update 0 of epoch 0", "actor update 1 of epoch 0"] * 2, warnings
    assert all("skipped: inf/NaN gradient (weights unchanged)" in ln for ln in warnings)
    lines = _error_lines(out)
    # every rank reaches the same verdict; whichever prints first, torchrun may stop the other
    assert 1 <= len(lines) <= 2 and all(re.fullmatch(
        r"hybridflow train: error: rank [01]: stage \w+: non-finite gradients: every actor update of "
        r"the last 2 steps \(to step 3\) was skipped \(trainer.max_skipped_steps=2\); the "
        r"weights are those of step 1; the mini-batches are in .*nonfinite", ln)
        for ln in lines), lines
    assert _no_rank_traceback(out), out[-3000:]
    saved = sorted(os.listdir(tmp_path / "nonfinite"))
    assert saved == sorted(f"step{s}_actor_e0_mb{i}_rank{r}.pt"
                           for s in (2, 3) for i in (0, 1) for r in (0, 1)), saved

    import json

    from hybridflow.nonfinite import replay_batch

    rows = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/update_skipped"] == 0.0 and "actor/grad_norm" in rows[0]
    assert rows[1]["actor/update_skipped"] == 1.0 and "actor/grad_norm" not in rows[1]
    batch = replay_batch(str(tmp_path / "nonfinite" / "step2_actor_e0_mb0_rank1.pt"))
    assert batch.batch_size == 4 and batch.advantages is not None  # this rank's half of 8 rows
