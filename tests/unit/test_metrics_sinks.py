"""MetricsLogger at start-up and at the end: an unwritable sink is one OSError naming the file and
the errno (real errors: a directory where the log file goes, a file where the tensorboard dir
goes); the reward summary numbers the real steps of a resumed run."""

from __future__ import annotations

import errno

import pytest

from hybridflow.metrics import MetricsLogger


def _logger(path, **kw):
    return MetricsLogger(str(path), total_steps=10, enabled=True, progress_bar=False, **kw)


def test_unwritable_sinks_name_the_path_and_errno(tmp_path):
    (tmp_path / "a" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(OSError) as info:
        _logger(tmp_path / "a", tensorboard=False)
    assert info.value.errno == errno.EISDIR
    assert info.value.filename == str(tmp_path / "a" / "metrics.jsonl")
    assert str(info.value).startswith("[Errno 21] cannot open the metrics log: Is a directory")

    pytest.importorskip("torch.utils.tensorboard")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tensorboard").write_text("not a dir")
    with pytest.raises(OSError) as info:
        _logger(tmp_path / "b", tensorboard=True)
    assert info.value.errno == errno.EEXIST and "tensorboard" in str(info.value)
    assert info.value.filename == str(tmp_path / "b" / "tensorboard")


def test_summary_numbers_the_real_steps(tmp_path, capsys):
    log = _logger(tmp_path, tensorboard=False)
    history = [{"critic/score/mean": float(i)} for i in range(6)]  # steps 5..10 after a resume
    log.summary(history, first_step=5, windows=3)
    log.summary(history[:1], first_step=8)
    log.close()
    out = capsys.readouterr().out.splitlines()
    # windows of 2: (0+1)/2, (2+3)/2, (4+5)/2
    assert out == ["mean reward by steps  5-6: 0.500 | 7-8: 2.500 | 9-10: 4.500",
                   "mean reward by steps  8-8: 0.000"]


def test_rollout_lengths_log(tmp_path):
    """One line per step with every trained response's length; none from a disabled logger."""
    import json

    log = _logger(tmp_path / "run", tensorboard=False)
    log.log_lengths(1, [3, 5, 1024])
    log.log_lengths(2, (7,))
    log.log_lengths(3, None)            # a step that trained nothing
    log.close()
    lines = (tmp_path / "run" / MetricsLogger.LENGTHS_FILE).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 1, "response_lengths": [3, 5, 1024]},
                                             {"step": 2, "response_lengths": [7]}]
    off = MetricsLogger(str(tmp_path / "off"), total_steps=1, enabled=False, tensorboard=False,
                        progress_bar=False)
    off.log_lengths(1, [1])
    assert not (tmp_path / "off").exists()
    (tmp_path / "bad" / MetricsLogger.LENGTHS_FILE).mkdir(parents=True)
    bad = _logger(tmp_path / "bad", tensorboard=False)
    with pytest.raises(OSError, match="cannot open the rollout lengths log"):
        bad.log_lengths(1, [1])
