"""rltrain.plan at the training data's prompt lengths (#36): the trainer and the CLI read the data as the trainer
does and plan memory (and the fit) at its longest prompt, time at its mean, in place of data.max_prompt_length; the
CLI falls back to the config's bound, saying so, when the data or the tokenizer is not here."""

from __future__ import annotations

import json
import random

import pytest

from rltrain.config.entry import compose_config as compose
from rltrain.data.lengths import DataLengths, data_lengths
from rltrain.plan import make_plan
from rltrain.plan.__main__ import main
from rltrain.trainer.setup import plan_check


GPU = ["model=qwen3_0.6b_random", "trainer.device=cuda", "rollout=vllm", "data.train_batch_size=32", "rollout.n=8",
       "rollout.max_response_length=64", "data.max_prompt_length=256", "actor.use_kl_loss=true",
       "actor.max_tokens_per_micro_batch=32768"]  # 128 x 104 tokens a mini-batch is one micro-batch; 128 x 320, two


def _rows(tmp_path, prompts):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def test_data_lengths_of_a_file_are_its_tokenized_prompts(tmp_path):
    rng = random.Random()
    prompts = ["x" * rng.randint(1, 90) for _ in range(rng.randint(5, 40))] + ["y" * 300]  # one over the bound
    path = _rows(tmp_path, prompts)
    cfg = compose("grpo_tiny", ["data.source=file", f"data.train_files=[{path}]", "data.val_files=[]",
                                "data.max_prompt_length=128", "data.apply_chat_template=false"])
    # the character tokenizer: one token per (ASCII) character and <bos>; the trainer drops the prompt over 128
    kept = [len(p) + 1 for p in prompts if len(p) + 1 <= 128]
    d = data_lengths(cfg)
    assert (d.longest, d.count) == (max(kept), len(kept))
    assert d.mean == pytest.approx(sum(kept) / len(kept))
    assert str(path) in d.where


def test_the_embedded_task_is_five_tokens():
    d = data_lengths(compose("grpo_tiny", []))
    assert (d.longest, d.mean, d.count) == (5, 5.0, 4096) and "copy_last" in d.where
    # a large synthetic set (tokenized on access) is sampled evenly, and says so
    big = data_lengths(compose("grpo_tiny", ["data.synthetic.train_size=50000", "data.synthetic.task=successor"]))
    assert (big.longest, big.count) == (5, 20_000) and "20,000 of 50,000 sampled" in big.where


def test_memory_at_the_longest_prompt_time_at_the_mean():
    """A worked example: prompts of at most 40 tokens, 12 on average, against a 256-token bound."""
    cfg = compose("grpo_tiny", GPU)
    at_data = make_plan(cfg, prompts=DataLengths(longest=40, mean=12.4, count=100, where="t"))
    at_40 = make_plan(cfg, prompt_tokens=40)
    at_12 = make_plan(cfg, prompt_tokens=12)
    worst = make_plan(cfg)
    assert [g.peak_bytes for g in at_data.gpus] == [g.peak_bytes for g in at_40.gpus]
    assert [g.allocator_peak_bytes for g in at_data.gpus] == [g.allocator_peak_bytes for g in at_40.gpus]
    assert at_data.seconds == at_12.seconds
    assert worst.inputs.max_prompt_length == 256 and worst.seconds["step"] > at_40.seconds["step"]
    upd = lambda p: next(ph.torch_bytes for ph in p.gpus[0].phases if ph.name.startswith("update"))  # noqa: E731
    assert upd(worst) > upd(at_40)  # 32,768-token micro-batches against 13,312
    # given lengths win over the data's; the data's longest never exceeds the config's bound
    assert make_plan(cfg, prompt_tokens=7, prompts=DataLengths(40, 12.4, 100, "t")).seconds == \
        make_plan(cfg, prompt_tokens=7).seconds
    capped = make_plan(cfg, prompts=DataLengths(longest=999, mean=500.0, count=3, where="t"))
    assert capped.inputs.max_prompt_length == 256 and capped.seconds == worst.seconds


def test_cli_reads_the_data_by_default(capsys):
    rc = main(["--config-name", "grpo_tiny", *GPU, "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["lengths"]["from"] == "data" and d["lengths"]["prompt_tokens"] == 5
    assert d["lengths"]["data"] == {"longest": 5, "mean": 5.0, "count": 4096, "where": "the synthetic task 'copy_last'"}
    assert "the data's longest" in d["summary"]
    rc = main(["--config-name", "grpo_tiny", *GPU, "--json", "--worst-case"])
    w = json.loads(capsys.readouterr().out)
    assert rc == 0 and w["lengths"]["from"] == "config" and w["lengths"]["prompt_tokens"] == 256
    assert w["phase_seconds"]["step"] > d["phase_seconds"]["step"]


def test_cli_without_the_data_plans_the_worst_case_and_says_why(capsys, tmp_path):
    missing = tmp_path / "nope.parquet"
    rc = main(["--config-name", "grpo_tiny", *GPU, "data.source=file", f"data.train_files=[{missing}]", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["lengths"]["from"] == "config" and d["lengths"]["prompt_tokens"] == 256
    assert d["warnings"][0].startswith("the training data could not be read here (data file")
    assert str(missing) in d["warnings"][0] and "planned at data.max_prompt_length" in d["warnings"][0]


def test_the_trainer_plans_at_its_dataset(capsys):
    from rltrain.trainer.setup import build_datasets

    cfg = compose("grpo_tiny", GPU)
    _, train, _, _, _ = build_datasets(cfg)
    plan = plan_check(cfg, device="cuda", gpu_memory_gib=80.0, dataset=train)
    assert plan.inputs.max_prompt_length == 5 and plan.prompts.count == 4096
    assert "sequences of 5 + 64 tokens (prompts: the data's longest" in capsys.readouterr().err
