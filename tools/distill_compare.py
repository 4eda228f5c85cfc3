"""On-policy distillation against GRPO from the same random init, on CPU (docs/distill.md; issue 62).

  python tools/distill_compare.py --out outputs/distill_compare [--teacher-steps 40] [--distill-steps 30]

1. grpo_tiny (shaped to learn in tens of steps: SHAPE) from the default random init for --teacher-steps steps; its
   HF export (grpo/hf; its last checkpoint kept too) is the teacher, and its held-out curve is GRPO's from that init.
2. distill_tiny from the same init (same seed) with that teacher, for --distill-steps steps (0: stop at the last
   validation before the step GRPO first reached the target, all a "fewer steps" claim needs).
The target is --fraction (0.9) of the teacher's final held-out accuracy (greedy, data.synthetic.val_size prompts,
every trainer.test_freq steps). Prints the two curves side by side, the step each first reached the target and
the training seconds to it; writes OUT/summary.json and OUT/curves.png (by step and by wall clock; CSV without
matplotlib). tests/trainer/test_distill_e2e.py runs it at CI size. Exit 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# grpo_tiny shaped to learn in tens of steps (test_async_e2e.py's LEARN, in process)
SHAPE = ["trainer.use_ray=false", "data.train_batch_size=32", "rollout.n=16", "actor.ppo_mini_batch_size=16",
         "actor.lr=3e-3", "data.synthetic.val_size=128", "data.val_batch_size=128", "trainer.test_freq=2",
         "reward.max_workers=0", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.progress_bar=false"]


def _curve(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val/accuracy"] for r in rows if isinstance(r.get("val/accuracy"), (int, float))}


def _reached(rows: list[dict], target: float) -> tuple[int | None, float | None]:
    """(first step whose held-out accuracy >= target, summed timing_s/step up to it) or (None, None)."""
    seconds = 0.0
    for r in rows:
        seconds += r.get("timing_s/step", 0.0)
        if r.get("val/accuracy", -1.0) >= target:
            return r["step"], seconds
    return None, None


def compare(out: str, *, teacher_steps: int, distill_steps: int = 0, fraction: float = 0.9,
            overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Run both (module docstring) under `out` (grpo/, distill/) and return the summary written to summary.json."""
    from rltrain.config.entry import compose_config
    from rltrain.trainer.ppo import run_from_config
    from rltrain.utils.plotting import plot_runs
    from rltrain.utils.tracking import read_metrics

    grpo, distill = os.path.join(out, "grpo"), os.path.join(out, "distill")
    run_from_config(compose_config("grpo_tiny", [*SHAPE, *overrides, f"trainer.total_steps={teacher_steps}",
                                                 f"trainer.save_freq={teacher_steps}",
                                                 "trainer.export_hf_on_end=true"]), grpo)
    grpo_rows = read_metrics(grpo)
    teacher_acc = _curve(grpo_rows)[max(_curve(grpo_rows))]  # validated at the last step
    target = fraction * teacher_acc
    grpo_step, grpo_s = _reached(grpo_rows, target)
    steps = distill_steps or max(1, grpo_step - 1)
    run_from_config(compose_config("distill_tiny", [*SHAPE, *overrides, f"trainer.total_steps={steps}",
                                                    f"teacher.path={os.path.join(grpo, 'hf')}"]), distill)
    rows = read_metrics(distill)
    step, seconds = _reached(rows, target)
    trained = [r for r in rows if "distill/reverse_kl/mean" in r]
    summary = {"teacher_accuracy": teacher_acc, "target": target, "grpo": {"step": grpo_step, "train_s": grpo_s,
               "curve": _curve(grpo_rows)}, "distill": {"step": step, "train_s": seconds, "curve": _curve(rows),
               "reverse_kl_mean": {r["step"]: r["distill/reverse_kl/mean"] for r in trained},
               "teacher_s_per_step": sum(r["timing_s/teacher"] for r in trained) / max(1, len(trained)),
               "step_s": sum(r["timing_s/step"] for r in trained) / max(1, len(trained))}}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    summary["plot"] = plot_runs({"grpo": grpo, "distill": distill}, os.path.join(out, "curves.png"))
    return summary


def report(s: dict) -> str:
    """The curves side by side and the verdict, as printed."""
    g, d = s["grpo"]["curve"], s["distill"]["curve"]
    lines = [f"teacher (grpo) held-out accuracy {s['teacher_accuracy']:.3f}; target {s['target']:.3f}",
             "step  grpo   distill"]
    for step in sorted(set(g) | set(d)):
        cell = [f"{c[step]:.3f}" if step in c else "  -  " for c in (g, d)]
        lines.append(f"{step:4d}  {cell[0]}  {cell[1]}")
    for name in ("grpo", "distill"):
        r = s[name]
        lines.append(f"{name}: target first reached at step {r['step']}" +
                     (f" after {r['train_s']:.1f} training seconds" if r["step"] is not None else ""))
    lines.append(f"distill: {s['distill']['step_s']:.2f} s per step, of which the teacher "
                 f"{s['distill']['teacher_s_per_step']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a new or empty directory for the two runs and the results")
    ap.add_argument("--teacher-steps", type=int, default=40, help="GRPO steps (the teacher)")
    ap.add_argument("--distill-steps", type=int, default=30, help="distillation steps (0: just before GRPO's step)")
    ap.add_argument("--fraction", type=float, default=0.9, help="of the teacher's held-out accuracy")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="Hydra overrides of both runs")
    args = ap.parse_args(argv)
    if os.path.isdir(args.out) and os.listdir(args.out):
        print(f"distill_compare: --out {args.out} is not empty; give a new directory", file=sys.stderr)
        return 2
    if args.teacher_steps < 1 or args.distill_steps < 0 or not 0 < args.fraction <= 1:
        print("distill_compare: --teacher-steps must be >= 1, --distill-steps >= 0, --fraction in (0, 1]",
              file=sys.stderr)
        return 2
    s = compare(args.out, teacher_steps=args.teacher_steps, distill_steps=args.distill_steps,
                fraction=args.fraction, overrides=tuple(args.set))
    print(report(s))
    print(f"wrote {os.path.join(args.out, 'summary.json')} and {s['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
