"""The README's and the user guide's commands, as written, in their order, in a fresh directory (no training).

Each ```bash block's `python ...` lines are read from README.md and docs/guide/*.md. What runs: the data-making
commands (rltrain.data.retool_synthetic, examples/own_data/make_rows.py) for real, and `python -m rltrain.plan` for
real (in-process). What is checked without training: every `python -m rltrain.main|rltrain.sft` command composes
and validates as its entry point would, and each data file it reads exists at that point or is made by a command
earlier in the same document (network-only downloads, GPU runs). The guide's own-data example is also loaded as the
trainer loads it (tiny model's tokenizer, its chat template), scored with its reward function and trained two steps.
"""

import os
import re
import runpy
import shlex
import sys

import pytest
from hydra import compose, initialize_config_dir

from rltrain.config import register_configs, validate_config
from rltrain.config.validate import validate_sft_config
from rltrain.data.dataset import PREPARE
from rltrain.main import CONFIG_DIR

register_configs()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", "guide", f) for f in os.listdir(os.path.join(ROOT, "docs", "guide"))
                              if f.endswith(".md"))
ENTRY_POINTS = {"rltrain.main": validate_config, "rltrain.sft": validate_sft_config}
NOT_RUN_HERE = (["-m", "rltrain.data.prepare"],)  # downloads (network); its files count as made for later commands


