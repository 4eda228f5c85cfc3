"""The tiny ReTool pipeline end to end: SFT (CLI) on synthetic tool-use traces, then GRPO with the real sandbox."""

import json
import math

import pytest
import torch

from rltrain.data.tokenizer import CharTokenizer
from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = [pytest.mark.timeout(600), pytest.mark.sandbox]


@pytest.fixture(scope="module")
def sft_model(retool_sft_model):
    """Data files and the HF model written by `python -m rltrain.sft --config-name retool_tiny_sft` (conftest.py)."""
    paths, out, run_dir = retool_sft_model
    rows = read_metrics(run_dir)
    assert rows[-1]["sft/loss"] < 0.1 * rows[0]["sft/loss"]
    return paths, out


def _rollout_role(model_dir):
    from transformers import AutoModelForCausalLM

    from rltrain.config.schema import MultiTurnConfig, RolloutConfig
    from rltrain.workers.rollout import RolloutRole

    cfg = RolloutConfig(max_batch_size=64, n=4, max_response_length=48,
                        multi_turn=MultiTurnConfig(enable=True, tool_pattern="code_tag", max_turns=3, max_total_tokens=96,
                                                   tool_timeout_s=5.0, tool_memory_mb=256, tool_max_workers=2))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return RolloutRole(engine="hf", model=model, tokenizer=CharTokenizer(), rollout_cfg=cfg, device="cpu",
                       dtype=torch.float32)


def test_sft_model_calls_the_tool_and_tool_output_is_loss_masked(sft_model):
    paths, model_dir = sft_model
    prompts = []
    tok = CharTokenizer()
    for line in open(paths["val"]):
        row = json.loads(line)
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        prompts.append({"prompt_ids": ids, "ground_truth": row["answer"], "data_source": row["data_source"]})
    role = _rollout_role(model_dir)
    batch, _ = role.generate(prompts[:8], group_offset=0, validate=True, seed=0)  # greedy
    assert sum(batch.non_tensor["tool_calls"]) >= 6  # the SFT'd model emits <code> calls
    for r in range(len(batch)):
        n = int(batch.response_mask[r].sum())
        ids, lm = batch.response_ids[r, :n].tolist(), batch.loss_mask[r, :n].tolist()
        text = tok.decode(ids)
        masked_out = tok.decode([i for i, m in zip(ids, lm) if m == 0])
        if batch.non_tensor["tool_calls"][r]:
            # the ONLY tokens with loss_mask 0 are the tool output, which is what the sandbox printed
            code = text[text.index("<code>") + 6:text.index("</code>")]  # e.g. print(12*7+3)
            a, b, c = map(int, code[len("print("):-1].replace("*", " ").replace("+", " ").split())
            assert masked_out == f"\n<output>\n{a * b + c}\n\n</output>\n", text
            assert tok.decode([i for i, m in zip(ids, lm) if m == 1]).startswith("<code>print(")
        else:
            assert masked_out == ""


def test_grpo_with_real_sandbox_logs_tool_use(tmp_path, sft_model, ray_session, cfg_for):
    """GRPO plus on-policy distillation from a teacher that is the SFT model itself: its reverse KL to the student is 0
    on the first step (the same weights score the model's tokens of multi-turn rows; tool output is masked), and
    logged (finite) on every step."""
    paths, model_dir = sft_model
    run_dir = str(tmp_path / "rl")
    cfg = cfg_for(f"model.path={model_dir}", f"data.train_files=[{paths['train']}]",
                  f"data.val_files=[{paths['val']}]", "trainer.total_steps=2", "trainer.test_freq=2",
                  "trainer.plots=false", "trainer.logger=[jsonl]", f"teacher.path={model_dir}", name="retool_tiny")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["tool_call_counts/mean"] > 0 and row["num_turns/mean"] > 1
        # tool-output tokens are in the response but excluded from the loss mask
        assert row["rollout/model_tokens/mean"] < row["response_length/mean"]
        # the actor recomputes the sampler's log-probs on model tokens (tool tokens masked out of the check)
        assert abs(row["rollout/logprob_diff_max"]) < 1e-3 and math.isfinite(row["actor/pg_loss"])
        assert row["timing_s/teacher"] > 0
    assert abs(rows[1]["distill/reverse_kl/mean"]) < 1e-5 and math.isfinite(rows[2]["distill/reverse_kl/mean"])
    assert rows[-1]["val/accuracy"] > 0


def test_tool_use_reaches_the_reward_as_extras():
    """ppo.py passes num_turns (messages: 2 + 2 per executed call) and tool_calls to reward functions."""
    from rltrain.config.convert import as_config
    from rltrain.data.batch import Batch
    from rltrain.rewards import retool
    from rltrain.trainer.ppo import PPOTrainer

    seen = []

    def fn(response, ground_truth, *, data_source=None, extra=None):
        seen.append(dict(extra))
        return retool.compute_score("no box", ground_truth, extra=extra)["score"]

    t = PPOTrainer.__new__(PPOTrainer)
    t.cfg = as_config({"reward": {"timeout_s": 5.0, "max_workers": 0}, "rollout": {"multi_turn": {"enable": True},
                       "max_response_length": 8}, "algorithm": {"overlong": {"enable": False}}})
    t.tokenizer, t.reward = CharTokenizer(), fn
    ids = torch.tensor([[10, 11, 2], [12, 2, 0], [13, 14, 15]])
    mask = (ids != 0).long()
    batch = Batch(prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                  response_ids=ids, response_mask=mask, loss_mask=mask,
                  non_tensor={"ground_truth": ["1"] * 3, "data_source": ["x"] * 3, "extra": [{"k": 1}, {}, {}],
                              "tool_calls": [0, 1, 3], "num_turns": [1, 2, 4]})
    scored, _ = t._score(batch)
    assert [s["num_turns"] for s in seen] == [2, 4, 8] and [s["tool_calls"] for s in seen] == [0, 1, 3]
    assert seen[0]["k"] == 1
    # retool shaping: wrong answers get -1 + 0.1 per tool call, capped at -0.6
    assert scored.scores.tolist() == pytest.approx([-1.0, -0.9, -0.7])
