"""The probe's cost-model prediction is made at the lengths its steps measured (hybridflow/probe.py)."""

from hybridflow.config import load_config
from hybridflow.probe import _lengths, _prediction


def test_prediction_at_the_measured_lengths():
    cfg = load_config(["experiment=demo", "model=qwen2_0_5b", "data.max_prompt_length=256", "rollout.max_new_tokens=1024",
                       "trainer.precision=bf16"])
    history = [{"prompt_length/mean": 130.2, "response_length/mean": m, "response_length/max": mx}
               for m, mx in ((320.0, 900.0), (330.4, 1024.0), (340.0, 700.0))]
    assert _lengths(cfg, history) == dict(prompt_len=130, response_len=330, response_len_max=1024)
    assert _lengths(cfg, []) == dict(prompt_len=256, response_len=1024)  # nothing measured: maxima
    measured = _prediction(cfg, "H200", 1, history)["timing_s"]
    maxima = _prediction(cfg, "H200", 1)["timing_s"]
    # the training passes see ~460-token sequences instead of 1,280: much cheaper; generation still
    # decodes until the longest row (1,024) ends
    assert measured["timing_s/update_actor"] < 0.5 * maxima["timing_s/update_actor"]
    assert 0.3 * maxima["timing_s/gen"] < measured["timing_s/gen"] < maxima["timing_s/gen"]
