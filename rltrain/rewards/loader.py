"""Loading users' reward functions from `path/to/file.py:function` or `package.module:function`.

Must not call the function: it only finds it and checks that it is callable.

The function's signature: `fn(response_text: str, ground_truth: str, *, data_source: str | None = None,
extra: dict | None = None) -> float | dict` (a dict holds "score" plus numbers to log).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from typing import Callable

from rltrain.utils.errors import UserError


class RewardFnError(UserError, ValueError):
    """`reward.fn` names a file, module or function that cannot be loaded."""


def _import_failure(spec: str, target: str, err: BaseException) -> RewardFnError:
    """Where the user's code failed (its last frame in the user's file) and why, in one message."""
    where = ""
    if isinstance(err, SyntaxError) and err.lineno:
        where = f" (line {err.lineno})"
    else:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename.endswith(os.path.basename(target))]
        if frames:
            where = f" (line {frames[-1].lineno})"
    return RewardFnError(f"reward.fn={spec!r}: importing {target!r} failed{where}: {type(err).__name__}: {err}; "
                         "fix the file or install what it imports")


def load_function(spec: str) -> Callable:
    """`file.py:function` or `module:function` -> the function (config key `reward.fn`)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RewardFnError(f"reward.fn={spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    if target.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise RewardFnError(f"reward.fn={spec!r}: file {target!r} does not exist")
        mod_name = "rltrain_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        module = sys.modules.get(mod_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module  # so the function pickles by reference in this process
            try:
                file_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[mod_name]
                raise _import_failure(spec, target, e) from e
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardFnError(f"reward.fn={spec!r}: cannot import module {target!r}: {e}") from e
        except Exception as e:
            raise _import_failure(spec, target.replace(".", "/") + ".py", e) from e
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardFnError(f"reward.fn={spec!r}: {target!r} has no function {name!r}; it defines {public}")
    if not callable(fn):
        raise RewardFnError(f"reward.fn={spec!r}: {name!r} in {target!r} is a {type(fn).__name__}, not a function")
    return fn


class UserRewardFn:
    """A loaded user function that pickles as its spec string, so reward worker processes (which
    never imported the user's file) load it themselves."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._fn = load_function(spec)

    def __call__(self, response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None):
        return self._fn(response, ground_truth, data_source=data_source, extra=extra)

    def __getstate__(self) -> dict:
        return {"spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"])

    def __repr__(self) -> str:
        return f"UserRewardFn({self.spec!r})"
