"""Rollout / training mismatch: how far the generator's log-probs are from the training forward's,
and truncated importance sampling (TIS) to correct for it.

The generator samples from pi_rollout (its own kernels, bf16 decode, KV cache); the loss treats the
samples as drawn from pi_old, the training engine's forward on the same weights. They differ by
numerics. With d = logp_old - logp_rollout per valid token:
    TIS weight      w = min(exp(d), C)                 (Yao et al. 2025; verl's tis_imp_ratio_cap C)
                    multiplied into the per-token policy loss, detached. Capping only from above
                    bounds the variance; tokens the trainer finds less likely than the sampler get w < 1.
Metrics (verl's names where verl has the metric):
    training/rollout_probs_diff_{mean,max,std}  |p_rollout - p_old| over valid tokens (probabilities)
    training/rollout_logprobs_diff_{mean,max}   |logp_rollout - logp_old| (log space; ours)
    rollout_corr/kl                              mean(logp_rollout - logp_old): KL(rollout || old), k1
    rollout_corr/k3_kl                           mean(exp(d) - d - 1), k3 of the same KL
    rollout_corr/rollout_is_mean                 mean TIS weight (with a cap)
    rollout_corr/rollout_is_ratio_fraction_high  fraction of tokens with exp(d) > C (with a cap)
"""

import math
from typing import Optional

import torch
from torch import Tensor


def tis_weights(*, old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """min(pi_old / pi_rollout, cap) per token, (B, T); no gradient. Padding entries are arbitrary
    (finite) and must be masked by the caller's aggregation."""
    if cap <= 0:
        raise ValueError(f"TIS cap (algo.tis_imp_ratio_cap) must be > 0, got {cap}")
    d = (old_logprobs - rollout_logprobs).detach()
    return torch.exp(d.clamp(max=math.log(cap)))


def rollout_mismatch_metrics(*, old_logprobs: Tensor, rollout_logprobs: Tensor,
                             response_mask: Tensor, cap: Optional[float] = None) -> dict:
    """The module doc's metrics over the valid tokens of (B, T) inputs, as Python floats. The
    valid tokens are taken out first: in a long-tailed batch most of (B, T) is padding, and every
    reduction runs in float64."""
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    old, rollout = old_logprobs[mask].double(), rollout_logprobs[mask].double()
    prob_diff = (rollout.exp() - old.exp()).abs()
    d = old - rollout
    log_diff = d.abs()
    out = {
        "training/rollout_probs_diff_mean": prob_diff.mean(),
        "training/rollout_probs_diff_max": prob_diff.max(),
        "training/rollout_probs_diff_std": (prob_diff.var().sqrt() if prob_diff.numel() > 1
                                            else torch.zeros((), dtype=torch.float64)),
        "training/rollout_logprobs_diff_mean": log_diff.mean(),
        "training/rollout_logprobs_diff_max": log_diff.max(),
        "rollout_corr/kl": (rollout - old).mean(),
        "rollout_corr/k3_kl": (torch.expm1(d.clamp(max=20.0)) - d).mean(),
    }
    if cap is not None:
        w = tis_weights(old_logprobs=old, rollout_logprobs=rollout, cap=cap)
        out["rollout_corr/rollout_is_mean"] = w.mean()
        out["rollout_corr/rollout_is_ratio_fraction_high"] = (d.exp() > cap).double().mean()
    return {k: float(v) for k, v in out.items()}


def batch_mismatch_metrics(batch, *, cap: Optional[float] = None) -> dict:
    """The metrics above for a RolloutBatch: old_logprobs vs rollout_logprobs ({} without them)."""
    if batch.rollout_logprobs is None:
        return {}
    return rollout_mismatch_metrics(old_logprobs=batch.old_logprobs,
                                    rollout_logprobs=batch.rollout_logprobs,
                                    response_mask=batch.loss_mask(), cap=cap)
