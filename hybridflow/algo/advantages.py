"""Advantage estimators: a registry of pure tensor functions (as in verl).

Every estimator takes the same keyword-only arguments so the trainer dispatches by name:

    fn(*, token_rewards,   # (B, T) reward per response token (score on the last valid token,
                           #        minus the KL penalty when KL is in the reward)
          response_mask,   # (B, T) 1 on valid response tokens
          values=None,     # (B, T) critic values (gae only)
          group_ids=None,  # (B,)   int, equal ids = samples of the same prompt (group estimators)
          gamma=1.0, lam=1.0, norm_by_std=True, eps=1e-6)
       -> (advantages (B, T), returns (B, T))

Arguments an estimator does not use are accepted and ignored. Rewards and values on masked-out
positions never enter the math, and both outputs are 0 there. Outputs are float32 whatever the
input dtype (advantages feed a loss; bf16 sums over a group are too coarse).

The "score" of a sequence is the sum of its token rewards over the mask; group statistics use
the unbiased std, and a group of one sample has mean 0 and std 1, as in verl.
"""

from typing import Optional

import torch
from torch import Tensor

from hybridflow.algo.masked import masked_sum, masked_whiten
from hybridflow.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.lookup


# ---------------------------------------------------------------- helpers

def _prepare(token_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Checks shapes; returns (rewards zeroed off-mask float32, mask bool, mask float32)."""
    if token_rewards.dim() != 2 or token_rewards.shape != response_mask.shape:
        raise ValueError(f"token_rewards and response_mask must both be (B, T); got "
                         f"{tuple(token_rewards.shape)} and {tuple(response_mask.shape)}")
    mask = response_mask.bool()
    rewards = torch.where(mask, token_rewards.float(), 0.0)
    return rewards, mask, mask.float()


def _check_groups(group_ids: Optional[Tensor], batch: int, name: str) -> Tensor:
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (B,) naming each sample's prompt")
    if group_ids.shape != (batch,):
        raise ValueError(f"group_ids must be ({batch},), got {tuple(group_ids.shape)}")
    return group_ids


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample (group sum, group mean, unbiased group std, group size), each (B,)."""
    _, inv = torch.unique(group_ids, return_inverse=True)  # (B,) group index per sample
    num_groups = int(inv.max()) + 1 if inv.numel() else 0
    zeros = scores.new_zeros(num_groups)
    size = zeros.index_add(0, inv, torch.ones_like(scores))  # (G,)
    total = zeros.index_add(0, inv, scores)
    mean = total / size
    var = zeros.index_add(0, inv, (scores - mean[inv]) ** 2) / (size - 1).clamp_min(1)
    return total[inv], mean[inv], var.sqrt()[inv], size[inv]


def _broadcast(per_seq: Tensor, mask_f: Tensor) -> Tensor:
    return per_seq[:, None] * mask_f  # (B,) -> (B, T), 0 off-mask


# ---------------------------------------------------------------- estimators

@register_advantage_estimator("gae")
def gae(*, token_rewards, response_mask, values=None, group_ids=None,
        gamma=1.0, lam=1.0, norm_by_std=True, eps=1e-6):
    """Generalized advantage estimation (Schulman et al. 2016) over response tokens.

    delta_t = r_t + gamma * V_{t'} - V_t,  A_t = delta_t + gamma * lam * A_{t'}
    where t' is the next valid token (masked-out tokens are skipped, so a row's padding never
    enters) and V, A after a row's last valid token are 0 (the episode ends there).
    returns = A + V (before whitening); advantages = A whitened over all valid tokens.
    """
    rewards, mask, mask_f = _prepare(token_rewards, response_mask)
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values (B, T) from the critic")
    if values.shape != rewards.shape:
        raise ValueError(f"values must be {tuple(rewards.shape)}, got {tuple(values.shape)}")
    values = torch.where(mask, values.float(), 0.0)
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)  # (B,) V of the next valid token
    last_adv = rewards.new_zeros(batch)  # (B,) A of the next valid token
    adv = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        m = mask_f[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # On a masked token carry the previous state through unchanged.
        last_adv = m * (delta + gamma * lam * last_adv) + (1 - m) * last_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = last_adv
    adv = adv * mask_f
    returns = adv + values
    return masked_whiten(adv, mask), returns


@register_advantage_estimator("grpo")
def grpo(*, token_rewards, response_mask, values=None, group_ids=None,
         gamma=1.0, lam=1.0, norm_by_std=True, eps=1e-6):
    """GRPO (Shao et al. 2024) outcome advantage, the same on every valid token of a sequence.

    A_i = (s_i - mean_g(s)) / (std_g(s) + eps), s_i = sum of token rewards of sequence i,
    mean/std (unbiased) over the samples of i's group g. norm_by_std=False gives Dr.GRPO
    (Liu et al. 2025): A_i = s_i - mean_g(s). A group of one has mean 0 and std 1.
    returns = advantages.
    """
    rewards, mask, mask_f = _prepare(token_rewards, response_mask)
    group_ids = _check_groups(group_ids, rewards.shape[0], "grpo")
    scores = masked_sum(rewards, mask, dim=-1)  # (B,)
    _, mean, std, size = _group_stats(scores, group_ids)
    alone = size == 1
    mean = torch.where(alone, 0.0, mean)
    std = torch.where(alone, 1.0, std)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = _broadcast(adv, mask_f)
    return adv, adv


@register_advantage_estimator("grpo_no_std")
def grpo_no_std(*, token_rewards, response_mask, values=None, group_ids=None,
                gamma=1.0, lam=1.0, norm_by_std=True, eps=1e-6):
    """Dr.GRPO: grpo with norm_by_std forced to False, A_i = s_i - mean_g(s)."""
    return grpo(token_rewards=token_rewards, response_mask=response_mask, group_ids=group_ids,
                norm_by_std=False, eps=eps)


@register_advantage_estimator("rloo")
def rloo(*, token_rewards, response_mask, values=None, group_ids=None,
         gamma=1.0, lam=1.0, norm_by_std=True, eps=1e-6):
    """REINFORCE leave-one-out (Ahmadian et al. 2024), broadcast over valid tokens.

    A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1)  (= n/(n-1) * (s_i - mean_g(s))).
    A group of one has no other sample: its baseline is 0 and A_i = s_i (verl's convention).
    returns = advantages.
    """
    rewards, mask, mask_f = _prepare(token_rewards, response_mask)
    group_ids = _check_groups(group_ids, rewards.shape[0], "rloo")
    scores = masked_sum(rewards, mask, dim=-1)  # (B,)
    total, _, _, size = _group_stats(scores, group_ids)
    baseline = torch.where(size > 1, (total - scores) / (size - 1).clamp_min(1), 0.0)
    adv = _broadcast(scores - baseline, mask_f)
    return adv, adv


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(*, token_rewards, response_mask, values=None, group_ids=None,
                        gamma=1.0, lam=1.0, norm_by_std=True, eps=1e-6):
    """REINFORCE++ (Hu 2025): token-level discounted return-to-go, whitened over the batch.

    G_t = r_t + gamma * G_{t+1} over a row's valid tokens (0 after its last one; as in verl,
    the running return restarts at a masked token). returns = G; advantages = G whitened over
    all valid tokens of the batch.
    """
    rewards, mask, mask_f = _prepare(token_rewards, response_mask)
    batch, length = rewards.shape
    running = rewards.new_zeros(batch)  # (B,)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask_f[:, t]
    returns = returns * mask_f
    return masked_whiten(returns, mask), returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(*, token_rewards, response_mask, values=None, group_ids=None,
                                 gamma=1.0, lam=1.0, norm_by_std=True, eps=1e-6):
    """REINFORCE++ with a group baseline: A = whiten_batch(s_i - mean_g(s)) on valid tokens.

    The group-mean-subtracted score is broadcast over the sequence's valid tokens, then whitened
    over all valid tokens of the batch (token-weighted). A group of one has mean 0.
    returns = advantages.
    """
    rewards, mask, mask_f = _prepare(token_rewards, response_mask)
    group_ids = _check_groups(group_ids, rewards.shape[0], "reinforce_plus_plus_baseline")
    scores = masked_sum(rewards, mask, dim=-1)  # (B,)
    _, mean, _, size = _group_stats(scores, group_ids)
    centered = _broadcast(scores - torch.where(size == 1, 0.0, mean), mask_f)
    adv = masked_whiten(centered, mask)
    return adv, adv
