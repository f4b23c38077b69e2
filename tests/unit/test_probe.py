"""The probe's cost-model prediction is made at the lengths its steps measured (hybridflow/probe.py)."""

import pytest

from hybridflow.config import load_config
from hybridflow.probe import _lengths, _prediction


def test_prediction_at_the_measured_lengths():
    # token-budget micro-batches (fixed ones are padded to the step's longest row, at any mean)
    cfg = load_config(["experiment=demo", "model=qwen2_0_5b", "data.max_prompt_length=256", "rollout.max_new_tokens=1024",
                       "trainer.precision=bf16", "algo.use_dynamic_bsz=true",
                       "algo.max_tokens_per_micro_batch_per_gpu=8192",
                       "algo.forward_max_tokens_per_micro_batch_per_gpu=16384"])
    history = [{"prompt_length/mean": 130.2, "response_length/mean": m, "response_length/max": mx}
               for m, mx in ((320.0, 900.0), (330.4, 1024.0), (340.0, 700.0))]
    got = _lengths(cfg, history)
    # the response lengths as a distribution: the median step's mean (330.4), longest 1,024
    assert (got["prompt_len"], got["prompt_len_max"]) == (130, 130)
    assert sum(got["response_lengths"]) / len(got["response_lengths"]) == pytest.approx(330.4, rel=0.01)
    assert max(got["response_lengths"]) == 1024
    assert _lengths(cfg, []) == dict(prompt_len=256, response_len=1024)  # nothing measured: maxima
    measured = _prediction(cfg, "H200", 1, history)["timing_s"]
    maxima = _prediction(cfg, "H200", 1)["timing_s"]
    # the training passes see ~460-token sequences instead of 1,280: much cheaper; generation still
    # decodes until the longest row (1,024) ends
    # (less than the token ratio: rows of different lengths run masked attention kernels)
    assert measured["timing_s/update_actor"] < 0.75 * maxima["timing_s/update_actor"]
    assert 0.3 * maxima["timing_s/gen"] < measured["timing_s/gen"] < maxima["timing_s/gen"]
