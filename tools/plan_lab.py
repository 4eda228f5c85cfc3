"""The planner's lab: refit rltrain.plan's calibration constants from the measured runs of the results tables, score
the planner on every run, regenerate the planner's docs, and the GRPO scaling model of issue 22 (tools/planlab/).

    python tools/plan_lab.py fit                 # the refit constants beside calibration.py's (each from its run)
    python tools/plan_lab.py fit --write         # write them into rltrain/plan/calibration.py (after a run is added)
    python tools/plan_lab.py score               # the scorecard: held-out peaks, fit verdicts, held-out step time
    python tools/plan_lab.py score --markdown    # every comparison (run, quantity, measured, planned, error)
    python tools/plan_lab.py score --steps       # the whole steps' table; --placements: grouped by placement
    python tools/plan_lab.py docs                # docs/plan.md's generated blocks + tools/results/planner.jsonl
    python tools/plan_lab.py scaling [--write docs/benchmarks/placements.md]   # the scaling model (planlab/scaling.py)

The runs are the rows of tools/results/{update,placements,moe,rollout}.jsonl (--results DIR reads another copy);
cases.py's FITTED names every run a constant is solved from, and no such run is scored as held out.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for planlab and the harness

from planlab import REPO, docs, fit, report  # noqa: E402
from planlab.cases import DEFAULT_RESULTS, cases  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scaling"]:
        from planlab.scaling_report import main as scaling_main

        return scaling_main(argv[1:])
    ap = argparse.ArgumentParser(prog="tools/plan_lab.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("fit", "score", "docs"))
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="the results tables' folder (default: %(default)s)")
    ap.add_argument("--write", action="store_true", help="fit: write the refit values into --constants")
    ap.add_argument("--constants", default=fit.CALIBRATION, help="fit --write: the constants file (%(default)s)")
    ap.add_argument("--markdown", action="store_true", help="score: every comparison as a markdown table")
    ap.add_argument("--steps", action="store_true", help="score: the whole steps' table")
    ap.add_argument("--placements", action="store_true", help="score: the whole steps grouped by placement")
    ap.add_argument("--docs-dir", default=os.path.join(REPO, "docs"), help="docs: the docs folder (%(default)s)")
    args = ap.parse_args(argv)
    try:
        cs = cases(args.results)
    except FileNotFoundError as err:
        print(f"plan_lab: {err}", file=sys.stderr)
        return 2
    if args.command == "fit":
        values = fit.fit(verbose=not args.write, all_cases=cs)
        if args.write:
            fit.write_calibration(values, args.constants)
            print(f"wrote {len(values)} fitted constants into {args.constants}")
        else:  # the runs held out of that fit, scored at calibration.py's values (after --write: `score`)
            print("\n" + report.scorecard_text(report.scorecard(report.compare(cs), report.range_rows(cs))))
        return 0
    if args.command == "docs":
        docs.write_all(args.docs_dir, args.results, cs)
        return 0
    rows = report.compare(cs)
    if args.markdown:
        print(report.markdown(rows))
    elif args.steps:
        print(report.step_table(rows))
    elif args.placements:
        print(report.placement_table(rows, cs))
    else:
        ranges = report.range_rows(cs)
        print(report.scorecard_text(report.scorecard(rows, ranges)))
        print()
        print(report.summary(rows))
        print(report.range_summary(ranges))
    return 0


if __name__ == "__main__":
    sys.exit(main())
