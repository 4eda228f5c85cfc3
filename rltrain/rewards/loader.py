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
from typing import Callable


def load_function(spec: str) -> Callable:
    """`file.py:function` or `module:function` -> the function (config key `reward.fn`)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"reward.fn={spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    if target.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise ValueError(f"reward.fn={spec!r}: file {target!r} does not exist")
        mod_name = "rltrain_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        module = sys.modules.get(mod_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module  # so the function pickles by reference in this process
            try:
                file_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"reward.fn={spec!r}: cannot import module {target!r}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward.fn={spec!r}: {target!r} has no function {name!r}; it defines {public}")
    if not callable(fn):
        raise ValueError(f"reward.fn={spec!r}: {name!r} in {target!r} is a {type(fn).__name__}, not a function")
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
