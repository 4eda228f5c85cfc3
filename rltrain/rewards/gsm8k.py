"""GSM8K reward: the final number of the response against the ground-truth number.

Must not call a model or sympy: it is a regex and a number comparison.

strict (name "gsm8k"): the number after the LAST `#### ` marker (the GSM8K answer format) is
  compared; no marker -> 0.
flexible (name "gsm8k_flexible"): the last number anywhere in the response.
Numbers are compared after removing thousands commas, `$` and a trailing period; "72", "72.0"
and "72.00" are equal. Correct -> 1.0, otherwise 0.0.
"""

from __future__ import annotations

import re

_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?")


def _normalize(num: str) -> str | None:
    s = num.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return None
    return repr(value)


def extract_answer(response: str, method: str = "strict") -> str | None:
    """The answer number as written, or None."""
    if method == "strict":
        found = _STRICT.findall(response)
    elif method == "flexible":
        found = _NUMBER.findall(response)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    return found[-1] if found else None


def _score(response: str, ground_truth: str, method: str) -> float:
    pred = extract_answer(response, method)
    if pred is None:
        return 0.0
    gold = _normalize(ground_truth)
    if gold is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number")
    return 1.0 if _normalize(pred) == gold else 0.0


def compute_score(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> float:
    return _score(response, ground_truth, "strict")


def compute_score_flexible(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> float:
    return _score(response, ground_truth, "flexible")
