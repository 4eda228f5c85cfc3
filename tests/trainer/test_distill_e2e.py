"""On-policy distillation end to end on CPU. In process, through tools/distill_compare.py at CI size: grpo_tiny trained
from the default random init is the teacher (exported as HF, its last checkpoint kept); distill_tiny brings a student
from the same random init to 90% of the teacher's held-out accuracy in fewer steps than that GRPO run took to reach
it, and a teacher read from the checkpoint scores tokens as the one read from the HF export does. Through Ray:
asynchronous rollout with partial rollouts and the teacher on workers of its own; a teacher equal to the student's
initial weights gives a zero reverse KL on the first step (every token sampled by those weights), so the teacher
scores exactly the tokens trained on."""

import math
import os
import sys

import pytest
import torch

from rltrain.config.entry import compose_config
from rltrain.config.schema import ActorConfig, ModelConfig, RolloutConfig, TeacherConfig, TrainerConfig
from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import distill_compare  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# docs/distill.md's comparison, validated every 4 steps instead of 2 and stopped after the validation at which the
# student first reached the target: the teacher 40 GRPO steps (held-out 0.734 from 0.023; GRPO first reaches 90% of
# it at step 36), the student 28 distillation steps (there at step 26: 28 here)
TEACHER_STEPS, DISTILL_STEPS, EVERY = 40, 28, ["trainer.test_freq=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """-> (run root: grpo/ and distill/, the summary). One GRPO run serves as GRPO's curve and as the teacher."""
    root = tmp_path_factory.mktemp("distill")
    return root, distill_compare.compare(str(root), teacher_steps=TEACHER_STEPS, distill_steps=DISTILL_STEPS,
                                         overrides=EVERY)


def test_distillation_reaches_90_percent_of_the_teacher_in_fewer_steps_than_grpo(runs):
    root, s = runs
    teacher_rows, rows = read_metrics(str(root / "grpo")), read_metrics(str(root / "distill"))
    assert s["teacher_accuracy"] == teacher_rows[-1]["val/accuracy"] >= 0.4, s["grpo"]["curve"]
    assert s["target"] == pytest.approx(0.9 * s["teacher_accuracy"])
    assert rows[0]["val/accuracy"] == teacher_rows[0]["val/accuracy"] < 0.1  # the same random init
    assert s["grpo"]["step"] == distill_compare._reached(teacher_rows, s["target"])[0] is not None
    assert s["distill"]["step"] is not None and s["distill"]["step"] < s["grpo"]["step"], distill_compare.report(s)
    trained = [r for r in rows if "timing_s/step" in r]
    assert len(trained) == DISTILL_STEPS
    assert all(r["timing_s/teacher"] > 0 and math.isfinite(r["distill/reverse_kl/mean"]) for r in trained)
    assert trained[-1]["distill/reverse_kl/mean"] < 0.5 * trained[0]["distill/reverse_kl/mean"]
    assert all(r["distill/reverse_kl/min"] <= r["distill/reverse_kl/mean"] <= r["distill/reverse_kl/max"]
               for r in trained)
    assert not any("distill/reverse_kl/mean" in r for r in teacher_rows)  # off by default
    assert os.path.isfile(s["plot"]) and "step  grpo   distill" in distill_compare.report(s)


def test_a_checkpoint_teacher_scores_as_its_hf_export(runs):
    """teacher.path=<run>/checkpoints/step_N (Megatron shards, built from the run's config.json) and the run's HF
    export give the same log-probs of a batch the student sampled."""
    from rltrain.data.tokenizer import CharTokenizer
    from rltrain.models.megatron.compat import teardown_parallel
    from rltrain.workers.hybrid import build_teacher, initial_hf_model
    from rltrain.workers.rollout import RolloutRole
    from rltrain.workers.teacher import check_teacher

    grpo = runs[0] / "grpo"
    student = ModelConfig(builtin="tiny", tokenizer="char", dtype="float32")
    _, model = initial_hf_model(student, CharTokenizer(), 1, torch.float32)
    rollout = RolloutRole(engine="hf", model=model, tokenizer=CharTokenizer(), device="cpu", dtype=torch.float32,
                          rollout_cfg=RolloutConfig(n=2, max_response_length=4, temperature=1.0))
    prompts = [{"prompt_ids": CharTokenizer().encode(p), "ground_truth": p[-2], "data_source": "x"}
               for p in ("482=", "7=", "90311=")]
    batch, _ = rollout.generate(prompts, group_offset=0, seed=3)
    got = {}
    try:
        for name, path in (("hf", grpo / "hf"), ("checkpoint", grpo / "checkpoints" / f"step_{TEACHER_STEPS}")):
            teacher = TeacherConfig(path=str(path), dtype="float32")
            check_teacher(teacher, student=student, student_tokenizer=CharTokenizer(), actor=ActorConfig())
            role = build_teacher(teacher, student=student, actor=ActorConfig(), trainer=TrainerConfig(device="cpu"),
                                 device="cpu", seed=1)
            got[name] = role.compute_logprobs(batch)[0]
            teardown_parallel()
    finally:
        teardown_parallel()
    torch.testing.assert_close(got["checkpoint"], got["hf"], rtol=0, atol=1e-6)
    assert float(got["hf"].abs().sum()) > 0 and bool((got["hf"][batch.response_mask == 0] == 0).all())


def test_async_partial_rollouts_with_a_teacher_on_its_own_workers_score_the_trained_tokens(tmp_path, ray_session):
    """GRPO plus distillation, k = 2 batches in flight, partial rollouts (one-token chunks), the teacher a worker group
    of its own: the student's initial weights as the teacher give reverse KL 0 at step 1 (its batch was sampled by
    them and the actor has not moved), and not after (an entropy bonus moves the actor whatever the rewards)."""
    from rltrain.data.tokenizer import CharTokenizer
    from rltrain.models.hf_export import save_hf_checkpoint
    from rltrain.workers.hybrid import initial_hf_model

    hf_config, model = initial_hf_model(ModelConfig(builtin="tiny"), CharTokenizer(), 1, torch.float32)
    save_hf_checkpoint(str(tmp_path / "init"), hf_config, model.state_dict(), tokenizer=CharTokenizer())
    run_dir = str(tmp_path / "run")
    run_from_config(compose_config("grpo_tiny", [
        f"teacher.path={tmp_path / 'init'}", "teacher.colocate=false", "trainer.colocate=false", "trainer.num_cpus=2",
        "trainer.async_rollout=true", "trainer.max_staleness=2", "rollout.partial=true", "rollout.partial_chunk_tokens=1",
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.entropy_coef=0.01",
        "trainer.total_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false", "reward.max_workers=0",
        "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.progress_bar=false"]), run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    first = rows[0]
    assert first["rollout/staleness_max"] == 0
    for key in ("distill/reverse_kl/mean", "distill/reverse_kl/max", "distill/reverse_kl/min"):
        assert abs(first[key]) < 1e-5, (key, first[key])
    assert all(abs(r["distill/reverse_kl/mean"]) > 1e-4 for r in rows[1:])
    # batches in flight (staleness > 0) within the bound; 2 needs the rollout to run ahead, which a loaded
    # machine's timing does not promise (one CI run saw 1)
    assert 1 <= max(r["rollout/staleness_max"] for r in rows) <= 2 and all(r["timing_s/teacher"] > 0 for r in rows)
    assert all("rollout/partial_samples_frac" in r for r in rows)


def test_the_trainers_advantage_adds_the_teachers_term_on_model_tokens_only():
    """RL plus distillation on a multi-turn batch (tool output inside the response, loss_mask 0 there): GRPO's
    advantage everywhere in the response, plus distill_coef x (teacher - old - their mean over the model tokens) on
    the model tokens only; the reverse-KL metrics count the model tokens only."""
    from rltrain.algorithms import compute_advantages
    from rltrain.config.convert import as_config
    from rltrain.data.batch import Batch
    from rltrain.trainer.ppo import PPOTrainer

    t = PPOTrainer.__new__(PPOTrainer)
    t.cfg = as_config({"algorithm": {"adv_estimator": "grpo", "distill_coef": 0.5}})
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    loss_mask = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]])  # row 0: two tool-output tokens
    old = torch.tensor([[-1.0, -9.0, -9.0, -2.0, -0.5], [-3.0, -1.0, 0.0, 0.0, 0.0]])
    teacher = torch.tensor([[-0.5, 0.0, 0.0, -2.5, -0.5], [-1.0, -1.5, 0.0, 0.0, 0.0]])
    batch = Batch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                  response_ids=torch.full((2, 5), 9), response_mask=response_mask, loss_mask=loss_mask,
                  old_logprobs=old, teacher_logprobs=teacher, scores=torch.tensor([1.0, 0.0]),
                  group_ids=torch.tensor([0, 0]), non_tensor={"finish_reason": ["stop", "stop"]})
    m = {}
    out = t._advantages(batch, m)
    token_rewards = torch.zeros(2, 5)
    token_rewards[0, 4], token_rewards[1, 1] = 1.0, 0.0
    grpo, _ = compute_advantages("grpo", token_rewards, response_mask, group_ids=torch.tensor([0, 0]))
    # teacher - old on the model tokens: 0.5, -0.5, 0 (row 0), 2.0, -0.5 (row 1); their mean 1.5 / 5 = 0.3
    distill = torch.tensor([[0.2, 0.0, 0.0, -0.8, -0.3], [1.7, -0.8, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out.advantages, grpo * response_mask + 0.5 * distill)
    assert m["distill/reverse_kl/mean"] == pytest.approx(-0.3) and m["distill/reverse_kl/max"] == pytest.approx(0.5)
    assert m["distill/reverse_kl/min"] == pytest.approx(-2.0)
    assert m["distill/reverse_kl_seq/mean"] == pytest.approx((0.0 - 1.5) / 2)
