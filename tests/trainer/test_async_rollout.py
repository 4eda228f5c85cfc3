"""Asynchronous rollout, k batches in flight (trainer.max_staleness = k): the schedule (pushes when the rollout group is
idle, pacing by the bound, the staleness of each step), version stamps checked against the weights a fake rollout
group really held, drop and regenerate past the bound, checkpoints that resume exactly (every save point, k = 1..4,
with validation and DAPO refills), errors of the in-flight calls, and the configurations that cannot be asynchronous.

The fake rollout group runs its calls in submission order like a Ray actor: a generation uses the weights the group
holds when it is submitted (a push submitted later runs after it). Each row records those weights in
non_tensor["held"]: the reference the stamps (Batch.weight_versions, set by the source) are checked against."""

import os
import random
import tempfile

import pytest
import torch

from rltrain.config import ConfigError
from rltrain.config.schema import DynamicSamplingConfig
from rltrain.data.batch import Batch
from rltrain.data.dataset import PromptSampler
from rltrain.trainer.async_rollout import AsyncRollout, staleness_metrics
from rltrain.trainer.rollout_source import RolloutSource
from rltrain.utils.plain import load_plain, save_plain


def _through_a_file(state: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        save_plain(state, os.path.join(d, "trainer_state.pt"))
        return load_plain(os.path.join(d, "trainer_state.pt"))


class FakeGroup:
    """One rollout replica, recording calls; 2 samples per prompt. Partial rollouts (generate_start / _result): a
    queued generation makes one chunk of its 3 tokens per push it sees until it is collected, so token j carries the
    version of the j-th push after its start (the last one seen beyond it); whole generations: 2 tokens, one version."""

    num_replicas = 1

    def __init__(self, held=0, fail_on_wait=None):
        self.held = held  # the version of the weights the group holds
        self.log: list[tuple] = []
        self.fail_on_wait = fail_on_wait
        self.jobs: dict[int, tuple] = {}  # partial: job id -> (prompts, offset, seed, [versions seen])

    def submit_per_replica(self, method, args):
        if method == "generate_result":
            return ("result", args[0][0])
        if method == "generate_start":
            (job, prompts, offset, validate, seed), = args
            self.jobs[job] = (prompts, offset, seed, [self.held])
            self.log.append(("submit", seed, self.held))
            return ("started", job)
        (prompts, offset, validate, seed), = args
        self.log.append(("submit", seed, self.held))
        return prompts, offset, seed, [self.held]

    def pushed(self):
        for _, _, _, seen in self.jobs.values():
            seen.append(self.held)

    def wait(self, handle):
        if handle[0] == "started":
            return [None]
        if handle[0] == "result":
            handle = self.jobs.pop(handle[1])
            width = 3
        else:
            width = 2
        prompts, offset, seed, seen = handle
        self.log.append(("wait", seed))
        if self.fail_on_wait is not None:
            raise self.fail_on_wait
        n = 2 * len(prompts)
        versions = [seen[min(j, len(seen) - 1)] for j in range(width)]
        ones = torch.ones(n, width, dtype=torch.long)
        batch = Batch(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                      response_ids=ones, response_mask=ones, loss_mask=ones,
                      group_ids=torch.arange(len(prompts)).repeat_interleave(2) + offset,
                      non_tensor={"id": [p["id"] for p in prompts for _ in range(2)], "held": [seen[0]] * n,
                                  "seed": [seed] * n, "versions": [versions] * n})
        if width == 3:  # partial: the workers stamp the tokens
            batch = batch.replace(weight_versions=torch.tensor([versions] * n))
        return [(batch, {"seed": float(seed)})]


class Run:
    """PPOTrainer's calls on a real RolloutSource + AsyncRollout over a FakeGroup: boundary, next_batch, (update),
    validation, save, per step. refills: DAPO dynamic sampling, where a group is informative unless its prompt id
    plus the sampling seed is a multiple of 3."""

    def __init__(self, k, total_steps, *, refills=False, held=0, fail_on_wait=None, probe=False, partial=False):
        self.group = FakeGroup(held, fail_on_wait)
        self.actor_version = held
        sampler = PromptSampler([{"prompt_ids": [i], "id": i} for i in range(400)], 2, seed=0)
        self.source = RolloutSource(self.group, sampler, seed=1, score=self._score, want_groups=2,
                                    dynamic_sampling=DynamicSamplingConfig(enable=refills, max_tries=4),
                                    max_response_length=2, multi_turn=False, partial=partial)
        self.probes: list[bool] = []
        self.pipe = AsyncRollout(self.source, self.push, max_staleness=k, total_steps=total_steps, refills=refills,
                                 idle_probe=self._probe if probe else None)
        self.source.use_pipeline(self.pipe)
        self.rows: list[dict] = []

    def push(self, version=None):
        assert version == self.actor_version  # the pipeline names the version it pushes
        self.group.log.append(("push", self.actor_version))
        self.group.held = self.actor_version
        self.group.pushed()

    def _probe(self):
        self.probes.append(any(r.submitted is not None for r in self.pipe.queue))
        return {"probe": float(len(self.probes))}

    @staticmethod
    def _score(batch):
        informative = [(i + s) % 3 != 0 for i, s in zip(batch.non_tensor["id"], batch.non_tensor["seed"])]
        scores = [float(j % 2) if inf else 1.0 for j, inf in enumerate(informative)]
        return batch.replace(scores=torch.tensor(scores)), {}

    def train(self, steps, start=1, validate_at=(), save_at=None):
        state = None
        for step in range(start, start + steps):
            m = {}
            self.source.boundary(step, m)
            batch, gm = self.source.next_batch(step, m)
            held = torch.tensor(batch.non_tensor["held"])
            # the stamps are the weights that generated each token
            assert torch.equal(batch.weight_versions, torch.tensor(batch.non_tensor["versions"])), step
            self.rows.append({"step": step, "ids": batch.non_tensor["id"], "held": held.tolist(),
                              "versions": batch.non_tensor["versions"][0],
                              "staleness": step - 1 - held.min().item(), "dropped": m["rollout/dropped_samples"],
                              "queued": len(self.pipe.queue), **gm})
            self.group.log.append(("train", step))
            self.actor_version = step
            self.source.after_update(step, {})  # partial: the push into the batches in flight
            if step in validate_at:
                self.source.before_validation(step)
            if step == save_at:  # through a checkpoint file, as the trainer writes and reads it (utils/plain.py)
                state = _through_a_file({"step": step, **self.source.state_dict()})
        return state

    def events(self, kinds=("submit", "push", "train")):
        return [e for e in self.group.log if e[0] in kinds]


def _seed(step):  # RolloutSource.rollout_seed(step, 1) with seed 1
    return 1 * 100_003 + step * 101 + 1


def test_one_batch_in_flight_staleness_one_and_a_push_at_each_boundary():
    run = Run(k=1, total_steps=4)
    run.train(4)
    assert [r["staleness"] for r in run.rows] == [0, 1, 1, 1]
    assert [r["held"][0] for r in run.rows] == [0, 0, 1, 2]  # batch k+1 sampled with the weights of step k-1
    assert all(r["dropped"] == 0 for r in run.rows)
    # the next batch is submitted before the step trains, the push happens when both sides are idle, and
    # nothing is submitted past the last step
    s = _seed
    assert run.group.log == [("submit", s(1), 0), ("wait", s(1)), ("submit", s(2), 0), ("train", 1),
                             ("wait", s(2)), ("push", 1), ("submit", s(3), 1), ("train", 2),
                             ("wait", s(3)), ("push", 2), ("submit", s(4), 2), ("train", 3),
                             ("wait", s(4)), ("train", 4)]  # no push: nothing left to sample with it


@pytest.mark.parametrize("k", [2, 3, 4])
def test_k_in_flight_push_every_k_steps_and_staleness_cycles_one_to_k(k):
    steps = 3 * k + 2
    run = Run(k=k, total_steps=steps)
    run.train(steps)
    # hand-worked: version 0 generates steps 1..k+1; the push at the boundary of step b = 1 + j*k (j >= 1: the
    # pipeline is empty) generates steps b+1..b+k, trained at staleness 1..k
    expected = [0] + [(s - 2) % k + 1 for s in range(2, steps + 1)]
    assert [r["staleness"] for r in run.rows] == expected
    assert max(expected) == k
    pushes = [e[1] for e in run.events(("push",))]
    # the actor's version at those boundaries (none at the last step: nothing left to generate)
    assert pushes == [b - 1 for b in range(k + 1, steps, k)]
    assert all(r["queued"] <= k for r in run.rows) and max(r["queued"] for r in run.rows) == k
    assert all(r["dropped"] == 0 for r in run.rows)  # paced: nothing generated past the bound
    assert len(run.events(("submit",))) == steps  # each batch generated once, none past the last step
    # the logged metrics: every sample of a step's batch has the same staleness here
    for r in run.rows:
        assert r["rollout/staleness_max"] == r["rollout/staleness_mean"] == r["staleness"]
        assert r[f"rollout/tokens_staleness_{r['staleness']}"] == 1.0
        assert sorted(key for key in r if key.startswith("rollout/tokens_")) == sorted(
            f"rollout/tokens_staleness_{j}" for j in range(k + 1))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_prompt_order_equals_the_synchronous_order(k):
    run = Run(k=k, total_steps=9)
    run.train(9)
    ref = PromptSampler(list(range(400)), 2, seed=0)
    assert [r["ids"] for r in run.rows] == [[i for i in ref.next_indices() for _ in range(2)] for _ in range(9)]


def test_the_rollout_group_is_probed_only_while_idle():
    """Issue 35: the trainer read the rollout group's per-GPU memory after each step, while the group generated
    the next batch; a Ray actor runs one call at a time, so that read waited for the generation outside every
    phase timer. The pipeline probes the group only before a submit with nothing in flight."""
    for k in (1, 3):
        run = Run(k=k, total_steps=7, probe=True)
        run.train(7)
        assert run.probes and not any(run.probes), k
    # k = 3: before the submits of steps 1 and 2 (batch 1 is collected before the fill), then after the push at the
    # boundary of step 4; none at step 7 (nothing left to submit)
    assert len(run.probes) == 3
    assert run.pipe.idle_metrics == {"probe": 3.0}


@pytest.mark.parametrize("k", [1, 2])
def test_validation_pushes_current_weights_and_keeps_the_batches_in_flight(k):
    run = Run(k=k, total_steps=8)
    run.train(3)
    queued = [r.step for r in run.pipe.queue]
    run.source.before_validation(3)
    assert run.group.held == 3 and run.group.log[-1] == ("push", 3)
    assert [r.step for r in run.pipe.queue] == queued and all(r.batch is not None for r in run.pipe.queue)
    run.train(5, start=4)
    # the queued batches keep their versions; the batches submitted after the validation push sample with it
    held = [r["held"][0] for r in run.rows]
    # k = 1: batch 4 was submitted with version 2 before the validation; k = 2: batches 4, 5 with version 2, then
    # batch 6 with the validation's version 3 (the bound 3 + k + 1 lets it go), and the push at the boundary of 6
    assert held == ([0, 0, 1, 2, 3, 4, 5, 6] if k == 1 else [0, 0, 0, 2, 2, 3, 5, 5])
    assert max(r["staleness"] for r in run.rows) <= k


def test_a_batch_staler_than_the_bound_is_dropped_and_its_prompts_regenerated():
    run = Run(k=4, total_steps=12)
    state = run.train(3, save_at=3)  # queued: steps 4 and 5 (version 0)
    assert [b["version"] for b in state["async_rollout"]["batches"]] == [0, 0]
    resumed = Run(k=2, total_steps=12, held=3)  # the same checkpoint resumed with max_staleness=2
    resumed.source.load_state_dict(state, 3)
    resumed.train(3, start=4)
    rows = resumed.rows
    assert [r["dropped"] for r in rows] == [4, 4, 0]  # staleness 3 and 4 > 2: all 2x2 samples of each dropped
    assert [r["staleness"] for r in rows] == [0, 0, 2]  # regenerated with the weights pushed first
    assert [r["held"][0] for r in rows] == [3, 4, 3]
    saved_ids = [b["batch"]["non_tensor"]["id"] for b in state["async_rollout"]["batches"]]
    assert [r["ids"] for r in rows[:2]] == saved_ids  # the same prompts, with the same seeds
    assert resumed.events(("submit",)) == [("submit", _seed(4), 3), ("submit", _seed(6), 3),
                                           ("submit", _seed(5), 4), ("submit", _seed(7), 4)]


@pytest.mark.parametrize("k,refills", [(1, False), (2, False), (3, False), (4, False), (1, True), (2, True),
                                       (4, True)])
def test_resume_from_every_save_point_continues_exactly(k, refills):
    """The reference is the uninterrupted run; a checkpoint at each step, resumed in a new 'process' whose rollout
    group holds the restored weights (the trainer pushed them), must give the same batches, versions, pushes and
    metrics for every later step; validation at random steps moves the pushes."""
    steps = 13
    validate_at = set(random.Random(k).sample(range(1, steps + 1), 3))
    full = Run(k=k, total_steps=steps, refills=refills)
    full.train(steps, validate_at=validate_at)
    if refills:
        assert any(r.get("dynamic_sampling/tries", 1) > 1 for r in full.rows)
    assert max(r["staleness"] for r in full.rows) <= k and all(r["dropped"] == 0 for r in full.rows)
    for save_at in range(1, steps):
        first = Run(k=k, total_steps=steps, refills=refills)
        state = first.train(save_at, validate_at=validate_at, save_at=save_at)
        if state.get("async_rollout"):  # the data position of a synchronous resume: before the oldest queued batch
            assert state["sampler"] == state["async_rollout"]["batches"][0]["data_before"]["sampler"]
        resumed = Run(k=k, total_steps=steps, refills=refills, held=save_at)
        resumed.source.load_state_dict(state, save_at)
        resumed.train(steps - save_at, start=save_at + 1, validate_at=validate_at)
        assert resumed.rows == full.rows[save_at:], (k, save_at)  # nothing lost, nothing trained twice
        done = len(first.events())  # the interrupted run's submits and pushes (its validation's included)
        assert resumed.events() == full.events()[done:], (k, save_at)  # same submits (versions) and pushes
        assert resumed.source.sampler.state_dict() == full.source.sampler.state_dict()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_partial_pushes_after_each_update_into_the_batches_in_flight(k):
    """rollout.partial: the weights of step s are pushed right after its update, into the generations in flight,
    which continue with them: a batch's first chunk keeps its version, the later ones take the pushes it saw."""
    steps = 8
    run = Run(k=k, total_steps=steps, partial=True)
    run.train(steps)
    # a push after every update while a batch is in flight or left to submit (none after the last one)
    assert [e[1] for e in run.events(("push",))] == list(range(1, steps))
    assert all(r["dropped"] == 0 for r in run.rows) and len(run.events(("submit",))) == steps
    # hand-checked: the batch of step 5 is submitted at the boundary of step 5 - k with version 4 - k and then sees
    # the pushes of the updates of steps 5 - k .. 4; its 3 tokens take its version and the next two pushes
    want = {1: [3, 4, 4], 2: [2, 3, 4], 3: [1, 2, 3]}[k]
    assert run.rows[4]["versions"] == want
    r = run.rows[4]
    stale = [4 - v for v in want]
    assert r["rollout/staleness_max"] == r["staleness"] == max(stale) == k
    assert r["rollout/staleness_token_mean"] == pytest.approx(sum(stale) / 3)
    assert r["rollout/partial_samples_frac"] == 1.0
    for j in range(k + 1):
        assert r[f"rollout/tokens_staleness_{j}"] == pytest.approx(stale.count(j) / 3)
    assert max(r["staleness"] for r in run.rows) <= k


@pytest.mark.parametrize("k", [1, 2, 3])
def test_partial_resume_from_every_save_point_continues_exactly(k):
    """A checkpoint with partial batches in flight saves them finished (the save waits for them: they end with the
    weights they hold, their per-token versions saved); a run resumed from it continues exactly as the run that wrote
    it went on: same batches, per-token versions, submits and pushes (nothing lost, nothing trained twice)."""
    steps = 11
    validate_at = set(random.Random(k).sample(range(1, steps + 1), 2))
    for save_at in range(1, steps):
        first = Run(k=k, total_steps=steps, partial=True)
        state = first.train(save_at, validate_at=validate_at, save_at=save_at)
        done = len(first.events())
        for b in state.get("async_rollout", {}).get("batches", []):  # saved with their per-token versions
            assert torch.equal(b["batch"]["weight_versions"], torch.tensor(b["batch"]["non_tensor"]["versions"]))
        first.train(steps - save_at, start=save_at + 1, validate_at=validate_at)  # the run that was not killed
        resumed = Run(k=k, total_steps=steps, held=save_at, partial=True)
        resumed.source.load_state_dict(state, save_at)
        resumed.train(steps - save_at, start=save_at + 1, validate_at=validate_at)
        assert resumed.rows == first.rows[save_at:], (k, save_at)
        assert resumed.events() == first.events()[done:], (k, save_at)
        assert max(r["staleness"] for r in first.rows) <= k
    # the batches that were in flight at a save really were partial in some runs (else this checks little)
    assert any(r["rollout/partial_samples_frac"] > 0 for r in first.rows)


def test_error_of_the_in_flight_call_surfaces_at_the_boundary():
    class WorkerDied(RuntimeError):
        pass

    run = Run(k=2, total_steps=3, fail_on_wait=WorkerDied("rollout worker 0 died"))
    with pytest.raises(WorkerDied, match="rollout worker 0 died"):
        run.source.boundary(1, {})


def test_with_refills_the_next_batches_are_submitted_after_the_refills_with_fresh_weights():
    run = Run(k=2, total_steps=8, refills=True)
    run.train(4)
    log = run.group.log
    # step 4 (actor version 3) refills while its batches were generated with version 2: it pushes first, and the
    # next batches are submitted after the refill, with the pushed weights
    refill = next(i for i, e in enumerate(log) if e[0] == "submit" and e[1] % 101 != _seed(0) % 101)
    assert any(r.get("dynamic_sampling/tries", 1) > 1 for r in run.rows)
    step = next(r["step"] for r in run.rows if r.get("dynamic_sampling/tries", 1) > 1)
    assert log[refill][2] == step - 1  # refills sample with the current weights
    assert all(r["staleness"] <= 2 for r in run.rows)


def test_staleness_metrics_by_hand():
    # actor version 5; row 0 sampled at 5 (staleness 0, 2 tokens), row 1 at 3 (2 tokens), row 2: a partial
    # rollout's tokens from versions 4 and 3 (staleness 1 and 2: the sample counts as 2), row 3 has no token
    versions = torch.tensor([[5, 5, 0], [3, 3, 3], [4, 3, 0], [7, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
    out = staleness_metrics(versions, mask, 5, max_staleness=2)
    assert out == {"rollout/staleness_mean": 4 / 3, "rollout/staleness_max": 2.0,
                   "rollout/tokens_staleness_0": 2 / 6, "rollout/tokens_staleness_1": 1 / 6,
                   "rollout/tokens_staleness_2": 3 / 6, "rollout/staleness_token_mean": 7 / 6,
                   "rollout/partial_samples_frac": 1 / 3}
    big = staleness_metrics(torch.tensor([[0, 1, 2, 9]]), torch.ones(1, 4), 12, max_staleness=20)
    assert big["rollout/tokens_staleness_3"] == 1 / 4 and big["rollout/tokens_staleness_8plus"] == 3 / 4
    assert len([key for key in big if "tokens_" in key]) == 9 and big["rollout/staleness_max"] == 12.0


@pytest.mark.parametrize("overrides,match", [
    (["trainer.async_rollout=true"], "trainer.colocate=false"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "trainer.use_ray=false"], "trainer.use_ray"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "trainer.max_staleness=0"], "trainer.max_staleness"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "trainer.max_staleness=-2"], "trainer.max_staleness"),
    (["trainer.max_staleness=4"], "trainer.max_staleness=4 .* trainer.async_rollout=true"),
    (["actor.tis.mode=geometric"], "actor.tis.mode"),
    (["actor.tis.cap=0.5"], "actor.tis.cap"),
    (["rollout.partial=true"], "rollout.partial=true .* set trainer.async_rollout=true"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "rollout.partial=true", "rollout.multi_turn.enable=true"], "rollout.partial=true .* rollout.multi_turn.enable"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "rollout.partial=true", "rollout.tensor_parallel_size=2"], "rollout.partial=true .* rollout.tensor_parallel_size=2"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "rollout.partial=true", "rollout.engines_per_gpu=2"], "rollout.partial=true .* rollout.engines_per_gpu=2"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "rollout.partial=true", "rollout.partial_chunk_tokens=0"], "rollout.partial_chunk_tokens"),
])
def test_configs_that_cannot_be_async_or_bad_tis_are_refused(cfg_for, overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for(*overrides)


@pytest.mark.parametrize("overrides,words", [
    (["trainer.async_rollout=true"], ["trainer.async_rollout=true", "trainer.colocate=false"]),
    (["trainer.async_rollout=true", "trainer.colocate=false", "trainer.max_staleness=0"],
     ["trainer.max_staleness=0", "> 0"]),
    (["rollout.partial=true"], ["rollout.partial=true", "trainer.async_rollout=true"]),
])
def test_entry_point_refuses_bad_async_configs_with_exit_code_2(capsys, overrides, words):
    from hydra import compose, initialize_config_dir

    from rltrain.config import validate_config
    from rltrain.main import CONFIG_DIR, run_entry

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="grpo_tiny", overrides=overrides)
    with pytest.raises(SystemExit) as exit_info:
        run_entry(cfg, validate_config, lambda c: pytest.fail("the run must not start"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and "Traceback" not in err


def test_a_checkpoint_of_the_older_one_batch_pipeline_is_refused_naming_what_to_do():
    from rltrain.utils.errors import UserError

    run = Run(k=2, total_steps=6)
    old = {"sampler": run.source.sampler.state_dict(), "next_group_id": 4,
           "async_rollout": {"step": 3, "version": 2, "prompts": [], "seed": 7, "data_before": {}, "batch": None}}
    with pytest.raises(UserError, match="older rltrain.*trainer.resume=never"):
        run.source.load_state_dict(old, 3)


def test_mismatch_of_the_trained_versions_own_tokens_by_hand():
    """Async: the sampler-vs-actor difference over every sampled token, and over those the trained weights sampled
    themselves (version 5 here; older tokens differ by the policy's change, which the _current metrics leave out)."""
    from rltrain.config.schema import OffPolicyConfig
    from rltrain.trainer.ppo import _mismatch_metrics

    ones = torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    versions = torch.tensor([[5, 5, 4, 0], [4, 4, 5, 5]])
    sampler = torch.tensor([[-1.0, -2.0, -3.0, -9.0], [-1.0, -1.0, -0.5, -0.25]])
    old = sampler + torch.tensor([[0.0, 0.0, 0.5, 7.0], [0.25, -0.125, 0.0, 2.0 ** -20]])
    batch = Batch(prompt_ids=ones[:, :1], prompt_mask=ones[:, :1], response_ids=ones, response_mask=ones,
                  loss_mask=mask, sampler_logprobs=sampler, old_logprobs=old, weight_versions=versions)
    op = OffPolicyConfig(mode="none")
    out = _mismatch_metrics(batch, op, current_version=5)
    assert out["rollout/logprob_diff_max"] == 0.5 and out["rollout/logprob_diff_nonzero_frac"] == 4 / 7
    assert out["rollout/logprob_diff_max_current"] == 2.0 ** -20  # tokens (0,0), (0,1), (1,2), (1,3)
    assert out["rollout/logprob_diff_nonzero_frac_current"] == 1 / 4
    assert "rollout/logprob_diff_max_current" not in _mismatch_metrics(batch, op)  # synchronous: no split
    assert _mismatch_metrics(batch.replace(weight_versions=None), op, 5).keys() == _mismatch_metrics(batch, op).keys()
