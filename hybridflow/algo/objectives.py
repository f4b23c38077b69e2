"""The actor, critic and supervised objectives, assembled from the registered pure functions.

Each builder returns `loss_fn(out, mb) -> (loss, metrics)` for `Engine.train_step`, where `out` holds
the model's per-token outputs for micro-batch `mb` ("logprobs", "entropy" or "values", all (b, R)).
Losses use the mini-batch's global normalisers (`num_tokens`, `num_seqs`: summed over micro-batches
and DP ranks; `loss_scale_factor`: a constant, for seq-mean-token-sum-norm), so the summed
micro-batch losses equal the mini-batch loss. Metrics are returned as each micro-batch's share of a
mini-batch mean (weighted by its tokens), so the engine's sum over micro-batches and DP ranks is the
mini-batch mean. Masks are `RolloutBatch.loss_mask()`: the model's own response tokens (a
multi-turn rollout's tool results are context, never trained on). With `algo.tis_imp_ratio_cap` the policy loss is weighted per token by
min(pi_old / pi_rollout, cap) (hybridflow.algo.rollout_corr).
`old_is_current=True` (the trainer skipped the old_log_prob pass: hybridflow.algo.on_policy) takes
pi_old as the forward's own detached log-probs, so the ratio is exactly 1 and TIS compares the
training forward with the generator as before.
"""

from __future__ import annotations

from typing import Optional

from hybridflow.algo.losses import entropy_loss, get_policy_loss, kl_loss, value_loss
from hybridflow.algo.rollout_corr import tis_weights
from hybridflow.config import AlgoConfig


def actor_objective(cfg: AlgoConfig, *, num_tokens: int, num_seqs: int,
                    loss_scale_factor: Optional[float] = None, old_is_current: bool = False):
    policy_loss = get_policy_loss(cfg.policy_loss)
    norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    agg = cfg.loss_agg_mode

    def loss_fn(out, mb):
        logprobs = out["logprobs"]
        dev = logprobs.device
        mask = mb.loss_mask().to(logprobs.dtype)
        share = mask.sum() / num_tokens  # this micro-batch's weight in token means
        if old_is_current:  # one update on the weights that generated the batch: pi_old = pi
            assert mb.old_logprobs is None, "old_is_current, yet the batch has old log-probs"
            old = logprobs.detach()
        else:
            assert mb.old_logprobs is not None, "the batch has no old log-probs (old_log_prob pass)"
            old = mb.old_logprobs.to(dev)
        is_weights = None
        if cfg.tis_imp_ratio_cap is not None:
            if mb.rollout_logprobs is None:
                raise ValueError("algo.tis_imp_ratio_cap is set but the batch has no rollout "
                                 "log-probs: set rollout.return_logprobs=true")
            is_weights = tis_weights(old_logprobs=old, rollout_logprobs=mb.rollout_logprobs.to(dev),
                                     cap=cfg.tis_imp_ratio_cap)
        pg, m = policy_loss(logprobs=logprobs, old_logprobs=old,
                            advantages=mb.advantages.to(dev), response_mask=mask,
                            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                            clip_ratio_c=cfg.clip_ratio_c, agg_mode=agg,
                            rollout_is_weights=is_weights, **norm)
        loss = pg
        metrics = {"actor/pg_loss": pg, "actor/pg_clipfrac": m["pg_clipfrac"] * share,
                   "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
                   "actor/ppo_kl": m["ppo_kl"] * share}
        if "entropy" in out:
            ent = entropy_loss(out["entropy"], mask, agg, **norm)
            loss = loss - cfg.entropy_coeff * ent
            metrics["actor/entropy"] = (out["entropy"] * mask).sum() / num_tokens
        if cfg.use_kl_loss:
            kl = kl_loss(logprobs, mb.ref_logprobs.to(dev), mask, cfg.kl_loss_type, agg, **norm)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl
        return loss, metrics

    return loss_fn


def critic_objective(cfg: AlgoConfig, *, num_tokens: int, num_seqs: int,
                     loss_scale_factor: Optional[float] = None):
    def loss_fn(out, mb):
        mask = mb.loss_mask().to(out["values"].dtype)
        share = mask.sum() / num_tokens
        loss, m = value_loss(values=out["values"], old_values=mb.values.to(mask.device),
                             returns=mb.returns.to(mask.device), response_mask=mask,
                             cliprange_value=cfg.cliprange_value, agg_mode=cfg.loss_agg_mode,
                             num_tokens=num_tokens, num_seqs=num_seqs,
                             loss_scale_factor=loss_scale_factor)
        return loss, {"critic/vf_loss": loss, "critic/vf_clipfrac": m["vf_clipfrac"] * share}

    return loss_fn


def sft_objective(*, num_tokens: int):
    """Negative log-likelihood of the reference response, token mean over the mini-batch."""

    def loss_fn(out, mb):
        mask = mb.loss_mask().to(out["logprobs"].dtype)
        nll = -(out["logprobs"] * mask).sum() / num_tokens
        return nll, {"sft/nll": nll}

    return loss_fn
