"""User reward functions from files, and compute_rewards: errors, timeouts (enforced by killing the
worker), dict results, and the in-process mode."""

import math
import textwrap

import pytest

from rltrain.rewards import compute_rewards, get_reward_fn, shutdown_workers

USER_REWARD = textwrap.dedent('''
    import time

    def length_match(response, ground_truth, *, data_source=None, extra=None):
        if response == "boom":
            raise RuntimeError("user reward exploded")
        if response == "hang":
            time.sleep(120)
        if response == "nan":
            return float("nan")
        if response == "text":
            return "not a number"
        return {"score": float(len(response) == int(ground_truth)), "length": len(response), "note": "ignored"}

    NOT_A_FUNCTION = 3


    async def judged(response, ground_truth, *, data_source=None, extra=None):
        import asyncio

        await asyncio.sleep(60 if response == "hang" else 0.2)  # a judge over the network
        if response == "boom":
            raise RuntimeError("judge exploded")
        return {"score": float(response == ground_truth), "judged": 1.0}
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_reward.py"
    path.write_text(USER_REWARD)
    yield path
    shutdown_workers()


def test_user_function_loads_from_file_and_runs_in_workers(user_file):
    fn = get_reward_fn(f"{user_file}:length_match")
    assert fn("abc", "3") == {"score": 1.0, "length": 3, "note": "ignored"}
    scores, metrics = compute_rewards(fn, ["abc", "ab", "abcd"], ["3", "3", "4"], timeout_s=30, max_workers=2)
    assert scores == [1.0, 0.0, 1.0]
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0
    assert metrics["reward/length/mean"] == pytest.approx(3.0)
    assert "reward/note/mean" not in metrics


def test_module_path_form_loads_a_function():
    fn = get_reward_fn("rltrain.rewards.synthetic:compute_score")
    assert fn("5", "5") == 1.0


def test_user_function_errors_name_the_problem(user_file, tmp_path):
    with pytest.raises(ValueError, match="does not exist") as e:
        get_reward_fn(str(tmp_path / "missing.py") + ":f")
    assert "missing.py" in str(e.value)
    with pytest.raises(ValueError, match="has no function 'nope'.*length_match"):
        get_reward_fn(f"{user_file}:nope")
    with pytest.raises(ValueError, match="not a function"):
        get_reward_fn(f"{user_file}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="cannot import module"):
        get_reward_fn("no_such_package_xyz.mod:f")


def test_exceptions_bad_values_and_timeouts_score_zero_and_are_counted(user_file):
    fn = get_reward_fn(f"{user_file}:length_match")
    responses = ["abc", "boom", "hang", "nan", "text", "ab"]
    scores, metrics = compute_rewards(fn, responses, ["3"] * 6, data_sources=["s"] * 6, extras=[{}] * 6,
                                      timeout_s=2.0, max_workers=2)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 3
    # the killed worker was replaced: the pool still works
    again, metrics = compute_rewards(fn, ["abc"] * 3, ["3"] * 3, timeout_s=30, max_workers=2)
    assert again == [1.0] * 3 and metrics["reward/errors"] == 0


def test_math_verify_runs_in_a_worker_process():
    scores, metrics = compute_rewards(get_reward_fn("math"), ["\\boxed{\\frac{1}{2}}", "\\boxed{1}", "none"],
                                      ["0.5", "0.5", "0.5"], timeout_s=60, max_workers=1)
    assert scores == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 0


def test_in_process_mode_counts_exceptions_and_accepts_lambdas():
    def fn(response, ground_truth, *, data_source=None, extra=None):
        if response == "x":
            raise KeyError("bad")
        return 1.0 if response == ground_truth and data_source == "d" else 0.0

    scores, metrics = compute_rewards(fn, ["a", "x", "b"], ["a", "a", "a"], data_sources=["d"] * 3, max_workers=0)
    assert scores == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 1
    dapo_scores, dapo_metrics = compute_rewards(get_reward_fn("math_dapo"), ["\\boxed{1}", "\\boxed{2}"], ["1", "1"],
                                                max_workers=0)
    assert dapo_scores == [1.0, -1.0] and dapo_metrics["reward/acc/mean"] == 0.5
    with pytest.raises(ValueError, match="max_workers=0"):
        compute_rewards(lambda r, g, **k: 1.0, ["a"], ["a"], max_workers=1)


def test_async_functions_are_awaited_together_in_process_and_in_workers(user_file):
    import time

    fn = get_reward_fn(f"{user_file}:judged")
    responses, truths = ["7", "8", "boom", "hang", "7", "7"], ["7"] * 6
    start = time.monotonic()
    scores, metrics = compute_rewards(fn, responses, truths, timeout_s=2, max_workers=0)
    took = time.monotonic() - start
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (1.0, 1.0)
    assert metrics["reward/judged/mean"] == 1.0
    assert took < 2 + 5 * 0.2  # the five 0.2 s calls overlapped the 2 s timeout; one after another: 3 s
    scores, metrics = compute_rewards(fn, responses[:3], truths[:3], timeout_s=30, max_workers=2)
    assert scores == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 1.0


def test_argument_checks():
    fn = get_reward_fn("synthetic")
    with pytest.raises(ValueError, match="ground_truths"):
        compute_rewards(fn, ["a"], [], max_workers=0)
    with pytest.raises(ValueError, match="extras"):
        compute_rewards(fn, ["a"], ["a"], extras=[{}, {}], max_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        compute_rewards(fn, ["a"], ["a"], timeout_s=0)
    assert compute_rewards(fn, [], [], max_workers=2) == ([], {"reward/errors": 0.0, "reward/timeouts": 0.0})
    assert not any(math.isnan(s) for s in compute_rewards(fn, ["a"], ["a"], max_workers=0)[0])
