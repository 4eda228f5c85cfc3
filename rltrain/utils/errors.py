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
    """The UserError behind `err`: `err` itself, the worker's exception that a Ray error carries
    (`.cause`), or one it was raised from (`__cause__`). None when `err` is not a user's mistake."""
    for _ in range(8):  # a chain is short; the bound only guards against cycles
        if err is None:
            return None
        cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError: the remote exception
        if isinstance(cause, BaseException) and cause is not err:
            err = cause
        elif isinstance(err, UserError):
            return err
        else:
            err = err.__cause__
    return None
