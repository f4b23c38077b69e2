"""What a checkpoint records of its training data and how resume compares it
(hybridflow.run_state); the runs themselves: tests/learning/test_resume_and_io_faults.py."""

import hashlib

import pytest

from hybridflow.config import DataConfig
from hybridflow.run_state import check_resume_data, file_sha256, train_data_record

CKPT = "/runs/a/checkpoints/step_2"
SAMPLER = {"epoch": 1, "step_in_epoch": 2, "num_items": 3}


@pytest.fixture
def files(tmp_path):
    a, moved, b, c = (tmp_path / n for n in ("a.jsonl", "moved.jsonl", "b.jsonl", "c.jsonl"))
    a.write_text('{"p": 1}\n{"p": 2}\n{"p": 3}\n')
    moved.write_text(a.read_text())
    b.write_text('{"p": 4}\n{"p": 5}\n{"p": 6}\n')
    c.write_text('{"p": 4}\n{"p": 5}\n')
    return {f.stem: train_data_record(DataConfig(train_files=str(f)), num_rows=len(
        f.read_text().splitlines())) for f in (a, moved, b, c)}


def test_the_record_is_the_content(files, tmp_path):
    a = files["a"]
    assert a == {"source": str(tmp_path / "a.jsonl"), "num_rows": 3,
                 "sha256": hashlib.sha256((tmp_path / "a.jsonl").read_bytes()).hexdigest()}
    assert file_sha256(str(tmp_path / "a.jsonl"), chunk_bytes=4) == a["sha256"]  # streamed
    assert train_data_record(DataConfig(synthetic="arith"), num_rows=24) == \
        {"source": "synthetic:arith", "num_rows": 24}


def test_same_content_resumes_silently(files):
    for allow in (False, True):  # a moved file is the same data
        assert check_resume_data(files["a"], files["moved"], saved_sampler=SAMPLER,
                                 checkpoint=CKPT, allow_change=allow) == (False, None)


@pytest.mark.parametrize("new", ["b", "c"])
def test_other_data_is_refused_naming_both_files_and_the_override(files, new):
    a, b = files["a"], files[new]
    with pytest.raises(ValueError) as e:
        check_resume_data(a, b, saved_sampler=SAMPLER, checkpoint=CKPT, allow_change=False)
    assert str(e.value) == (
        f"data.train_files changed since checkpoint {CKPT}: it trained on {a['source']} (3 rows, "
        f"sha256 {a['sha256'][:12]}), this run reads {b['source']} ({b['num_rows']} rows, sha256 "
        f"{b['sha256'][:12]}); resume with the same data, or set "
        "trainer.resume_allow_data_change=true to train on the new prompts (the sampler then "
        "starts its epoch again over them)")
    restart, line = check_resume_data(a, b, saved_sampler=SAMPLER, checkpoint=CKPT,
                                      allow_change=True)
    assert restart and line == (
        f"hybridflow: warning: data.train_files changed since checkpoint {CKPT}: it trained on "
        f"{a['source']} (3 rows, sha256 {a['sha256'][:12]}), this run reads {b['source']} "
        f"({b['num_rows']} rows, sha256 {b['sha256'][:12]}); trainer.resume_allow_data_change=true: "
        "the sampler starts epoch 1 again over the new data")


def test_synthetic_and_file_data_differ(files):
    synthetic = {"source": "synthetic:arith", "num_rows": 3}
    assert check_resume_data(synthetic, synthetic, saved_sampler=SAMPLER, checkpoint=CKPT,
                             allow_change=False) == (False, None)
    with pytest.raises(ValueError, match=r"^data.train_files changed since checkpoint .*: it "
                                         r"trained on synthetic:arith \(3 rows\), this run reads "
                                         r".*a.jsonl \(3 rows, sha256"):
        check_resume_data(synthetic, files["a"], saved_sampler=SAMPLER, checkpoint=CKPT,
                          allow_change=False)
    with pytest.raises(ValueError, match=r"^data.synthetic changed since checkpoint .*: it trained "
                                         r"on synthetic:arith \(3 rows\), this run reads "
                                         r"synthetic:reverse \(3 rows\); "):
        check_resume_data(synthetic, {"source": "synthetic:reverse", "num_rows": 3},
                          saved_sampler=SAMPLER, checkpoint=CKPT, allow_change=False)


def test_checkpoints_without_a_record(files):
    """Saved before checkpoints recorded their data: the sampler's row count is all there is."""
    a, c = files["a"], files["c"]
    restart, line = check_resume_data(None, a, saved_sampler=SAMPLER, checkpoint=CKPT,
                                      allow_change=False)
    assert not restart and line == (
        f"hybridflow: warning: checkpoint {CKPT} does not record its training data (saved by an "
        f"older hybridflow): data.train_files={a['source']} (3 rows) is taken to be the data it "
        "trained on")
    with pytest.raises(ValueError) as e:
        check_resume_data(None, c, saved_sampler=SAMPLER, checkpoint=CKPT, allow_change=False)
    assert str(e.value) == (
        f"data.train_files changed since checkpoint {CKPT}: it trained on 3 rows (its file is not "
        f"recorded), this run reads {c['source']} (2 rows, sha256 {c['sha256'][:12]}); resume with "
        "the same data, or set trainer.resume_allow_data_change=true to train on the new prompts "
        "(the sampler then starts its epoch again over them)")
    restart, line = check_resume_data(None, c, saved_sampler=SAMPLER, checkpoint=CKPT,
                                      allow_change=True)
    assert restart and "the sampler starts epoch 1 again over the new data" in line
    synthetic = {"source": "synthetic:arith", "num_rows": 3}  # the sampler's own checks remain
    assert check_resume_data(None, synthetic, saved_sampler=SAMPLER, checkpoint=CKPT,
                             allow_change=False) == (False, None)
