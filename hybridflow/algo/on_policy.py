"""When the old_log_prob pass is redundant: the old policy IS the policy the update differentiates.

The PPO ratio pi / pi_old uses log-probs of the weights that generated the step's batch. The trainer
gets them from a forward-only pass (`old_log_prob`) before the updates. When the step makes ONE
optimizer step (algo.ppo_epochs == 1 and one mini-batch: algo.ppo_mini_batch_size equals the step's
global sequence count data.prompts_per_step x rollout.n), every micro-batch of that update is
computed with the same, not yet updated weights, so the update's own forward gives pi_old:
old_logprobs == logprobs.detach(), the ratio is identically 1 and the clip never acts (verl:
"on-policy: use the current log-probs as old"; TRL does the same). The pass is then skipped and the
loss uses its own detached log-probs (hybridflow.algo.objectives); the consumers that compare the
training forward with the generator (TIS weights, the training/rollout_* mismatch metrics) read
those same log-probs, which the update hands back.

`skip_old_log_prob(cfg, step=...)` decides, from the config alone, whether that is exact. It is not
when something reads old log-probs before the update, or when no actor update runs:
- algo.ppo_epochs > 1, or more than one mini-batch per step: later updates start from moved weights;
- algo.use_kl_in_reward: the reward's KL penalty needs old log-probs before the advantages;
- a critic warm-up step (step < trainer.critic_warmup): the actor does not update, so no update
  forward gives the log-probs. Then nothing but the mismatch metrics reads them, so the pass could be
  dropped outright; it is kept (few steps, metrics continuous, the step unchanged).
Dynamic sampling does not change the count: the step still trains on prompts_per_step x n rows
(hybridflow/rollout/dynamic_sampling.py tops the batch up to that size). The model has no dropout
(hybridflow/models/build.py), so the training-mode forward equals the forward-only pass up to fp32/
bf16 rounding (different micro-batch shapes and padding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.config import Config

APPLIES = "one epoch of one mini-batch per step: the actor update's own forward is the old policy"


def skip_old_log_prob(cfg: Config, *, step: int) -> tuple[bool, str]:
    """(skip, reason) for the step with 0-based index `step`: whether the trainer leaves out the
    old_log_prob pass and takes pi_old from the actor update's forward (see module doc)."""
    a = cfg.algo
    if not a.skip_redundant_old_log_prob:
        return False, "algo.skip_redundant_old_log_prob=false"
    if a.ppo_epochs > 1:
        return False, (f"algo.ppo_epochs={a.ppo_epochs}: the epochs after the first train on updated "
                       f"weights")
    seqs = cfg.data.prompts_per_step * cfg.rollout.n
    if a.ppo_mini_batch_size != seqs:
        return False, (f"algo.ppo_mini_batch_size={a.ppo_mini_batch_size} makes "
                       f"{seqs // a.ppo_mini_batch_size} optimizer steps of the data.prompts_per_step "
                       f"x rollout.n = {seqs} sequences per step: later ones train on updated weights")
    if a.use_kl_in_reward:
        return False, ("algo.use_kl_in_reward=true: the reward's KL penalty needs old log-probs "
                       "before the advantages")
    if step < cfg.trainer.critic_warmup:
        return False, (f"critic warm-up step (trainer.critic_warmup={cfg.trainer.critic_warmup}): "
                       f"the actor does not update, so no update forward gives the log-probs")
    return True, APPLIES


def old_log_prob_note(cfg: Config, *, start_step: int) -> str:
    """The start-up line: whether the pass is skipped, from the first step that updates the actor."""
    first = max(start_step, cfg.trainer.critic_warmup)
    skip, why = skip_old_log_prob(cfg, step=first)
    return f"old_log_prob pass: {f'skipped from step {first + 1}' if skip else 'kept'} ({why})"
