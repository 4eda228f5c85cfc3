"""Asynchronous rollout (`trainer.async_rollout`): the rollout group generates the batches of the next steps while the
train group updates on this one, up to `trainer.max_staleness` = k batches ahead; the pipeline of a RolloutSource
(trainer/rollout_source.py), which owns it. It must not touch Ray (group.py's submit/wait does) or losses.

Versions. The policy version v is the number of completed updates: during step s the actor is at v = s-1. The
rollout weights carry the version of the last push (`RolloutSource.weight_version`); every generated token is
stamped with it (`Batch.weight_versions`, by the source when the generation is collected: a rollout worker runs its
calls in submission order, so the version at submit time is the version that generates). A sample's staleness
is (s-1) - its version (the oldest of its tokens'); it is logged per step as `rollout/staleness_mean` / `_max` over
the samples trained and as the share of trained tokens per staleness, `rollout/tokens_staleness_<j>`
(`staleness_metrics`).

Schedule. A batch for step t sampled with version v is trained at staleness (t-1) - v, so version v may generate the
steps t <= v + k + 1, and at the boundary of step s at most k steps (s+1 .. s+k) may be queued:

  1. `boundary(s)` waits for the batch of step s (the oldest queued: the worker's calls finish in order);
  2. when no other batch is queued the rollout group is idle: the actor's weights (v = s-1) are pushed then (unless
     no step is left to generate for), so the push never waits for a generation (a push is a collective of both
     groups: with a batch still generating it would stall the trainer until that generation ends). With batches
     queued nothing is pushed;
  3. a batch staler than k (only possible from a checkpoint written with a larger k) is never trained on: its
     samples are dropped (`rollout/dropped_samples`) and its prompts generated again, same seed, with the weights
     pushed first (staleness 0);
  4. `fill(s)` submits the next steps while t <= min(s + k, v + k + 1, total_steps): generation is paced by the
     bound. It produces only samples that will be trained within it; past the bound the rollout group waits for
     the next push instead of generating samples to drop.

In steady state a push happens every k steps and generates the next k batches: the staleness of steps b+1 .. b+k
after the push at the boundary of step b is 1, 2, .., k (k = 1: every step, staleness 1). Validation pushes the
actor's weights first (after the queued batches: it waits for them) and DAPO refills push them before the step's
first refill: both sample with the current weights, and a later fill may then reach further. With refills the
next batches are submitted after the step's refills (`fill` from RolloutSource.next_batch), so at k = 1 prompts
are drawn in the synchronous order; at k > 1 the queued batches were drawn before the refills of the steps between.

Partial rollouts (rollout.partial, rollout/partial.py). The rollout workers generate in chunks and load a push between
two chunks, stamping each chunk's tokens with its version: `after_update(s)` pushes the weights of step s right after
its update while a batch is in flight or left to submit, and the boundary's push is then a no-op. Pacing is the same
(a sample is as stale as its oldest token, at most k). A checkpoint waits for the batches in flight as below: they
finish with the weights they hold and are saved with their per-token versions.

Checkpoints. The queued batches are SAVED, not regenerated (their weights are gone): `state_dict` waits for them
and stores each with its stamps, version, prompts and seed, the data position now and the rollout weights' version;
the top-level data position is the one from before the oldest queued batch was drawn (a synchronous resume draws
those prompts again). `load_state_dict` restores the batches, the position and the version of the last push: the
trainer pushed the restored (newer) weights on resume, but the schedule never generates with them before its next
push (after step s's fill the bound v + k + 1 is reached; refills, validation and regeneration push first), which
re-pushes the same weights. An async resume, SIGKILL mid-step included, therefore continues exactly as the
uninterrupted run: same batches, same versions, same pushes; a batch is never lost and never trained twice. Errors
of the queued calls (a dead rollout worker) surface from `WorkerGroup.wait` at the boundary that waits, unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.data.batch import Batch
from rltrain.utils.timing import timer

# rollout/tokens_staleness_<j> for j = 0 .. min(k, STALENESS_KEYS); past it one `<STALENESS_KEYS>plus` key
STALENESS_KEYS = 8


@dataclass
class _Rollout:
    """The first batch of one step, queued: in flight (`submitted` set) or generated (`batch` set)."""

    step: int  # the training step it is for
    version: int  # policy version of the rollout weights that generate it
    prompts: list[dict]
    seed: int
    data_before: dict  # {"sampler": state, "next_group_id": int} before its prompts were drawn
    submitted: Any = None  # RolloutSource.submit_generate's handle
    batch: Batch | None = None
    metrics: dict = field(default_factory=dict)


_SAVED = ("step", "version", "prompts", "seed", "data_before", "batch", "metrics")


class AsyncRollout:
    """The k-deep pipeline of a RolloutSource (uses its sampler, `next_group_id`, `weight_version`, `partial`,
    `rollout_seed`, `submit_generate`, `collect_generate`, `generate`). push_weights(version=v): the driver's weight
    push (WeightSync.push) of the actor's weights, policy version v."""

    def __init__(self, source, push_weights: Callable[..., None], *, max_staleness: int, total_steps: int,
                 refills: bool, idle_probe: Callable[[], dict] | None = None):
        assert max_staleness >= 1, max_staleness
        self.source, self.push_weights = source, push_weights
        # idle_probe(): metrics read from the rollout group while it is idle (its per-GPU memory), taken just
        # before a submit when nothing is in flight. A Ray actor runs one call at a time, so asking a generating
        # group would block the driver outside every phase timer until generation ends (issue 35: that wait made
        # async steps look 2.3x faster than sync ones); the trainer reads `idle_metrics` instead.
        self.idle_probe = idle_probe
        self.idle_metrics: dict = {}
        self.max_staleness, self.total_steps, self.refills = max_staleness, total_steps, refills
        self.queue: deque[_Rollout] = deque()  # submitted, not yet trained, in step order
        self.next_step = 1  # the next step whose batch is submitted
        self.current: _Rollout | None = None  # the batch of the step being trained

    # ------------------------------------------------------------------ the schedule
    def boundary(self, step: int, m: dict) -> None:
        """Start of step `step`: wait for its batch, push the weights if the rollout group is idle, drop the batch
        if too stale, submit the next ones (without refills)."""
        actor_version = step - 1
        if not self.queue:  # the first step (or a resume without saved batches): nothing to overlap with
            self.next_step = step
            self._submit()
        with timer("gen_wait", m):
            r = self.queue.popleft()
            self._collect(r)
        assert r.step == step, (step, r.step)
        with timer("update_weights", m):
            if self.source.partial:  # the batches in flight pause between two chunks and continue with them
                if self._generating_ahead():
                    self._push_weights(actor_version)
            elif not self.queue and self.next_step <= self.total_steps:  # idle, and a next batch will sample with them
                self._push_weights(actor_version)
        dropped = 0
        if actor_version - r.version > self.max_staleness:  # never trained on: the same prompts, fresh weights
            dropped = len(r.batch)
            with timer("gen_regenerate", m):
                self._push_weights(actor_version)
                r.batch, r.metrics = self.source.generate(r.prompts, validate=False, seed=r.seed)
            r.version = actor_version
        self.current = r
        m["rollout/dropped_samples"] = dropped
        if not self.refills:
            self.fill(step)

    def take(self) -> tuple[Batch, dict]:
        """The batch `boundary` prepared for this step, and its rollout metrics."""
        r, self.current = self.current, None
        assert r is not None and r.batch is not None
        return r.batch, dict(r.metrics)

    def fill(self, step: int) -> None:
        """Submit the batches of the steps after `step` that may generate now (no-op when none may)."""
        k = self.max_staleness
        last = min(self.total_steps, step + k, self.source.weight_version + k + 1)
        while self.next_step <= last:
            self._submit()

    def after_update(self, step: int) -> None:
        """rollout.partial: right after the update of step `step`, push its weights (version `step`) into the
        generations in flight; they pause between two chunks and continue with them. No-op otherwise."""
        if self.source.partial and self._generating_ahead():
            self._push_weights(step)

    def _generating_ahead(self) -> bool:
        """A batch is in flight or left to submit: new weights would reach a generation."""
        return bool(self.queue) or self.next_step <= self.total_steps

    def before_refill(self, step: int) -> None:
        """A DAPO refill of step `step` samples with the current weights (it queues behind the batches in flight)."""
        self._push_weights(step - 1)

    def before_validation(self, actor_version: int) -> None:
        """Validation samples with the current weights: finish the batches in flight, then push them."""
        for r in self.queue:
            self._collect(r)
        self._push_weights(actor_version)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Entries for the trainer's checkpoint state: the queued batches (waited for), and the data position from
        before the oldest was drawn (overriding the source's `sampler` / `next_group_id`, for a synchronous resume)."""
        if not self.queue:
            return {}
        for r in self.queue:
            self._collect(r)
        src = self.source
        saved = {"batches": [{k: getattr(r, k) if k != "batch" else r.batch.to_state() for k in _SAVED}
                             for r in self.queue], "next_step": self.next_step,
                 "weight_version": src.weight_version,
                 "data_now": {"sampler": src.sampler.state_dict(), "next_group_id": src.next_group_id}}
        return {**self.queue[0].data_before, "async_rollout": saved}

    def load_state_dict(self, state: dict, step: int) -> None:
        """After the source restored `state` (checkpoint of step `step`) and the trainer pushed the restored weights."""
        src = self.source
        src.weight_version = step
        saved = state.get("async_rollout")
        if saved is None:
            return
        missing = sorted({"data_now", "weight_version", "batches", "next_step"} - set(saved))
        if missing:
            from rltrain.utils.errors import UserError

            raise UserError(f"the checkpoint's asynchronous-rollout state has {sorted(saved)}, not {missing}: it was "
                            "written by an older rltrain (one batch in flight, no version stamps); resume it with "
                            "that version, or start afresh (trainer.resume=never, or a new run directory)")
        src.sampler.load_state_dict(saved["data_now"]["sampler"])
        src.next_group_id = saved["data_now"]["next_group_id"]
        src.weight_version = saved["weight_version"]  # the schedule's: see the module docstring
        self.queue = deque(_Rollout(**{**b, "batch": Batch.from_state(b["batch"])}) for b in saved["batches"])
        self.next_step = saved["next_step"]

    # ------------------------------------------------------------------ internals
    def _submit(self) -> None:
        """Start generating the first batch of step `next_step` with the rollout group's current weights."""
        src, step = self.source, self.next_step
        if self.idle_probe is not None and all(r.submitted is None for r in self.queue):
            self.idle_metrics = self.idle_probe()
        before = {"sampler": src.sampler.state_dict(), "next_group_id": src.next_group_id}
        prompts = src.sampler.next_batch()
        seed = src.rollout_seed(step, 1)
        handle = src.submit_generate(prompts, validate=False, seed=seed)
        self.queue.append(_Rollout(step, src.weight_version, prompts, seed, before, submitted=handle))
        self.next_step = step + 1

    def _collect(self, r: _Rollout) -> None:
        if r.submitted is not None:
            r.batch, r.metrics = self.source.collect_generate(r.submitted)
            r.submitted = None

    def _push_weights(self, version: int) -> None:
        if self.source.weight_version != version:
            self.push_weights(version=version)
            self.source.weight_version = version


def staleness_metrics(weight_versions: torch.Tensor, loss_mask: torch.Tensor, actor_version: int,
                      max_staleness: int) -> dict[str, float]:
    """The staleness of a trained batch: weight_versions [B, R] (Batch.weight_versions), loss_mask [B, R] (the
    generated tokens), actor_version = the policy version being trained. A sample's staleness is that of its oldest
    token. rollout/staleness_mean and _max over the samples with a generated token; rollout/tokens_staleness_<j>:
    the share of generated tokens j versions old, j = 0 .. min(max_staleness, STALENESS_KEYS) (the last key
    `<STALENESS_KEYS>plus` when max_staleness is larger); rollout/staleness_token_mean: the mean over the generated
    tokens; rollout/partial_samples_frac: the share of samples whose tokens come from more than one version (partial
    rollouts continued across a weight push, rollout.partial)."""
    mask = loss_mask.bool()
    token = actor_version - weight_versions.long()  # [B, R]
    rows = mask.any(-1)
    per_sample = token.masked_fill(~mask, torch.iinfo(torch.long).min).amax(-1)[rows].double()  # [B']
    newest = token.masked_fill(~mask, torch.iinfo(torch.long).max).amin(-1)[rows]  # [B']
    out = {"rollout/staleness_mean": per_sample.mean().item() if rows.any() else 0.0,
           "rollout/staleness_max": per_sample.max().item() if rows.any() else 0.0,
           # partial rollouts: the share of samples whose tokens come from more than one version
           "rollout/partial_samples_frac": (per_sample != newest).double().mean().item() if rows.any() else 0.0}
    tokens = token[mask]
    n = max(tokens.numel(), 1)
    out["rollout/staleness_token_mean"] = tokens.double().sum().item() / n
    top = min(max_staleness, STALENESS_KEYS)
    for j in range(top + 1):
        if j == top and max_staleness > top:
            out[f"rollout/tokens_staleness_{j}plus"] = (tokens >= j).sum().item() / n
        else:
            out[f"rollout/tokens_staleness_{j}"] = (tokens == j).sum().item() / n
    return out
