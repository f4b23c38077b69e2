"""RL algorithms as pure tensor functions: advantage estimators, policy/value/entropy/KL losses
(vanilla PPO with DAPO's clip-higher, GSPO, GSPO-token), loss aggregation modes, KL estimators and
controllers, DAPO's group filter and overlong penalty, rollout/training mismatch correction (TIS).
No process groups here; everything runs on CPU tensors."""

from hybridflow.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    register_advantage_estimator,
)
from hybridflow.algo import gspo as _gspo  # noqa: F401  (registers "gspo", "gspo_token")
from hybridflow.algo.dapo import informative_groups, overlong_penalty
from hybridflow.algo.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_estimate,
)
from hybridflow.algo.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    entropy_loss,
    get_policy_loss,
    kl_loss,
    register_policy_loss,
    value_loss,
)
from hybridflow.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algo.rollout_corr import batch_mismatch_metrics, rollout_mismatch_metrics, tis_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "KL_KINDS", "POLICY_LOSSES",
    "AdaptiveKLController", "FixedKLController",
    "agg_loss", "apply_kl_penalty", "batch_mismatch_metrics", "build_kl_controller", "entropy_loss",
    "get_advantage_estimator", "get_policy_loss", "informative_groups", "kl_estimate", "kl_loss",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "overlong_penalty",
    "register_advantage_estimator", "register_policy_loss", "rollout_mismatch_metrics",
    "tis_weights", "value_loss",
]
