"""The packed-pass bench's inputs (benchmarks/bench_packed_pass.py): a trainer step's own
response lengths (--lengths-from FILE:STEP) and token ids drawn as text repeats them (--ids zipf)."""

import argparse
import json

import pytest
import torch


def _args(**kw):
    from benchmarks.bench_packed_pass import add_length_args

    ap = argparse.ArgumentParser()
    add_length_args(ap)
    return ap.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_lengths_from_a_trainer_step(tmp_path):
    from benchmarks.bench_packed_pass import gsm8k_lengths

    f = tmp_path / "rollout_lengths.jsonl"
    f.write_text("\n".join(json.dumps({"step": s, "response_lengths": [s, s + 1, 7]})
                           for s in (1, 2)) + "\n")
    assert gsm8k_lengths(_args(lengths_from=f"{f}:2")) == [2, 3, 7]
    with pytest.raises(SystemExit, match="no step 5"):
        gsm8k_lengths(_args(lengths_from=f"{f}:5"))
    with pytest.raises(SystemExit, match="expected FILE:STEP"):
        gsm8k_lengths(_args(lengths_from=str(f)))
    assert len(gsm8k_lengths(_args(rows=16))) == 16  # without it: the fitted distribution


def test_zipf_ids_repeat_and_stay_in_the_vocabulary():
    from benchmarks.bench_packed_pass import make_batch, token_ids

    g = torch.Generator().manual_seed(0)
    z = token_ids((64, 100), 5000, g, "zipf")
    u = token_ids((64, 100), 5000, g, "uniform")
    assert z.shape == (64, 100) and int(z.min()) >= 1 and int(z.max()) < 5000
    # the most frequent id of 6,400 draws: ~1/ln(5000) of them under 1/k weights, a few uniform
    assert int(z.flatten().bincount().max()) > 400 > int(u.flatten().bincount().max())
    with pytest.raises(ValueError, match="--ids 'pareto'"):
        token_ids((2, 2), 10, g, "pareto")
    b = make_batch(4, [3, 5], 5000, ids="zipf")
    assert int(b.response_ids[0, 3:].abs().sum()) == 0  # masked past each row's length
