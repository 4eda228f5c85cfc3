"""Off-policy training side by side (issue #37): grpo_tiny in split placement, synchronous and asynchronous with
k = trainer.max_staleness batches in flight, with and without partial rollouts, and every correction mode of
actor.off_policy.mode at the deepest k; held-out accuracy by step and by wall-clock, tokens/s, staleness, samples
dropped, and each mode's weight statistics. Writes bench_offpolicy.json, bench_offpolicy.md and PNGs under --out.

  PYTHONPATH=/tmp/site python tools/bench_offpolicy.py --out $OUT --engine vllm --parallel 8 --deadline 560  # 2 GPUs
  python tools/bench_offpolicy.py --out /tmp/offpolicy --cpu --variants sync k2 --steps 12 --parallel 2  # a dry run

Runs are `python -m rltrain.main` in their own process (fresh Ray, own vLLM), --parallel of them at once in waves
(grpo_tiny is small: on two GPUs the runs of a wave share both cards; each run's train group takes one GPU and its
rollout group the other). Runs of one wave slow each other down alike, so wall-clock and tokens/s compare within a
wave, not with a run made alone; the report names each run's wave. A run that cannot start before --deadline is
skipped and a run still going at the deadline is stopped; what was measured is always written.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import Deadline, device_name, log, md_table, report_header, run_children, run_rows, trainer_command
from harness import results as tables
from harness import write_report as write_files
from harness.cases import SPLIT, TINY_LEARN
from harness.runs import learning_curve, speed_summary, steps_to

from rltrain.algorithms.off_policy import OFF_POLICY_MODES
from rltrain.utils.plotting import plot_lines

SWEEP_MODE = "token_tis"  # the k sweep's correction (actor.tis.enable's), as in the 2026-11-26 table
PARTIAL = ["rollout.partial=true", "rollout.partial_chunk_tokens=2"]  # grpo_tiny answers in <= 4 tokens: 2 chunks


def variants(deepest: int) -> dict[str, list[str]]:
    """name -> overrides: sync; k = 1, 2, deepest with SWEEP_MODE, without and with partial rollouts;
    every other correction mode at k = deepest."""
    def asyn(k: int, mode: str = SWEEP_MODE) -> list[str]:
        return ["trainer.async_rollout=true", f"trainer.max_staleness={k}", f"actor.off_policy.mode={mode}"]

    out = {"sync": []}
    for k in sorted({1, 2, deepest}):
        out[f"k{k}"] = asyn(k)
        out[f"k{k}_partial"] = [*asyn(k), *PARTIAL]
    out.update({f"k{deepest}_{m}": asyn(deepest, m) for m in OFF_POLICY_MODES if m != SWEEP_MODE})
    return out


STATS = ("rollout/is_weight_mean", "rollout/is_ratio_max", "rollout/is_clipfrac", "rollout/is_masked_frac",
         "rollout/mismatch_kl", "actor/grad_norm", "rollout/partial_samples_frac")


def summarize(rows: list[dict]) -> dict:
    """One run's learning curve, speed and off-policy statistics (means over its steps; ratio max is the max)."""
    steps = [r for r in rows if "timing_s/step" in r]
    out = {"curve": learning_curve(rows), "speed": speed_summary(rows), "steps": len(steps),
           "dropped_samples": sum(r.get("rollout/dropped_samples", 0) for r in steps),
           "staleness_mean": sum(r.get("rollout/staleness_mean", 0.0) for r in steps) / max(len(steps), 1)}
    for k in STATS:
        vals = [r[k] for r in steps if k in r]
        if vals:
            out[k] = max(vals) if k.endswith("_max") else sum(vals) / len(vals)
    acc = [a for _, a in out["curve"]["by_step"]]
    if acc:
        out.update(best=max(acc), final=acc[-1], final3=sum(acc[-3:]) / len(acc[-3:]))
    return out


