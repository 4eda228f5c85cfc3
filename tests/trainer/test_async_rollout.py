"""Asynchronous rollout: the one-batch-in-flight schedule (staleness, weight pushes at the boundary, drop and
regenerate past max_staleness, checkpoint state, errors of the in-flight call) on a recording fake rollout source,
and the configurations that cannot be asynchronous."""

import pytest
import torch

from rltrain.config import ConfigError
from rltrain.data.batch import Batch
from rltrain.data.dataset import PromptSampler
from rltrain.trainer.async_rollout import AsyncRollout


class FakeTrainer:
    """The RolloutSource members AsyncRollout uses and the driver's weight push, recording calls. A generated batch's rows carry the prompt
    ids as group ids and the rollout weights' version in `scores`, so tests can read where a batch came from."""

    def __init__(self, n_prompts=40, batch_size=2, fail_on_wait=None):
        self.sampler = PromptSampler([{"prompt_ids": [i], "id": i} for i in range(n_prompts)], batch_size, seed=0)
        self.next_group_id = 0
        self.rollout_weights = 0  # version of the weights the fake rollout group holds
        self.actor_version = 0
        self.log: list[tuple] = []
        self.fail_on_wait = fail_on_wait

    def rollout_seed(self, step, tries):
        return 1000 * step + tries

    def submit_generate(self, prompts, *, validate, seed):
        self.next_group_id += len(prompts)
        self.log.append(("submit", seed, self.rollout_weights))
        return prompts, seed, self.rollout_weights

    def collect_generate(self, submitted):
        prompts, seed, version = submitted
        self.log.append(("wait", seed))
        if self.fail_on_wait is not None:
            raise self.fail_on_wait
        n = len(prompts)
        batch = Batch(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                      response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1, dtype=torch.long),
                      loss_mask=torch.ones(n, 1, dtype=torch.long), scores=torch.full((n,), float(version)),
                      group_ids=torch.tensor([p["id"] for p in prompts]))
        return batch, {"seed": seed}

    def generate(self, prompts, *, validate, seed):
        return self.collect_generate(self.submit_generate(prompts, validate=validate, seed=seed))

    def push(self):
        self.log.append(("push", self.actor_version))
        self.rollout_weights = self.actor_version


def _train(trainer, pipe, steps, start=1):
    """The PPOTrainer loop's calls: boundary, take, (train = one update), per step; returns step metrics."""
    rows = []
    for step in range(start, start + steps):
        m = {}
        pipe.boundary(step, m)
        batch, gm = pipe.take()
        m["versions"] = sorted(set(batch.scores.tolist()))
        m["prompt_ids"] = batch.group_ids.tolist()
        pipe.submit(step + 1)  # no-op unless refills (it is already in flight)
        trainer.log.append(("train", step))
        trainer.actor_version = step
        rows.append({k: v for k, v in m.items() if not k.startswith("timing_s/")})
    return rows


def test_steady_state_staleness_is_one_and_weights_are_pushed_at_each_boundary():
    tr = FakeTrainer()
    pipe = AsyncRollout(tr, tr.push, max_staleness=1, total_steps=4, refills=False)
    rows = _train(tr, pipe, 4)
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert [r["versions"] for r in rows] == [[0.0], [0.0], [1.0], [2.0]]  # batch k+1 sampled with weights k-1
    assert all(r["rollout/stale_batches_dropped"] == 0 for r in rows)
    # the next batch is submitted before the step trains, the push happens when both sides are idle, and
    # nothing is submitted past the last step
    assert tr.log == [("submit", 1001, 0), ("wait", 1001), ("submit", 2001, 0), ("train", 1),
                      ("wait", 2001), ("push", 1), ("submit", 3001, 1), ("train", 2),
                      ("wait", 3001), ("push", 2), ("submit", 4001, 2), ("train", 3),
                      ("wait", 4001), ("push", 3), ("train", 4)]


def test_the_rollout_group_is_probed_only_while_idle():
    """Issue 35: the trainer read the rollout group's per-GPU memory after each step, while the group generated
    the next batch; a Ray actor runs one call at a time, so that read waited for the generation outside every
    phase timer. The pipeline probes the group just before each submit, when nothing is in flight."""
    tr = FakeTrainer()
    in_flight = []

    def probe():
        in_flight.append(pipe.in_flight is not None)
        tr.log.append(("probe",))
        return {"perf/max_memory_allocated_gb/rollout_rank0": float(len(in_flight))}

    pipe = AsyncRollout(tr, tr.push, max_staleness=1, total_steps=3, refills=False, idle_probe=probe)
    _train(tr, pipe, 3)
    assert in_flight == [False, False, False]  # one probe per submitted batch, none while one generates
    assert [e for e in tr.log if e[0] in ("probe", "submit", "wait")] == [
        ("probe",), ("submit", 1001, 0), ("wait", 1001), ("probe",), ("submit", 2001, 0),
        ("wait", 2001), ("probe",), ("submit", 3001, 1), ("wait", 3001)]
    assert pipe.idle_metrics == {"perf/max_memory_allocated_gb/rollout_rank0": 3.0}


def test_prompt_order_equals_the_synchronous_order():
    tr = FakeTrainer()
    ref = PromptSampler(list(range(40)), 2, seed=0)
    rows = _train(tr, AsyncRollout(tr, tr.push, max_staleness=1, total_steps=5, refills=False), 5)
    assert [r["prompt_ids"] for r in rows] == [ref.next_indices() for _ in range(5)]


