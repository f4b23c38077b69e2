"""KL estimators, controllers and the in-reward penalty against numbers worked out by hand."""

import math

import pytest
import torch

from hybridflow.algo import apply_kl_penalty, build_kl_controller, kl_estimate

LOGP = torch.tensor([0.0, -1.0, -2.0])
REF = torch.tensor([-1.0, -1.0, 0.0])  # d = logp - ref = [1, 0, -2]


@pytest.mark.parametrize("kind, expected", [
    ("k1", [1.0, 0.0, -2.0]),
    ("k2", [0.5, 0.0, 2.0]),
    # x = ref - logp = [-1, 0, 2]: exp(x) - x - 1
    ("k3", [math.exp(-1.0), 0.0, math.exp(2.0) - 3.0]),
    ("abs", [1.0, 0.0, 2.0]),
])
def test_kl_estimators(kind, expected):
    torch.testing.assert_close(kl_estimate(LOGP, REF, kind), torch.tensor(expected))


def test_k3_clamped():
    # x = ref - logp = 5: exp(5) - 6 = 142.4 -> 10; x = -30 -> clamped to -20: e^-20 + 19 -> 10.
    out = kl_estimate(torch.tensor([0.0, 30.0]), torch.tensor([5.0, 0.0]), "k3")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"'low_var'.*k3"):
        kl_estimate(LOGP, REF, "low_var")


def test_adaptive_controller():
    ctl = build_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    # 9/6 - 1 = 0.5 -> clipped to 0.2; mult = 1 + 0.2 * 500 / 10000 = 1.01
    ctl.update(9.0, n_steps=500)
    assert ctl.value == pytest.approx(0.1 * 1.01)
    # 3/6 - 1 = -0.5 -> -0.2; mult 0.99
    ctl.update(torch.tensor(3.0), n_steps=500)
    assert ctl.value == pytest.approx(0.1 * 1.01 * 0.99)
    # 6.6/6 - 1 = 0.1 (inside the clip); mult = 1 + 0.1 * 0.05 = 1.005
    ctl.update(6.6, n_steps=500)
    assert ctl.value == pytest.approx(0.1 * 1.01 * 0.99 * 1.005)
    other = build_kl_controller("adaptive", kl_coef=1.0, target_kl=6.0, horizon=10000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value


def test_fixed_controller_and_builder_errors():
    ctl = build_kl_controller("fixed", kl_coef=0.05)
    ctl.update(100.0, n_steps=1000)
    assert ctl.value == 0.05
    assert ctl.state_dict() == {"value": 0.05}
    with pytest.raises(ValueError, match="target_kl"):
        build_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="'pid'"):
        build_kl_controller("pid", kl_coef=0.1)


def test_apply_kl_penalty_by_hand():
    # k1, d = logp - ref = [[.1, .2, .3], [.4, junk, junk]], kl_coef 0.5.
    ref = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])
    scores = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rewards, m = apply_kl_penalty(token_scores=scores, logprobs=logp, ref_logprobs=ref,
                                  response_mask=mask, kl_coef=0.5, kind="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [1.8, 0.0, 0.0]]))
    # per-sequence means 0.2 and 0.4, then their mean 0.3
    torch.testing.assert_close(m["kl"], torch.tensor(0.3))
    torch.testing.assert_close(m["kl_coef"], torch.tensor(0.5))
