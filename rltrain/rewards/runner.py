"""Batched reward computation with a real per-call timeout.

Must not decide what a reward means: it calls the function, turns failures into 0 and counts them.

Calls run in worker processes (spawned, kept alive between batches) so a call that hangs (e.g.
math-verify on a pathological expression) is stopped for real: the worker is killed and
replaced, and the call scores 0 (`reward/timeouts`). A call that raises, returns a non-number or
NaN, or kills its worker scores 0 (`reward/errors`); the first such failure of each function is
reported on the console once (a function that fails on every call would otherwise only show as a
count in the metrics), later ones at debug level. `max_workers=0` runs calls in the calling
thread instead: no process overhead (for cheap trusted functions such as the synthetic checker)
but no timeout for a plain function.

An `async def` reward function (e.g. one that awaits a judge over HTTP) is awaited: in a worker process one call
at a time, with `max_workers=0` all of a batch's calls at once on one event loop, each cancelled at timeout_s.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import math
import multiprocessing as mp
import pickle
import signal
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Callable, Sequence

logger = logging.getLogger(__name__)


async def _awaited(value):
    return await value


async def _await_all(pending: dict[int, object], timeout_s: float) -> dict[int, tuple[str, object]]:
    """An async reward function's calls of one batch awaited together, each cancelled after timeout_s."""
    async def one(aw) -> tuple[str, object]:
        try:
            return "ok", await asyncio.wait_for(aw, timeout_s)
        except asyncio.TimeoutError:
            return "timeout", f"took longer than timeout_s={timeout_s}"
        except Exception as e:  # noqa: BLE001 - scored 0 and counted
            return "error", f"{type(e).__name__}: {e}"

    keys = list(pending)
    return dict(zip(keys, await asyncio.gather(*(one(pending[k]) for k in keys))))


