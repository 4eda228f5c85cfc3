"""RL algorithms as pure tensor math: advantages, policy and value losses, KL estimators, loss
aggregation, DAPO's batch shaping, on-policy distillation's reverse-KL advantage and off-policy correction (the
corrections registry: truncated IS, masking and masked IS per token, sequence or geometric mean; the
training/inference mismatch). Imports nothing else from rltrain; takes tensors and floats only.

Each pluggable choice is a registry keyed by its config string; the allowed names are exported as
tuples (`ADV_ESTIMATORS`, `POLICY_LOSS_MODES`, `KL_KINDS`, `AGG_MODES`, `OFF_POLICY_MODES`, `TIS_MODES`) for
config validation.
Advantage estimators can also be user functions: `register_advantage_estimator(name)` or a
`"pkg.module:function"` path (signature in `rltrain.algorithms.advantages`).
"""

from rltrain.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from rltrain.algorithms.aggregation import AGG_MODES, aggregate_loss, masked_mean
from rltrain.algorithms.dapo import filter_informative_groups, overlong_penalty, truncated_response_mask
from rltrain.algorithms.distill import distill_advantages
from rltrain.algorithms.kl import KL_KINDS, kl_penalty
from rltrain.algorithms.off_policy import (
    OFF_POLICY_MODES,
    TIS_MODES,
    OffPolicyCorrection,
    check_off_policy_args,
    off_policy_weights,
    policy_mismatch,
    truncated_is_weights,
)
from rltrain.algorithms.policy_loss import POLICY_LOSS_MODES, policy_loss
from rltrain.algorithms.value_loss import value_loss

__all__ = [
    "compute_advantages",
    "register_advantage_estimator",
    "get_advantage_estimator",
    "policy_loss",
    "kl_penalty",
    "aggregate_loss",
    "masked_mean",
    "value_loss",
    "distill_advantages",
    "filter_informative_groups",
    "overlong_penalty",
    "truncated_response_mask",
    "off_policy_weights",
    "check_off_policy_args",
    "OffPolicyCorrection",
    "truncated_is_weights",
    "policy_mismatch",
    "ADV_ESTIMATORS",
    "POLICY_LOSS_MODES",
    "KL_KINDS",
    "AGG_MODES",
    "OFF_POLICY_MODES",
    "TIS_MODES",
]
