"""TRL's policy snapshots (benchmarks/trl_gsm8k.py --save-at) scored by our validation
(benchmarks/score_snapshots.py), on CPU with the tiny qwen2 GGUF of test_gsm8k_peers, through the
scripts the GPU calls run: gsm8k_peers.sh PHASES="trl score" and gsm8k_h200.sh score.

The like-for-like proof: the step-0 snapshot is the GGUF file dequantised by transformers and saved
as an HF directory (weights, config, tokenizer, chat template), so our validation of it must give
exactly the generations of our validation of the GGUF file itself (`hybridflow.train
trainer.val_only=true`, a separate process), and those must be the decode of transformers' own
greedy tokens on the same weights (an independent reference). The snapshot's tokenizer calls
`<|endoftext|>` its EOS (as transformers 5.17 reads the real file), so the scorer must still stop at
`<|im_end|>`: a snapshot with its final norm zeroed (every logit 0, greedy picks id 0 =
`<|im_end|>`) must answer in one token. It is scored first, the step-2 snapshot second and step 0
last, in one process: step 0 matching the GGUF run also shows that each load replaces all weights.
TRL trains on a reward with a signal for a random model (the parity of the completion's length:
`math_exact` is 0 for every sample, so GRPO's advantages and the gradient would be 0).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow,  # TRL trains and our validation scores, in subprocesses on CPU
              pytest.mark.skipif(importlib.util.find_spec("trl") is None
                                 or importlib.util.find_spec("datasets") is None,
                                 reason="trl and datasets are not installed")]

from tests.peers.test_gsm8k_peers import files, reference_greedy  # noqa: E402,F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
MAX_NEW = 12
PARITY = "def parity(prompt, response, ground_truth, extra_info=None):\n    return float(len(response) % 2)\n"


def _run(cmd: list[str], **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                                      os.environ["PATH"]]),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env_extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


# the experiment at a tiny scale; prompts, template, greedy decoding and rules as on the GPU
SCALE = ["data.prompts_per_step=2", "rollout.n=2", "algo.ppo_mini_batch_size=4", "algo.micro_batch_size_per_gpu=2",
         "algo.forward_micro_batch_size_per_gpu=4", f"rollout.max_new_tokens={MAX_NEW}", "trainer.precision=fp32",
         "trainer.val_log_generations=4", "trainer.tensorboard=false", "trainer.progress_bar=false"]


def _experiment(data: Path) -> list[str]:
    return ["experiment=gsm8k_qwen_coder_0_5b", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'val.parquet'}"]


@pytest.fixture(scope="module")
def trl_run(files, tmp_path_factory):
    """The last call of the GPU recipe: gsm8k_peers.sh PHASES="trl score" (TRL 2 steps saving at 0
    and 2, then our scoring of both). -> (dir, TRL's JSON, the scores JSON)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("trl_snapshots")
    data = d / "data"
    data.mkdir()
    for split in ("train", "val"):
        records = [json.loads(line) for line in open(files / f"{split}.jsonl")]
        pq.write_table(pa.Table.from_pylist(records), data / f"{split}.parquet")
    (d / "parity.py").write_text(PARITY)
    (d / "wheels").mkdir()
    _run(["bash", str(ROOT / "benchmarks" / "gsm8k_peers.sh")], MODEL=str(files / "tiny.gguf"), DATA=str(data),
         WHEELS=str(d / "wheels"), SITE=str(d / "site"), OUT=str(d / "out"), PHASES="trl score",
         TRL_WORKDIR=str(d / "work"), TRL_STEPS="2", TRL_SAVE_AT="0,2", SCORE_DIR=str(d / "score_driver"),
         TRL_ARGS=f"--prompts-per-step 2 --samples 4 --micro-batch 8 --max-new-tokens 8 --lr 1e-2 "
                  f"--reward {d / 'parity.py'}:parity", SCORE_ARGS=" ".join(SCALE))
    return d, json.loads((d / "out" / "trl_gsm8k.json").read_text()), \
        json.loads((d / "out" / "trl_scores.json").read_text())


@pytest.fixture(scope="module")
def scored(files, trl_run, tmp_path_factory):
    """Our val_only on the GGUF file, and gsm8k_h200.sh score on [zeroed, step 2, step 0] in one
    process. -> (GGUF metrics, GGUF generations, scores JSON, metrics by step, generations by step)."""
    d, result, _ = trl_run
    snaps = dict(result["snapshots"])
    zeroed = tmp_path_factory.mktemp("zeroed") / "step_7"
    shutil.copytree(snaps[0], zeroed)
    from safetensors.torch import load_file, save_file

    sd = load_file(zeroed / "model.safetensors")
    sd["model.norm.weight"].zero_()
    save_file(sd, zeroed / "model.safetensors", metadata={"format": "pt"})
    gguf_out, score_out, out = d / "gguf_val", d / "score_run", d / "out_score"
    # our run on the GGUF file: the real file's EOS is <|im_end|> and the experiment adds
    # <|endoftext|>; the tiny file's EOS is <|endoftext|>, so both ids are named here
    _run([sys.executable, "-m", "hybridflow.train", "experiment=demo", *_experiment(d / "data"), *SCALE,
          f"model.gguf_path={files / 'tiny.gguf'}", "trainer.val_only=true", "trainer.resume=false",
          f"trainer.output_dir={gguf_out}", "rollout.stop_token_ids=[0,1]"])
    _run(["bash", str(ROOT / "benchmarks" / "gsm8k_h200.sh"), "score", str(zeroed), snaps[2], snaps[0], "--", *SCALE],
         OUT=str(out), DATA=str(d / "data"), SITE=str(d / "site"), SCORE_DIR=str(score_out))

    def rows(path):
        return [json.loads(line) for line in open(path)]

    (gguf_metrics,) = rows(gguf_out / "metrics.jsonl")
    assert rows(out / "trl_score_metrics.jsonl") == rows(score_out / "metrics.jsonl")
    by_step = {r["step"]: r for r in rows(score_out / "metrics.jsonl")}
    gens = {}
    for g in rows(score_out / "val_generations.jsonl"):
        gens.setdefault(g["step"], []).append(g)
    return (gguf_metrics, rows(gguf_out / "val_generations.jsonl"), json.loads((out / "trl_scores.json").read_text()),
            by_step, gens)


def test_trl_saves_snapshots_at_steps(files, trl_run):
    from safetensors.torch import load_file

    from hybridflow.models.gguf import read_gguf

    d, r, _ = trl_run
    work = d / "work" / "snapshots"
    assert r["steps_done"] == 2 and r["config"]["save_at"] == [0, 2]
    assert r["snapshots"] == [[0, str(work / "step_0")], [2, str(work / "step_2")]]
    assert sorted(p.name for p in work.iterdir()) == ["step_0", "step_2"]  # no temporary folders left
    for _, path in r["snapshots"]:
        names = {p.name for p in Path(path).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja"} <= names, names
    assert [log["step"] for log in r["logs"] if "reward_std" in log] == [1, 2]
    assert all(log["reward_std"] > 0 for log in r["logs"] if "reward_std" in log)  # a learning signal
    # step 0 holds the GGUF file's tensors exactly (F32 there); step 2 has moved every matrix
    _, gguf_sd = read_gguf(str(files / "tiny.gguf"))
    step0, step2 = (load_file(Path(p) / "model.safetensors") for _, p in r["snapshots"])
    assert set(step0) == set(gguf_sd) == set(step2)
    for name, t in gguf_sd.items():
        assert torch.equal(step0[name], t.float()), name
    assert all(not torch.equal(step0[n], step2[n]) for n in step0 if step0[n].dim() == 2)


def test_step0_snapshot_scores_exactly_like_the_gguf_file(files, trl_run, scored):
    import gsm8k_hf_eval as ev

    gguf_metrics, gguf_gens, result, by_step, gens = scored
    assert len(gguf_gens) == 4 and [g["index"] for g in gens[0]] == [0, 1, 2, 3]
    assert gens[0] == gguf_gens  # prompt text, response text and every rule's score, per prompt
    timing = {"timing_s/val", "step"}
    assert {k: v for k, v in by_step[0].items() if k not in timing} == \
        {k: v for k, v in gguf_metrics.items() if k not in timing}
    assert gguf_metrics["val-aux/response_length/mean"] > 1  # not trivially the zeroed model's answers
    # the responses are the decode of transformers' greedy tokens on the snapshot's weights
    snap = dict(trl_run[1]["snapshots"])[0]
    tok, model = ev.load_tokenizer(snap), ev.load_model(snap, dtype=torch.float32, device="cpu")
    for rec, g in zip(ev.load_records(files / "val.jsonl"), gguf_gens):
        prompt = tok.apply_chat_template(rec["prompt"], add_generation_prompt=True, tokenize=False)
        assert prompt == g["prompt"]
        ref = reference_greedy(model, tok, prompt, max_new_tokens=MAX_NEW, stops={0, 1})
        assert tok.decode(ref, skip_special_tokens=True) == g["response"]
    core, strict = "val-core/openai/gsm8k/reward/mean@1", "val-aux/openai/gsm8k/gsm8k_strict/mean@1"
    assert result["scores"][0] == [0, gguf_metrics[core], gguf_metrics[strict]]


def test_scorer_stops_at_im_end_and_scores_the_trained_snapshot(trl_run, scored):
    _, _, result, by_step, gens = scored
    snap = dict(trl_run[1]["snapshots"])[0]
    assert json.loads((Path(snap) / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert by_step[7]["val-aux/response_length/max"] == 1.0  # stopped at <|im_end|>, its first token
    assert [g["response"] for g in gens[7]] == [""] * 4
    assert result["stop_token_ids"] == [0, 1]  # <|im_end|>, <|endoftext|>
    # step 2 (TRL-trained weights) scored in the same process, between the two others
    assert [s for s, *_ in result["scores"]] == [0, 2, 7] and [s for s, _ in result["val_accuracy"]] == [0, 2, 7]
    for step, acc, strict in result["scores"]:
        assert acc == by_step[step]["val-core/openai/gsm8k/reward/mean@1"]
        assert strict == by_step[step]["val-aux/openai/gsm8k/gsm8k_strict/mean@1"]
    assert len(gens[2]) == 4 and [g["response"] for g in gens[2]] != [g["response"] for g in gens[0]]
    assert result["reward_fn"] == "math_exact" and result["build_s"] > 0


def test_driver_trains_then_scores(trl_run, scored):
    """PHASES="trl score" scored the snapshots TRL had just saved, as the separate call did."""
    _, r, driver = trl_run
    result = scored[2]
    assert driver["snapshots"] == r["snapshots"]
    assert driver["scores"] == [row for row in result["scores"] if row[0] in (0, 2)]


def test_scorer_refuses_mismatched_snapshots(files, trl_run, tmp_path):
    import score_snapshots as ss

    snap = dict(trl_run[1]["snapshots"])
    with pytest.raises(ValueError, match="step_<N>"):
        ss.snapshot_step(str(Path(snap[0]).parent))
    with pytest.raises(ValueError, match="model.hf_path"):
        ss.build_config(snap[0], str(tmp_path / "run"), ["model.hf_path=x"])
    cfg, fixed = ss.build_config(snap[0], str(tmp_path / "run"), [*_experiment(trl_run[0] / "data"), *SCALE])
    assert "rollout.stop_token_ids=[0,1]" in fixed and cfg.model.hf_path == snap[0]
    ss.check_like_first(snap[2], first=snap[0], model_cfg=cfg.model)
    for name, edit in (("config.json", lambda c: {**c, "num_hidden_layers": 1}),
                       ("tokenizer_config.json", lambda c: {**c, "eos_token": "<|im_end|>"})):
        other = tmp_path / name / "step_3"
        shutil.copytree(snap[2], other)
        (other / name).write_text(json.dumps(edit(json.loads((other / name).read_text()))))
        with pytest.raises(ValueError, match="shape differs" if name == "config.json" else "tokenizer files"):
            ss.check_like_first(str(other), first=snap[0], model_cfg=cfg.model)


def test_report_takes_trl_accuracy_from_the_scores(trl_run, tmp_path, monkeypatch):
    import gsm8k_report

    d, _, scores = trl_run
    rows = [{"step": 0, "val-core/openai/gsm8k/reward/mean@1": 0.25}]
    rows += [{"step": s, "timing_s/step": 10.0 + s, "timing_s/gen": 5.0, "critic/score/mean": 0.1 * s,
              "response_length/mean": 100.0, "training/rollout_probs_diff_mean": 0.01,
              "training/rollout_probs_diff_max": 0.1, "rollout_corr/kl": 1e-4} for s in (1, 2, 3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = {"accuracy": {"math_exact": 0.24}, "n": 4, "machine": {"gpu": "cpu"}, "versions": {}}
    (tmp_path / "hf.json").write_text(json.dumps(hf))
    out = tmp_path / "summary.json"
    base = ["gsm8k_report.py", "--metrics", str(tmp_path / "m.jsonl"), "--hf-eval", str(tmp_path / "hf.json"),
            "--trl", str(d / "out" / "trl_gsm8k.json"), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", base)
    gsm8k_report.main()
    assert json.loads(out.read_text())["trl"]["val_accuracy"] == []  # TRL's own --val-at: none here
    monkeypatch.setattr(sys, "argv", [*base, "--trl-scores", str(d / "out" / "trl_scores.json")])
    gsm8k_report.main()
    trl = json.loads(out.read_text())["trl"]
    assert trl["val_accuracy"] == scores["val_accuracy"] and [s for s, _ in trl["val_accuracy"]] == [0, 2]
    assert trl["val_accuracy_strict"] == scores["val_accuracy_strict"] and "score_snapshots" in trl["val_scored_by"]


def test_report_matches_steps_keeps_notes_and_lists_evals(trl_run, tmp_path, monkeypatch):
    import gsm8k_report

    d, _, scores = trl_run
    rows = [{"step": s, "val-core/openai/gsm8k/reward/mean@1": 0.25 + 0.01 * s} for s in (0, 2)]
    rows += [{"step": s, "timing_s/step": 10.0, "critic/score/mean": 0.1, "response_length/mean": 100.0}
             for s in (1, 2, 3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, acc, bs in (("hf.json", 0.24, 64), ("hf_old.json", 0.22, 320)):
        (tmp_path / name).write_text(json.dumps({"accuracy": {"math_exact": acc}, "batch_size": bs,
                                                 "machine": {}, "versions": {}}))
    out = tmp_path / "summary.json"
    out.write_text(json.dumps({"what": "a note", "earlier_runs": [1], "val_accuracy": "stale"}))
    monkeypatch.setattr(sys, "argv", [
        "gsm8k_report.py", "--metrics", str(tmp_path / "m.jsonl"), "--hf-eval", str(tmp_path / "hf.json"),
        "--hf-eval", str(tmp_path / "hf_old.json"), "--trl", str(d / "out" / "trl_gsm8k.json"),
        "--trl-scores", str(d / "out" / "trl_scores.json"), "--out", str(out), "--keep", "what,earlier_runs",
        "--table", str(tmp_path / "t.md")])
    gsm8k_report.main()
    got = json.loads(out.read_text())
    assert got["what"] == "a note" and got["earlier_runs"] == [1]  # kept; computed keys recomputed
    assert got["val_accuracy"] == [[0, 0.25], [2, 0.27]]
    assert got["transformers_val_accuracy"] == 0.24
    assert [(r["math_exact"], r["batch_size"]) for r in got["transformers_val_accuracy_runs"]] == [(0.24, 64), (0.22, 320)]
    trl = dict(scores["val_accuracy"])
    assert got["accuracy_per_step_vs_trl"] == [[s, a, trl[s], pytest.approx(100 * (a - trl[s]))]
                                               for s, a in ((0, 0.25), (2, 0.27))]
    rew = got["train_reward_per_step_vs_trl"]
    trl_logs = {r["step"]: r["reward"] for r in trl_run[1]["logs"] if "reward" in r}
    assert [p[0] for p in rew["steps"]] == sorted(set(trl_logs) & {1, 2, 3}) != []
    assert all(p[1] == 0.1 and p[2] == trl_logs[p[0]] for p in rew["steps"]) and rew["ours_mean"] == 0.1
    md = (tmp_path / "t.md").read_text()
    assert "TRL val math_exact %" in md and f"| {100 * trl[2]:.1f} |" in md
    # problem by problem: our val_scores.jsonl against our scoring of TRL's snapshots, common steps
    for name, rows in (("ours.jsonl", {0: [1, 0, 1, 1], 2: [1, 1, 1, 0], 4: [1, 1, 1, 1]}),
                       ("theirs.jsonl", {0: [1, 0, 1, 1], 2: [0, 0, 1, 1]})):
        (tmp_path / name).write_text("".join(
            json.dumps({"step": st, "index": [13, 11, 12, 10][::-1], "scores": {"reward": v[::-1]}}) + "\n"
            for st, v in rows.items()))
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--val-scores", str(tmp_path / "ours.jsonl"),
                                      "--trl-val-scores", str(tmp_path / "theirs.jsonl")])
    gsm8k_report.main()
    paired = json.loads(out.read_text())["accuracy_per_step_vs_trl_paired"]
    assert [p["step"] for p in paired] == [0, 2]
    assert (paired[0]["only_a"], paired[0]["only_b"], paired[0]["mcnemar_p"]) == (0, 0, 1.0)
    assert (paired[1]["only_a"], paired[1]["only_b"]) == (2, 1) and paired[1]["accuracy_a"] == 0.75
    monkeypatch.setattr(sys, "argv", [*sys.argv[:-8], "--keep", "raw"])
    with pytest.raises(SystemExit, match="no key"):
        gsm8k_report.main()
