"""The planner's generated docs: docs/plan.md's example, constants and scorecard, the planner accuracy page's table
by placement (docs/benchmarks/planner.md), and the planner table (tools/results/planner.jsonl: per run, each
quantity measured, planned and its error). Each block sits between `<!-- BEGIN plan_lab NAME -->` and
`<!-- END plan_lab NAME -->` and is replaced whole. Must not fit anything.
"""

from __future__ import annotations

import io
import os
from contextlib import redirect_stderr, redirect_stdout

from harness import results as tables
from planlab import report
from planlab.cases import Case

# the example of docs/plan.md: the Qwen3-4B config that does not fit an 80 GiB GPU
EXAMPLE = ["--config-name", "grpo_qwen3", "model=qwen3_4b", "actor.max_tokens_per_micro_batch=16384",
           "actor.recompute_activations=false", "--gpu-memory-gib", "80", "--worst-case"]


def replace_block(path: str, name: str, block: str) -> None:
    """Replace the text between the markers `name` of the file at `path` with `block` (ValueError without them)."""
    begin, end = f"<!-- BEGIN plan_lab {name} -->", f"<!-- END plan_lab {name} -->"
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise ValueError(f"{path} lacks the markers {begin} ... {end}")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{block.rstrip()}\n{end}{tail}")


def example_output() -> str:
    from rltrain.plan.__main__ import main as plan_main

    buf = io.StringIO()
    with redirect_stdout(buf), redirect_stderr(io.StringIO()):
        plan_main(list(EXAMPLE))
    return f"    python -m rltrain.plan {' '.join(EXAMPLE)}\n\n```\n{buf.getvalue().rstrip()}\n```"


def write_all(docs_dir: str, results_dir: str, cs: list[Case]) -> None:
    rows = report.compare(cs)
    ranges = report.range_rows(cs)
    plan = os.path.join(docs_dir, "plan.md")
    replace_block(plan, "example", example_output())
    replace_block(plan, "constants", report.constants_markdown())
    replace_block(plan, "score", "```\n" + report.scorecard_text(report.scorecard(rows, ranges)) + "\n```")
    replace_block(os.path.join(docs_dir, "benchmarks", "planner.md"), "placements", report.placement_table(rows, cs))
    tables.write_rows(tables.table_path("planner", results_dir), report.planner_rows(rows, cs))
