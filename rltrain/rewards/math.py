"""MATH-style reward: math-verify equivalence of the LAST `\\boxed{}` in the response with the answer.

Must not enforce its own timeout (math-verify's signal-based one only works in the main thread):
run it through `rewards.compute_rewards`, which kills a call that exceeds `timeout_s`.

The ground truth may be bare LaTeX ("\\frac{1}{2}"), a number, or itself boxed. No box in the
response -> 0.0; equivalent (e.g. `\\boxed{\\frac{1}{2}}` vs "0.5") -> 1.0; otherwise 0.0.
"""

from __future__ import annotations

import logging

from rltrain.rewards.boxed import last_boxed


def compute_score(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> float:
    pred = last_boxed(response)
    if pred is None:
        return 0.0
    from math_verify import parse, verify  # lazy: sympy import takes ~1 s

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns when we disable its timeout
    gold_text = last_boxed(ground_truth) or ground_truth
    gold = parse("\\boxed{" + gold_text + "}", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math reward: math-verify could not parse the ground truth {ground_truth!r}")
    answer = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
