"""rollout.engine=vllm through the whole trainer on real vLLM (CPU build): split under Ray (weights streamed over
gloo), colocated under Ray (the learning run; two workers with one engine each), and the ReTool tiny pipeline
(multi-turn rollouts equal to hf's, then GRPO steps colocated in process, trainer.use_ray=false).

vLLM's CPU attention kernels take head_dim >= 32, so these runs give the tiny preset head_dim 32 (the hf
reference runs of the learning test use the same model).
"""

import json
import math

import pytest
import torch

from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(900)
VLLM = ["rollout=vllm", "+model.overrides.head_dim=32"]
KEYS = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean", "timing_s/gen",
        "timing_s/update_weights", "rollout/logprob_diff_max", "rollout/model_tokens/mean"]


def _check_rows(rows, steps):
    assert [r["step"] for r in rows if r["step"] > 0] == list(range(1, steps + 1))
    for r in rows:
        if r["step"] == 0:
            continue
        bad = {k: r.get(k) for k in KEYS if not (isinstance(r.get(k), (int, float)) and math.isfinite(r[k]))}
        assert not bad, bad
        assert r["rollout/model_tokens/mean"] > 0
        # the sampler's log-probs equal the actor's recomputed ones: vLLM holds the actor's current weights
        assert r["rollout/logprob_diff_max"] < 1e-3, r["rollout/logprob_diff_max"]


def test_split_placement_streams_weights_to_the_vllm_group_over_gloo(tmp_path, ray_session, cfg_for):
    run_dir = str(tmp_path / "split")
    cfg = cfg_for(*VLLM, "trainer.colocate=false", "trainer.total_steps=2", "trainer.test_freq=-1",
                  "trainer.logger=[jsonl]", "trainer.num_cpus=1", "trainer.plots=false")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    _check_rows(rows, 2)
    assert rows[1]["timing_s/update_weights"] > 0


LEARN_STEPS = 80


def test_grpo_tiny_on_vllm_learns(tmp_path, ray_session, cfg_for):
    """Colocated under Ray, the default's batch (16 prompts x 8 samples). The same config with rollout=hf goes
    from the same start to about the same accuracy (docs/vllm.md records both runs)."""
    run_dir = str(tmp_path / "learn")
    cfg = cfg_for(*VLLM, f"trainer.total_steps={LEARN_STEPS}", f"trainer.test_freq={LEARN_STEPS}",
                  "trainer.logger=[jsonl]", "trainer.plots=false", "data.train_batch_size=16", "rollout.n=8",
                  "actor.ppo_mini_batch_size=16", "data.synthetic.val_size=64", "data.val_batch_size=64",
                  "reward.max_workers=0")  # the synthetic checker is cheap and trusted: score in process
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    _check_rows(rows, LEARN_STEPS)
    before, after = rows[0]["val/accuracy"], rows[-1]["val/accuracy"]
    print(f"vllm learning run: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.3, (before, after)


@pytest.fixture(scope="module")
def sft_model_hd32(retool_sft_model):
    """The tiny ReTool SFT model (stage 1 of the pipeline; head_dim 32, conftest.py), and its data files."""
    paths, out, _ = retool_sft_model
    return paths, out


def test_retool_multi_turn_on_vllm_matches_hf_tokens_and_loss_masks(sft_model_hd32):
    """Greedy multi-turn rollouts with the real sandbox: vLLM gives the hf engine's tokens, tool calls and
    loss masks (tool output masked out), turn by turn."""
    from transformers import AutoModelForCausalLM

    from rltrain.config.schema import MultiTurnConfig, RolloutConfig
    from rltrain.data.tokenizer import CharTokenizer
    from rltrain.workers.rollout import RolloutRole

    paths, model_dir = sft_model_hd32
    tok = CharTokenizer()
    prompts = []
    for line in open(paths["val"]):
        row = json.loads(line)
        prompts.append({"prompt_ids": tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True),
                        "ground_truth": row["answer"], "data_source": row["data_source"]})
    cfg = RolloutConfig(max_batch_size=64, n=4, max_response_length=48, enforce_eager=True,
                        multi_turn=MultiTurnConfig(enable=True, tool_pattern="code_tag", max_turns=3, max_total_tokens=96,
                                                   tool_timeout_s=5.0, tool_memory_mb=256, tool_max_workers=2))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batches = {}
    for engine in ("hf", "vllm"):
        role = RolloutRole(engine=engine, model=model, tokenizer=tok, rollout_cfg=cfg, device="cpu",
                           dtype=torch.float32)
        batches[engine], _ = role.generate(prompts[:8], group_offset=0, validate=True, seed=0)
        role.close()
    hf, vl = batches["hf"], batches["vllm"]
    assert sum(vl.non_tensor["tool_calls"]) >= 6  # the SFT'd model calls the tool through vLLM too
    for key in ("tool_calls", "num_turns", "finish_reason"):
        assert vl.non_tensor[key] == hf.non_tensor[key], key
    assert torch.equal(vl.response_ids, hf.response_ids) and torch.equal(vl.loss_mask, hf.loss_mask)
    assert (vl.loss_mask < vl.response_mask).any()  # tool-output tokens are in the response, out of the loss
    torch.testing.assert_close(vl.sampler_logprobs, hf.sampler_logprobs, atol=1e-4, rtol=0)


