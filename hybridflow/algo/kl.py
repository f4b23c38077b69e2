"""KL between the policy and the reference: per-token estimators, coefficient controllers,
and the KL penalty folded into the reward.

Estimators of KL(pi || pi_ref) from samples of pi (J. Schulman, "Approximating KL
Divergence", 2020), with d = logp - logp_ref per token:
    k1  = d                      unbiased, high variance, can be negative
    k2  = 0.5 * d^2              biased, low variance, >= 0
    k3  = exp(-d) + d - 1        unbiased, low variance, >= 0 ("low_var_kl" in verl);
                                 -d clamped to [-20, 20] before exp, result to [-10, 10]
    abs = |d|
Controllers give the coefficient beta of the in-reward penalty r_t = score_t - beta * kl_t:
fixed, or adaptive (Ziegler et al. 2019): e = clip(KL / target - 1, -0.2, 0.2),
beta <- beta * (1 + e * n_steps / horizon).
"""

from typing import Optional, Union

import torch
from torch import Tensor

from hybridflow.algo.masked import masked_mean

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate, same shape as the inputs (B, T)."""
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        neg = (-diff).clamp(-20.0, 20.0)  # log(pi_ref / pi)
        return (torch.exp(neg) - neg - 1).clamp(-10.0, 10.0)
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {KL_KINDS}")


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: Union[float, Tensor], n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al.: move beta so the measured KL tracks target_kl over `horizon` samples."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL controller needs target_kl > 0 and horizon > 0, "
                             f"got target_kl={target_kl}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: Union[float, Tensor], n_steps: int) -> None:
        """`current_kl`: the batch's mean KL; `n_steps`: samples in the batch."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def build_kl_controller(kind: str = "fixed", *, kl_coef: float, target_kl: Optional[float] = None,
                        horizon: Optional[int] = None) -> Union[FixedKLController, AdaptiveKLController]:
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("kl_ctrl='adaptive' needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected 'fixed' or 'adaptive'")


def apply_kl_penalty(*, token_scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor,
                     response_mask: Tensor, kl_coef: float, kind: str) -> tuple[Tensor, dict]:
    """token_rewards = token_scores - kl_coef * kl, all (B, T), 0 off the mask.

    metrics: "kl" = per-sequence mean KL over valid tokens, averaged over sequences that have
    any (verl's `reward_kl_penalty`; feed it to the controller's update), "kl_coef"; 0-dim tensors.
    """
    mask = response_mask.bool()
    kl = torch.where(mask, kl_estimate(logprobs, ref_logprobs, kind), 0.0)  # (B, T)
    rewards = torch.where(mask, token_scores - kl_coef * kl, 0.0)
    per_seq = masked_mean(kl, mask, dim=-1)  # (B,)
    current = masked_mean(per_seq, mask.any(dim=-1))
    metrics = {"kl": current.detach(), "kl_coef": torch.tensor(float(kl_coef))}
    return rewards, metrics
