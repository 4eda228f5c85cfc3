"""Synthetic arithmetic for the learning recipe (examples/learn/): column addition with a chain of thought, and
big products that need the Python tool. Pure and seeded; must not tokenize, run code or score answers.

Task "add": `a+b=` with two `digits`-digit numbers. The demonstrated chain of thought adds one column per
line, units first, writing the carry it brings in explicitly, then the answer after `####`:

    user:       "4738+2956="
    assistant:  "8+6+0=14\\n3+5+1=9\\n7+9+0=16\\n4+2+1=7\\n#### 7694"

A line is `x+y+c=s` with c the carry in (the previous line's s // 10) and s = x+y+c; the answer's digits are
the lines' s % 10 read bottom-up, led by the last carry. 5 digits make ~55 response tokens.

The SFT demonstrations come from a sloppy teacher: where the true carry in is 1 it writes 0 with probability
`drop_carry_p` (its arithmetic is otherwise right, and the rest of the trace follows what it wrote, so the
answer is wrong). With drop_carry_p > 0.5 the most likely demonstrated carry after a column sum >= 10 is 0,
so a model that imitates the teacher well (greedy decoding) reproduces the mistake on every problem that has
a carry, and only the reward tells the RL stage which traces are right. The RL rows hold the true answer.

Task "mul_tool": `a*b=` with a of `digits` digits and b of `digits` ("long") or `short_digits` ("short")
digits, half each. Two demonstrated strategies:

    tool:    assistant "<code>print(4738*2956)</code>", tool "14005528\\n", assistant "#### 14005528"
    mental:  assistant "5000*3000=15000000\\n#### 15000000"   (both operands rounded to one significant digit)

The teacher uses the tool with probability `tool_p_long` on long problems and `tool_p_short` on short ones
(defaults 0.8 / 0.2: it trusts mental estimates for small multipliers). The estimate is exact only when both
operands are already round, so imitating the teacher solves about the long half; GRPO with the exact-answer
reward (rltrain/rewards/arithmetic.py) has to discover that the tool pays on short problems too.

Held-out split: a problem belongs to "val" iff crc32 of its prompt % 5 == 0, else to "train"; item i of a
split is drawn from numpy's generator seeded with (seed, task, split, i), so every file is reproducible and
val problems never appear in SFT or RL training. Demonstration noise uses its own seeds (seed, task, 2, i).

Write the files: `python -m rltrain.data.arithmetic --task add --out data/learn/add --digits 5`
(sft.jsonl: {"messages"} rows for rltrain.sft; train.jsonl / val.jsonl: RL prompt rows with "answer").
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from rltrain.data.synthetic import SPLITS, prompt_split  # the synthetic tasks' split rule and seed streams

TASK_IDS = {"add": 0, "mul_tool": 1}
_NOISE = 2  # seed slot of the demonstrations' noise
TASK_DATA_SOURCES = {"add": "arith_add", "mul_tool": "arith_mul_tool"}


def _number(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1), 10 ** digits))


# ---------------------------------------------------------------------------- add
def add_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def add_cot(a: int, b: int, *, drop: list[bool] | None = None) -> tuple[str, int]:
    """(chain of thought ending in "#### answer", the answer the trace reaches).

    drop[j] (column j, units first): write carry 0 where the true carry into column j is 1. Without drops the
    answer is a + b."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    lines, digits, carry = [], [], 0
    for j in range(width):
        x = int(xs[j]) if j < len(xs) else 0
        y = int(ys[j]) if j < len(ys) else 0
        c = 0 if (carry and drop is not None and drop[j]) else carry
        s = x + y + c
        lines.append(f"{x}+{y}+{c}={s}")
        digits.append(s % 10)
        carry = s // 10
    answer = int(("1" if carry else "") + "".join(map(str, digits[::-1])))
    return "\n".join(lines) + f"\n#### {answer}", answer


def add_problem(seed: int, split: str, i: int, *, digits: int) -> tuple[int, int]:
    rng = np.random.default_rng([seed, TASK_IDS["add"], SPLITS[split], i])
    while True:  # rejection: ~1.25 draws for train, ~5 for val
        a, b = _number(rng, digits), _number(rng, digits)
        if prompt_split(add_prompt(a, b)) == split:
            return a, b