def test_retool_grpo_steps_on_vllm(tmp_path, sft_model_hd32, cfg_for):
    paths, model_dir = sft_model_hd32
    run_dir = str(tmp_path / "rl")
    cfg = cfg_for(*VLLM, f"model.path={model_dir}", f"data.train_files=[{paths['train']}]",
                  f"data.val_files=[{paths['val']}]", "trainer.total_steps=2", "trainer.test_freq=2",
                  "trainer.use_ray=false", "trainer.plots=false", "trainer.logger=[jsonl]", name="retool_tiny")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/accuracy" in rows[-1]
    for row in rows[1:]:
        assert row["tool_call_counts/mean"] > 0 and row["num_turns/mean"] > 1
        assert row["rollout/model_tokens/mean"] < row["response_length/mean"]  # tool tokens masked out
        assert row["rollout/logprob_diff_max"] < 1e-3 and math.isfinite(row["actor/pg_loss"])


@pytest.mark.heavy
def test_colocated_two_workers_run_one_vllm_engine_each(tmp_path, ray_session, cfg_for):
    """Issue #35's layout on the CPU build: trainer.n_gpus_per_node=2 colocated with rollout.tensor_parallel_size=1 is
    two vLLM engines (one per worker, vLLM's external data-parallel ranks), each generating its share of the prompts
    and reloading the actor's weights in its own process. After the second GRPO step, the two engines' greedy tokens
    for 3 prompts (shares of 2 and 1) equal those of engine 0 alone on all 3: both hold the same, updated, weights,
    and the join keeps the prompt order."""
    from rltrain.trainer.ppo import PPOTrainer

    cfg = cfg_for(*VLLM, "trainer.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.test_freq=-1",
                  "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.plots=false")
    got = {}

    def after_step(step):  # the weights of this step's update are in both engines (the workers stop after fit)
        if step == 2:
            prompts = [trainer.val_ds[i] for i in range(3)]
            got["together"], _ = trainer.rollout.generate(prompts, validate=True, seed=0)
            got["alone"] = g.run_per_replica("generate", [(prompts, 0, True, 0), ([], 3, True, 3)])
            got["truth"] = [p.get("ground_truth") for p in prompts]

    trainer = PPOTrainer(cfg, str(tmp_path), after_step=after_step)
    g = trainer.rollout_group
    assert g is trainer.train_group and g.num_replicas == 2 and g.dp_size == 2  # colocated: actor DP=2, 2 engines
    trainer.fit()
    _check_rows(read_metrics(str(tmp_path)), 2)  # both engines sampled with the actor's weights (diff < 1e-3)
    together, alone = got["together"], got["alone"]
    assert alone[1] == (None, {})  # a replica given no prompts answers nothing
    assert torch.equal(together.response_ids, alone[0][0].response_ids)
    assert together.non_tensor["ground_truth"] == got["truth"]
