"""Issue 59's GPU runs on one 4 x H200 host: Qwen3-8B and the whole Qwen3-30B-A3B (48 layers, 128 experts, EP=4),
random init made by the actor's own ranks (model.init=engine), GRPO colocated with vLLM at 256 x (512 + 1024) tokens
(32 prompts of 511 digits x 8 samples, up to 1,024 response tokens; a random model never stops early). One run per
device call, unattended: the whole command stays under --deadline (540 s by default: a device call is 600 s), and what
it has is on disk after every step, so a run cut short keeps its steps. Writes under --out (at most 6 files):

  scale_runs.json / .md      the step table, tokens/s/GPU, the update's MFU on active parameters, memory per GPU
                             (the allocator's and nvidia-smi's) against the plan, the mismatch with replay on and off,
                             the weight sync per step; a failed run keeps its log's tail and each process's last lines
  <run>_metrics.jsonl        the trainer's rows
  <run>_run.log              the trainer's log (its last 4 MiB)
  results/<area>.jsonl       the run's row (the moe table for the 30B, placements for the 8B) with the plan's numbers
                             beside the measured ones (--results; default --out/results): `python
                             tools/harness/results.py merge` takes it into tools/results/

  python tools/scale_runs.py --plan                 # no GPU: each run's plan as a row of its table (committed first)
  export PYTHONPATH=/tmp/site:$PWD; python tools/scale_runs.py --out $OUT --results $OUT/results --runs qwen3_8b

Runs:
  qwen3_8b        actor DP=4 (sharded optimizer), no recompute, 8,192-token micro-batches, one vLLM engine per GPU
  qwen3_30b_a3b   actor EP=4 x DP=4 (dense state sharded over 4, experts 32 a rank), full recompute, 8,192-token
                  micro-batches, one optimizer step a step, vLLM TP=4 beside the actor's ~102 GiB of weights and
                  optimizer state: a fixed 6 GiB KV cache (262k tokens; not sized by vLLM's profiling, which other
                  tensors of the process upset) and rollout.gpu_memory_utilization=0.15 (vLLM's start check of the free
                  memory); routing replay on, the old log-probs also computed without it
                  (actor.moe_routing_replay_compare: the mismatch both ways on the same samples); the experts' weight
                  sync through vLLM's loader for the first two syncs (the push before step 1 checks vLLM's fused
                  layout; step 1's times the loader), then written straight into its fused tensors, the first direct
                  write checked against what vLLM holds after it (rollout.direct_expert_sync_after=2: steps 2-4)
  qwen3_8b_offload  (optional) qwen3_8b with actor.offload_while_rollout=true: the copies' seconds and what the
                  generation phase frees
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness.procs import dump_stacks, log_checks, process_tails, ray_worker_pids
from harness import md_table, report_header, run_rows, write_report
from harness import log as harness_log
from harness import results as tables
from harness import run_trainer as run_trainer_child

DATA = "scale_prompts.jsonl"
DEVICE = "h200x4"
GPUS = 4
H200_GIB = 139.8
# trainer.plan_check=warn: the run is the plan's test; a plan that says no must not stop it
COMMON = ["model=qwen3_0.6b_random", "model.init=engine", "trainer.device=cuda", "trainer.use_ray=true",
          "trainer.n_gpus_per_node=4", "trainer.logger=[console,jsonl]", "trainer.progress_bar=false",
          "trainer.plots=false", "trainer.plan_check=warn", "trainer.test_freq=-1", "trainer.val_before_train=false",
          "trainer.save_freq=-1",
          "trainer.fused_linear_logprob_backend=auto", "trainer.export_hf_on_end=false", "rollout=vllm",
          "rollout.n=8", "rollout.max_response_length=1024", "data.source=file", "data.apply_chat_template=false",
          "data.max_prompt_length=512", "data.train_batch_size=32", "reward.fn=gsm8k", "actor.ppo_mini_batch_size=16",
          "actor.lr=1e-6", "actor.use_kl_loss=false"]
RUNS = {
    "qwen3_8b": ["model.builtin=qwen3-8b", "rollout.tensor_parallel_size=1", "actor.recompute_activations=false",
                 "actor.max_tokens_per_micro_batch=8192", "trainer.total_steps=6"],
    "qwen3_30b_a3b": ["model.builtin=qwen3-30b-a3b", "actor.expert_parallel_size=4", "rollout.tensor_parallel_size=4",
                      "rollout.gpu_memory_utilization=0.15", "rollout.kv_cache_memory_gb=6",
                      "actor.recompute_activations=true",
                      "actor.max_tokens_per_micro_batch=8192", "actor.ppo_mini_batch_size=32",
                      "actor.moe_routing_replay=true", "actor.moe_routing_replay_compare=true",
                      "rollout.direct_expert_sync_after=2", "trainer.total_steps=4"],
    # optional, if the session's GPU time allows: the 8B run with its state on the host while vLLM generates
    "qwen3_8b_offload": ["model.builtin=qwen3-8b", "rollout.tensor_parallel_size=1",
                         "actor.recompute_activations=false", "actor.max_tokens_per_micro_batch=8192",
                         "actor.offload_while_rollout=true",
                         "trainer.total_steps=5"],
}
SHAPE = {"qwen3_8b": "qwen3-8b", "qwen3_30b_a3b": "qwen3-30b-a3b", "qwen3_8b_offload": "qwen3-8b"}
AREA = {"qwen3_8b": "placements", "qwen3_30b_a3b": "moe", "qwen3_8b_offload": "placements"}
TOOL = "scale_runs"
PHASES = ["gen", "rollout_sleep", "old_log_prob", "old_log_prob_no_replay", "update_actor", "rollout_wake",
          "update_weights"]  # timing_s/<phase>; the table's step_s is timing_s/step
# Every process on the GPU machine (NVLink multicast off; vLLM's TP all-reduce on plain NCCL); set here too, so a
# command line that forgot one still runs safely.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
           "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
LOG_KEEP_BYTES = 4 << 20


def log(msg: str) -> None:
    harness_log(TOOL, msg)


def write_prompts(path: str, n: int = 256, length: int = 511, seed: int = 0) -> None:
    """n prompts of `length` random digits (the character tokenizer: one token each; the model adds none)."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": "".join(rng.choice("0123456789") for _ in range(length)),
                                "answer": str(i % 10)}) + "\n")