def table_rows(res: dict, seed: int, cpu: bool) -> list[dict]:
    """One offpolicy-table row per finished run: best and last-three held-out accuracy, tokens/s, staleness, samples
    dropped, the off-policy weights' statistics; keyed by the run's name and seed."""
    device = "cpu" if cpu else tables.device_kind(device_name(), 2)
    out = []
    for name, r in res["runs"].items():
        if "speed" not in r or "best" not in r:
            continue
        m = {"best": r["best"], "final3": round(r["final3"], 4), "tokens_per_s": round(r["speed"]["tokens_per_s"], 1),
             "staleness_mean": r["staleness_mean"], "staleness_max": r["speed"]["max_staleness_seen"],
             "dropped_samples": r["dropped_samples"], "wave": r["wave"]}
        m.update({k: round(r[k], 5) for k in STATS if k in r and k != "actor/grad_norm"})
        out.append(tables.row("bench_offpolicy", "tiny", device, f"{name}, seed {seed}", m, date=res["date"],
                              config=r["overrides"]))
    return out


def to_markdown(res: dict) -> str:
    lines = [f"# Off-policy training: sync, k in flight, partial rollouts, corrections ({res['date']}, {res['device']})",
             "", f"Command: `{res['command']}`; total {res['total_s']:.0f} s.", ""]
    runs = res["runs"]
    sync = runs.get("sync", {})
    target = 0.9 * sync["best"] if sync.get("best") is not None else None
    if target is not None:
        lines += [f"Target: 90% of the synchronous run's best held-out accuracy = {target:.3f}.", ""]
    head = ["run", "wave", "steps", "steps to target", "s to target", "best", "final (mean last 3)", "tokens/s",
            "staleness mean / max", "dropped", "IS weight mean", "ratio max", "clipped", "masked", "mismatch KL",
            "grad norm", "partial samples"]
    rows = []
    for name, r in runs.items():
        if "speed" not in r:
            rows.append((name, r.get("wave", ""), r.get("error", "no rows"), *[""] * (len(head) - 3)))
            continue
        c = r["curve"]
        f = (lambda k, p=3: "" if k not in r else f"{r[k]:.{p}f}")
        rows.append((name, r["wave"], r["steps"], steps_to(c["by_step"], target) if target else "",
                     steps_to(c["by_time_s"], target) if target else "", f("best"), f("final3"),
                     f"{r['speed'].get('tokens_per_s', 0):.0f}",
                     f"{r['staleness_mean']:.2f} / {r['speed'].get('max_staleness_seen', 0):.0f}",
                     r["dropped_samples"], f("rollout/is_weight_mean"), f("rollout/is_ratio_max", 2),
                     f("rollout/is_clipfrac", 4), f("rollout/is_masked_frac", 4), f("rollout/mismatch_kl", 5),
                     f("actor/grad_norm"), f("rollout/partial_samples_frac")))
    lines += [md_table(head, rows), "", "Curves: `offpolicy_k.png` (sync and the k sweep, with and without partial "
              "rollouts), `offpolicy_modes.png` (the correction modes at the deepest k).", ""]
    lines += [f"- {k}: {v}" for k, v in res.get("skipped", {}).items()]
    return "\n".join(lines) + "\n"


