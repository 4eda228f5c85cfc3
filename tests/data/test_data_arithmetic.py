"""The learning recipe's task generators: traces checked against hand-worked examples and plain integer math."""

import random
import re

import pytest

from rltrain.data.arithmetic import (add_cot, add_demo, main, make_splits, mul_demo, prompt_split, round_one_digit,
                                     write_splits)


def test_add_cot_matches_a_hand_worked_trace():
    text, answer = add_cot(4738, 2956)
    assert text == "8+6+0=14\n3+5+1=9\n7+9+0=16\n4+2+1=7\n#### 7694"
    assert answer == 7694


@pytest.mark.parametrize("digits", [1, 2, 5, 9])
def test_add_cot_without_drops_is_integer_addition_and_its_lines_are_consistent(digits):
    rng = random.Random(digits)
    for _ in range(200):
        a, b = rng.randrange(10 ** (digits - 1), 10 ** digits), rng.randrange(10 ** (digits - 1), 10 ** digits)
        text, answer = add_cot(a, b)
        assert answer == a + b
        lines = text.split("\n")
        assert lines[-1] == f"#### {a + b}" and len(lines) == digits + 1
        carry = 0
        for line in lines[:-1]:
            x, y, c, s = map(int, re.fullmatch(r"(\d)\+(\d)\+([01])=(\d+)", line).groups())
            assert c == carry and s == x + y + c
            carry = s // 10


def test_a_dropped_carry_writes_zero_and_the_answer_follows_the_trace():
    # 58+67: units 8+7=15 carries 1 into the tens; the sloppy teacher writes +0 there
    text, answer = add_cot(58, 67, drop=[True, True])
    assert text == "8+7+0=15\n5+6+0=11\n#### 115"
    assert answer == 115 != 58 + 67
    # a drop where no carry comes in changes nothing
    assert add_cot(12, 34, drop=[True, True]) == add_cot(12, 34)


def test_teacher_drop_rate_is_drop_carry_p():
    rows = [add_demo(58, 67, seed=0, i=i, drop_carry_p=0.6) for i in range(2000)]
    dropped = sum("5+6+0=" in r[1]["content"] for r in rows) / len(rows)
    assert abs(dropped - 0.6) < 0.04  # binomial sd ~0.011


def test_round_one_digit():
    assert [round_one_digit(n) for n in (4738, 29, 7, 15, 949, 950, 9999)] == [5000, 30, 7, 20, 900, 1000, 10000]


def test_mul_demos_call_the_tool_at_the_configured_rates_and_the_tool_trace_is_exact():
    long = [mul_demo(4738, 2956, seed=1, i=i, digits=4) for i in range(1000)]
    short = [mul_demo(4738, 29, seed=1, i=i, digits=4) for i in range(1000)]
    rate = lambda rows: sum(len(m) == 4 for m in rows) / len(rows)  # noqa: E731
    assert abs(rate(long) - 0.8) < 0.05 and abs(rate(short) - 0.2) < 0.05
    tool = next(m for m in short if len(m) == 4)
    assert [m["role"] for m in tool] == ["user", "assistant", "tool", "assistant"]
    assert tool[1]["content"] == "<code>print(4738*29)</code>" and tool[2]["content"] == f"{4738 * 29}\n"
    assert tool[3]["content"] == f"#### {4738 * 29}"
    mental = next(m for m in short if len(m) == 2)
    assert mental[1]["content"] == "5000*30=150000\n#### 150000"


@pytest.mark.parametrize("task", ["add", "mul_tool"])
def test_splits_are_reproducible_and_val_is_disjoint_from_training(task):
    kw = dict(sft_size=300, train_size=300, val_size=100, seed=3, digits=3, short_digits=2)
    a, b = make_splits(task, **kw), make_splits(task, **kw)
    assert a == b
    user = lambda row: (row.get("messages") or row.get("prompt"))[0]["content"]  # noqa: E731
    val = {user(r) for r in a["val"]}
    seen = {user(r) for r in a["sft"]} | {user(r) for r in a["train"]}
    assert len(val) > 90 and not val & seen
    assert all(prompt_split(p) == "val" for p in val) and all(prompt_split(p) == "train" for p in seen)
    for r in a["train"] + a["val"]:  # RL rows hold the TRUE answer, whatever the teacher wrote
        x, op, y = re.fullmatch(r"(\d+)([+*])(\d+)=", user(r)).groups()
        assert int(r["answer"]) == (int(x) + int(y) if op == "+" else int(x) * int(y))
    assert make_splits(task, **{**kw, "seed": 4})["val"] != a["val"]


def test_bad_parameters_name_the_parameter():
    with pytest.raises(ValueError, match="arithmetic task"):
        make_splits("sub", sft_size=1, train_size=1, val_size=1)
    with pytest.raises(ValueError, match="drop_carry_p"):
        make_splits("add", sft_size=1, train_size=1, val_size=1, drop_carry_p=1.5)
    with pytest.raises(ValueError, match="short_digits"):
        make_splits("mul_tool", sft_size=1, train_size=1, val_size=1, digits=3, short_digits=4)


def test_cli_writes_three_files_and_exits_2_on_bad_input(tmp_path, capsys):
    main(["--task", "add", "--out", str(tmp_path), "--sft-size", "5", "--train-size", "4", "--val-size", "3"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft.jsonl", "train.jsonl", "val.jsonl"]
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 4
    with pytest.raises(SystemExit) as exc:
        main(["--task", "add", "--out", str(tmp_path), "--digits", "0"])
    assert exc.value.code == 2 and "digits" in capsys.readouterr().err
    assert write_splits(str(tmp_path / "w"), "mul_tool", sft_size=2, train_size=2, val_size=2, digits=2,
                        short_digits=1)["val"].endswith("val.jsonl")
