"""Resume and storage faults end to end, as a user meets them (1-rank CLI runs on CPU).

- Exact resume: a PPO run (critic, adaptive KL in the reward, LR warm-up and decay, an epoch
  boundary) crashes between publishing step_2 and rewriting `latest` (tests/dist/fault_entry.py),
  leaving `latest` at 1; a crashed save's `step_7.tmp` and `latest.tmp` are planted beside it. The
  resumed run cleans them, repairs `latest`, continues from step 2, and its per-step metrics
  (losses, rewards, KL, grad norms, LR, lengths: all but timings and memory) equal the uninterrupted
  run's bit for bit; its reward summary numbers steps 3-4.
- Resuming under another model is refused with one line naming each differing key; vocab resizing
  runs when asked for explicitly.
- Resuming on other training data (another file, same or another row count, or synthetic data
  swapped for a file) is refused with one line naming data.train_files, both sources and
  trainer.resume_allow_data_change; with it the sampler starts its epoch again over the new data;
  a checkpoint that does not record its data resumes with a warning line.
- Start-up on a read-only, a full and a forbidden output directory (real tmpfs mounts; the last
  run by root without CAP_DAC_OVERRIDE, which otherwise ignores permission bits): one line naming
  the errno and the path,
  exit 2, nothing earlier touched. A disk that fills up during a checkpoint save: one line, the
  partial step removed, the previous step and `latest` intact.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from hybridflow.run_state import file_sha256
from tests.tmpfs import fill, mount_tmpfs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ["data.synthetic_size=24", "data.prompts_per_step=8", "rollout.n=2",  # 3 steps per epoch
       "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4", "trainer.sft_warmup_steps=2",
       "algo.use_kl_in_reward=true", "algo.kl_ctrl=adaptive", "actor_optim.lr_warmup_steps=1",
       "actor_optim.lr_decay_style=linear", "trainer.total_steps=4", "trainer.save_every=1",
       "trainer.progress_bar=false", "trainer.tensorboard=false"]


# root without the capabilities that let it ignore file permissions (root's EACCES)
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search"]


def _run(*args, fault=None, prefix=()):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in ("RANK", "WORLD_SIZE", "HYBRIDFLOW_TEST_FAULT"):
        env.pop(key, None)
    if fault:
        env["HYBRIDFLOW_TEST_FAULT"] = fault
    entry = [os.path.join(ROOT, "tests", "dist", "fault_entry.py")] if fault else \
        ["-m", "hybridflow.train"]
    args = ("experiment=demo", *args)
    return subprocess.run([*prefix, sys.executable, *entry, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _one_error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hybridflow train: error:")]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    whole, crashed = base / "whole", base / "crashed"
    a = _run(*RUN, f"trainer.output_dir={whole}")
    assert a.returncode == 0, a.stderr[-3000:]
    b1 = _run(*RUN, f"trainer.output_dir={crashed}", fault="0:2:crash_publish")
    assert b1.returncode == 9, b1.stderr[-3000:]
    ckpt = crashed / "checkpoints"
    state = {"listing": sorted(os.listdir(ckpt)), "latest": (ckpt / "latest").read_text().strip()}
    (ckpt / "step_7.tmp" / "actor").mkdir(parents=True)  # what a save killed mid-write leaves
    (ckpt / "step_7.tmp" / "actor" / "__0_0.distcp").write_bytes(b"partial")
    (ckpt / "latest.tmp").write_text("7\n")
    b2 = _run(*RUN, f"trainer.output_dir={crashed}")
    assert b2.returncode == 0, b2.stderr[-3000:]
    return whole, crashed, state, b2


def test_resume_after_a_crash_is_exact(runs):
    whole, crashed, after_crash, resumed = runs
    assert after_crash == {"listing": ["latest", "step_1", "step_2"], "latest": "1"}
    assert "at step 2 of 4" in resumed.stdout
    assert sorted(os.listdir(crashed / "checkpoints")) == ["latest", "step_1", "step_2", "step_3",
                                                           "step_4"]
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "4"
    a, b = _rows(whole / "metrics.jsonl"), _rows(crashed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        math = {k for k in ra if not k.startswith(("timing_s/", "perf/"))}
        assert math == {k for k in rb if not k.startswith(("timing_s/", "perf/"))}
        assert {k: ra[k] for k in math} == {k: rb[k] for k in math}, ra["step"]
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm",
                "critic/score/mean", "actor/reward_kl_penalty_coeff", "actor/lr"):
        assert key in a[0], key  # the compared keys include the ones that carry state
    summary = [ln for ln in resumed.stdout.splitlines() if ln.startswith("mean reward by steps")]
    r3, r4 = (b[i]["critic/score/mean"] for i in (2, 3))
    assert summary == [f"mean reward by steps  3-3: {r3:.3f} | 4-4: {r4:.3f}"]


def test_resume_refuses_another_model_unless_vocab_resize_is_asked(runs):
    _, crashed, _, _ = runs
    common = [*RUN, f"trainer.output_dir={crashed}", "trainer.total_steps=5"]
    line = _one_error_line(_run(*common, "model.vocab_size=96", "model.num_layers=4"))
    assert f"checkpoint {crashed / 'checkpoints' / 'step_4'} holds a different" in line
    assert "num_layers=2 saved, 4 requested" in line and "vocab_size=64 saved, 96 requested" in line
    assert "trainer.resume_allow_vocab_resize=true" in line
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "4"  # nothing touched
    ok = _run(*common, "model.vocab_size=96", "trainer.resume_allow_vocab_resize=true")
    assert ok.returncode == 0 and "at step 4 of 5" in ok.stdout, ok.stderr[-3000:]
    assert _rows(crashed / "metrics.jsonl")[-1]["step"] == 5


def test_resume_from_a_truncated_checkpoint_names_the_file(runs, tmp_path):
    whole = runs[0]  # only read by the other tests (the crashed run's gets a step 5 of another model)
    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    actor = copy / "checkpoints" / "step_4" / "actor"
    shard = max(actor.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    line = _one_error_line(_run(*RUN, f"trainer.output_dir={copy}", "trainer.total_steps=5"))
    assert f"{shard}: truncated:" in line, line
    assert (copy / "checkpoints" / "latest").read_text().strip() == "4"  # nothing touched


def test_unwritable_output_dir_at_start(tmp_path):
    quick = ["trainer.total_steps=1", "trainer.sft_warmup_steps=0"]
    with mount_tmpfs(str(tmp_path / "ro"), read_only=True) as ro:
        line = _one_error_line(_run(*quick, f"trainer.output_dir={ro}/run"))
        assert line == (f"hybridflow train: error: [Errno 30] trainer.output_dir={ro}/run is not "
                        f"writable: Read-only file system: '{ro}/run'")
    with mount_tmpfs(str(tmp_path / "full"), size="64k") as full:
        (tmp_path / "full" / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run's
        fill(full)
        line = _one_error_line(_run(*quick, f"trainer.output_dir={full}"))
        assert line.startswith(f"hybridflow train: error: [Errno {errno.ENOSPC}] trainer.output_dir="
                               f"{full} is not writable: No space left on device: '{full}/")
        assert sorted(os.listdir(full)) == ["filler", "metrics.jsonl"]  # probe removed
        assert (tmp_path / "full" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("dropping root's permission override needs root and setpriv")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    line = _one_error_line(_run(*quick, f"trainer.output_dir={locked}/run", prefix=NO_DAC))
    assert line == (f"hybridflow train: error: [Errno 13] trainer.output_dir={locked}/run is not "
                    f"writable: Permission denied: '{locked}/run'")


def test_disk_full_during_a_checkpoint_save(tmp_path):
    """One step's checkpoint (actor, critic, reference with optimizer states: ~3.6 MB) fits in
    6 MB, the second does not."""
    with mount_tmpfs(str(tmp_path / "disk"), size="6m") as disk:
        out = f"{disk}/run"
        proc = _run(*RUN, "trainer.total_steps=2", f"trainer.output_dir={out}")
        line = _one_error_line(proc)  # in whichever file of step 2 the space ran out
        assert line.startswith(f"hybridflow train: error: [Errno {errno.ENOSPC}] saving checkpoint "
                               f"step 2: No space left on device (ENOSPC): "
                               f"'{out}/checkpoints/step_2.tmp"), line
        assert sorted(os.listdir(f"{out}/checkpoints")) == ["latest", "step_1"]
        assert open(f"{out}/checkpoints/latest").read().strip() == "1"
        assert [r["step"] for r in _rows(f"{out}/metrics.jsonl")] == [1, 2]


def test_fresh_run_refuses_a_directory_with_checkpoints(runs):
    """trainer.resume=false over published checkpoints would silently skip its own saves of those
    steps (a published step is never rewritten): refused at start, nothing touched."""
    whole = runs[0]
    before = sorted(os.listdir(whole / "checkpoints"))
    proc = _run(*RUN, f"trainer.output_dir={whole}", "trainer.resume=false")
    line = _one_error_line(proc)
    assert "trainer.resume=false" in line and "step_4" in line and "trainer.output_dir" in line
    assert sorted(os.listdir(whole / "checkpoints")) == before


def _arith_files(folder, **sizes_by_seed) -> dict:
    """jsonl files of the demo's arith task ({name: (seed, rows)}) and a char tokenizer for them."""
    from hybridflow.data import train_sentencepiece
    from hybridflow.data.synthetic import make_task, tokenizer_corpus

    files, corpus = {}, []
    for name, (seed, rows) in sizes_by_seed.items():
        records = make_task("arith", size=rows, seed=seed)
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in records))
        corpus += tokenizer_corpus(records)
    files["tokenizer"] = train_sentencepiece(lines=corpus, model_prefix=folder / "spm",
                                             vocab_size=64, model_type="char")
    return files