def add_demo(a: int, b: int, *, seed: int, i: int, drop_carry_p: float) -> list[dict]:
    """The sloppy teacher's SFT conversation for a+b (see the module docstring)."""
    rng = np.random.default_rng([seed, TASK_IDS["add"], _NOISE, i])
    width = max(len(str(a)), len(str(b)))
    drop = (rng.random(width) < drop_carry_p).tolist()
    text, _ = add_cot(a, b, drop=drop)
    return [{"role": "user", "content": add_prompt(a, b)}, {"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------- mul_tool
def mul_prompt(a: int, b: int) -> str:
    return f"{a}*{b}="


def round_one_digit(n: int) -> int:
    """n rounded to one significant digit (half up): 4738 -> 5000, 29 -> 30, 7 -> 7."""
    scale = 10 ** (len(str(n)) - 1)
    return (n + scale // 2) // scale * scale


def mul_problem(seed: int, split: str, i: int, *, digits: int, short_digits: int) -> tuple[int, int]:
    """Item i: even i long (b has `digits` digits), odd i short (b has `short_digits`)."""
    rng = np.random.default_rng([seed, TASK_IDS["mul_tool"], SPLITS[split], i])
    b_digits = digits if i % 2 == 0 else short_digits
    while True:
        a, b = _number(rng, digits), _number(rng, b_digits)
        if prompt_split(mul_prompt(a, b)) == split:
            return a, b


def tool_call(a: int, b: int) -> str:
    return f"<code>print({a}*{b})</code>"


def mul_demo(a: int, b: int, *, seed: int, i: int, use_tool: bool | None = None, tool_p_long: float = 0.8,
             tool_p_short: float = 0.2, digits: int | None = None) -> list[dict]:
    """The teacher's SFT conversation for a*b: a tool call (then its output and the answer) or a mental
    estimate. use_tool=None draws the choice: tool_p_long when b has `digits` digits, else tool_p_short."""
    if use_tool is None:
        rng = np.random.default_rng([seed, TASK_IDS["mul_tool"], _NOISE, i])
        long = len(str(b)) >= (digits if digits is not None else len(str(a)))
        use_tool = bool(rng.random() < (tool_p_long if long else tool_p_short))
    user = {"role": "user", "content": mul_prompt(a, b)}
    if use_tool:
        return [user, {"role": "assistant", "content": tool_call(a, b)},
                {"role": "tool", "content": f"{a * b}\n"},  # what print() writes
                {"role": "assistant", "content": f"#### {a * b}"}]
    ra, rb = round_one_digit(a), round_one_digit(b)
    return [user, {"role": "assistant", "content": f"{ra}*{rb}={ra * rb}\n#### {ra * rb}"}]


# ---------------------------------------------------------------------------- files
def rl_row(task: str, a: int, b: int) -> dict:
    prompt, answer = (add_prompt(a, b), a + b) if task == "add" else (mul_prompt(a, b), a * b)
    return {"prompt": [{"role": "user", "content": prompt}], "answer": str(answer), "data_source": TASK_DATA_SOURCES[task]}


def make_splits(task: str, *, sft_size: int, train_size: int, val_size: int, seed: int = 0, digits: int = 5,
                short_digits: int = 2, drop_carry_p: float = 0.6, tool_p_long: float = 0.8,
                tool_p_short: float = 0.2) -> dict[str, list[dict]]:
    """{"sft": [{"messages"}], "train": [RL rows], "val": [RL rows]} for `task`. SFT and RL-train problems are
    items [0, sft_size) and [sft_size, sft_size + train_size) of the train split: disjoint from each other and,
    by construction, from val."""
    if task not in TASK_IDS:
        raise ValueError(f"arithmetic task must be one of {sorted(TASK_IDS)}, got {task!r}")
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be in [1, 18], got {digits}")
    if task == "mul_tool" and not 1 <= short_digits <= digits:
        raise ValueError(f"short_digits must be in [1, digits={digits}], got {short_digits}")
    for name, p in (("drop_carry_p", drop_carry_p), ("tool_p_long", tool_p_long), ("tool_p_short", tool_p_short)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
    for name, n in (("sft_size", sft_size), ("train_size", train_size), ("val_size", val_size)):
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    if task == "add":
        def problem(split, i):
            return add_problem(seed, split, i, digits=digits)

        def demo(a, b, i):
            return add_demo(a, b, seed=seed, i=i, drop_carry_p=drop_carry_p)
    else:
        def problem(split, i):
            return mul_problem(seed, split, i, digits=digits, short_digits=short_digits)

        def demo(a, b, i):
            return mul_demo(a, b, seed=seed, i=i, tool_p_long=tool_p_long, tool_p_short=tool_p_short, digits=digits)
    sft = [demo(*problem("train", i), i) for i in range(sft_size)]
    return {
        "sft": [{"messages": m} for m in sft],
        "train": [rl_row(task, *problem("train", i)) for i in range(sft_size, sft_size + train_size)],
        "val": [rl_row(task, *problem("val", i)) for i in range(val_size)],
    }


def write_splits(out_dir: str, task: str, **kwargs) -> dict[str, str]:
    """Write sft.jsonl, train.jsonl and val.jsonl for `task` under out_dir; returns split -> path."""
    from rltrain.data.dataset import write_rows

    paths = {}
    for name, rows in make_splits(task, **kwargs).items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        write_rows(rows, paths[name])
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(TASK_IDS), required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--sft-size", type=int, default=20000)
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--digits", type=int, default=5)
    p.add_argument("--short-digits", type=int, default=2)
    p.add_argument("--drop-carry-p", type=float, default=0.6)
    p.add_argument("--tool-p-long", type=float, default=0.8)
    p.add_argument("--tool-p-short", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        paths = write_splits(a.out, a.task, sft_size=a.sft_size, train_size=a.train_size, val_size=a.val_size,
                             seed=a.seed, digits=a.digits, short_digits=a.short_digits, drop_carry_p=a.drop_carry_p,
                             tool_p_long=a.tool_p_long, tool_p_short=a.tool_p_short)
    except ValueError as err:
        print(f"rltrain.data.arithmetic: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