def commands(doc: str) -> list[list[str]]:
    """The `python ...` commands of a document's ```bash blocks, continuation lines joined, comments cut."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == "python":
                out.append(argv[1:])
    return out


def _compose(module: str, argv: list[str]):
    name, overrides, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--config-name":
            name, i = argv[i + 1], i + 2
        elif argv[i] == "--cfg":  # hydra's "print the config" flag and its argument
            i += 2
        else:
            overrides.append(argv[i])
            i += 1
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    ENTRY_POINTS[module](cfg)
    return cfg


def _run_script(path: str, args: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [path, *args])
    runpy.run_path(os.path.join(ROOT, path), run_name="__main__")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_commands_run_as_written(doc, tmp_path, monkeypatch, capsys):
    cmds = commands(doc)
    if doc == "README.md":
        assert len(cmds) >= 8, cmds
    for name in ("examples", "tools"):  # the commands name these relative to the repository root
        (tmp_path / name).symlink_to(os.path.join(ROOT, name))
    monkeypatch.chdir(tmp_path)
    made: list[str] = []  # data the network-only commands before this one make
    for argv in cmds:
        if argv[:2] in NOT_RUN_HERE:
            made += [p for p, cmd in PREPARE.items() if cmd == shlex.join(["python", *argv])]
        elif argv[0] == "-m" and argv[1] in ENTRY_POINTS:
            cfg = _compose(argv[1], argv[2:])
            files = [] if "--cfg" in argv or cfg.data.get("source", "file") == "synthetic" else [*cfg.data.train_files,
                                                                              *cfg.data.val_files]
            for f in files:
                assert os.path.isfile(f) or any(f.startswith(p) for p in made), \
                    f"{doc}: `python {shlex.join(argv)}` reads {f}, which no earlier command makes"
        elif argv[:2] == ["-m", "rltrain.plan"]:
            from rltrain.plan.__main__ import main as plan

            capsys.readouterr()
            assert plan(argv[2:]) == 0, capsys.readouterr().err
            assert "fits: yes" in capsys.readouterr().out
        elif argv[:2] == ["-m", "rltrain.data.retool_synthetic"]:
            from rltrain.data.retool_synthetic import main as make_retool

            make_retool(argv[2:])
        elif argv[0].startswith("examples/") and argv[0].endswith(".py"):
            _run_script(argv[0], argv[1:], monkeypatch)
        else:
            pytest.fail(f"{doc}: this test does not know how to check `python {shlex.join(argv)}`; teach it")


def test_own_data_example_loads_and_scores(tmp_path, monkeypatch):
    """docs/guide/data.md's run: its rows load as the trainer loads them (the tiny model's tokenizer and chat
    template, nothing dropped) and its reward scores the right answer 1 and a wrong one 0."""
    from rltrain.trainer.setup import build_datasets

    run = next(a for a in commands("docs/guide/data.md") if a[:2] == ["-m", "rltrain.main"])
    (tmp_path / "examples").symlink_to(os.path.join(ROOT, "examples"))
    monkeypatch.chdir(tmp_path)
    _run_script("examples/own_data/make_rows.py", ["--out", "data/own", "--train-size", "50", "--val-size", "7"],
                monkeypatch)
    _, train, val, _, score = build_datasets(_compose("rltrain.main", run[2:]))  # as the trainer builds them
    assert (len(train), len(val)) == (50, 7) and train.num_dropped == val.num_dropped == 0
    for item in (train[3], val[5]):
        assert item["data_source"] == "max3" and item["prompt"].count("max ") == 1
        digits = item["extra"]["digits"]
        assert item["ground_truth"] == str(max(digits))
        assert score(f" {max(digits)}", item["ground_truth"], extra=item["extra"])["score"] == 1.0
        wrong = next(d for d in range(10) if d != max(digits))
        assert score(str(wrong), item["ground_truth"])["score"] == 0.0
    # and it trains as written (two short steps, in process): the metrics the guide names are in metrics.jsonl
    from rltrain.config.entry import compose_config
    from rltrain.trainer.ppo import run_from_config
    from rltrain.utils.tracking import read_metrics

    short = ["trainer.total_steps=2", "trainer.test_freq=2", "trainer.use_ray=false", "trainer.logger=[jsonl]",
             "trainer.plots=false", "trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4",
             "actor.ppo_mini_batch_size=2", "data.val_batch_size=7"]
    assert run[2] == "--config-name"
    run_from_config(compose_config(run[3], [*run[4:], *short]), str(tmp_path / "run"))
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in (rows[0], rows[2]):  # validation before training and at the last step: 7 prompts, 1 sample each
        assert r["val/max3/accuracy"] * 7 == pytest.approx(round(r["val/max3/accuracy"] * 7))
    assert all(0.0 <= r["reward/digit/mean"] <= 1.0 and 0.0 <= r["critic/score/mean"] <= 1.0 for r in rows[1:])


def test_the_guides_reward_and_estimator_signatures_are_the_ones_rltrain_calls(tmp_path):
    """docs/guide/rewards.md's code: its reward function is called as the reward runner calls one (and scores as
    examples/own_data/reward.py), and its estimator, given a body, runs as `algorithm.adv_estimator=file.py:fn`."""
    import torch

    from rltrain.algorithms.advantages import compute_advantages
    from rltrain.rewards.loader import load_function

    text = open(os.path.join(ROOT, "docs", "guide", "rewards.md"), encoding="utf-8").read()
    reward_src, estimator_src = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (tmp_path / "guide_reward.py").write_text(reward_src)
    guide_score = load_function(f"{tmp_path}/guide_reward.py:score")
    example = runpy.run_path(os.path.join(ROOT, "examples", "own_data", "reward.py"))["score"]
    for response, truth in ((" 7 is it", "7"), ("x7", "7"), ("", "3"), ("35", "3")):
        assert guide_score(response, truth, data_source="max3", extra={}) == example(response, truth)
    # the estimator's documented signature with a body: the score minus its group's mean, on every response token
    body = ("    last = token_rewards.sum(-1)\n    mean = torch.stack([last[group_ids == g].mean() for g in group_ids])\n"
            "    adv = (last - mean)[:, None] * response_mask\n    return adv, adv\n")
    (tmp_path / "guide_estimator.py").write_text("import torch\n\n" + estimator_src.replace("    ...\n", body))
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    adv, ret = compute_advantages(f"{tmp_path}/guide_estimator.py:my_estimator", rewards, mask,
                                  group_ids=torch.tensor([0, 0, 1, 1]))
    want = torch.tensor([0.5, -0.5, 0.0, 0.0])[:, None] * mask  # worked by hand: groups {1, 0} and {0.5, 0.5}
    assert torch.equal(adv, want) and torch.equal(ret, want)