def overrides(name: str, data: str) -> list[str]:
    return [*COMMON, f"data.train_files=[{data}]", *RUNS[name]]


def plan(name: str, data: str, gib: float = H200_GIB) -> dict:
    """The planner's JSON for run `name` on GPUs of `gib`: `python -m rltrain.plan --json`, as a user runs it."""
    cmd = [sys.executable, "-m", "rltrain.plan", "--config-name", "grpo_tiny", *overrides(name, data), "--device",
           "h200", "--gpu-memory-gib", str(gib), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         timeout=120)
    return json.loads(out.stdout)


def plan_metrics(predicted: dict) -> dict[str, float]:
    """The plan's numbers a run is compared with: each phase's seconds, the peak per GPU (GiB on the device, and the
    allocator's max_memory_allocated the run logs), whether it fits."""
    out = {f"plan/{k.replace(' ', '_').replace('-', '_')}_s": round(v, 4)
           for k, v in predicted["phase_seconds"].items() if "/" not in k}
    out["plan/peak_gib"] = round(predicted["peak_gib"], 3)
    out["plan/allocator_peak_gib"] = round(max(g["allocator_peak_gib"] for g in predicted["gpus"]), 3)
    out["plan/fits"] = float(bool(predicted["fits"]))
    return out


def plan_row(name: str, predicted: dict, date: str) -> dict:
    """Run `name`'s plan as a row of its table (variant `<name> plan`), committed before the run."""
    return tables.row(TOOL, SHAPE[name], DEVICE, f"{name} plan", plan_metrics(predicted), date=date,
                      config=[*COMMON, *RUNS[name]], note="python tools/scale_runs.py --plan (python -m rltrain.plan "
                      f"--json): {predicted['summary'].split(' at H200 rates')[0]}")


def committed_plan(name: str) -> dict[str, float] | None:
    """Run `name`'s plan as committed before the run (its `<name> plan` row in tools/results/), None if absent."""
    for r in tables.read(AREA[name]):
        if (r["tool"], r["device"], r["variant"]) == (TOOL, DEVICE, f"{name} plan"):
            return r["metrics"]
    return None


