"""Advantage estimators against numbers worked out by hand (or by plain-Python loops)."""

import math
import statistics

import pytest
import torch

from hybridflow.algo import ADVANTAGE_ESTIMATORS, get_advantage_estimator, register_advantage_estimator

JUNK = 100.0  # sits on masked-out positions; must never reach a result


def whiten(xs):
    """Plain-Python whitening: (x - mean) / sqrt(unbiased var + 1e-8)."""
    mean, var = statistics.fmean(xs), statistics.variance(xs)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def scatter(rows, length):
    """List of per-row valid-prefix values -> (B, T) tensor, 0 after each prefix."""
    return torch.tensor([r + [0.0] * (length - len(r)) for r in rows])


def test_registry_lists_names_on_unknown():
    assert {"gae", "grpo", "grpo_no_std", "rloo", "reinforce_plus_plus",
            "reinforce_plus_plus_baseline"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match=r"'nope'.*grpo"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gae")(lambda **kw: None)


# Two rows, T = 3: row 0 has 3 valid tokens, row 1 has 2 (its last position holds junk).
MASK2 = torch.tensor([[1, 1, 1], [1, 1, 0]])
REWARDS2 = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, JUNK]])
VALUES2 = torch.tensor([[0.5, 0.25, 0.5], [1.0, 0.5, JUNK]])


def test_gae_by_hand():
    # gamma = lam = 0.5.  Row 0: t2: d=1-0.5=0.5, A=0.5; t1: d=0+0.5*0.5-0.25=0, A=0+0.25*0.5=0.125;
    # t0: d=0+0.5*0.25-0.5=-0.375, A=-0.375+0.25*0.125=-0.34375.
    # Row 1 (ends at t1, bootstrap 0): t1: d=2-0.5=1.5, A=1.5; t0: d=0.5*0.5-1=-0.75, A=-0.75+0.25*1.5=-0.375.
    raw = [[-0.34375, 0.125, 0.5], [-0.375, 1.5]]
    adv, ret = get_advantage_estimator("gae")(
        token_rewards=REWARDS2, response_mask=MASK2, values=VALUES2, gamma=0.5, lam=0.5)
    # returns = raw A + V
    torch.testing.assert_close(ret, torch.tensor([[0.15625, 0.375, 1.0], [0.625, 2.0, 0.0]]))
    flat = whiten(raw[0] + raw[1])
    torch.testing.assert_close(adv, scatter([flat[:3], flat[3:]], 3))


def test_gae_gamma_lam_one_is_monte_carlo():
    # gamma = lam = 1: A_t = (reward-to-go) - V_t, returns = reward-to-go.
    adv, ret = get_advantage_estimator("gae")(
        token_rewards=REWARDS2, response_mask=MASK2, values=VALUES2)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    flat = whiten([0.5, 0.75, 0.5, 1.0, 1.5])
    torch.testing.assert_close(adv, scatter([flat[:3], flat[3:]], 3))


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        get_advantage_estimator("gae")(token_rewards=REWARDS2, response_mask=MASK2)


