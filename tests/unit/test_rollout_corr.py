"""Rollout / training mismatch: TIS weights and the mismatch metrics by hand."""

import math

import pytest
import torch

from hybridflow.algo import rollout_mismatch_metrics, tis_weights

JUNK = 100.0


def test_tis_weights_by_hand():
    # pi_old / pi_rollout = 0.5, 3, 1 -> capped at 2: 0.5, 2, 1; no gradient flows to old log-probs
    rollout = torch.log(torch.tensor([[0.4, 0.1, 0.3]]))
    old = torch.log(torch.tensor([[0.2, 0.3, 0.3]])).requires_grad_()
    w = tis_weights(old_logprobs=old, rollout_logprobs=rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 2.0, 1.0]]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="tis_imp_ratio_cap"):
        tis_weights(old_logprobs=old, rollout_logprobs=rollout, cap=0.0)


def test_mismatch_metrics_by_hand():
    # valid tokens: (p_rollout, p_old) = (0.5, 0.4), (0.2, 0.3), (0.9, 0.9); one masked junk entry
    rollout = torch.log(torch.tensor([[0.5, 0.2], [0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.4, 0.3], [0.9, JUNK]]).clamp(max=1.0))
    mask = torch.tensor([[1, 1], [1, 0]])
    m = rollout_mismatch_metrics(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                                 cap=1.2)
    pr, po = [0.5, 0.2, 0.9], [0.4, 0.3, 0.9]
    diffs = [abs(a - b) for a, b in zip(pr, po)]
    mean = sum(diffs) / 3
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(mean)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(
        math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2))
    logd = [math.log(a) - math.log(b) for a, b in zip(pr, po)]  # log p_rollout - log p_old
    assert m["training/rollout_logprobs_diff_mean"] == pytest.approx(sum(map(abs, logd)) / 3)
    assert m["training/rollout_logprobs_diff_max"] == pytest.approx(math.log(0.3 / 0.2))
    assert m["rollout_corr/kl"] == pytest.approx(sum(logd) / 3)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(-x) + x - 1 for x in logd) / 3)
    ratios = [b / a for a, b in zip(pr, po)]  # 0.8, 1.5, 1.0 -> capped 0.8, 1.2, 1.0
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((0.8 + 1.2 + 1.0) / 3)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert sum(r > 1.2 for r in ratios) == 1


def test_mismatch_metrics_identical_and_empty():
    lp = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    m = rollout_mismatch_metrics(old_logprobs=lp, rollout_logprobs=lp.clone(),
                                 response_mask=torch.ones(3, 4))
    assert all(v == pytest.approx(0.0, abs=1e-12) for v in m.values())
    assert "rollout_corr/rollout_is_mean" not in m
    assert rollout_mismatch_metrics(old_logprobs=lp, rollout_logprobs=lp,
                                    response_mask=torch.zeros(3, 4)) == {}


def _dense_metrics(old, rollout, mask, cap):
    """The metrics over the whole (B, T) with masked reductions: what the valid-token form must
    equal (padding holding NaN / inf must not leak)."""
    from hybridflow.algo.masked import masked_mean, masked_var

    mask = mask.bool()
    old, rollout = old.double(), rollout.double()
    prob_diff = (rollout.exp() - old.exp()).abs()
    d = old - rollout
    zero = torch.tensor(0.0, dtype=torch.float64)
    w = tis_weights(old_logprobs=old, rollout_logprobs=rollout, cap=cap)
    return {"training/rollout_probs_diff_mean": masked_mean(prob_diff, mask),
            "training/rollout_probs_diff_max": torch.where(mask, prob_diff, zero).max(),
            "training/rollout_probs_diff_std": masked_var(prob_diff, mask).sqrt(),
            "training/rollout_logprobs_diff_mean": masked_mean(d.abs(), mask),
            "training/rollout_logprobs_diff_max": torch.where(mask, d.abs(), zero).max(),
            "rollout_corr/kl": masked_mean(rollout - old, mask),
            "rollout_corr/k3_kl": masked_mean(torch.expm1(d.clamp(max=20.0)) - d, mask),
            "rollout_corr/rollout_is_mean": masked_mean(w, mask),
            "rollout_corr/rollout_is_ratio_fraction_high": masked_mean((d.exp() > cap).double(),
                                                                       mask)}


def test_mismatch_metrics_equal_the_masked_reductions_over_a_ragged_batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 37, 200, 5, 1024, 64])
    mask = torch.arange(1024)[None] < lengths[:, None]
    old = -torch.rand(6, 1024, generator=g) * 3
    rollout = old + 0.05 * torch.randn(6, 1024, generator=g)
    old[~mask], rollout[~mask] = float("nan"), float("-inf")  # padding the valid tokens never see
    got = rollout_mismatch_metrics(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                                   cap=1.05)
    want = _dense_metrics(old, rollout, mask, cap=1.05)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), rel=1e-12, abs=1e-15), k
    one = torch.zeros(6, 1024, dtype=torch.bool)
    one[2, 7] = True  # a single valid token: its spread is 0, as the masked variance has it
    got = rollout_mismatch_metrics(old_logprobs=old, rollout_logprobs=rollout, response_mask=one)
    assert got["training/rollout_probs_diff_std"] == 0.0
    assert got["rollout_corr/kl"] == pytest.approx(float(rollout[2, 7] - old[2, 7]), rel=1e-12)
