"""Finding the final `\\boxed{...}` answer in model output (shared by the math rewards).

Must not judge equivalence: it only extracts text; math.py and math_dapo.py compare.
"""

from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) with nested braces
    matched; None when there is none or its braces never close."""
    starts = [(text.rfind(tag), tag) for tag in ("\\boxed", "\\fbox")]
    start, tag = max(starts)
    if start < 0:
        return None
    i = start + len(tag)
    if text.startswith(" ", i) and not text.startswith(" {", i):  # "\boxed 5": up to the next space or $
        rest = text[i + 1 :]
        end = min([j for j in (rest.find("$"), rest.find(" "), rest.find("\n")) if j >= 0], default=len(rest))
        return rest[:end].strip() or None
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None
