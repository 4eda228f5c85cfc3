"""Loading users' reward functions from `path/to/file.py:function` or `package.module:function`.

Must not call the function: it only finds it and checks that it is callable.

The user's module is imported in a helper thread with a time limit (RLTRAIN_REWARD_IMPORT_TIMEOUT_S, default
120 s; a line every 15 s says it is still importing): a module that blocks at import (input(), a lock, the
network) is reported by name instead of hanging the trainer, and one that calls sys.exit() while being imported
is a user error, not the run's end. (Module-level code that needs the main thread, e.g. signal.signal, fails.)

The function's signature: `fn(response_text: str, ground_truth: str, *, data_source: str | None = None,
extra: dict | None = None) -> float | dict` (a dict holds "score" plus numbers to log).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading
import time
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


def _import_timeout_s() -> float:
    try:
        return float(os.environ.get("RLTRAIN_REWARD_IMPORT_TIMEOUT_S", "120"))
    except ValueError:
        return 120.0


def _run_import(spec: str, target: str, do_import: Callable[[], object]):
    """`do_import()` in a daemon thread, waited for at most the import time limit; its exception (SystemExit
    and KeyboardInterrupt included) is re-raised here, a module that does not finish is a RewardFnError."""
    result: dict = {}

    def body() -> None:
        try:
            result["module"] = do_import()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=body, name="rltrain-reward-import", daemon=True)
    start, limit = time.monotonic(), _import_timeout_s()
    thread.start()
    while True:
        thread.join(min(15.0, max(0.0, limit - (time.monotonic() - start))))
        waited = time.monotonic() - start
        if not thread.is_alive():
            break
        if waited >= limit:
            raise RewardFnError(
                f"reward.fn={spec!r}: importing {target!r} did not finish in {limit:.0f} s (does it wait for input, "
                "a lock or the network at import?); move that work into the function, or raise the limit with "
                "RLTRAIN_REWARD_IMPORT_TIMEOUT_S")
        print(f"rltrain: still importing the reward module {target!r} ({waited:.0f} s of {limit:.0f} s)",
              file=sys.stderr, flush=True)
    if "error" in result:
        err = result["error"]
        if isinstance(err, SystemExit):
            raise RewardFnError(f"reward.fn={spec!r}: importing {target!r} called sys.exit({err.code!r}), which would "
                                "end the run; a reward module must not exit at import (guard script code with "
                                "`if __name__ == '__main__':`)") from None
        raise err
    return result["module"]


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
                _run_import(spec, target, lambda: file_spec.loader.exec_module(module))
            except RewardFnError:
                sys.modules.pop(mod_name, None)
                raise
            except Exception as e:
                sys.modules.pop(mod_name, None)
                raise _import_failure(spec, target, e) from e
            except BaseException:
                sys.modules.pop(mod_name, None)
                raise
    else:
        try:
            module = _run_import(spec, target, lambda: importlib.import_module(target))
        except RewardFnError:
            raise
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
