"""Policy, value, entropy and KL losses: pure tensor functions; policy losses in a registry.

Aggregation (`agg_loss`, verl's `loss_agg_mode` names) turns a per-token loss l (B, T) over the
mask m into a scalar:
    token-mean               sum_{i,t} m l / N_tokens                      (DAPO; every token weighs the same)
    seq-mean-token-sum       sum_i (sum_t m l) / N_seqs                    (length-weighted sum per sequence)
    seq-mean-token-mean      sum_i (sum_t m l / sum_t m) / N_seqs          (original GRPO, GSPO)
    seq-mean-token-sum-norm  sum_{i,t} m l / (N_seqs * C)                  (Dr.GRPO: a constant C, the max
                                                                            response length, for 1/|o_i|)
Normalisers are GLOBAL. N_tokens / N_seqs default to this batch's valid tokens / sequences with any
valid token. A trainer that splits a mini-batch into micro-batches (and over DP ranks) passes the
mini-batch's totals as `num_tokens` / `num_seqs`; each micro-batch loss is then its share, and the
sum of the micro-batch losses over all micro-batches and ranks equals the loss of the whole
mini-batch. (DP's gradient all-reduce averages, so the engine scales by the DP size to get that sum.)
C (`loss_scale_factor`) has no default: a batch's padded width changes with trimming and with the
micro-batch split, so the caller passes a constant (the trainer: rollout.max_new_tokens, verl's
default). Unlike verl's seq-mean-token-sum-norm (sum / C), we also divide by N_seqs, as in Dr.GRPO's
objective (1/G sum_i), so the loss scale does not grow with the batch size.

The vanilla PPO policy loss, with r = exp(clamp(logp - logp_old, -20, 20)) and advantage A:
    l     = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))     (clip-higher: DAPO)
    l     = min(l, -A c)  where A < 0                                (dual-clip, Ye et al. 2020)
The dual clip bounds the loss of a token whose ratio ran far up with a negative advantage.
Every policy loss takes `rollout_is_weights` (B, T) or None: per-token weights (detached), multiplied
into the per-token loss before aggregation: truncated importance sampling (TIS) against the
rollout engine's log-probs, see hybridflow.algo.rollout_corr.
"""

from typing import Optional

import torch
from torch import Tensor

from hybridflow.algo.kl import kl_estimate
from hybridflow.algo.masked import masked_mean, masked_sum
from hybridflow.registry import Registry

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

POLICY_LOSSES = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.lookup


def _denominator(local: Tensor, given: Optional[float], name: str) -> Tensor | float:
    if given is None:
        return local.clamp_min(1)
    if given <= 0:
        raise ValueError(f"{name} must be > 0, got {given}")
    # a Python float, not a new device tensor: building one from a host scalar is a blocking copy,
    # i.e. a stream sync per micro-batch that stops the host from queueing ahead of the GPU
    return float(given)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, *, num_tokens: Optional[float] = None,
             num_seqs: Optional[float] = None, loss_scale_factor: Optional[float] = None) -> Tensor:
    """Aggregate a per-token loss (B, T) over `mask` (B, T) into a 0-dim tensor (see module doc)."""
    mask = mask.bool()
    if mode == "token-mean":
        local = mask.sum().to(loss_mat.dtype)
        return masked_sum(loss_mat, mask) / _denominator(local, num_tokens, "num_tokens")
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        seq = masked_sum(loss_mat, mask, dim=-1)  # (B,)
        if mode == "seq-mean-token-mean":
            seq = seq / mask.sum(dim=-1).clamp_min(1)
        local = mask.any(dim=-1).sum().to(loss_mat.dtype)
        loss = seq.sum() / _denominator(local, num_seqs, "num_seqs")
        if mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None or loss_scale_factor <= 0:
                raise ValueError(f"loss_agg_mode 'seq-mean-token-sum-norm' needs a constant "
                                 f"loss_scale_factor > 0 (e.g. the max response length), got "
                                 f"{loss_scale_factor}")
            loss = loss / loss_scale_factor
        return loss
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")


def weighted(loss_mat: Tensor, rollout_is_weights: Optional[Tensor]) -> Tensor:
    """loss_mat * weights (detached) when weights are given (TIS), else loss_mat; (B, T)."""
    return loss_mat if rollout_is_weights is None else loss_mat * rollout_is_weights.detach()


@register_policy_loss("vanilla")
def policy_loss_vanilla(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                        response_mask: Tensor, clip_ratio_low: float = 0.2,
                        clip_ratio_high: float = 0.2, clip_ratio_c: Optional[float] = 3.0,
                        agg_mode: str = "token-mean", num_tokens: Optional[float] = None,
                        num_seqs: Optional[float] = None, loss_scale_factor: Optional[float] = None,
                        rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """Clipped PPO surrogate with asymmetric clip and dual clip; all inputs (B, T).

    metrics (0-dim, detached, means over this batch's valid tokens): pg_clipfrac (the clip
    bound was active), pg_clipfrac_lower (the dual clip was active), ppo_kl (mean logp_old - logp).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to disable dual clip), got {clip_ratio_c}")
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # (B, T)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    if clip_ratio_c is not None:
        loss_dual = -advantages * clip_ratio_c
        negative = advantages < 0
        clipfrac_lower = masked_mean(((loss > loss_dual) & negative).float(), response_mask)
        loss = torch.where(negative, torch.minimum(loss, loss_dual), loss)
    else:
        clipfrac_lower = torch.zeros((), device=loss.device)
    pg_loss = agg_loss(weighted(loss, rollout_is_weights), response_mask, agg_mode,
                       num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    metrics = {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return pg_loss, metrics


def value_loss(*, values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor,
               cliprange_value: Optional[float] = 0.2, agg_mode: str = "token-mean",
               num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
               loss_scale_factor: Optional[float] = None) -> tuple[Tensor, dict]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2); inputs (B, T).

    cliprange_value=None: plain 0.5 * (v - R)^2. metrics: vf_clipfrac (the clipped term won).
    """
    loss = (values - returns).square()
    if cliprange_value is not None:
        clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        loss_clipped = (clipped - returns).square()
        clipfrac = masked_mean((loss_clipped > loss).float(), response_mask)
        loss = torch.maximum(loss, loss_clipped)
    else:
        clipfrac = torch.zeros((), device=loss.device)
    vf_loss = 0.5 * agg_loss(loss, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                             loss_scale_factor=loss_scale_factor)
    return vf_loss, {"vf_clipfrac": clipfrac.detach()}


def entropy_loss(entropy: Tensor, response_mask: Tensor, agg_mode: str = "token-mean", *,
                 num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                 loss_scale_factor: Optional[float] = None) -> Tensor:
    """Aggregated token entropy (B, T) -> 0-dim; the trainer subtracts entropy_coeff * this."""
    return agg_loss(entropy, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, kind: str = "k3",
            agg_mode: str = "token-mean", *, num_tokens: Optional[float] = None,
            num_seqs: Optional[float] = None, loss_scale_factor: Optional[float] = None) -> Tensor:
    """KL(pi || pi_ref) as a loss term (GRPO): aggregated kl_estimate(kind) over valid tokens."""
    kl = kl_estimate(logprobs, ref_logprobs, kind)  # (B, T)
    return agg_loss(kl, response_mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)
