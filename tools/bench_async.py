"""Synchronous vs asynchronous rollout (`trainer.async_rollout`) in split placement, side by side: step time and
tokens/s of the Qwen3-0.6B-shaped GRPO run, and learning curves (held-out accuracy by step and by wall-clock time)
of grpo_tiny and, when given, a GPU learning recipe. Writes bench_async.json, bench_async.md and PNGs under --out.

  PYTHONPATH=/tmp/site python tools/bench_async.py --out $OUT --deadline 540   # 2 GPUs (split 1+1)
  python tools/bench_async.py --out /tmp/bench_async --cpu --deadline 900       # the CPU table of docs/benchmarks.md
  ... --only speed | --only learn                # one section (each fits one device command on its own)
  ... --overrides "rollout=vllm"                 # extra overrides for every run (e.g. the vLLM rollout engine)
  ... --recipe NAME --recipe-overrides "k=v k=v" # also a learning recipe (configs/NAME.yaml)

Every run is `python -m rltrain.main` in its own process (fresh Ray, fresh GPU memory) with trainer.colocate=false:
the train group on one device, the rollout group on another; the async run adds trainer.async_rollout=true and
actor.tis.enable=true. Timings are means (and the median step) over the steady steps (the first two are left out: step 1 compiles kernels
and, in async mode, has nothing to overlap with). tokens/s = tokens of those steps / their summed step time. The
script finishes within --deadline seconds of its start (one 10-minute device command): a run that cannot finish
in what is left is skipped, a run still going at the deadline is stopped, and the report says which; the results
written so far are always saved.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import Deadline, device_name, md_table, report_header
from harness import run_trainer as harness_run_trainer
from harness import write_report as write_files
from harness.cases import GRPO_06B_OVERRIDES, SPLIT, TINY_LEARN
from harness.runs import PHASES, learning_curve, speed_summary, steps_to

from rltrain.utils.plotting import plot_lines, pyplot


ASYNC = ["trainer.async_rollout=true", "actor.tis.enable=true"]


def run_trainer(run_dir: str, config: str, overrides: list[str], timeout_s: float) -> dict:
    """One training run in a fresh process; returns {"rows", "wall_s", "returncode", "log_tail"}."""
    env = dict(os.environ, WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS="local")
    # the deadline stops the run and the Ray workers it started (its process group)
    r = harness_run_trainer(config, overrides, run_dir, timeout_s=max(1.0, timeout_s), env=env, poll_s=1.0,
                            stop=((signal.SIGTERM, 20), (signal.SIGKILL, 10)))
    return {"rows": r["rows"], "wall_s": r["wall_s"], "log_tail": r["tail"], "command": " ".join(r["command"]),
            "returncode": "stopped at the deadline" if r["timed_out"] else r["rc"]}


def compare_learning(sync: dict, asyn: dict) -> dict:
    """Target = 90% of the best held-out accuracy the synchronous run reached; the steps each run needs."""
    best = max((a for _, a in sync["by_step"]), default=0.0)
    target = 0.9 * best
    s, a = steps_to(sync["by_step"], target), steps_to(asyn["by_step"], target)
    ts, ta = steps_to(sync["by_time_s"], target), steps_to(asyn["by_time_s"], target)
    return {"target_accuracy": target, "sync_steps": s, "async_steps": a,
            "async_over_sync_steps": (a / s) if (a and s) else None, "sync_seconds": ts, "async_seconds": ta,
            "final_sync": sync["by_step"][-1][1] if sync["by_step"] else None,
            "final_async": asyn["by_step"][-1][1] if asyn["by_step"] else None}


def plot_learning(name: str, curves: dict, path: str) -> None:
    plot_lines(path, [{"title": "", "xlabel": xlabel, "ylabel": "val/accuracy",
                       "series": {mode: c[key] for mode, c in curves.items()}}
                      for key, xlabel in (("by_step", "step"), ("by_time_s", "loop seconds (step + validation)"))],
               suptitle=f"{name}: synchronous vs asynchronous rollout")


def plot_speed(speed: dict, path: str) -> None:
    modes = [m for m in ("sync", "async") if speed.get(m, {}).get("mean")]
    plt = pyplot()
    if not modes or plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=100)
    axes[0].bar(modes, [speed[m]["mean"]["timing_s/step"] for m in modes], color=["tab:blue", "tab:orange"][:len(modes)])
    axes[0].set_ylabel("s / step")
    axes[1].bar(modes, [speed[m]["tokens_per_s"] for m in modes], color=["tab:blue", "tab:orange"][:len(modes)])
    axes[1].set_ylabel("tokens / s")
    fig.suptitle(speed.get("title", "step time"))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def to_markdown(res: dict) -> str:
    lines = [f"# Synchronous vs asynchronous rollout ({res['date']}, {res['device']})", "",
             f"Command: `{res['command']}`; total {res['total_s']:.0f} s.", ""]
    sp = res.get("speed", {})
    if any(sp.get(m, {}).get("mean") for m in ("sync", "async")):
        rows = [(m, *(f"{s['mean'][k]:.3f}" for k in PHASES), f"{s['median_step_s']:.3f}", f"{s['tokens_per_s']:.0f}",
                 s["max_staleness_seen"]) for m, s in ((m, sp.get(m, {})) for m in ("sync", "async")) if s.get("mean")]
        lines += [f"## Step time: {sp['title']}", "", md_table(
            ["mode", *(k.split("/")[1] for k in PHASES), "median step", "tokens/s", "max staleness"], rows)]
        if sp.get("speedup"):
            lines += ["", f"async / sync tokens/s: **{sp['speedup']:.2f}x**; mismatch |log p_sampler - log p_old| "
                      f"sync {sp['sync'].get('mismatch_abs_mean', 0):.4f}, async {sp['async'].get('mismatch_abs_mean', 0):.4f}"]
        lines.append("")
    for name, lr in res.get("learning", {}).items():
        c = lr.get("compare")
        if not c:
            continue
        lines += [f"## Learning: {name}", "", f"Overrides: `{' '.join(lr['overrides'])}`", "",
                  md_table(["mode", "steps to target", "loop s (step + validation) to target", "final val/accuracy"],
                           [("sync", c["sync_steps"], c["sync_seconds"], c["final_sync"]),
                            ("async", c["async_steps"], c["async_seconds"], c["final_async"])]), "",
                  f"target = 90% of the sync run's best held-out accuracy = {c['target_accuracy']:.3f}; "
                  f"async/sync steps = {c['async_over_sync_steps']}; curves: `learning_{name}.png`", ""]
    for k, v in res.get("skipped", {}).items():
        lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def run_pair(out: str, name: str, config: str, overrides: list[str], est_s: float, budget: Deadline,
             skipped: dict) -> dict:
    """The same run synchronous and asynchronous; each only when its estimate fits the budget left."""
    res = {}
    for mode in ("sync", "async"):
        left = budget.left()
        if left < est_s:
            skipped[f"{name}/{mode}"] = f"skipped: {left:.0f} s left of the budget, the run needs about {est_s:.0f} s"
            continue
        r = run_trainer(os.path.join(out, name, mode), config, [*overrides, *(ASYNC if mode == "async" else [])],
                        timeout_s=left)
        print(f"[bench_async] {name}/{mode}: rc={r['returncode']} in {r['wall_s']:.0f} s", flush=True)
        if r["returncode"] != 0:
            skipped[f"{name}/{mode}"] = f"failed (rc={r['returncode']}): {r['log_tail'][-600:]}"
        res[mode] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_async_out"))
    ap.add_argument("--cpu", action="store_true", help="CPU: grpo_tiny only (speed and learning)")
    ap.add_argument("--only", nargs="+", choices=("speed", "learn"), default=["speed", "learn"])
    ap.add_argument("--speed-steps", type=int, default=8)
    ap.add_argument("--learn-steps", type=int, default=60, help="grpo_tiny learning steps (0: only --recipe)")
    ap.add_argument("--recipe", help="a GPU learning recipe (config name) to compare as well")
    ap.add_argument("--recipe-overrides", default="")
    ap.add_argument("--recipe-steps", type=int, default=60)
    ap.add_argument("--overrides", default="", help="extra overrides for every run, space-separated")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds from start by which everything, reports included, is written")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    budget, skipped = Deadline(args.deadline - 15.0), {}  # 15 s for plots and reports
    t0 = time.time()
    import torch

    gpu = not args.cpu
    if gpu and torch.cuda.device_count() < 2:
        sys.exit("bench_async: split placement 1+1 needs 2 GPUs (or pass --cpu)")
    device = f"{torch.cuda.device_count()} x {device_name()}" if gpu else device_name()
    res = {**report_header("bench_async", device), "learning": {}, "skipped": skipped}
    place = ["trainer.device=cuda", "trainer.n_gpus_per_node=1"] if gpu else \
        ["trainer.device=cpu", "trainer.num_cpus=2", "trainer.n_gpus_per_node=1"]
    place += args.overrides.split()

    if "speed" in args.only:
        run_speed(args, res, place, gpu, budget, skipped, t0)
    if "learn" in args.only:
        run_learning(args, res, place, gpu, budget, skipped, t0)
    print(write_report(args.out, res, t0))


def run_speed(args, res: dict, place: list[str], gpu: bool, budget: Deadline, skipped: dict, t0: float) -> None:
    """Step time and tokens/s, sync vs async."""
    if gpu:
        speed_ov = [*GRPO_06B_OVERRIDES, *SPLIT, *place, f"trainer.total_steps={args.speed_steps}",
                    "trainer.logger=[jsonl]"]
        title, est = "GRPO, Qwen3-0.6B shapes (random init), HF rollout, split 1+1", 150.0
    else:
        speed_ov = [*SPLIT, *place, *TINY_LEARN, "trainer.test_freq=-1",
                    f"trainer.total_steps={args.speed_steps}"]
        title, est = "grpo_tiny, 32 prompts x 16 samples, split 1+1 on 2 CPU cores", 60.0
    pair = run_pair(args.out, "speed", "grpo_tiny", speed_ov, est, budget, skipped)
    speed = {"title": title, "overrides": speed_ov}
    for mode, r in pair.items():
        speed[mode] = speed_summary(r["rows"])
        speed[mode]["wall_s"] = r["wall_s"]
    if speed.get("sync", {}).get("tokens_per_s") and speed.get("async", {}).get("tokens_per_s"):
        speed["speedup"] = speed["async"]["tokens_per_s"] / speed["sync"]["tokens_per_s"]
    res["speed"] = speed
    plot_speed(speed, os.path.join(args.out, "speed.png"))
    write_report(args.out, res, t0)


def run_learning(args, res: dict, place: list[str], gpu: bool, budget: Deadline, skipped: dict, t0: float) -> None:
    """Held-out accuracy curves, sync vs async: grpo_tiny and, when given, a learning recipe."""
    learns = [("grpo_tiny", "grpo_tiny", [*TINY_LEARN, *SPLIT, *place, f"trainer.total_steps={args.learn_steps}",
                                          "trainer.test_freq=2"], 150.0 if gpu else 120.0)] if args.learn_steps else []
    if args.recipe:
        learns.append((args.recipe, args.recipe, [*SPLIT, *place, *args.recipe_overrides.split(),
                                                  f"trainer.total_steps={args.recipe_steps}"], 180.0))
    for name, config, ov, est in learns:
        pair = run_pair(args.out, f"learn_{name}", config, ov, est, budget, skipped)
        curves = {m: learning_curve(r["rows"]) for m, r in pair.items() if r["rows"]}
        entry = {"overrides": ov, "curves": curves,
                 "wall_s": {m: r["wall_s"] for m, r in pair.items()},
                 "max_staleness_seen": max((row.get("rollout/staleness_max", 0) for r in pair.values()
                                            for row in r["rows"]), default=0)}
        if {"sync", "async"} <= set(curves):
            entry["compare"] = compare_learning(curves["sync"], curves["async"])
            plot_learning(name, curves, os.path.join(args.out, f"learning_{name}.png"))
        res["learning"][name] = entry
        write_report(args.out, res, t0)


def write_report(out: str, res: dict, t0: float) -> str:
    """bench_async.json and bench_async.md with what is measured so far (rewritten after each pair of runs)."""
    res["total_s"] = time.time() - t0
    md = to_markdown(res)
    write_files(out, "bench_async", res, md)
    return md


if __name__ == "__main__":
    main()