def plot(out: str, runs: dict, deepest: int) -> None:
    groups = {"k": [n for n in runs if n == "sync" or re.fullmatch(r"k\d+(_partial)?", n)],
              "modes": [n for n in runs if re.fullmatch(rf"k{deepest}(_(?!partial).+)?", n)]}
    for g, names in groups.items():
        curves = {n: runs[n]["curve"] for n in names if "curve" in runs[n]}
        if curves:
            plot_lines(os.path.join(out, f"offpolicy_{g}.png"),
                       [{"title": "", "xlabel": x, "ylabel": "val/accuracy",
                         "series": {n: c[key] for n, c in curves.items()}}
                        for key, x in (("by_step", "step"), ("by_time_s", "loop seconds (step + validation)"))],
                       suptitle=f"grpo_tiny, split 1+1: {'sync and k in flight' if g == 'k' else 'corrections'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_offpolicy_out"))
    ap.add_argument("--cpu", action="store_true", help="a dry run on CPU (grpo_tiny's hf engine unless --engine)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default=None, help="rollout engine (GPU default: vllm)")
    ap.add_argument("--deepest", type=int, default=4, help="the deepest k, where every correction mode runs")
    ap.add_argument("--variants", nargs="*", help="names to run (default: all, in the order of the table)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--test-freq", type=int, default=3)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=8, help="runs at once")
    ap.add_argument("--overrides", nargs="*", default=[], help="extra overrides for every run")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds from start by which all is written")
    tables.add_arguments(ap, "a row per run (offpolicy)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0, budget = time.time(), Deadline(args.deadline - 10.0)
    allv = variants(args.deepest)
    unknown = sorted(set(args.variants or []) - set(allv))
    if unknown:
        sys.exit(f"bench_offpolicy: unknown variants {unknown}; known: {', '.join(allv)}")
    names = [n for n in allv if n in set(args.variants or allv)]
    engine = args.engine or ("hf" if args.cpu else "vllm")
    place = (["trainer.device=cpu", "trainer.num_cpus=2"] if args.cpu else ["trainer.device=cuda"])
    base = [*TINY_LEARN, *SPLIT, *place, "trainer.n_gpus_per_node=1", f"rollout={engine}",
            f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}", f"trainer.seed={args.seed}",
            *args.overrides]
    res = {**report_header("bench_offpolicy", device_name() if args.cpu else f"2 x {device_name()}"),
           "base_overrides": base, "runs": {}, "skipped": {}}
    env = dict(os.environ, WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS="local")

    def finish(wave: int, name: str, result: dict) -> None:
        run_dir = os.path.join(args.out, name)
        rows = run_rows(run_dir)
        entry = {"wave": wave, "overrides": allv[name], "wall_s": result["wall_s"], "rc": result["rc"]}
        if rows:
            entry.update(summarize(rows))
        if result["timed_out"] or result["rc"] != 0:
            with open(os.path.join(run_dir, "run.log"), errors="replace") as f:
                entry["error"] = ("stopped at the deadline" if result["timed_out"] else f"rc={result['rc']}")
                entry["log_tail"] = f.read()[-1500:]
        res["runs"][name] = entry
        log("bench_offpolicy", f"{name}: rc={result['rc']} in {result['wall_s']:.0f} s, best "
            f"{entry.get('best')}, final {entry.get('final')}")

    for wave, i in enumerate(range(0, len(names), args.parallel), 1):
        chunk = names[i:i + args.parallel]
        if budget.left() < 60:
            res["skipped"].update({n: f"not started: {budget.left():.0f} s left of the deadline" for n in chunk})
            continue
        log("bench_offpolicy", f"wave {wave}: {' '.join(chunk)}")
        jobs = {n: (trainer_command("grpo_tiny", [*base, *allv[n]], os.path.join(args.out, n)),
                    os.path.join(args.out, n, "run.log")) for n in chunk}
        results = run_children(jobs, timeout_s=budget.left(), env=env, poll_s=1.0,
                               on_exit=lambda n, r, w=wave: finish(w, n, r),
                               stop=((signal.SIGTERM, 20), (signal.SIGKILL, 10)))
        for n in chunk:  # stopped at the deadline: on_exit is not called for those
            if n not in res["runs"]:
                finish(wave, n, results[n])
        res["total_s"] = time.time() - t0
        write_files(args.out, "bench_offpolicy", res, to_markdown(res))
    plot(args.out, res["runs"], args.deepest)
    res["total_s"] = time.time() - t0
    md = to_markdown(res)
    write_files(args.out, "bench_offpolicy", res, md)
    tables.upsert("offpolicy", table_rows(res, args.seed, args.cpu), args.results)
    print(md)


if __name__ == "__main__":
    main()
