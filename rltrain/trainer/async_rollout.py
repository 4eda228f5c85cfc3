"""Asynchronous rollout (`trainer.async_rollout`): the rollout group generates the batch of step k+1 while
the train group updates on the batch of step k; the pipeline of a RolloutSource (trainer/rollout_source.py), which
owns it. It must not touch Ray (group.py's submit/wait does) or losses.

Schedule (split placement, one batch in flight). Policy version v = number of completed updates; during step
k the actor is at v = k-1. At the boundary of step k (`boundary`):

  1. wait for the in-flight batch of step k (generated with rollout weights v_gen);
  2. push the actor's weights (v = k-1) to the rollout group: both groups are idle here, so the only stall
     is the transfer itself (the actor side waits for generation only when generation is the slower side);
  3. staleness = (k-1) - v_gen. In steady state v_gen = k-2, i.e. staleness 1: the batch of step k+1 is
     generated with the weights of step k-1 while step k trains. A batch with staleness > max_staleness is
     never trained on: it is dropped (counted) and its prompts are generated again with the weights just
     pushed (staleness 0);
  4. submit the batch of step k+1 (after the step's DAPO refills when dynamic sampling is on, so the prompt
     order is the synchronous run's and the refills, generated at the boundary, are fresh).

The loss corrects the staleness with the sampler's log-probs as behaviour policy (actor.tis, truncated
importance sampling). Validation uses the current weights: it waits for the in-flight batch and pushes the
actor's weights first (`before_validation`); that batch keeps its generation version and is used next step.

Checkpoints: the in-flight batch is SAVED, not regenerated. `state_dict` waits for it and stores it with its
version and prompts, and reports the data position from before its prompts were drawn; `load_state_dict`
restores it and the position after the draw. An async resume therefore continues exactly as the uninterrupted
run (same batch, same staleness); a synchronous resume of the same checkpoint draws those prompts again. A batch
is never lost and never trained twice. Errors of the in-flight calls (a dead rollout worker) surface from
`WorkerGroup.wait` at the next boundary, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rltrain.data.batch import Batch
from rltrain.utils.timing import timer


@dataclass
class _Rollout:
    """One generation of a step's first batch, in flight (`submitted` set) or done (`batch` set)."""

    step: int  # the training step it is for
    version: int  # policy version of the rollout weights that generate it
    prompts: list[dict]
    seed: int
    data_before: dict  # {"sampler": state, "next_group_id": int} before its prompts were drawn
    data_after: dict  # the same after the draw
    submitted: Any = None  # RolloutSource.submit_generate's handle
    batch: Batch | None = None
    metrics: dict = field(default_factory=dict)


class AsyncRollout:
    """The one-batch-in-flight pipeline of a RolloutSource (uses its sampler, `next_group_id`, `rollout_seed`,
    `submit_generate`, `collect_generate`, `generate`). push_weights(): the driver's weight push (WeightSync.push)."""

    def __init__(self, source, push_weights: Callable[[], None], *, max_staleness: int, total_steps: int,
                 refills: bool, idle_probe: Callable[[], dict] | None = None):
        assert max_staleness >= 1, max_staleness
        self.source, self.push_weights = source, push_weights
        # idle_probe(): metrics read from the rollout group while it is idle (its per-GPU memory), taken just
        # before each submit. A Ray actor runs one call at a time, so asking a generating group would block the
        # driver outside every phase timer until generation ends (issue 35: that wait made async steps look 2.3x
        # faster than sync ones); the trainer reads `idle_metrics` instead.
        self.idle_probe = idle_probe
        self.idle_metrics: dict = {}
        self.max_staleness, self.total_steps, self.refills = max_staleness, total_steps, refills
        self.rollout_version = 0  # both groups start from the same seeded or pretrained weights
        self.in_flight: _Rollout | None = None
        self.ready: _Rollout | None = None  # generated, waiting for its step
        self.current: _Rollout | None = None  # the batch of the step being trained

    # ------------------------------------------------------------------ the schedule
    def submit(self, step: int) -> None:
        """Start generating the first batch of `step` with the rollout group's current weights (no-op when it
        is already generated or in flight, or past the last step)."""
        if step > self.total_steps or any(r is not None and r.step >= step for r in (self.in_flight, self.ready)):
            return
        src = self.source
        before = {"sampler": src.sampler.state_dict(), "next_group_id": src.next_group_id}
        if self.idle_probe is not None:
            self.idle_metrics = self.idle_probe()
        prompts = src.sampler.next_batch()
        seed = src.rollout_seed(step, 1)
        handle = src.submit_generate(prompts, validate=False, seed=seed)
        after = {"sampler": src.sampler.state_dict(), "next_group_id": src.next_group_id}
        self.in_flight = _Rollout(step, self.rollout_version, prompts, seed, before, after, submitted=handle)

    def boundary(self, step: int, m: dict) -> None:
        """Start of step `step`: wait for its batch, push the weights, drop it if too stale, submit the next."""
        actor_version = step - 1
        if self.in_flight is None and self.ready is None:
            self.submit(step)  # the first step (or a resume without a saved batch): nothing to overlap with
        with timer("gen_wait", m):
            self._drain()
        r, self.ready = self.ready, None
        assert r is not None and r.step == step, (step, r and r.step)
        with timer("update_weights", m):
            self._push_weights(actor_version)
        staleness, dropped = actor_version - r.version, 0
        if staleness > self.max_staleness:  # never trained on: the same prompts again with the current weights
            dropped = 1
            with timer("gen_regenerate", m):
                r.batch, r.metrics = self.source.generate(r.prompts, validate=False, seed=r.seed)
            r.version, staleness = actor_version, 0
        self.current = r
        m["rollout/staleness"] = staleness
        m["rollout/stale_batches_dropped"] = dropped
        if not self.refills:
            self.submit(step + 1)

    def take(self) -> tuple[Batch, dict]:
        """The batch `boundary` prepared for this step, and its rollout metrics."""
        r, self.current = self.current, None
        assert r is not None and r.batch is not None
        return r.batch, dict(r.metrics)

    def before_validation(self, actor_version: int) -> None:
        """Validation samples with the current weights: finish the in-flight batch, then push them."""
        self._drain()
        self._push_weights(actor_version)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Entries for the trainer's checkpoint state: the generated next batch and the data position from
        before its prompts were drawn (overriding the source's `sampler` / `next_group_id`)."""
        self._drain()
        r = self.ready
        if r is None:
            return {}
        saved = {k: getattr(r, k) for k in ("step", "version", "prompts", "seed", "data_before", "data_after",
                                            "batch", "metrics")}
        return {**r.data_before, "async_rollout": saved}

    def load_state_dict(self, state: dict, step: int) -> None:
        """After the source restored `state` (checkpoint of step `step`) and the trainer pushed the restored weights."""
        self.rollout_version = step
        saved = state.get("async_rollout")
        if saved is None:
            return
        self.source.sampler.load_state_dict(saved["data_after"]["sampler"])
        self.source.next_group_id = saved["data_after"]["next_group_id"]
        self.ready = _Rollout(**saved)

    # ------------------------------------------------------------------ internals
    def _drain(self) -> None:
        r, self.in_flight = self.in_flight, None
        if r is not None:
            r.batch, r.metrics = self.source.collect_generate(r.submitted)
            r.submitted = None
            self.ready = r

    def _push_weights(self, version: int) -> None:
        if self.rollout_version != version:
            self.push_weights()
            self.rollout_version = version