def summary(name: str, rows: list[dict], planned: dict[str, float] | None) -> dict:
    """The step table and the run's numbers (steps 2.. are steady: the first compiles and allocates)."""
    from rltrain.config.presets import BUILTINS
    from rltrain.utils import flops

    cfg = argparse.Namespace(**dict(BUILTINS[SHAPE[name]]))
    steps = [r for r in rows if r.get("step", 0) >= 1 and "timing_s/step" in r]
    table = [{"step": r["step"], "step_s": r["timing_s/step"], **{p: r.get(f"timing_s/{p}") for p in PHASES},
              "tokens": r.get("perf/total_num_tokens"), "response_len": r.get("response_length/mean"),
              "mismatch": r.get("rollout/mismatch_abs_mean"),
              "mismatch_no_replay": r.get("rollout/no_replay/mismatch_abs_mean"),
              "diff_max": r.get("rollout/logprob_diff_max"),
              "diff_max_no_replay": r.get("rollout/no_replay/logprob_diff_max")} for r in steps]
    out: dict = {"steps": table}
    steady = steps[1:] or steps
    if steady:
        tok = sum(r["perf/total_num_tokens"] for r in steady) / len(steady)
        step_s = sum(r["timing_s/step"] for r in steady) / len(steady)
        upd = sum(r["timing_s/update_actor"] for r in steady) / len(steady)
        model_flops = flops.train_flops(cfg, tok, tok / (32 * 8))  # forward + backward on the active parameters
        out.update(steady_steps=[r["step"] for r in steady], tokens_per_s_per_gpu=tok / step_s / GPUS, step_s=step_s,
                   update_s=upd, update_mfu=model_flops / (upd * GPUS * flops.peak_flops("H200")),
                   weight_sync_s=[r.get("timing_s/update_weights") for r in steps])
        for k, label in (("rollout/mismatch_abs_mean", "mismatch"), ("rollout/no_replay/mismatch_abs_mean",
                                                                      "mismatch_no_replay")):
            vals = [r[k] for r in steps if k in r]
            if vals:
                out[label] = sum(vals) / len(vals)
        out["peak_gib_per_gpu"] = {k.split("/")[-1]: max(r.get(k, 0.0) for r in steps) for k in sorted(steps[-1])
                                   if k.startswith("perf/max_memory_allocated_gb/")}
    if planned is not None:
        out["planned"] = planned
    return out


def measured_row(name: str, s: dict, date: str, note: str) -> dict | None:
    """The run's row for its table: the steady steps' means, the peaks, the mismatch, the plan beside (None before
    a step)."""
    if "step_s" not in s:
        return None
    m = {k: s[k] for k in ("step_s", "update_s", "tokens_per_s_per_gpu", "update_mfu", "mismatch",
                           "mismatch_no_replay") if k in s}
    for p in PHASES:
        vals = [r[p] for r in s["steps"] if r.get("step") in s["steady_steps"] and r.get(p) is not None]
        if vals:
            m[f"timing_s/{p}"] = sum(vals) / len(vals)
    syncs = [x for x in s.get("weight_sync_s", []) if x is not None]
    if syncs:
        m["weight_sync_s/last"] = syncs[-1]
    if s.get("peak_gib_per_gpu"):
        m["allocator_peak_gib"] = max(s["peak_gib_per_gpu"].values())
    if s.get("nvidia_smi_peak_gib"):
        m["nvidia_smi_peak_gib"] = max(s["nvidia_smi_peak_gib"])
    planned = s.get("planned", {})
    m.update(planned)
    if "plan/step_s" in planned and planned["plan/step_s"]:
        m["step_s/error_pct"] = round(100 * (s["step_s"] / planned["plan/step_s"] - 1), 2)
    if "allocator_peak_gib" in m and planned.get("plan/allocator_peak_gib"):
        m["allocator_peak_gib/error_pct"] = round(100 * (planned["plan/allocator_peak_gib"] / m["allocator_peak_gib"]
                                                         - 1), 2)
    m["steps"] = len(s["steps"])
    return tables.row(TOOL, SHAPE[name], DEVICE, name, {k: round(v, 5) if isinstance(v, float) else v
                                                        for k, v in m.items()}, date=date,
                      config=[*COMMON, *RUNS[name]], note=note)


