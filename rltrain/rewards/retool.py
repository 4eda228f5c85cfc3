"""ReTool reward: math_dapo's strict boxed +1/-1, softened for wrong answers that used the tool.

Must not run code or count tool calls itself: the multi-turn rollout reports `extra["num_turns"]`.

Wrong answers get -1 + 0.1 per tool call, capped at -0.6, where tool calls = (num_turns - 2) / 2
(a plain exchange is 2 turns, each tool call adds a call and a result). This is the shaping of
the published ReTool recipes: it keeps tool use alive before the model can use results well.
Correct answers get +1 regardless. Returns math_dapo's dict plus "num_turns".
"""

from __future__ import annotations

from rltrain.rewards import math_dapo


def compute_score(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> dict:
    result = math_dapo.compute_score(response, ground_truth)
    num_turns = int((extra or {}).get("num_turns", 2))
    if result["score"] < 0:
        result["score"] = min(-0.6, result["score"] + (num_turns - 2) / 2 * 0.1)
    result["num_turns"] = float(num_turns)
    return result
