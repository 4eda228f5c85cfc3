"""Where the trainer's batches come from: `RolloutSource` owns the prompt sampler, the group ids, the sampling seeds,
DAPO's dynamic-sampling refills, the version stamps of generated tokens and, with `trainer.async_rollout`, the
batches in flight and their staleness (trainer/async_rollout.py). The trainer asks it for the next scored batch and
never sees how it was made. It must not compute log-probs, advantages or losses, nor touch Ray (workers/group.py's
submit/wait does).

Version stamps: `weight_version` is the policy version (number of updates) of the rollout group's weights; every
generation is stamped with its value at submit time (`Batch.weight_versions`, per token). The synchronous schedule
pushes the actor's weights after every update, so step s samples with version s-1; the pipeline tracks its pushes.
With partial rollouts (rollout.partial) the rollout workers stamp the tokens per chunk, with the version each push
names (WeightSync.push(version=...)).

Seeds: the k-th try of step s samples with seed * 100_003 + s * 101 + k. The prompts are cut into one contiguous
share per rollout replica (rollout/pool.py's `shares`: sizes differing by at most one) and joined back in prompt
order; a share starting at prompt j samples with that seed + j, so request j's seed is the same whichever replica
serves it (a vLLM engine seeds its request i with seed + i: pool.py's rule). Group ids number the prompts in the
order drawn, across steps (checkpointed with the sampler).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rltrain.algorithms import filter_informative_groups
from rltrain.data.batch import Batch
from rltrain.rollout.pool import shares
from rltrain.trainer.async_rollout import staleness_metrics
from rltrain.utils.timing import timer
from rltrain.workers.group import mean_metrics


def stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """{prefix}/mean, /max, /min of x (where mask is set); 0.0 each when empty."""
    v = x[mask.bool()] if mask is not None else x.flatten()
    if v.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": v.float().mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


class RolloutSource:
    """rollout_group: the group whose replicas generate (`submit_per_replica("generate", ...)`, `wait`).
    score(batch) -> (batch with scores, reward metrics): the trainer's reward step. dynamic_sampling: the config's
    algorithm.dynamic_sampling (`enable`, `max_tries`); want_groups: data.train_batch_size."""

    def __init__(self, rollout_group, sampler, *, seed: int, score: Callable[[Batch], tuple[Batch, dict]],
                 want_groups: int, dynamic_sampling, max_response_length: int, multi_turn: bool,
                 partial: bool = False) -> None:
        self.rollout_group, self.sampler, self.seed, self.score = rollout_group, sampler, seed, score
        self.want_groups, self.dynamic_sampling = want_groups, dynamic_sampling
        self.max_response_length, self.multi_turn = max_response_length, multi_turn
        self.next_group_id = 0
        self.weight_version = 0  # both groups start from the same seeded or pretrained weights
        self.pipeline = None  # AsyncRollout when the next batches generate while this one trains (use_pipeline)
        # rollout.partial: generations are queued on the rollout workers (generate_start / generate_result), so a
        # weight push reaches them mid-generation; the workers stamp each token with the version of its chunk
        self.partial = partial
        self.next_job = 0

    def use_pipeline(self, pipeline) -> None:
        """Asynchronous rollout: `pipeline` (trainer/async_rollout.AsyncRollout over this source) makes each
        step's first batch while the previous steps train."""
        self.pipeline = pipeline

    # ------------------------------------------------------------------ the trainer's calls
    def boundary(self, step: int, m: dict) -> None:
        """Start of step `step` (async: wait for its batch, push the weights when due, submit the next ones; sync: the
        rollout weights are the actor's, pushed after the previous update or restored on resume)."""
        if self.pipeline is not None:
            self.pipeline.boundary(step, m)
        else:
            self.weight_version = step - 1

    def next_batch(self, step: int, m: dict) -> tuple[Batch, dict]:
        """Sample n responses per prompt and score them; with DAPO dynamic sampling, keep only groups whose scores
        differ and refill (bounded tries) until the batch holds train_batch_size groups. `m` gets timing_s/reward.
        Returns the batch and its rollout metrics."""
        ds = self.dynamic_sampling
        kept: list[Batch] = []
        n_groups, tries, dropped_total = 0, 0, 0
        gen_metrics: dict = {}
        while True:
            tries += 1
            if tries == 1 and self.pipeline is not None:
                batch, gm = self.pipeline.take()  # generated while the previous step trained
            else:
                if self.pipeline is not None:
                    self.pipeline.before_refill(step)
                prompts = self.sampler.next_batch()
                batch, gm = self.generate(prompts, validate=False, seed=self.rollout_seed(step, tries))
            gen_metrics = gm if not gen_metrics else gen_metrics
            with timer("reward", m):
                batch, rm = self.score(batch)
            gen_metrics.update(rm)
            if not ds.enable:
                kept.append(batch)
                break
            keep, dropped = filter_informative_groups(batch.scores, batch.group_ids)
            dropped_total += dropped
            if keep.any():
                kept.append(batch.select(keep))
                n_groups += int(torch.unique(batch.group_ids[keep]).numel())
            if n_groups >= self.want_groups or tries >= ds.max_tries:
                break
        if self.pipeline is not None:
            self.pipeline.fill(step)  # after the refills (no-op when already submitted)
        if ds.enable and n_groups == 0:  # nothing kept (before: an IndexError on the empty list, not this message)
            raise RuntimeError("dynamic sampling found no group with differing scores in "
                               f"{tries} tries; raise algorithm.dynamic_sampling.max_tries or disable it")
        batch = Batch.concat(kept) if len(kept) > 1 else kept[0]
        if ds.enable:
            gen_metrics["dynamic_sampling/dropped_groups"] = dropped_total
            gen_metrics["dynamic_sampling/tries"] = tries
        gen_metrics.update(self._batch_metrics(batch))
        if self.pipeline is not None:
            gen_metrics.update(staleness_metrics(batch.weight_versions, batch.loss_mask, step - 1,
                                                 self.pipeline.max_staleness))
        return batch, gen_metrics

    def after_update(self, step: int, m: dict) -> None:
        """After the update of step `step`: with partial rollouts, push its weights into the generations in flight
        (timing_s/update_weights)."""
        if self.pipeline is not None and self.partial:
            with timer("update_weights", m):
                self.pipeline.after_update(step)

    def before_validation(self, actor_version: int) -> None:
        """Validation samples with the current weights (async: finish the batch in flight, push them)."""
        if self.pipeline is not None:
            self.pipeline.before_validation(actor_version)

    # ------------------------------------------------------------------ generation
    def rollout_seed(self, step: int, tries: int) -> int:
        return self.seed * 100_003 + step * 101 + tries

    def generate(self, prompts: list[dict], *, validate: bool, seed: int) -> tuple[Batch, dict]:
        return self.collect_generate(self.submit_generate(prompts, validate=validate, seed=seed))

    def submit_generate(self, prompts: list[dict], *, validate: bool, seed: int):
        """Start sampling `prompts` on the rollout group without waiting; `collect_generate` gives the result."""
        g = self.rollout_group
        parts = shares(len(prompts), g.num_replicas)
        parts += [(len(prompts), len(prompts))] * (g.num_replicas - len(parts))  # fewer prompts than replicas: idle
        args = [(prompts[start:stop], self.next_group_id + start, validate, seed + start) for start, stop in parts]
        self.next_group_id += len(prompts)
        nonempty = [stop > start for start, stop in parts]
        if self.partial:  # queued on the workers: a later push pauses it between two chunks, not after it
            job, self.next_job = self.next_job, self.next_job + 1
            return ("partial", job, g.submit_per_replica("generate_start", [(job, *a) for a in args])), nonempty, None
        # a worker runs its calls in order: the weights it holds now are the ones that generate (a push comes after)
        return g.submit_per_replica("generate", args), nonempty, self.weight_version

    def collect_generate(self, submitted) -> tuple[Batch, dict]:
        """The batch of `submit_generate`'s handle, each response token stamped with the version that sampled it
        (partial: by the workers, per chunk)."""
        handle, nonempty, version = submitted
        g = self.rollout_group
        if isinstance(handle, tuple) and handle[0] == "partial":  # queued by generate_start: ask for its result
            _, job, started = handle
            g.wait(started)
            handle = g.submit_per_replica("generate_result", [(job,)] * g.num_replicas)
        outs = [o for o, keep in zip(g.wait(handle), nonempty) if keep]
        batch = Batch.concat([o[0] for o in outs])
        if version is not None:
            batch = batch.replace(weight_versions=batch.response_mask.long() * version)
        metrics = mean_metrics([o[1] for o in outs])
        return batch, metrics

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The trainer checkpoint's data position: {"sampler", "next_group_id"} (async: from before the oldest batch
        in flight was drawn) and, async, the batches in flight ("async_rollout")."""
        state = {"next_group_id": self.next_group_id, "sampler": self.sampler.state_dict()}
        if self.pipeline is not None:
            state.update(self.pipeline.state_dict())  # the batches in flight are saved, not lost
        return state

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore from a checkpoint of step `step` (after the trainer pushed the restored weights)."""
        self.sampler.load_state_dict(state["sampler"])
        self.next_group_id = state["next_group_id"]
        if self.pipeline is not None:
            self.pipeline.load_state_dict(state, step)

    # ------------------------------------------------------------------ metrics
    def _batch_metrics(self, batch: Batch) -> dict:
        out = stats("critic/score", batch.scores)
        lengths = batch.response_mask.sum(-1).float()
        out.update(stats("response_length", lengths))
        out["response_length/clip_ratio"] = (lengths >= self.max_response_length).float().mean().item()
        out.update(stats("prompt_length", batch.prompt_mask.sum(-1).float()))
        if self.multi_turn:
            out["num_turns/mean"] = float(np.mean(batch.non_tensor["num_turns"]))
            out["tool_call_counts/mean"] = float(np.mean(batch.non_tensor["tool_calls"]))
        return out
