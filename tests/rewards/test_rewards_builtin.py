"""Built-in rewards on hand-written correct, incorrect and malformed answers."""

import pytest

from rltrain.rewards import REWARD_FNS, get_reward_fn
from rltrain.rewards.boxed import last_boxed
from rltrain.rewards.math_dapo import normalize_answer


def test_last_boxed_extraction():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\sqrt{\\frac{a}{b}}}") == "\\sqrt{\\frac{a}{b}}"
    assert last_boxed("so $\\boxed 7$") == "7"
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("no box here") is None
    assert last_boxed("\\boxed{unclosed") is None


@pytest.mark.parametrize("response,truth,strict,flexible", [
    ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),
    ("#### 1,000", "1000", 1.0, 1.0),
    ("#### $72.00", "72", 1.0, 1.0),
    ("#### 6\nactually #### 8", "8", 1.0, 1.0),        # the last marker counts
    ("#### 8\nactually #### 6", "8", 0.0, 0.0),
    ("the answer is 72", "72", 0.0, 1.0),               # no marker: only flexible finds it
    ("I got 71, not 72. Final: 70", "72", 0.0, 0.0),
    ("nothing numeric", "72", 0.0, 0.0),
    ("#### -3", "-3", 1.0, 1.0),
    ("#### 2.25", "2.25", 1.0, 1.0),
])
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    assert get_reward_fn("gsm8k")(response, truth) == strict
    assert get_reward_fn("gsm8k_flexible")(response, truth) == flexible


def test_gsm8k_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="not a number"):
        get_reward_fn("gsm8k")("#### 3", "three")


@pytest.mark.parametrize("response,truth,expected", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{2}", "\\boxed{2}", 1.0),                  # boxed ground truth
    ("the answer is 0.5", "0.5", 0.0),                  # missing box
    ("\\boxed{0.5} no wait \\boxed{0.25}", "0.5", 0.0),  # two boxes: the last one counts
    ("\\boxed{0.25} no wait \\boxed{0.5}", "0.5", 1.0),
    ("\\boxed{0.5", "0.5", 0.0),                        # malformed (unclosed) box
    ("\\boxed{3}", "4", 0.0),
])
def test_math_verify_reward(response, truth, expected):
    assert get_reward_fn("math")(response, truth) == expected


@pytest.mark.parametrize("response,truth,correct", [
    ("\\boxed{28}", "28", True),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{ 5\\text{ cm} }", "5cm", True),
    ("\\boxed{30^\\circ}", "30", True),
    ("\\boxed{2.50}", "2.5", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", False),           # strict: no numeric equivalence of forms
    ("Answer: 28", "28", False),                        # no box
    ("\\boxed{27} then \\boxed{28}", "28", True),
    ("\\boxed{28} then \\boxed{27}", "28", False),
])
def test_math_dapo_strict_boxed_plus_minus_one(response, truth, correct):
    out = get_reward_fn("math_dapo")(response, truth)
    assert out["score"] == (1.0 if correct else -1.0) and out["acc"] == (1.0 if correct else 0.0)


def test_math_dapo_pred_and_normalizer():
    assert get_reward_fn("math_dapo")("\\boxed{7}", "8")["pred"] == "7"
    assert get_reward_fn("math_dapo")("none", "8")["pred"] == ""
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_answer("-007.50") == "-7.5" and normalize_answer("-0.0") == "0"


@pytest.mark.parametrize("response,num_turns,expected", [
    ("\\boxed{5}", 2, 1.0),
    ("\\boxed{5}", 10, 1.0),       # correct answers are not shaped
    ("\\boxed{4}", 2, -1.0),       # wrong, no tool call
    ("\\boxed{4}", 6, -0.8),       # wrong, 2 tool calls: -1 + 0.2
    ("\\boxed{4}", 30, -0.6),      # capped
    ("no box", 4, -0.9),
])
def test_retool_shaping_for_wrong_answers(response, num_turns, expected):
    out = get_reward_fn("retool")(response, "5", extra={"num_turns": num_turns})
    assert out["score"] == pytest.approx(expected) and out["num_turns"] == num_turns


def test_synthetic_checker_prefix_and_exact():
    fn = get_reward_fn("synthetic")
    assert fn("7", "7") == 1.0 and fn("7xy", "7") == 1.0 and fn(" 7", "7") == 0.0 and fn("", "7") == 0.0
    assert fn("8", "7") == 0.0
    assert fn("7 \n", "7", extra={"match": "exact"}) == 1.0 and fn("7x", "7", extra={"match": "exact"}) == 0.0
    with pytest.raises(ValueError, match="prefix"):
        fn("7", "7", extra={"match": "fuzzy"})


def test_registry_names_and_unknown_name():
    assert set(REWARD_FNS) >= {"gsm8k", "math", "math_dapo", "retool", "synthetic"}
    with pytest.raises(ValueError, match="math_dapo"):
        get_reward_fn("no_such_reward")
