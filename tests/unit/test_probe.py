"""The probe's cost-model prediction is made at the lengths its steps measured, and says what the
estimator would change at them (hybridflow/probe.py)."""

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


def test_prediction_says_what_the_estimator_would_change():
    """GSM8K's lengths (mean ~300, longest 1,024, every step): partial rollouts are suggested with
    the overrides that run them; the same run with them on, or with short responses: nothing."""
    gsm8k = ["experiment=gsm8k_qwen_coder_0_5b", "rollout.decode_kernels=triton"]  # (as on a GPU)
    history = [{"prompt_length/mean": 105.0, "prompt_length/max": 232.0,
                "response_length/mean": m, "response_length/max": 1024.0,
                "response_length/clip_ratio": 0.01} for m in (290.0, 300.0, 310.0)]
    consider = _prediction(load_config(gsm8k), "H100", 1, history)["consider"]
    assert len(consider) == 1 and consider[0].startswith("consider rollout.partial.enable=true")
    on = gsm8k + ["rollout.partial.enable=true", "rollout.partial.max_decode_steps=512",
                  "rollout.partial.extra_prompts=32", "rollout.max_batch_size=576",
                  "algo.tis_imp_ratio_cap=2.0"]
    assert _prediction(load_config(on), "H100", 1, history)["consider"] == []
    short = [dict(h, **{"response_length/max": 400.0, "response_length/clip_ratio": 0.0})
             for h in history]
    assert _prediction(load_config(gsm8k), "H100", 1, short)["consider"] == []


def test_observed_lengths_replace_the_fitted_shape(tmp_path):
    """With the probe steps' response lengths (the trainer hands them to `Probe.on_lengths`), the
    prediction and probe.json's lengths are those lengths, not a shape fitted to the statistics
    (here rows spread evenly up to 530 tokens but for 6 at the cap, against the log-normal of the
    same mean, longest and share at the cap)."""
    import json

    from hybridflow.cost.lengths import load_lengths, quantile_points
    from hybridflow.probe import Probe, _length_stats

    gsm8k = load_config(["experiment=gsm8k_qwen_coder_0_5b", "rollout.decode_kernels=triton"])
    rows = [40 + (490 * j) // 505 for j in range(506)] + [1024] * 6     # 512 rows, mean ~288
    mean = sum(rows) / len(rows)
    history = [{"prompt_length/mean": 105.0, "prompt_length/max": 232.0,
                "response_length/mean": mean, "response_length/max": 1024.0,
                "response_length/min": 40.0, "response_length/clip_ratio": 6 / 512}] * 2
    points = quantile_points(rows * 2)
    assert _lengths(gsm8k, history, points)["response_lengths"] == quantile_points(rows * 2)
    fitted = _prediction(gsm8k, "H100", 1, history)["timing_s"]["timing_s/gen"]
    observed = _prediction(gsm8k, "H100", 1, history, points)["timing_s"]["timing_s/gen"]
    assert abs(observed / fitted - 1) > 0.005
    w = dict(_lengths(gsm8k, history), response_lengths=quantile_points(rows * 2))
    assert _lengths(gsm8k, history, points) == w
    stats = _length_stats(history, points)
    (tmp_path / "probe.json").write_text(json.dumps({"lengths": stats}))
    assert load_lengths(tmp_path / "probe.json", cap=1024)["response_lengths"] == quantile_points(
        rows * 2)
    probe = Probe(gsm8k, start_step=0)
    probe.on_lengths(1, rows)
    probe.on_lengths(2, None)                                   # a step that trained nothing
    assert probe.response_lengths == rows
