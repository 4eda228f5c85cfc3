"""Reward functions by name (config `reward.fn`) and the batched runner.

Must not import heavy libraries at import time (math-verify/sympy load on first use) or call models.

Every reward function has the signature
    fn(response_text: str, ground_truth: str, *, data_source: str | None = None,
       extra: dict | None = None) -> float | dict
where a dict holds "score" plus numbers that are logged as `reward/<key>/mean`.

Built-ins: gsm8k (strict `#### n`), gsm8k_flexible (last number), math (math-verify on the last
\\boxed{}), math_dapo (strict boxed match, +1/-1), retool (math_dapo + tool-use shaping),
synthetic (the tiny task's checker), arithmetic / arithmetic_tool (the learning recipe's
exact answer, and its tool-use metrics). Anything containing ":" is a user function,
`path/to/file.py:function` or `package.module:function`.
"""

from __future__ import annotations

from typing import Callable

from rltrain.rewards import arithmetic, gsm8k, math, math_dapo, retool, synthetic
from rltrain.rewards.loader import RewardFnError, UserRewardFn, load_function
from rltrain.rewards.runner import compute_rewards, shutdown_workers

REWARD_FNS: dict[str, Callable] = {
    "arithmetic": arithmetic.compute_score,
    "arithmetic_tool": arithmetic.compute_score_tool,
    "gsm8k": gsm8k.compute_score,
    "gsm8k_flexible": gsm8k.compute_score_flexible,
    "math": math.compute_score,
    "math_dapo": math_dapo.compute_score,
    "retool": retool.compute_score,
    "synthetic": synthetic.compute_score,
}


def get_reward_fn(name_or_path: str) -> Callable:
    """A built-in by name, or a user function from `file.py:function` / `module:function`."""
    if name_or_path in REWARD_FNS:
        return REWARD_FNS[name_or_path]
    if ":" in name_or_path:
        return UserRewardFn(name_or_path)
    raise RewardFnError(f"reward.fn={name_or_path!r}: not a built-in ({', '.join(sorted(REWARD_FNS))}) and not "
                        "'path/to/file.py:function'")


__all__ = ["REWARD_FNS", "get_reward_fn", "compute_rewards", "shutdown_workers", "load_function", "UserRewardFn"]