def _worker_main(conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the workers
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, fn, args, kwargs = msg
        try:
            value = fn(*args, **kwargs)
            reply = (idx, "ok", asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value)
        except BaseException as e:  # noqa: BLE001 - anything the user function does is scored 0
            reply = (idx, "error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            conn.send((idx, "error", f"result could not be sent back: {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), name="rltrain-reward-worker")
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.kill()


class _Pool:
    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.workers: list[_Worker] = []

    def resize(self, n: int) -> None:
        self.workers = [w for w in self.workers if w.proc.is_alive()]
        while len(self.workers) < n:
            self.workers.append(_Worker(self.ctx))

    def shutdown(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []

    def run(self, fn: Callable, calls: list[tuple[tuple, dict]], timeout_s: float, n_workers: int) -> list[tuple[str, object]]:
        """(status, value) per call; status is "ok", "error" or "timeout"."""
        self.resize(n_workers)
        active = self.workers[:n_workers]
        results: list = [None] * len(calls)
        todo = deque(range(len(calls)))
        busy: dict[_Worker, tuple[int, float]] = {}

        def assign(w: _Worker) -> None:
            if todo:
                i = todo.popleft()
                args, kwargs = calls[i]
                w.conn.send((i, fn, args, kwargs))
                busy[w] = (i, time.monotonic() + timeout_s)

        def replace(w: _Worker) -> _Worker:
            w.kill()
            new = _Worker(self.ctx)
            self.workers[self.workers.index(w)] = new
            return new

        for w in active:
            assign(w)
        while busy:
            next_deadline = min(d for _, d in busy.values())
            ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            for conn in ready:
                w = next(w for w in busy if w.conn is conn)
                i, _ = busy.pop(w)
                try:
                    got_i, status, value = conn.recv()
                    assert got_i == i
                    results[i] = (status, value)
                except (EOFError, OSError):
                    results[i] = ("error", f"reward worker died (exit code {w.proc.exitcode})")
                    w = replace(w)
                assign(w)
            now = time.monotonic()
            for w, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    busy.pop(w)
                    results[i] = ("timeout", f"took longer than timeout_s={timeout_s}")
                    assign(replace(w))
        return results


_POOL: _Pool | None = None
_REPORTED: set[str] = set()  # functions whose first failure was already reported on the console


def _pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(_POOL.shutdown)
    return _POOL


def shutdown_workers() -> None:
    """Stop the reward worker processes (they are restarted on the next compute_rewards)."""
    if _POOL is not None:
        _POOL.shutdown()


def _as_score(value) -> tuple[float | None, dict, str | None]:
    """(score, numeric extras, error message)."""
    extras = {}
    if isinstance(value, dict):
        if "score" not in value:
            return None, {}, f"returned a dict without 'score' (keys {sorted(value)})"
        extras = {k: float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        value = value["score"]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        return None, {}, f"returned {type(value).__name__}, expected a float or a dict with 'score'"
    if not math.isfinite(value):
        return None, {}, f"returned a non-finite score {value}"
    return float(value), extras, None


def compute_rewards(
    fn: Callable,
    responses: Sequence[str],
    ground_truths: Sequence[str],
    *,
    data_sources: Sequence[str | None] | None = None,
    extras: Sequence[dict | None] | None = None,
    timeout_s: float = 10.0,
    max_workers: int = 4,
) -> tuple[list[float], dict[str, float]]:
    """Score every response. Returns (scores [B] floats, metrics) with metrics "reward/errors",
    "reward/timeouts" (counts) and "reward/<key>/mean" for each numeric key a dict result carries.

    fn: `fn(response, ground_truth, *, data_source=None, extra=None) -> float | dict` that pickles
    (a module-level function or what `get_reward_fn` returns) unless max_workers=0.
    """
    n = len(responses)
    if len(ground_truths) != n:
        raise ValueError(f"compute_rewards: {n} responses but {len(ground_truths)} ground_truths")
    for name, seq in (("data_sources", data_sources), ("extras", extras)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"compute_rewards: {n} responses but {len(seq)} {name}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s (reward.timeout_s) must be positive, got {timeout_s}")
    if max_workers < 0:
        raise ValueError(f"max_workers (reward.max_workers) must be >= 0, got {max_workers}")
    calls = [((responses[i], ground_truths[i]),
              {"data_source": None if data_sources is None else data_sources[i],
               "extra": None if extras is None else extras[i]}) for i in range(n)]
    if max_workers == 0 or n == 0:
        raw: list = []
        pending: dict[int, object] = {}  # an async function's calls, awaited together below
        for i, (args, kwargs) in enumerate(calls):
            try:
                value = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - scored 0 and counted
                raw.append(("error", f"{type(e).__name__}: {e}"))
                continue
            raw.append(("ok", value))
            if inspect.isawaitable(value):
                pending[i] = value
        if pending:
            for i, got in asyncio.run(_await_all(pending, timeout_s)).items():
                raw[i] = got
    else:
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"reward function {fn!r} cannot be sent to worker processes ({e}); use a "
                             "module-level function or max_workers=0 (no timeout)") from e
        raw = _pool().run(fn, calls, timeout_s, min(max_workers, n))

    scores: list[float] = []
    errors = timeouts = 0
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    first_problem = None
    for status, value in raw:
        if status == "ok":
            score, extra, problem = _as_score(value)
        else:
            score, extra, problem = None, {}, value
        if score is None:
            scores.append(0.0)
            if status == "timeout":
                timeouts += 1
            else:
                errors += 1
            first_problem = first_problem or problem
            continue
        scores.append(score)
        for k, v in extra.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    if first_problem is not None:
        if repr(fn) not in _REPORTED:
            _REPORTED.add(repr(fn))
            logger.warning("reward function %r failed on %d of %d calls (%d timeouts), scored 0; first error: %s "
                           "(reported once; see reward/errors and reward/timeouts in the metrics)",
                           fn, errors + timeouts, n, timeouts, first_problem)
        else:
            logger.debug("reward: %d errors and %d timeouts in %d calls scored 0; first: %s",
                         errors, timeouts, n, first_problem)
    metrics: dict[str, float] = {"reward/errors": float(errors), "reward/timeouts": float(timeouts)}
    metrics.update({f"reward/{k}/mean": sums[k] / counts[k] for k in sums})
    return scores, metrics
