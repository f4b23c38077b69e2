"""The recipe config groups (conf/algo/dapo|gspo|drgrpo.yaml) and the validation of their keys."""

import pytest

from hybridflow.config import load_config
from hybridflow.config_checks import validate


def cfg_of(*overrides):
    cfg = load_config(["experiment=demo", *overrides])
    validate(cfg, world_size=1)
    return cfg


def test_published_defaults():
    dapo = cfg_of("algo=dapo", "reward.overlong_buffer.len=2")
    a = dapo.algo
    assert (a.adv_estimator, a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high) == \
        ("grpo", "token-mean", 0.2, 0.28)
    assert a.dynamic_sampling.enable and a.dynamic_sampling.max_rounds == 10
    # rounds of up to 3 batches, sized in prompts from the kept fraction
    ds = a.dynamic_sampling
    assert (ds.batches_per_round, ds.adaptive, ds.round_confidence) == (3, True, 0.9)
    assert not a.use_kl_loss and not a.use_kl_in_reward
    ob = dapo.reward.overlong_buffer
    assert ob.enable and ob.penalty_factor == 1.0
    g = cfg_of("algo=gspo").algo
    assert (g.policy_loss, g.loss_agg_mode, g.clip_ratio_low, g.clip_ratio_high) == \
        ("gspo", "seq-mean-token-mean", 3e-4, 4e-4)
    d = cfg_of("algo=drgrpo").algo
    assert (d.adv_estimator, d.norm_adv_by_std, d.loss_agg_mode) == \
        ("grpo", False, "seq-mean-token-sum-norm")
    assert cfg_of("algo=grpo", "algo.policy_loss=gspo_token").algo.policy_loss == "gspo_token"


@pytest.mark.parametrize("overrides, match", [
    (["algo.loss_agg_mode=token-sum"], r"algo.loss_agg_mode='token-sum'.*seq-mean-token-sum-norm"),
    (["algo.loss_scale_factor=0"], r"algo.loss_scale_factor=0"),
    (["algo.clip_ratio_low=1.0"], r"algo.clip_ratio_low=1.0 must be in \(0, 1\)"),
    (["algo.clip_ratio_low=0"], r"algo.clip_ratio_low=0.0 must be in \(0, 1\)"),
    (["algo.clip_ratio_high=-0.1"], r"algo.clip_ratio_high=-0.1 must be > 0"),
    (["algo.clip_ratio_high=0"], r"algo.clip_ratio_high=0.0 must be > 0"),
    (["algo.clip_ratio_c=1.0"], r"algo.clip_ratio_c=1.0 must be > 1"),
    (["algo.cliprange_value=0"], r"algo.cliprange_value=0.0 must be > 0"),
    (["algo.tis_imp_ratio_cap=2.0"], r"rollout.return_logprobs=true"),
    (["algo.tis_imp_ratio_cap=-1", "rollout.return_logprobs=true"], r"algo.tis_imp_ratio_cap=-1"),
    (["algo=grpo", "algo.dynamic_sampling.enable=true", "algo.dynamic_sampling.max_rounds=0"],
     r"algo.dynamic_sampling.max_rounds=0"),
    (["algo=grpo", "algo.dynamic_sampling.enable=true", "algo.dynamic_sampling.batches_per_round=0"],
     r"algo.dynamic_sampling.batches_per_round=0"),
    (["algo=grpo", "algo.dynamic_sampling.enable=true", "algo.dynamic_sampling.adaptive=true"],
     r"algo.dynamic_sampling.adaptive=true .*batches_per_round batches: set it >= 2 \(got 1\)"),
    (["algo=dapo"], r"reward.overlong_buffer.len=4096 must be in \(0, rollout.max_new_tokens=6\)"),
    (["algo=dapo", "reward.overlong_buffer.len=2", "reward.overlong_buffer.penalty_factor=-1"],
     r"penalty_factor=-1"),
    (["algo=gspo", "algo.policy_loss=gspo_seq"], r"algo.policy_loss='gspo_seq'.*gspo_token"),
    (["reward.launch_reward_fn_async=true", "algo=dapo", "reward.overlong_buffer.len=2"],
     r"reward.launch_reward_fn_async=true .*algo.dynamic_sampling.enable=true"),
    (["reward.launch_reward_fn_async=true", "reward.model_path=/rm"],
     r"reward.launch_reward_fn_async=true .*reward.model_path is set"),
    (["reward.launch_reward_fn_async=true", "rollout.partial.enable=true"],
     r"reward.launch_reward_fn_async=true .*rollout.partial.enable=true"),
    (["reward.score_in_pass=true", "reward.model_path=/rm"],
     r"reward.score_in_pass=true .*reward.model_path is set"),
    (["reward.score_in_pass=true", "algo=dapo", "reward.overlong_buffer.len=2"],
     r"reward.score_in_pass=true .*algo.dynamic_sampling.enable=true"),
    (["reward.score_in_pass=true", "reward.launch_reward_fn_async=true"],
     r"worker thread or inside a pass, not both"),
])
def test_bad_values_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        cfg_of(*overrides)


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ValueError, match=r"rollout.n >= 2"):
        cfg_of("algo.dynamic_sampling.enable=true", "rollout.n=1", "algo.ppo_mini_batch_size=32",
               "algo.micro_batch_size_per_gpu=16")


def test_tis_with_logprobs_is_valid():
    cfg = cfg_of("algo.tis_imp_ratio_cap=2.0", "rollout.return_logprobs=true")
    assert cfg.algo.tis_imp_ratio_cap == 2.0
