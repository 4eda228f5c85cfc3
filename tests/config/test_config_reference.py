"""rltrain/config_reference.py: docs/guide/keys.md is current, lists every key of the schema once per entry point with
a meaning, and its allowed values are the ones the owners accept."""

import dataclasses
import typing

import pytest

from rltrain import config_reference
from rltrain.config.schema import RLConfig, SFTConfig


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


@pytest.fixture(scope="module")
def text():
    return config_reference.render()


def _rows(text, part):
    """key -> cells of the table rows under the `## ...` heading that starts with `part`."""
    body = text.split(f"## {part}", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_committed_reference_is_current(text):
    with open(config_reference.OUT, encoding="utf-8") as f:
        assert f.read() == text, "docs/guide/keys.md is stale: run python -m rltrain.config_reference"
    assert config_reference.main(["--check"]) == 0


def test_every_key_has_one_row_with_a_meaning(text):
    rl, sft = _rows(text, "RL runs"), _rows(text, "Supervised")
    assert set(rl) == set(_leaves(RLConfig))
    # SFT's model section is RL's (one class), referred to rather than repeated
    assert set(sft) == {k for k in _leaves(SFTConfig) if not k.startswith("model.")}
    assert "The `model.*` keys of RL runs, above." in text.split("## Supervised", 1)[1]
    for key, cells in {**rl, **sft}.items():
        assert len(cells) == 5 and len(cells[4]) > 8, key
    assert rl["trainer.total_steps"][1:3] == ["int", "`100`"]
    assert rl["actor.dual_clip"][1:3] == ["float or null", "`null`"]
    assert sft["optim.lr"][2] == "`1e-05`"  # SFT's own default of an inherited key
    assert rl["actor.lr"][4] == rl["critic.lr"][4]  # an inherited key keeps its group's meaning


def test_allowed_values_are_the_owners(text):
    from rltrain.algorithms import ADV_ESTIMATORS, KL_KINDS, POLICY_LOSS_MODES
    from rltrain.ops.logprob import BACKENDS
    from rltrain.rewards import REWARD_FNS
    from rltrain.rollout import ENGINES

    rl = _rows(text, "RL runs")

    def listed(key):
        return [c.strip("`") for c in rl[key][3].split(", ")]

    assert listed("rollout.engine") == list(ENGINES)
    assert listed("actor.loss_mode") == list(POLICY_LOSS_MODES)
    assert listed("actor.kl_loss_type") == list(KL_KINDS)
    assert listed("algorithm.adv_estimator") == [*ADV_ESTIMATORS, "a 'module:function' path"]
    assert listed("trainer.fused_linear_logprob_backend") == ["auto", *BACKENDS]
    assert set(listed("reward.fn")) == {*REWARD_FNS, "a 'module:function' path"}
    assert rl["actor.lr"][3] == ""  # a number: no list


def test_a_key_without_a_meaning_stops_the_generator(monkeypatch, capsys):
    comments = config_reference._comments()
    comments.pop(("TrainerConfig", "total_steps"))
    monkeypatch.setattr(config_reference, "_comments", lambda: comments)
    with pytest.raises(ValueError, match=r"trainer\.total_steps \(TrainerConfig\.total_steps\)"):
        config_reference.render()
    assert config_reference.main(["--check"]) == 2
    assert "add a comment" in capsys.readouterr().err
