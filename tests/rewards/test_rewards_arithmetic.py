"""The learning recipe's rewards: exact answers, and the tool-use metrics on responses laid out as the rollout
lays them out (DEFAULT_TOOL_OUTPUT_TEMPLATE after each executed call)."""

import pytest

from rltrain.rewards import REWARD_FNS, get_reward_fn
from rltrain.rewards.arithmetic import compute_score, compute_score_tool
from rltrain.rollout.multiturn import DEFAULT_TOOL_OUTPUT_TEMPLATE
from rltrain.sandbox.runner import SandboxResult


def executed(code: str, stdout: str, status: str = "ok", stderr: str = "") -> str:
    """A model turn with a call, followed by what the rollout appends for the sandbox's result."""
    result = SandboxResult(status=status, stdout=stdout, stderr=stderr, exit_code=0 if status == "ok" else 1,
                           duration_s=0.01, message="timed out" if status == "timeout" else "")
    return f"<code>{code}</code>" + DEFAULT_TOOL_OUTPUT_TEMPLATE.replace("{output}", result.to_tool_output())


def test_exact_answer_after_the_last_marker():
    assert compute_score("8+6+0=14\n#### 7694", "7694") == 1.0
    assert compute_score("#### 7694\n#### 7695", "7694") == 0.0  # the last marker counts
    assert compute_score("7694", "7694") == 0.0  # no marker, no answer
    assert compute_score("#### 07694", "7694") == 1.0  # integers, not strings
    assert compute_score("#### 7694.5", "7694") == 0.0
    big = 123456789012345678 * 987654321
    assert compute_score(f"#### {big}", str(big)) == 1.0
    assert compute_score(f"#### {big + 1}", str(big)) == 0.0  # beyond float precision, still exact
    with pytest.raises(ValueError, match="not an integer"):
        compute_score("#### 1", "one")


def test_registered_by_name():
    assert get_reward_fn("arithmetic") is REWARD_FNS["arithmetic"] is compute_score
    assert get_reward_fn("arithmetic_tool") is compute_score_tool


def test_correct_tool_call_runs_and_its_output_is_the_answer():
    r = executed("print(4738*29)", "137402\n") + "#### 137402"
    assert compute_score_tool(r, "137402") == {"score": 1.0, "tool_call": 1.0, "correct_tool_call": 1.0,
                                               "answer_found": 1.0}
    # the code ran and its output was used, but it computed the wrong product: a correct call, a wrong answer
    r = executed("print(4738*28)", "132664\n") + "#### 132664"
    assert compute_score_tool(r, "137402") == {"score": 0.0, "tool_call": 1.0, "correct_tool_call": 1.0,
                                               "answer_found": 1.0}


@pytest.mark.parametrize("response", [
    executed("print(4738*29", "", status="error", stderr="SyntaxError: '(' was never closed\n") + "#### 137402",
    executed("while True: pass", "", status="timeout") + "#### 137402",
    executed("print(4738*29)", "137402\n") + "#### 137400",  # output not used
    "#### 137402" + executed("print(4738*29)", "137402\n"),  # answered before the output came
    executed("print(4738*29)", "137402\n"),  # no answer
    executed("print('x')", "x\n") + "#### 137402",  # output is not a number
])
def test_calls_that_fail_or_are_not_used_are_not_correct(response):
    m = compute_score_tool(response, "137402")
    assert m["tool_call"] == 1.0 and m["correct_tool_call"] == 0.0


def test_a_written_but_unexecuted_call_is_not_a_tool_call():
    # the rollout ends a sample at </code> without running it when no turn is left: no output block follows
    assert compute_score_tool("<code>print(4738*29)</code>", "137402")["tool_call"] == 0.0
    m = compute_score_tool("5000*30=150000\n#### 150000", "137402")
    assert m == {"score": 0.0, "tool_call": 0.0, "correct_tool_call": 0.0, "answer_found": 1.0}


def test_the_last_executed_call_decides():
    r = (executed("print(4738*28)", "132664\n") + executed("print(4738*29)", "137402\n") + "#### 137402")
    assert compute_score_tool(r, "137402")["correct_tool_call"] == 1.0
    r = (executed("print(4738*29)", "137402\n") + executed("print(4738*29", "", "error", "SyntaxError: x\n")
         + "#### 137402")
    assert compute_score_tool(r, "137402")["correct_tool_call"] == 0.0
