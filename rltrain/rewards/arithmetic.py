"""Rewards of the learning recipe's arithmetic tasks (rltrain/data/arithmetic.py): the exact final answer, and
for the tool task how the Python tool was used. Must not run code: it reads the response text only.

"arithmetic" (task add): 1.0 iff the integer (no fraction) after the LAST `####` equals the ground truth exactly (compared
as integers, so 15-digit sums are exact), else 0.0. Nothing else in the response is graded.

"arithmetic_tool" (task mul_tool): the same score, returned as a dict with the tool metrics (logged as
`reward/<key>/mean`, and by the recipe's evaluation over held-out prompts):
  tool_call          1 when the response holds an EXECUTED tool call: `<code>...</code>` immediately followed
                     by the output block the multi-turn rollout appends ("\\n<output>\\n{out}\\n</output>\\n",
                     DEFAULT_TOOL_OUTPUT_TEMPLATE of rltrain/data/sft_data.py). The rollout stops
                     generation at `</code>`, so the model cannot write that block itself.
  correct_tool_call  1 when the LAST executed call's code ran (its output has no "Error:" line: the sandbox
                     reports exceptions, timeouts and kills that way), the output's last non-empty line is an
                     integer, and the final answer after `####` (written after that output) equals it: the
                     code runs and its output is what the model answers. It does not need the code to compute
                     the right product (the score says whether the answer is right).
  answer_found       1 when there is an integer after a `####`.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####[ \t]*(-?\d+)(?!\.?\d)")  # "#### 12.5" is not 12
_CALL = re.compile(r"<code>(.*?)</code>\n<output>\n(.*?)\n</output>\n", re.DOTALL)
_INT = re.compile(r"-?\d+")


def final_answer(response: str) -> tuple[int, int] | None:
    """(the integer after the last `####`, its position in the response), or None."""
    found = list(_ANSWER.finditer(response))
    if not found:
        return None
    return int(found[-1].group(1)), found[-1].start()


def _truth(ground_truth: str) -> int:
    try:
        return int(str(ground_truth).strip())
    except ValueError as err:
        raise ValueError(f"arithmetic reward: ground truth {ground_truth!r} is not an integer") from err


def compute_score(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> float:
    found = final_answer(response)
    return 1.0 if found is not None and found[0] == _truth(ground_truth) else 0.0


def tool_use(response: str) -> dict[str, float]:
    """tool_call, correct_tool_call and answer_found of one response (see the module docstring)."""
    calls = list(_CALL.finditer(response))
    found = final_answer(response)
    out = {"tool_call": float(bool(calls)), "correct_tool_call": 0.0, "answer_found": float(found is not None)}
    if calls and found is not None:
        last = calls[-1]
        lines = [ln.strip() for ln in last.group(2).splitlines() if ln.strip()]
        ran = not any(ln.startswith("Error:") for ln in lines)
        if ran and lines and _INT.fullmatch(lines[-1]) and found[1] >= last.end() and int(lines[-1]) == found[0]:
            out["correct_tool_call"] = 1.0
    return out


def compute_score_tool(response: str, ground_truth: str, *, data_source: str | None = None,
                       extra: dict | None = None) -> dict:
    return {"score": compute_score(response, ground_truth), **tool_use(response)}