def test_validation_pushes_current_weights_and_keeps_the_in_flight_batch():
    tr = FakeTrainer()
    pipe = AsyncRollout(tr, tr.push, max_staleness=1, total_steps=3, refills=False)
    _train(tr, pipe, 2)  # batch 3 is in flight with weights 1; the actor is at 2
    pipe.before_validation(actor_version=2)
    assert tr.log[-2:] == [("wait", 3001), ("push", 2)] and tr.rollout_weights == 2
    rows = _train(tr, pipe, 1, start=3)
    assert rows[0]["rollout/staleness"] == 1 and rows[0]["versions"] == [1.0]  # no second push, no regeneration
    assert ("push", 2) == tr.log[-2] and tr.log[-1] == ("train", 3)


def test_a_batch_older_than_max_staleness_is_dropped_and_its_prompts_regenerated():
    tr = FakeTrainer()
    pipe = AsyncRollout(tr, tr.push, max_staleness=1, total_steps=8, refills=False)
    _train(tr, pipe, 2)
    state = {"step": 2, **pipe.state_dict()}  # holds batch 3, generated with weights 1
    # resume that checkpoint at a later policy version (as if the run had gone on to step 4 without it)
    tr2 = FakeTrainer()
    tr2.actor_version = tr2.rollout_weights = 4
    pipe2 = AsyncRollout(tr2, tr2.push, max_staleness=1, total_steps=8, refills=False)
    pipe2.load_state_dict(state, step=4)
    pipe2.ready.step = 5
    rows = _train(tr2, pipe2, 1, start=5)
    assert rows[0]["rollout/stale_batches_dropped"] == 1 and rows[0]["rollout/staleness"] == 0
    assert rows[0]["versions"] == [4.0]  # regenerated with the current weights
    assert rows[0]["prompt_ids"] == state["async_rollout"]["batch"].group_ids.tolist()  # the same prompts
    assert tr2.log[0] == ("submit", 3001, 4)  # with the same seed


def test_state_dict_saves_the_in_flight_batch_and_resume_continues_identically():
    full = FakeTrainer()
    rows_full = _train(full, AsyncRollout(full, full.push, max_staleness=1, total_steps=6, refills=False), 6)

    tr = FakeTrainer()
    pipe = AsyncRollout(tr, tr.push, max_staleness=1, total_steps=6, refills=False)
    _train(tr, pipe, 3)
    state = {"step": 3, "sampler": tr.sampler.state_dict(), "next_group_id": tr.next_group_id}
    state.update(pipe.state_dict())  # what PPOTrainer.save writes
    # the data position saved is from before the in-flight batch's prompts were drawn (a synchronous resume
    # draws them again), the batch itself is saved with its version
    assert state["sampler"]["position"] == 3 and state["next_group_id"] == 6
    assert state["async_rollout"]["step"] == 4 and state["async_rollout"]["version"] == 2

    resumed = FakeTrainer()  # a new process: restores the sampler, then the pipeline
    resumed.sampler.load_state_dict(state["sampler"])
    resumed.next_group_id = state["next_group_id"]
    resumed.actor_version = resumed.rollout_weights = 3  # the trainer loaded step 3 and pushed it
    pipe2 = AsyncRollout(resumed, resumed.push, max_staleness=1, total_steps=6, refills=False)
    pipe2.load_state_dict(state, step=3)
    rows = _train(resumed, pipe2, 3, start=4)
    for a, b in zip(rows_full[3:], rows):
        assert a == b  # same batches, versions, staleness; nothing trained twice or skipped
    assert resumed.sampler.state_dict() == full.sampler.state_dict()


def test_error_of_the_in_flight_call_surfaces_at_the_boundary():
    class WorkerDied(RuntimeError):
        pass

    tr = FakeTrainer(fail_on_wait=WorkerDied("rollout worker 0 died"))
    pipe = AsyncRollout(tr, tr.push, max_staleness=1, total_steps=3, refills=False)
    with pytest.raises(WorkerDied, match="rollout worker 0 died"):
        pipe.boundary(1, {})


def test_with_refills_the_next_batch_is_submitted_after_the_step_draws_its_refills():
    tr = FakeTrainer()
    pipe = AsyncRollout(tr, tr.push, max_staleness=1, total_steps=3, refills=True)
    m = {}
    pipe.boundary(1, m)
    pipe.take()
    assert pipe.in_flight is None  # nothing submitted yet: the step may still refill
    tr.generate(tr.sampler.next_batch(), validate=False, seed=1002)  # a DAPO refill, synchronous
    pipe.submit(2)
    assert [e[0] for e in tr.log] == ["submit", "wait", "submit", "wait", "submit"] and tr.log[-1][1] == 2001


@pytest.mark.parametrize("overrides,match", [
    (["trainer.async_rollout=true"], "trainer.colocate=false"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "trainer.use_ray=false"], "trainer.use_ray"),
    (["trainer.async_rollout=true", "trainer.colocate=false", "trainer.max_staleness=0"], "trainer.max_staleness"),
    (["actor.tis.mode=geometric"], "actor.tis.mode"),
    (["actor.tis.cap=0.5"], "actor.tis.cap"),
])
def test_configs_that_cannot_be_async_or_bad_tis_are_refused(cfg_for, overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for(*overrides)


def test_entry_point_refuses_colocated_async_with_exit_code_2(capsys):
    from hydra import compose, initialize_config_dir

    from rltrain.config import validate_config
    from rltrain.main import CONFIG_DIR, run_entry

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="grpo_tiny", overrides=["trainer.async_rollout=true"])  # colocated by default
    with pytest.raises(SystemExit) as exit_info:
        run_entry(cfg, validate_config, lambda c: pytest.fail("the run must not start"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "trainer.async_rollout=true" in err and "trainer.colocate=false" in err and "Traceback" not in err
