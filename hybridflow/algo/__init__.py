"""RL algorithms as pure tensor functions: advantage estimators, policy/value/entropy/KL losses,
KL estimators and controllers. No process groups here; everything runs on CPU tensors."""

from hybridflow.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    register_advantage_estimator,
)
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

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "KL_KINDS", "POLICY_LOSSES",
    "AdaptiveKLController", "FixedKLController",
    "agg_loss", "apply_kl_penalty", "build_kl_controller", "entropy_loss",
    "get_advantage_estimator", "get_policy_loss", "kl_estimate", "kl_loss",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "register_advantage_estimator", "register_policy_loss", "value_loss",
]
