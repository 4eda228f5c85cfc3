"""DAPO-style math reward: strict string match of the LAST `\\boxed{}` after normalization, +1 / -1.

Must not use sympy or math-verify: the match is deliberately strict (cheap and hard to game).

Normalization of both sides: drop `\\left`/`\\right`, spacing commands (`\\!`, `\\,`, `\\;`, `\\ `),
`$`, degree and percent signs, a `\\text{..}`/`\\mbox{..}`/`\\mathrm{..}` wrapper (keeps its
content), whitespace and a trailing period; `\\dfrac`/`\\tfrac` -> `\\frac`; thousands commas in a
plain number ("1,000" -> "1000"); a plain number is written canonically ("2.50" -> "2.5",
"3.0" -> "3"). Returns {"score": 1.0 | -1.0, "acc": 1.0 | 0.0, "pred": extracted answer or ""}.
"""

from __future__ import annotations

import re

from rltrain.rewards.boxed import last_boxed

_WRAPPERS = re.compile(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUMBER = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")


def normalize_answer(ans: str) -> str:
    s = ans.strip()
    s = _WRAPPERS.sub(r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^{\\circ}", ""), ("^\\circ", ""),
                     ("\\%", ""), ("%", ""), ("$", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _NUMBER.match(s):
        sign = "-" if s.startswith("-") else ""
        int_part, _, frac = s.lstrip("-").partition(".")
        frac = frac.rstrip("0")
        s = (int_part.lstrip("0") or "0") + ("." + frac if frac else "")
        s = "0" if s == "0" else sign + s
    return s


def compute_score(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> dict:
    pred = last_boxed(response)
    correct = pred is not None and normalize_answer(pred) == normalize_answer(last_boxed(ground_truth) or ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0, "pred": pred or ""}
