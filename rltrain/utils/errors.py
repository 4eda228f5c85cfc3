"""The user's mistakes as one exception type, which the entry points print as a short message (exit code 2).
Must not import anything from rltrain or third parties: every room may raise it, workers included.

Raise a subclass of `UserError` (mixed with the builtin type callers expect, e.g. `ValueError`) for what a
user can fix: a config key, a missing path, a malformed data row, a model the backend cannot run. The
message names the key or file and the fix. `rltrain.main` and `rltrain.sft` print it as
`rltrain: <message>` and exit 2, also when it was raised in a Ray worker.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; the message names the config key or file and how to fix it."""


def find_user_error(err: BaseException | None) -> UserError | None:
    """The UserError behind `err`: `err` itself, or the worker's exception that a Ray error carries
    (`.cause`, possibly wrapped again). None when `err` is not a user's mistake: an error merely raised
    *from* a UserError (`__cause__`) is a bug elsewhere and keeps its traceback."""
    for _ in range(8):  # wrappers nest shallowly; the bound only guards against cycles
        cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError: the remote exception
        if not isinstance(cause, BaseException) or cause is err:
            break
        err = cause
    return err if isinstance(err, UserError) else None
