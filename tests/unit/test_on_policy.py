"""When the old_log_prob pass may be skipped (hybridflow.algo.on_policy); the actor loss without it.

The decision is checked case by case with its exact reason. The loss in skip mode (old log-probs
absent, `old_is_current=True`) is compared with the normal loss given the forward's own log-probs as
old ones (what the skipped pass computes), for the vanilla, GSPO and GSPO-token losses with TIS, and
with the REINFORCE form it must reduce to at ratio 1: -sum(A * mask) / tokens and its gradient.
"""

import dataclasses

import pytest
import torch

from hybridflow.algo.objectives import actor_objective
from hybridflow.algo.on_policy import APPLIES, old_log_prob_note, skip_old_log_prob
from hybridflow.config import (AlgoConfig, Config, DataConfig, DynamicSamplingConfig,
                               RolloutConfig, TrainerConfig)
from hybridflow.data.batch import RolloutBatch


def _cfg(*, algo=None, trainer=None) -> Config:
    """GRPO-like: 8 prompts x 4 samples per step, one global mini-batch of 32."""
    algo = {"adv_estimator": "grpo", "ppo_mini_batch_size": 32, **(algo or {})}
    return Config(data=DataConfig(prompts_per_step=8), rollout=RolloutConfig(n=4),
                  algo=AlgoConfig(**algo),
                  trainer=TrainerConfig(**(trainer or {})))


CASES = {
    "applies": (_cfg(), 0, True, APPLIES),
    # consumers that can read the update's forward do not stop the skip
    "tis_kl_loss_gspo": (_cfg(algo={"tis_imp_ratio_cap": 2.0, "use_kl_loss": True,
                                    "policy_loss": "gspo"}), 0, True, APPLIES),
    # dynamic sampling tops the step up to prompts_per_step x n rows: still one mini-batch
    "dynamic_sampling": (_cfg(algo={"dynamic_sampling": DynamicSamplingConfig(enable=True)}), 0,
                         True, APPLIES),
    "key_off": (_cfg(algo={"skip_redundant_old_log_prob": False}), 0, False,
                "algo.skip_redundant_old_log_prob=false"),
    "epochs": (_cfg(algo={"ppo_epochs": 2}), 0, False,
               "algo.ppo_epochs=2: the epochs after the first train on updated weights"),
    "mini_batches": (_cfg(algo={"ppo_mini_batch_size": 8}), 0, False,
                     "algo.ppo_mini_batch_size=8 makes 4 optimizer steps of the "
                     "data.prompts_per_step x rollout.n = 32 sequences per step: later ones train "
                     "on updated weights"),
    "kl_in_reward": (_cfg(algo={"use_kl_in_reward": True}), 0, False,
                     "algo.use_kl_in_reward=true: the reward's KL penalty needs old log-probs before "
                     "the advantages"),
    "critic_warmup": (_cfg(algo={"adv_estimator": "gae"}, trainer={"critic_warmup": 2}), 1, False,
                      "critic warm-up step (trainer.critic_warmup=2): the actor does not update, so "
                      "no update forward gives the log-probs"),
    "after_critic_warmup": (_cfg(algo={"adv_estimator": "gae"}, trainer={"critic_warmup": 2}), 2,
                            True, APPLIES),
}


@pytest.mark.parametrize("name", CASES)
def test_decision(name):
    cfg, step, skip, reason = CASES[name]
    assert skip_old_log_prob(cfg, step=step) == (skip, reason)


def test_startup_note():
    warm = _cfg(trainer={"critic_warmup": 2})
    note = "old_log_prob pass: skipped from step {} (" + APPLIES + ")"
    assert old_log_prob_note(warm, start_step=0) == note.format(3)  # after the critic warm-up
    assert old_log_prob_note(warm, start_step=5) == note.format(6)  # resumed
    assert old_log_prob_note(_cfg(algo={"ppo_epochs": 2}), start_step=0) == (
        "old_log_prob pass: kept (algo.ppo_epochs=2: the epochs after the first train on updated "
        "weights)")


def _batch(old=None) -> tuple[RolloutBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b, r = 4, 5
    mask = torch.ones(b, r)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    logprobs = (-2.0 + 0.5 * torch.randn(b, r, generator=g)).requires_grad_()
    mb = RolloutBatch(prompt_ids=torch.zeros(b, 2, dtype=torch.long),
                      prompt_mask=torch.ones(b, 2, dtype=torch.long),
                      response_ids=torch.zeros(b, r, dtype=torch.long), response_mask=mask,
                      group_ids=torch.arange(b) // 2, indices=torch.arange(b),
                      rollout_logprobs=logprobs.detach() + 0.3 * torch.randn(b, r, generator=g),
                      old_logprobs=old, advantages=torch.randn(b, r, generator=g))
    return mb, logprobs


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo", "gspo_token"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_loss_without_old_equals_loss_with_its_own_logprobs(policy_loss, cap):
    cfg = AlgoConfig(policy_loss=policy_loss, tis_imp_ratio_cap=cap)
    norm = dict(num_tokens=13, num_seqs=4)
    mb, lp = _batch()
    loss, m = actor_objective(cfg, **norm, old_is_current=True)({"logprobs": lp}, mb)
    (grad,) = torch.autograd.grad(loss, lp)
    ref_mb, ref_lp = _batch()
    ref_mb = dataclasses.replace(ref_mb, old_logprobs=ref_lp.detach().clone())
    ref_loss, ref_m = actor_objective(cfg, **norm)({"logprobs": ref_lp}, ref_mb)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_lp)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert m.keys() == ref_m.keys()
    for k in m:
        torch.testing.assert_close(m[k], ref_m[k])
    assert float(m["actor/ppo_kl"]) == 0.0 and float(m["actor/pg_clipfrac"]) == 0.0


def test_ratio_one_is_reinforce():
    """token-mean vanilla PPO at ratio 1: loss -sum(A * mask) / tokens, gradient -A mask / tokens."""
    mb, lp = _batch()
    tokens = int(mb.response_mask.sum())
    loss, _ = actor_objective(AlgoConfig(), num_tokens=tokens, num_seqs=4,
                              old_is_current=True)({"logprobs": lp}, mb)
    (grad,) = torch.autograd.grad(loss, lp)
    want = -mb.advantages * mb.response_mask / tokens
    torch.testing.assert_close(loss, want.sum())
    torch.testing.assert_close(grad, want)


def test_missing_old_logprobs_is_an_error_outside_skip_mode():
    mb, lp = _batch()
    with pytest.raises(AssertionError, match="no old log-probs"):
        actor_objective(AlgoConfig(), num_tokens=13, num_seqs=4)({"logprobs": lp}, mb)
    mb, lp = _batch(old=torch.zeros(4, 5))
    with pytest.raises(AssertionError, match="old_is_current"):
        actor_objective(AlgoConfig(), num_tokens=13, num_seqs=4,
                        old_is_current=True)({"logprobs": lp}, mb)