def gpu_used_gib() -> list[float]:
    """nvidia-smi's memory.used per GPU (every process's: vLLM's pool and NCCL's buffers too); [] without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return [round(float(x) / 1024, 2) for x in out.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


def gpu_names() -> str | None:
    """`4 x NVIDIA H200` from nvidia-smi (None without it): the report's device, without a CUDA context in this
    process (torch's would hold half a GiB of GPU 0 beside the run)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out if n.strip()]
    return f"{len(names)} x {names[0]}" if names else None


def copy_tail(src: str, dst: str, keep: int = LOG_KEEP_BYTES) -> None:
    if not os.path.exists(src):
        return
    with open(src, "rb") as f:
        f.seek(max(0, os.path.getsize(src) - keep))
        data = f.read()
    with open(dst + ".tmp", "wb") as f:
        f.write(data)
    os.replace(dst + ".tmp", dst)


class Progress:
    """What a run has so far, written out after every step (and the log every 30 s): a run stopped by the deadline
    or by the device call's limit still leaves its steps, its memory samples and its log."""

    def __init__(self, name: str, run_dir: str, args, res: dict, planned: dict[str, float] | None):
        self.name, self.run_dir, self.args, self.res, self.planned = name, run_dir, args, res, planned
        self.t0, self.step, self.last_log = time.time(), None, 0.0  # the first poll writes the report
        self.smi_peak: list[float] = []
        self.smi_samples: list[list[float]] = []
        self.entry: dict = {"rc": None, "seconds": 0.0, "timed_out": False}
        res["runs"][name] = self.entry

    def sample(self) -> None:
        used = gpu_used_gib()
        if used:
            self.smi_peak = [max(a, b) for a, b in zip(self.smi_peak, used)] if self.smi_peak else used
            if not self.smi_samples or time.time() - self.smi_samples[-1][0] - self.t0 >= 15:
                self.smi_samples.append([round(time.time() - self.t0, 1), *used])

    def poll(self, _n: str = "") -> None:
        self.sample()
        rows = run_rows(self.run_dir)
        step = max((r.get("step", -1) for r in rows), default=-1)
        if time.time() - self.last_log >= 30:
            self.last_log = time.time()
            copy_tail(os.path.join(self.run_dir, "run.log"), os.path.join(self.args.out, f"{self.name}_run.log"))
        if step != self.step:
            self.step = step
            log(f"{self.name}: step {step} after {time.time() - self.t0:.0f} s; GPUs hold {self.smi_peak} GiB at most")
            self.write(rows)

    def write(self, rows: list[dict], final: bool = False) -> None:
        if os.path.exists(os.path.join(self.run_dir, "metrics.jsonl")):
            shutil.copyfile(os.path.join(self.run_dir, "metrics.jsonl"),
                            os.path.join(self.args.out, f"{self.name}_metrics.jsonl"))
        s = summary(self.name, rows, self.planned)
        s.update(nvidia_smi_peak_gib=self.smi_peak, nvidia_smi_samples=self.smi_samples)
        self.entry.update(seconds=round(time.time() - self.t0, 1), summary=s)
        write_report(self.args.out, TOOL, self.res, to_markdown(self.res))
        e = self.entry
        note = ((f"rc {e['rc']}" + (", stopped at the deadline" if e["timed_out"] else "")) if final
                else f"partial: written at step {self.step} while it ran")
        row = measured_row(self.name, s, self.res["date"], note + "; data: tools/scale_runs.py's prompts")
        if row is not None:
            tables.upsert(AREA[self.name], [row], self.args.results)


def stop_leftovers() -> int:
    """Kill this machine's rltrain Ray workers still alive after a run (a run cut at the deadline); they hold the
    GPUs the next run needs. Returns how many."""
    pids = ray_worker_pids()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(pids)


def run(name: str, data: str, args, res: dict, planned: dict[str, float] | None, timeout_s: float) -> dict:
    run_dir = os.path.join(tempfile.mkdtemp(prefix=f"scale-{name}-"), "run")  # not under --out: it has many files
    prog = Progress(name, run_dir, args, res, planned)

    def over(_n: str, proc) -> None:
        log(f"{name}: over {timeout_s:.0f} s: stacks of {dump_stacks([proc.pid, *ray_worker_pids()])} processes "
            "asked for, then stopped (its steps so far are kept)")
        time.sleep(5)

    out = prog.entry
    try:
        r = run_trainer_child("grpo_tiny", overrides(name, data), run_dir, timeout_s=timeout_s, poll_s=5.0,
                              poll_every_s=0.0, on_poll=prog.poll, on_timeout=over, stop=((signal.SIGKILL, 20),),
                              env=GPU_ENV)
        out.update(rc=r["rc"], timed_out=r["timed_out"], command=" ".join(r["command"][1:]))
    finally:
        killed = stop_leftovers()
        if killed:
            log(f"{name}: {killed} Ray workers outlived the run; killed")
        log_path = os.path.join(run_dir, "run.log")
        text = ""
        if os.path.exists(log_path):
            with open(log_path, errors="replace") as f:
                text = f.read()
        copy_tail(log_path, os.path.join(args.out, f"{name}_run.log"))
        out.update(log_checks=log_checks(text), leftover_workers=killed,
                   log_lines=[ln[:400] for ln in text.splitlines() if "rltrain:" in ln][-40:],  # Ray prefixes workers'
                   expert_sync_lines=[ln[:400] for ln in text.splitlines() if "expert weights" in ln][:8])
        if out.get("rc") != 0:
            out.update(log_tail=text[-3000:], process_tails=process_tails(text))
        prog.write(run_rows(run_dir), final=True)
    return out


def to_markdown(res: dict) -> str:
    lines = [f"# Issue 59's runs ({res['date']}, {res['device']}, torch {res['torch']})", "", f"`{res['command']}`", ""]
    for name, r in res["runs"].items():
        s = r.get("summary", {})
        lines += [f"## {name}: rc {r.get('rc')}, {r.get('seconds', 0):.0f} s", ""]
        if s.get("steps"):
            cols = ["step", "step_s", *PHASES, "tokens", "mismatch", "mismatch_no_replay", "diff_max",
                    "diff_max_no_replay"]
            lines += [md_table(cols, [[("-" if row.get(c) is None else f"{row[c]:.4g}") for c in cols]
                                      for row in s["steps"]]), ""]
        for k in ("tokens_per_s_per_gpu", "step_s", "update_s", "update_mfu", "mismatch", "mismatch_no_replay"):
            if k in s:
                lines.append(f"- {k}: {s[k]:.4g}")
        for k in ("weight_sync_s", "peak_gib_per_gpu", "nvidia_smi_peak_gib", "planned"):
            if k in s:
                lines.append(f"- {k}: {json.dumps(s[k])}")
        lines += [f"- {ln}" for ln in r.get("expert_sync_lines", [])]
        if r.get("rc"):
            lines += ["", "```", r.get("log_tail", "")[-1500:], "```"]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where the report, metrics and log go (required unless --plan)")
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=["qwen3_8b", "qwen3_30b_a3b"])
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds for the whole command; the last run is stopped in time to write its results")
    ap.add_argument("--plan", action="store_true", help="no GPU: upsert each run's plan (variant '<run> plan')")
    tables.add_arguments(ap, "each run's row (the plan's with --plan)")
    args = ap.parse_args()
    data = os.path.join(tempfile.mkdtemp(prefix="scale-runs-"), DATA)  # not under --out: only results come back
    write_prompts(data)
    date = datetime.date.today().isoformat()
    if args.plan:
        for name in args.runs:
            predicted = plan(name, data)
            tables.upsert(AREA[name], [plan_row(name, predicted, date)], args.results)
            log(f"{name}: {predicted['summary']}")
        return 0
    if not args.out:
        ap.error("--out is required (or --plan)")
    os.makedirs(args.out, exist_ok=True)
    if args.results == tables.DEFAULT_DIR:  # a run's rows stay under --out (a device machine's checkout does not return)
        args.results = os.path.join(args.out, "results")
    for k, v in GPU_ENV.items():
        os.environ.setdefault(k, v)
    res = {**report_header(TOOL, gpu_names()), "runs": {}}
    for name in args.runs:
        planned = committed_plan(name)  # the prediction committed before the run (no time spent planning here)
        if planned is None:
            log(f"{name}: no committed plan in tools/results/{AREA[name]}.jsonl (python tools/scale_runs.py --plan)")
        left = args.deadline - (time.time() - start) - 40  # a poll late, stacks (5 s), the kill (<= 20 s), the writes
        if left < 120:
            log(f"{name}: not started, {left:.0f} s left before the deadline")
            continue
        log(f"{name}: starting, {left:.0f} s at most ({' '.join(RUNS[name])})")
        r = run(name, data, args, res, planned, left)
        brief = {k: v for k, v in r.get("summary", {}).items() if k not in ("steps", "nvidia_smi_samples")}
        log(f"{name}: rc {r.get('rc')} after {r.get('seconds', 0):.0f} s; {json.dumps(brief)[:800]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
