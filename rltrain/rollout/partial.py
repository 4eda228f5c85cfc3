"""Partial rollouts (`rollout.partial=true`): generation in chunks of `rollout.partial_chunk_tokens` new tokens, so
new weights can be loaded between two chunks and the unfinished sequences continued from prompt + tokens so far.
It drives any Engine through `Engine.generate` only (one code path for hf and vLLM); it must not move weights or
decide when they change (the rollout worker does, through `PartialRunner.paused`).

A row's tokens, sampler log-probs and weight versions are concatenated over its chunks: every chunk continues the
row with the remaining token budget (`max_tokens` minus the tokens made) under the weights loaded at that chunk's
start, whose version stamps its tokens. The continuation re-reads prompt + tokens so far (hf: a fresh prefill;
vLLM: a fresh request, its prefix cache reset at every weight load), so the log-probs of the tokens of a chunk are
those of the weights that sampled them. MoE routing (routing replay, `RolloutResponse.routed_experts`) is joined the
same way: each position keeps the routing of the first chunk that fed it to the model (a chunk's last token is fed
by the next chunk, under that chunk's weights). A row finishes on EOS / a stop token / a stop string (also one spanning two
chunks: the row is cut after the token completing it), or when its budget is spent ("length").

Sampling seeds: chunk c of a call with seed s samples with seed s + c * CHUNK_SEED_STRIDE (None stays None). Greedy
chunked generation equals unchunked generation while the weights do not change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from rltrain.rollout.base import Engine, RolloutResponse, SamplingParams, check_prompts

CHUNK_SEED_STRIDE = 1_000_003


@dataclass
class _Row:
    prompt_index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    stop_reason: str | int | None = None
    routing: torch.Tensor | None = None  # [positions fed so far, L, k] (MoE routing replay)


class FixedVersion:
    """The gate of a generation whose weights never change: every chunk at `version`."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    @contextlib.contextmanager
    def chunk(self) -> Iterator[int]:
        yield self.version


def generate_in_chunks(engine: Engine, prompts_token_ids: list[list[int]], sampling: SamplingParams, *,
                       chunk_tokens: int, gate=None, decode: Callable[[list[int]], str] | None = None,
                       ) -> tuple[list[RolloutResponse], list[list[int]]]:
    """Sample `sampling.n` responses per prompt in chunks of at most `chunk_tokens` new tokens each.

    gate.chunk(): a context manager around each chunk's engine call that yields the weight version the chunk samples
    with (weights may change only outside it); default FixedVersion(0). decode: token ids -> text, needed for stop
    strings. Returns the responses prompt-major (as Engine.generate) and each response's per-token versions."""
    check_prompts(prompts_token_ids)
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"rollout.partial_chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if sampling.stop and decode is None:
        raise ValueError("SamplingParams.stop strings need decode= (a tokenizer's decode) for partial rollouts")
    gate = FixedVersion() if gate is None else gate
    rows = [_Row(i, list(p)) for i, p in enumerate(prompts_token_ids) for _ in range(sampling.n)]
    chunk = 0
    while live := [r for r in rows if r.finish is None]:
        made = len(live[0].tokens)  # every live row made the same number of tokens: whole chunks
        budget = min(chunk_tokens, sampling.max_tokens - made)
        seed = None if sampling.seed is None else sampling.seed + chunk * CHUNK_SEED_STRIDE
        params = dataclasses.replace(sampling, n=1, max_tokens=budget, seed=seed)
        with gate.chunk() as version:
            outs = engine.generate([r.prompt + r.tokens for r in live], params)
        for r, out in zip(live, outs, strict=True):
            _extend(r, out, version, sampling, decode, budget)
        chunk += 1
    responses = [RolloutResponse(prompt_index=r.prompt_index, token_ids=r.tokens, logprobs=r.logprobs,
                                 finish_reason=r.finish, stop_reason=r.stop_reason, routed_experts=r.routing)
                 for r in rows]
    return responses, [r.versions for r in rows]


def _extend(r: _Row, out: RolloutResponse, version: int, sampling: SamplingParams, decode, budget: int) -> None:
    """Append one chunk's output to row r; decide whether r finished."""
    before = len(r.tokens)
    if out.routed_experts is not None:  # positions this chunk fed first: from the end of what earlier chunks fed
        have = 0 if r.routing is None else r.routing.shape[0]
        new = out.routed_experts[have:]
        r.routing = new if r.routing is None else torch.cat([r.routing, new])
    r.tokens += out.token_ids
    r.logprobs += out.logprobs
    r.versions += [version] * len(out.token_ids)
    if out.finish_reason == "stop":
        r.finish, r.stop_reason = "stop", out.stop_reason
    elif out.finish_reason == "abort":
        r.finish = "abort"
    elif len(r.tokens) >= sampling.max_tokens or len(out.token_ids) < budget:  # short: the engine's own length limit
        r.finish = "length"
    if sampling.stop and before > 0 and r.finish != "stop":  # a stop string across the chunk boundary
        cut = _stop_string_end(r.tokens, before, sampling.stop, decode)
        if cut is not None:
            end, hit = cut
            del r.tokens[end:], r.logprobs[end:], r.versions[end:]
            r.finish, r.stop_reason = "stop", hit


def _stop_string_end(tokens: list[int], before: int, stops: tuple[str, ...], decode) -> tuple[int, str] | None:
    """(n, stop) for the fewest tokens n > before whose text holds a stop string, else None."""
    if not any(s in decode(tokens) for s in stops):
        return None
    for n in range(before + 1, len(tokens) + 1):
        text = decode(tokens[:n])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            return n, min(hits)[1]
    return None


class PartialRunner:
    """Runs generation jobs one at a time, in submission order, in a thread of its own, so that the rollout worker's
    calls (a weight receive) run while a job generates. `paused()` waits for the running chunk to end and holds the
    next one until the block exits: the weights and `version` may change inside it. Used as the gate of
    generate_in_chunks (`chunk()` yields `version` read after any pause)."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._cv = threading.Condition()
        self._busy = False  # a chunk is running
        self._pauses = 0  # paused() blocks waiting or inside
        self._jobs: queue.Queue = queue.Queue()
        self._results: dict = {}
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- the gate
    @contextlib.contextmanager
    def chunk(self) -> Iterator[int]:
        with self._cv:
            while self._pauses:
                self._cv.wait()
            self._busy = True
            version = self.version
        try:
            yield version
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold generation between two chunks (or before the next job) while the block runs."""
        with self._cv:
            self._pauses += 1
            while self._busy:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._pauses -= 1
                self._cv.notify_all()

    # -------------------------------------------------------------- jobs
    def submit(self, job_id, fn: Callable[[], object]) -> None:
        """Queue fn() as job `job_id`; `result(job_id)` waits for what it returned (or raises what it raised)."""
        if self._thread is None:
            # OpenMP's thread count is per thread: a new thread starts at the default, and vLLM's CPU attention
            # checks its count against the one its metadata was built with (this thread's)
            self._thread = threading.Thread(target=self._loop, args=(torch.get_num_threads(),),
                                            name="rltrain-partial-rollout", daemon=True)
            self._thread.start()
        self._jobs.put((job_id, fn))

    def result(self, job_id):
        with self._cv:
            while job_id not in self._results:
                self._cv.wait()
            ok, value = self._results.pop(job_id)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def _loop(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        while (job := self._jobs.get()) is not None:
            job_id, fn = job
            try:
                out = (True, fn())
            except BaseException as err:  # noqa: BLE001  (handed to the caller of result)
                out = (False, err)
            with self._cv:
                self._results[job_id] = out
                self._cv.notify_all()
