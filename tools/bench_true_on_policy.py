"""rollout.true_on_policy side by side (issue 60): the same run with the key off and on, each `python -m rltrain.main`
in a process of its own, one after the other; per run the mean time of each phase of a step (generation, the actor's
log-prob forward, the update, the weight push) over the steps after the first, the log-prob difference between the
rollout engine and the actor (max and share of tokens that differ, every step) and the held-out accuracy by step.
Writes bench_true_on_policy.json and .md to --out.

  python tools/bench_true_on_policy.py --out /tmp/top --steps 12                   # grpo_tiny on CPU, hf engine
  python tools/bench_true_on_policy.py --out /tmp/top --steps 150 --set trainer.test_freq=25   # learning curves
  PYTHONPATH=/tmp/site:$PWD python tools/bench_true_on_policy.py --out $OUT --gpu-06b --steps 50   # one H200, vLLM

--gpu-06b: the Qwen3-0.6B-shaped random model of tools/gpu_smoke.py's GRPO section (harness.cases.GRPO_06B_OVERRIDES)
with the vLLM engine colocated and the torch head (what true on-policy needs on both sides).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import md_table, report_header, run_trainer, write_report
from harness.cases import GRPO_06B_OVERRIDES
from harness.runs import learning_curve

PHASES = ("timing_s/step", "timing_s/gen", "timing_s/gen_engine", "timing_s/old_log_prob", "timing_s/update_actor",
          "timing_s/update_weights")
CPU = ["trainer.use_ray=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.plots=false",
       "trainer.save_freq=-1"]
GPU_06B = [*GRPO_06B_OVERRIDES, "rollout=vllm", "trainer.use_ray=false", "trainer.save_freq=-1"]
# the key on: on a GPU the head's torch backend (the default run keeps GRPO_06B_OVERRIDES' Triton head)
ON = {"cpu": ["rollout.true_on_policy=true"],
      "cuda": ["rollout.true_on_policy=true", "trainer.fused_linear_logprob_backend=torch"]}


def summary(rows: list[dict]) -> dict:
    """Phase means over the steps after the first (it compiles and allocates), and the mismatch of every step."""
    steps = [r for r in rows if "timing_s/step" in r]
    steady = steps[1:] or steps
    mean = {k: sum(r.get(k, 0.0) for r in steady) / max(len(steady), 1) for k in PHASES}
    diff = [r.get("rollout/logprob_diff_max") for r in steps]
    return {"steps": len(steps), "mean": mean, "logprob_diff_max": diff,
            "nonzero_frac": [r.get("rollout/logprob_diff_nonzero_frac") for r in steps],
            "all_zero": bool(steps) and all(d == 0.0 for d in diff),
            "score_last10": sum(r.get("critic/score/mean", 0.0) for r in steps[-10:]) / max(len(steps[-10:]), 1),
            "val_accuracy": learning_curve(rows)["by_step"]}


def markdown(report: dict) -> str:
    runs = report["runs"]
    rows = []
    for k in PHASES:
        off, on = runs["off"]["mean"][k], runs["on"]["mean"][k]
        rows.append([k, f"{off:.4f}", f"{on:.4f}", f"{on / off:.2f}x" if off > 0 else "-"])
    out = [f"# rollout.true_on_policy: cost and mismatch ({report['date']}, {report['device']})", "",
           f"`{report['command']}`", "", "Mean seconds per step after the first:", "",
           md_table(["phase", "off", "on", "on / off"], rows, ["---", "---:", "---:", "---:"]), ""]
    for name, r in runs.items():
        diffs = [d for d in r["logprob_diff_max"] if d is not None]
        fracs = [f for f in r["nonzero_frac"] if f is not None]
        out.append(f"- {name}: {r['steps']} steps; rollout/logprob_diff_max max {max(diffs, default=float('nan')):.3g}"
                   f" (exactly 0 every step: {r['all_zero']}); share of tokens that differ, mean "
                   f"{sum(fracs) / max(len(fracs), 1):.3g}; critic/score/mean over the last 10 steps "
                   f"{r['score_last10']:.3f}; val/accuracy by step {r['val_accuracy']}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="grpo_tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gpu-06b", action="store_true", help="Qwen3-0.6B shape, vLLM colocated, one GPU")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for both runs")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run")
    ap.add_argument("--runs", default=None, help="where the two run directories go (default: --out)")
    args = ap.parse_args()
    device = "cuda" if args.gpu_06b else "cpu"
    base = (GPU_06B if args.gpu_06b else CPU) + [f"trainer.total_steps={args.steps}", *args.set]
    report = {**report_header("bench_true_on_policy", device=device), "runs": {}}
    for name, key in (("off", ["rollout.true_on_policy=false"]), ("on", ON[device])):
        run = run_trainer(args.config, [*base, *key], os.path.join(args.runs or args.out, name),
                          timeout_s=args.timeout)
        if run["rc"] != 0:
            print(f"bench_true_on_policy: the {name} run failed (rc {run['rc']}):\n{run['tail']}", file=sys.stderr)
        report["runs"][name] = {"rc": run["rc"], "wall_s": run["wall_s"], **summary(run["rows"])}
        if len(report["runs"]) == 2:
            write_report(args.out, "bench_true_on_policy", report, markdown(report))
    print(open(os.path.join(args.out, "bench_true_on_policy.md")).read() if len(report["runs"]) == 2 else "")
    return 0 if report["runs"]["on"].get("all_zero") else 1


if __name__ == "__main__":
    raise SystemExit(main())
