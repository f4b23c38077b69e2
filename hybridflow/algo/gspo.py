"""GSPO (Zheng et al. 2025, arXiv 2507.18071): the importance ratio and its clipping per sequence.

The sequence ratio is the length-normalised geometric mean of the token ratios,
    s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp( sum_t m (logp - logp_old) / |y_i| ),
and the clipped surrogate is taken per sequence with the sequence's advantage A_i:
    "gspo"        l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)),
                  A_i = the mean of the advantages over the sequence's valid tokens (outcome
                  advantages are constant there); l_i is spread over the sequence's tokens.
    "gspo_token"  s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]: the value of s_i, the gradient of one
                  token; l_it = max(-A_it s_it, -A_it clip(s_it, ...)) with per-token advantages.
With advantages constant over each sequence the two give the same loss and gradient (GSPO-token
only differs when advantages vary along a sequence). The paper's objective averages over sequences
(`loss_agg_mode=seq-mean-token-mean`, as conf/algo/gspo.yaml sets); other modes are accepted (the
per-token loss is aggregated like any other). Clip ranges are tiny (paper: 3e-4 / 4e-4) because
s_i is a geometric mean; no dual clip. log s_i is clamped to [-20, 20] like the token log-ratio of
the vanilla loss.

metrics as the vanilla loss: pg_clipfrac = fraction of valid tokens whose (sequence's) ratio was
clipped, pg_clipfrac_lower = 0 (no dual clip), ppo_kl = mean of logp_old - logp over valid tokens.
"""

from typing import Optional

import torch
from torch import Tensor

from hybridflow.algo.losses import agg_loss, register_policy_loss, weighted
from hybridflow.algo.masked import masked_mean


def _seq_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log s_i (B,): masked mean over each sequence of logp - logp_old (0 for an empty row)."""
    return masked_mean(logprobs - old_logprobs, mask, dim=-1).clamp(-20.0, 20.0)


def _clipped(advantages: Tensor, ratio: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _finish(loss_mat, clipped, logprobs, old_logprobs, mask, agg_mode, rollout_is_weights, norm):
    loss = agg_loss(weighted(loss_mat, rollout_is_weights), mask, agg_mode, **norm)
    metrics = {"pg_clipfrac": masked_mean(clipped.float(), mask).detach(),
               "pg_clipfrac_lower": torch.zeros((), device=loss.device),
               "ppo_kl": masked_mean(old_logprobs - logprobs, mask).detach()}
    return loss, metrics


@register_policy_loss("gspo")
def policy_loss_gspo(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                     response_mask: Tensor, clip_ratio_low: float = 3e-4,
                     clip_ratio_high: float = 4e-4, clip_ratio_c: Optional[float] = None,
                     agg_mode: str = "seq-mean-token-mean", num_tokens: Optional[float] = None,
                     num_seqs: Optional[float] = None, loss_scale_factor: Optional[float] = None,
                     rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """Sequence-level GSPO; inputs (B, T). clip_ratio_c is accepted and unused (no dual clip)."""
    mask = response_mask.bool()
    ratio = torch.exp(_seq_log_ratio(logprobs, old_logprobs, mask))  # (B,)
    adv = masked_mean(advantages, mask, dim=-1)  # (B,)
    loss_seq, clipped_seq = _clipped(adv, ratio, clip_ratio_low, clip_ratio_high)  # (B,)
    loss_mat = loss_seq[:, None].expand_as(logprobs)  # (B, T): l_i on every token of row i
    clipped = clipped_seq[:, None].expand_as(logprobs)
    norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(loss_mat, clipped, logprobs, old_logprobs, mask, agg_mode, rollout_is_weights,
                   norm)


@register_policy_loss("gspo_token")
def policy_loss_gspo_token(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                           response_mask: Tensor, clip_ratio_low: float = 3e-4,
                           clip_ratio_high: float = 4e-4, clip_ratio_c: Optional[float] = None,
                           agg_mode: str = "seq-mean-token-mean",
                           num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                           loss_scale_factor: Optional[float] = None,
                           rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """GSPO-token: the sequence ratio's value with each token's own gradient; inputs (B, T)."""
    mask = response_mask.bool()
    log_seq = _seq_log_ratio(logprobs, old_logprobs, mask).detach()  # (B,)
    log_ratio = log_seq[:, None] + logprobs - logprobs.detach()  # (B, T), value log s_i
    loss_mat, clipped = _clipped(advantages, torch.exp(log_ratio), clip_ratio_low, clip_ratio_high)
    norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(loss_mat, clipped, logprobs, old_logprobs, mask, agg_mode, rollout_is_weights,
                   norm)
