"""The actor, critic and supervised objectives, assembled from the registered pure functions.

Each builder returns `loss_fn(out, mb) -> (loss, metrics)` for `Engine.train_step`, where `out` holds
the model's per-token outputs for micro-batch `mb` ("logprobs", "entropy" or "values", all (b, R)).
Losses use the mini-batch's global token / sequence counts (`num_tokens`, `num_seqs`: summed over
micro-batches and DP ranks), so the summed micro-batch losses equal the mini-batch loss. Metrics are
returned as each micro-batch's share of a mini-batch mean (weighted by its tokens), so the engine's sum
over micro-batches and DP ranks is the mini-batch mean.
"""

from __future__ import annotations

from hybridflow.algo.kl import kl_estimate
from hybridflow.algo.losses import agg_loss, get_policy_loss, value_loss
from hybridflow.config import AlgoConfig


def actor_objective(cfg: AlgoConfig, *, num_tokens: int, num_seqs: int):
    policy_loss = get_policy_loss(cfg.policy_loss)
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs)

    def loss_fn(out, mb):
        mask = mb.response_mask.to(out["logprobs"].dtype)
        share = mask.sum() / num_tokens  # this micro-batch's weight in token means
        pg, m = policy_loss(logprobs=out["logprobs"], old_logprobs=mb.old_logprobs.to(mask.device),
                            advantages=mb.advantages.to(mask.device), response_mask=mask,
                            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                            clip_ratio_c=cfg.clip_ratio_c, agg_mode=cfg.loss_agg_mode, **agg)
        loss = pg
        metrics = {"actor/pg_loss": pg, "actor/pg_clipfrac": m["pg_clipfrac"] * share,
                   "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
                   "actor/ppo_kl": m["ppo_kl"] * share}
        if "entropy" in out:
            ent = agg_loss(out["entropy"], mask, cfg.loss_agg_mode, **agg)
            loss = loss - cfg.entropy_coeff * ent
            metrics["actor/entropy"] = (out["entropy"] * mask).sum() / num_tokens
        if cfg.use_kl_loss:
            kl = agg_loss(kl_estimate(out["logprobs"], mb.ref_logprobs.to(mask.device),
                                      cfg.kl_loss_type), mask, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl
        return loss, metrics

    return loss_fn


def critic_objective(cfg: AlgoConfig, *, num_tokens: int, num_seqs: int):
    def loss_fn(out, mb):
        mask = mb.response_mask.to(out["values"].dtype)
        share = mask.sum() / num_tokens
        loss, m = value_loss(values=out["values"], old_values=mb.values.to(mask.device),
                             returns=mb.returns.to(mask.device), response_mask=mask,
                             cliprange_value=cfg.cliprange_value, agg_mode=cfg.loss_agg_mode,
                             num_tokens=num_tokens, num_seqs=num_seqs)
        return loss, {"critic/vf_loss": loss, "critic/vf_clipfrac": m["vf_clipfrac"] * share}

    return loss_fn


def sft_objective(*, num_tokens: int):
    """Negative log-likelihood of the reference response, token mean over the mini-batch."""

    def loss_fn(out, mb):
        mask = mb.response_mask.to(out["logprobs"].dtype)
        nll = -(out["logprobs"] * mask).sum() / num_tokens
        return nll, {"sft/nll": nll}

    return loss_fn
