"""Exact checker for the synthetic tasks of `rltrain.data.synthetic`.

Must not generate prompts or know the task rules: it compares the response with the ground truth.

Default match "prefix": correct iff the response text (special tokens already stripped, so <eos>
is gone) STARTS WITH the answer; what follows is ignored, so the tiny policy need not learn to
stop. No other forgiveness: leading whitespace or another character first is wrong.
`extra={"match": "exact"}`: the response with trailing whitespace removed must equal the answer.
"""

from __future__ import annotations

MATCH_MODES = ("prefix", "exact")


def compute_score(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> float:
    match = (extra or {}).get("match", "prefix")
    if match == "prefix":
        return 1.0 if response.startswith(ground_truth) else 0.0
    if match == "exact":
        return 1.0 if response.rstrip() == ground_truth else 0.0
    raise ValueError(f"synthetic reward: extra['match'] must be one of {MATCH_MODES}, got {match!r}")
