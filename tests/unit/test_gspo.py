"""GSPO and GSPO-token against numbers worked out by hand."""

import math

import pytest
import torch

from hybridflow.algo import AGG_MODES, get_policy_loss

JUNK = 100.0


# Row 0: d = logp - logp_old = [0.3, -0.1, 0.1] -> log s_0 = 0.1, s_0 = e^0.1 = 1.10517; A_0 = -1.
#        -A s = 1.10517, -A clip(s, 0.8, 1.05) = 1.05 -> max 1.10517, unclipped.
# Row 1: d = [-0.4] (then junk)   -> s_1 = e^-0.4 = 0.67032; A_1 = -2.
#        -A s = 1.34064, -A clip(s) = 2 * 0.8 = 1.6 -> max 1.6, clipped (no gradient).
D = torch.tensor([[0.3, -0.1, 0.1], [-0.4, JUNK, JUNK]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
ADV = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, JUNK, JUNK]])
S0 = math.exp(0.1)


def run(name, advantages=ADV, **kw):
    old = torch.full((2, 3), -2.0)
    logprobs = (old + D).requires_grad_()
    args = dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=MASK,
                clip_ratio_low=0.2, clip_ratio_high=0.05, agg_mode="seq-mean-token-mean")
    args.update(kw)
    loss, metrics = get_policy_loss(name)(**args)
    loss.backward()
    return loss, metrics, logprobs.grad


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_by_hand(name):
    loss, m, grad = run(name)
    torch.testing.assert_close(loss, torch.tensor((S0 + 1.6) / 2))
    # d l_0 / d logp_t = -A_0 s_0 / |y_0| on row 0's tokens, times the sequence mean's 1/2.
    torch.testing.assert_close(grad, torch.tensor([[S0 / 3 / 2] * 3, [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(1 / 4))  # row 1's one token
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(-(0.3 - 0.1 + 0.1 - 0.4) / 4))
    assert m["pg_clipfrac_lower"] == 0


def test_gspo_token_mean_weighs_sequences_by_length():
    loss, _, _ = run("gspo", agg_mode="token-mean")
    torch.testing.assert_close(loss, torch.tensor((3 * S0 + 1.6) / 4))


def test_clipping_is_per_sequence():
    # A sequence whose geometric mean stays inside the range is not clipped even if single token
    # ratios are far outside it (the token-level PPO clip would clip tokens 0 and 1 here).
    d = torch.tensor([[0.5, -0.5, 0.0]])
    old = torch.zeros(1, 3)
    logprobs = (old + d).requires_grad_()
    loss, m = get_policy_loss("gspo")(logprobs=logprobs, old_logprobs=old,
                                      advantages=torch.ones(1, 3), response_mask=torch.ones(1, 3),
                                      clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    torch.testing.assert_close(loss, torch.tensor(-1.0))
    assert m["pg_clipfrac"] == 0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.full((1, 3), -1 / 3))
    _, m_ppo = get_policy_loss("vanilla")(logprobs=logprobs.detach(), old_logprobs=old,
                                          advantages=torch.ones(1, 3),
                                          response_mask=torch.ones(1, 3),
                                          clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    torch.testing.assert_close(m_ppo["pg_clipfrac"], torch.tensor(1 / 3))  # token 0 (high side)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_token_equals_gspo_for_sequence_advantages(mode):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 2, 4, 1])
    mask = (torch.arange(5)[None] < lengths[:, None]).long()
    old = -torch.rand(4, 5, generator=gen) * 3
    d = 0.05 * torch.randn(4, 5, generator=gen)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])[:, None] * mask
    out = {}
    for name in ("gspo", "gspo_token"):
        logprobs = (old + d).requires_grad_()
        loss, m = get_policy_loss(name)(logprobs=logprobs, old_logprobs=old, advantages=adv,
                                        response_mask=mask, clip_ratio_low=0.02,
                                        clip_ratio_high=0.03, agg_mode=mode, loss_scale_factor=5)
        loss.backward()
        out[name] = (loss, logprobs.grad, m["pg_clipfrac"])
    assert out["gspo"][2] > 0  # some sequences are clipped and some are not
    for a, b in zip(out["gspo"], out["gspo_token"]):
        torch.testing.assert_close(a, b)


def test_gspo_token_uses_per_token_advantages():
    # One row, d = [0.2, 0.0] -> s = e^0.1 = 1.10517 (value on both tokens); A = [1, -1];
    # clip (0.8, 1.05): token 0: max(-s, -1.05) = -1.05 clipped; token 1: max(s, 1.05) = s, unclipped.
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[0.2, 0.0]], requires_grad=True)
    loss, m = get_policy_loss("gspo_token")(logprobs=logprobs, old_logprobs=old,
                                            advantages=torch.tensor([[1.0, -1.0]]),
                                            response_mask=torch.ones(1, 2), clip_ratio_low=0.2,
                                            clip_ratio_high=0.05)
    s = math.exp(0.1)
    torch.testing.assert_close(loss, torch.tensor((-1.05 + s) / 2))
    loss.backward()  # only token 1 carries a gradient: d(s_it)/d logp_1 = s
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, s / 2]]))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.5))


def test_gspo_rollout_is_weights():
    w = torch.tensor([[2.0, 0.5, 1.0], [0.25, JUNK, JUNK]])
    loss, _, _ = run("gspo", rollout_is_weights=w)
    torch.testing.assert_close(loss, torch.tensor((S0 * (2 + 0.5 + 1) / 3 + 1.6 * 0.25) / 2))