def _source(path, rows) -> str:
    return f"{path} ({rows} rows, sha256 {file_sha256(str(path))[:12]})"


def test_resume_refuses_a_swap_of_synthetic_data_for_a_file(runs, tmp_path):
    whole = runs[0]
    files = _arith_files(tmp_path, a=(5, 24))
    line = _one_error_line(_run(*RUN, f"trainer.output_dir={whole}", "trainer.total_steps=5",
                                "data.synthetic=null", f"data.train_files={files['a']}",
                                f"data.tokenizer={files['tokenizer']}"))
    assert line == (f"hybridflow train: error: data.train_files changed since checkpoint "
                    f"{whole / 'checkpoints' / 'step_4'}: it trained on synthetic:arith (24 "
                    f"rows), this run reads {_source(files['a'], 24)}; resume with the same data, "
                    "or set trainer.resume_allow_data_change=true to train on the new prompts (the "
                    "sampler then starts its epoch again over them)")


@pytest.mark.slow  # six runs in subprocesses
def test_resume_checks_the_training_data(tmp_path):
    files = _arith_files(tmp_path, a=(1, 24), b=(2, 24), c=(3, 16))
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    common = [*RUN, "data.synthetic=null", f"data.tokenizer={files['tokenizer']}",
              "trainer.sft_warmup_steps=0", f"trainer.output_dir={out}"]
    first = _run(*common, f"data.train_files={files['a']}", "trainer.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    for other, rows in (("b", 24), ("c", 16)):  # the same row count, another row count
        line = _one_error_line(_run(*common, f"data.train_files={files[other]}",
                                    "trainer.total_steps=3"))
        assert line == (f"hybridflow train: error: data.train_files changed since checkpoint "
                        f"{ckpt / 'step_2'}: it trained on {_source(files['a'], 24)}, this run "
                        f"reads {_source(files[other], rows)}; resume with the same data, or set "
                        "trainer.resume_allow_data_change=true to train on the new prompts (the "
                        "sampler then starts its epoch again over them)")
    assert (ckpt / "latest").read_text().strip() == "2"  # nothing touched

    ok = _run(*common, f"data.train_files={files['b']}", "trainer.total_steps=3",
              "trainer.resume_allow_data_change=true")
    assert ok.returncode == 0 and "at step 2 of 3" in ok.stdout, ok.stderr[-3000:]
    assert (f"hybridflow: warning: data.train_files changed since checkpoint {ckpt / 'step_2'}: "
            f"it trained on {_source(files['a'], 24)}, this run reads {_source(files['b'], 24)}; "
            "trainer.resume_allow_data_change=true: the sampler starts epoch 0 again over the new "
            "data") in ok.stdout.splitlines()
    state = json.loads((ckpt / "step_3" / "trainer_state.json").read_text())
    assert state["train_data"] == {"source": str(files["b"]), "num_rows": 24,
                                   "sha256": file_sha256(str(files["b"]))}
    # step 2 ended at step 2 of epoch 0 (3 steps per epoch); epoch 0 restarted: one step into it
    assert (state["sampler"]["epoch"], state["sampler"]["step_in_epoch"]) == (0, 1)

    del state["train_data"]  # as a checkpoint saved before the data was recorded
    (ckpt / "step_3" / "trainer_state.json").write_text(json.dumps(state))
    line = _one_error_line(_run(*common, f"data.train_files={files['c']}", "trainer.total_steps=4"))
    assert line.startswith(f"hybridflow train: error: data.train_files changed since checkpoint "
                           f"{ckpt / 'step_3'}: it trained on 24 rows (its file is not recorded), "
                           f"this run reads {_source(files['c'], 16)}; "), line
    old = _run(*common, f"data.train_files={files['b']}", "trainer.total_steps=4")
    assert old.returncode == 0 and "at step 3 of 4" in old.stdout, old.stderr[-3000:]
    assert (f"hybridflow: warning: checkpoint {ckpt / 'step_3'} does not record its training data "
            f"(saved by an older hybridflow): data.train_files={files['b']} (24 rows) is taken to "
            "be the data it trained on") in old.stdout.splitlines()
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == [1, 2, 3, 4]
