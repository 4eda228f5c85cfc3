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


def read_block(path: str, name: str) -> str:
    """The text between the markers `name` of the file at `path` (ValueError without them)."""
    with open(path) as f:
        head, rest, tail = _split(f.read(), path, name)
    return rest.strip("\n")


def replace_block(path: str, name: str, block: str) -> None:
    """Replace the text between the markers `name` of the file at `path` with `block` (ValueError without them)."""
    with open(path) as f:
        head, _, tail = _split(f.read(), path, name)
    with open(path, "w") as f:
        f.write(f"{head}\n{block.rstrip()}\n{tail}")


def _split(text: str, path: str, name: str) -> tuple[str, str, str]:
    begin, end = f"<!-- BEGIN plan_lab {name} -->", f"<!-- END plan_lab {name} -->"
    if begin not in text or end not in text:
        raise ValueError(f"{path} lacks the markers {begin} ... {end}")
    head, rest = text.split(begin, 1)
    inner, tail = rest.split(end, 1)
    return head + begin, inner, end + tail


def example_output() -> str:
    from rltrain.plan.__main__ import main as plan_main

    buf = io.StringIO()
    with redirect_stdout(buf), redirect_stderr(io.StringIO()):
        plan_main(list(EXAMPLE))
    return f"    python -m rltrain.plan {' '.join(EXAMPLE)}\n\n```\n{buf.getvalue().rstrip()}\n```"


def blocks(docs_dir: str, rows: list[dict], cs: list[Case]) -> dict[tuple[str, str], str]:
    """Each generated block by (file, marker name), from the comparison `rows` of the cases `cs`."""
    plan = os.path.join(docs_dir, "plan.md")
    score = report.scorecard_text(report.scorecard(rows, report.range_rows(cs)))
    return {(plan, "example"): example_output(), (plan, "constants"): report.constants_markdown(),
            (plan, "score"): f"```\n{score}\n```",
            (os.path.join(docs_dir, "benchmarks", "planner.md"), "placements"): report.placement_table(rows, cs)}


def write_all(docs_dir: str, results_dir: str, cs: list[Case]) -> None:
    rows = report.compare(cs)
    for (path, name), block in blocks(docs_dir, rows, cs).items():
        replace_block(path, name, block)
    tables.write_rows(tables.table_path("planner", results_dir), report.planner_rows(rows, cs))
