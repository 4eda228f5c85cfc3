"""The user's mistakes as one exception type, which the entry points print as a short message (exit code 2).
Must not import anything from rltrain or third parties: every room may raise it, workers included.

Raise a subclass of `UserError` (mixed with the builtin type callers expect, e.g. `ValueError`) for what a
user can fix: a config key, a missing path, a malformed data row, a model the backend cannot run. The
message names the key or file and the fix. `rltrain.main` and `rltrain.sft` print it as
`rltrain: <message>` and exit 2, also when it was raised in a Ray worker.
"""

from __future__ import annotations

import re
import sys

# the last line of a Python traceback: `pkg.module.ErrorClass: message` (Ray keeps only this text of an error
# raised in an actor's constructor: ActorDiedError's message)
_EXC_LINE = re.compile(r"^(?:ray::\S+ \(pid=\d+[^)]*\) )?([A-Za-z_][\w.]*): (.*)$")


class UserError(Exception):
    """A problem the user can fix; the message names the config key or file and how to fix it."""


def find_user_error(err: BaseException | None) -> UserError | None:
    """The UserError behind `err`: `err` itself, or the worker's exception that a Ray error carries
    (`.cause`, possibly wrapped again), or, for an actor that died raising a UserError in its constructor
    (ray's ActorDiedError, which keeps only the remote traceback's text), a UserError with that message.
    None when `err` is not a user's mistake: an error merely raised *from* a UserError (`__cause__`) is a bug
    elsewhere and keeps its traceback."""
    for _ in range(8):  # wrappers nest shallowly; the bound only guards against cycles
        cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError: the remote exception
        if not isinstance(cause, BaseException) or cause is err:
            break
        err = cause
    if isinstance(err, UserError):
        return err
    if getattr(err, "actor_init_failed", False):  # ray.exceptions.ActorDiedError of a failed __init__
        return _user_error_in_text(str(err))
    return None


def _user_error_in_text(text: str) -> UserError | None:
    """The UserError whose `module.Class: message` line ends a traceback's text, rebuilt from it (only classes
    already imported in this process, so nothing is imported on the strength of a message)."""
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(("Traceback (most recent call last)", "  File ")):
            return None  # above the last exception's text: its frames, or an earlier exception
        m = _EXC_LINE.match(lines[i].strip())
        if not m:
            continue
        module, _, name = m.group(1).rpartition(".")
        candidates = [sys.modules.get(module)] if module else list(sys.modules.values())
        for mod in candidates:
            # the module's own namespace only: getattr would make lazy modules (transformers) import things
            cls = (getattr(mod, "__dict__", None) or {}).get(name) if mod is not None else None
            if isinstance(cls, type) and issubclass(cls, UserError):
                message = "\n".join([m.group(2), *lines[i + 1:]]).strip()
                return UserError(message)
    return None


def remote_code_refusal(err: BaseException, what: str) -> str | None:
    """One line for transformers' refusal (`err`, under trust_remote_code=False) to run the Python code that `what`
    (a model or tokenizer, named with its config key) ships; None when `err` is another error."""
    if "trust_remote_code" not in str(err):
        return None
    return (f"{what} ships its own Python code (auto_map), which rltrain runs only with model.trust_remote_code=true: "
            "set it only for code you have read and trust, or use one without custom code")


def nearest(name: str, names: list[str]) -> list[str]:
    """The names in `names` nearest to `name` (difflib's ratio >= 0.6, within 0.05 of the best)."""
    import difflib

    ratios = sorted(((difflib.SequenceMatcher(None, name, n).ratio(), n) for n in names), reverse=True)
    return [n for r, n in ratios if r >= 0.6 and r >= ratios[0][0] - 0.05][:3] if ratios else []