def test_reinforce_plus_plus_by_hand():
    # gamma = 0.5. Row 0: G = [0.25, 0.5, 1]. Row 1: G = [1, 2] (junk after its end ignored).
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(
        token_rewards=REWARDS2, response_mask=MASK2, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    flat = whiten([0.25, 0.5, 1.0, 1.0, 2.0])
    torch.testing.assert_close(adv, scatter([flat[:3], flat[3:]], 3))


# Four rows, T = 3, lengths 3, 2, 1, 2. Groups: rows 0-2 share prompt 7, row 3 is alone (prompt 3).
# Rewards spread over tokens so the score is their sum: scores = [1.0, 0.0, 0.5, 2.0].
MASK4 = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
REWARDS4 = torch.tensor([[0.25, 0.0, 0.75], [0.0, 0.0, JUNK], [0.5, JUNK, JUNK], [1.0, 1.0, JUNK]])
GROUPS4 = torch.tensor([7, 7, 7, 3])


def per_seq(advs):
    """Per-sequence advantages -> (B, T) broadcast over MASK4."""
    return torch.tensor(advs)[:, None] * MASK4.float()


def test_grpo_by_hand():
    # Group 7: mean 0.5, unbiased std sqrt((0.25+0.25+0)/2) = 0.5. Row 3 alone: mean 0, std 1.
    eps = 1e-6
    adv, ret = get_advantage_estimator("grpo")(
        token_rewards=REWARDS4, response_mask=MASK4, group_ids=GROUPS4, eps=eps)
    expected = per_seq([0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.0, 2.0 / (1.0 + eps)])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_dr_grpo_no_std():
    expected = per_seq([0.5, -0.5, 0.0, 2.0])
    adv, _ = get_advantage_estimator("grpo")(
        token_rewards=REWARDS4, response_mask=MASK4, group_ids=GROUPS4, norm_by_std=False)
    torch.testing.assert_close(adv, expected)
    adv, _ = get_advantage_estimator("grpo_no_std")(
        token_rewards=REWARDS4, response_mask=MASK4, group_ids=GROUPS4)
    torch.testing.assert_close(adv, expected)


def test_grpo_group_order_independent():
    # Same groups, interleaved rows: results follow their rows.
    perm = torch.tensor([3, 0, 2, 1])
    adv, _ = get_advantage_estimator("grpo")(
        token_rewards=REWARDS4[perm], response_mask=MASK4[perm], group_ids=GROUPS4[perm], eps=0.0)
    torch.testing.assert_close(adv, per_seq([1.0, -1.0, 0.0, 2.0])[perm])


def test_rloo_by_hand():
    # Group 7 scores [1, 0, 0.5]: 1 - (0+0.5)/2 = 0.75; 0 - (1+0.5)/2 = -0.75; 0.5 - (1+0)/2 = 0.
    # Row 3 alone: baseline 0, advantage = score = 2.
    adv, ret = get_advantage_estimator("rloo")(
        token_rewards=REWARDS4, response_mask=MASK4, group_ids=GROUPS4)
    torch.testing.assert_close(adv, per_seq([0.75, -0.75, 0.0, 2.0]))
    torch.testing.assert_close(ret, adv)


def test_reinforce_plus_plus_baseline_by_hand():
    # Centered scores: group 7 -> [0.5, -0.5, 0.0], row 3 alone -> 2.0; broadcast over lengths 3,2,1,2
    # then whitened over all 8 valid tokens.
    flat = whiten([0.5] * 3 + [-0.5] * 2 + [0.0] + [2.0] * 2)
    adv, ret = get_advantage_estimator("reinforce_plus_plus_baseline")(
        token_rewards=REWARDS4, response_mask=MASK4, group_ids=GROUPS4)
    torch.testing.assert_close(adv, scatter([flat[0:3], flat[3:5], flat[5:6], flat[6:8]], 3))
    torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_need_group_ids(name):
    with pytest.raises(ValueError, match="group_ids"):
        get_advantage_estimator(name)(token_rewards=REWARDS4, response_mask=MASK4)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_zero_off_mask_and_uniform_signature(name):
    out = get_advantage_estimator(name)(
        token_rewards=REWARDS4, response_mask=MASK4, values=torch.full((4, 3), JUNK),
        group_ids=GROUPS4, gamma=0.9, lam=0.95, norm_by_std=True, eps=1e-6)
    for t in out:
        assert t.shape == (4, 3) and t.dtype == torch.float32
        assert torch.isfinite(t).all()
        assert (t[MASK4 == 0] == 0).all()


def test_shape_mismatch_is_value_error():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        get_advantage_estimator("grpo")(
            token_rewards=REWARDS4, response_mask=MASK4[:, :2], group_ids=GROUPS4)
