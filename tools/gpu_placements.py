"""The GPU placement and scale driver. The placement matrix (default) on 2-8 GPUs: writes gpu_placements.json + .md
under --out, updated after every run (a timeout still leaves the rows done so far), progress on stdout. The scale runs
(--runs, --plan) on one 4 x H200 host: below.

  PYTHONPATH=/tmp/site python tools/gpu_placements.py --out $OUT            # all sections (--deadline cuts at 520 s)
  python tools/gpu_placements.py --out $OUT --only nccl learn               # a subset
  python tools/gpu_placements.py --out $OUT --only qwen06b --model qwen3-4b --engine vllm --qwen-steps 3 \
      --placements colocated_tp2dp2 split_2p2 --overrides actor.max_tokens_per_micro_batch=8192   # 4 GPUs (issue 35)
  python tools/gpu_placements.py --out $OUT --only learn qwen06b --placements split_1p1 --engine vllm
  python tools/gpu_placements.py --out $OUT --only learn qwen06b --placements colocated_tp2 --engine vllm
      # issue 21's two-GPU runs, one device call each (each took 2.5-5 min on two H200s, vLLM starts included):
      # split 1+1 (NCCL weight transfer) and colocated vLLM TP=2 with the actor at TP=2
  python tools/gpu_placements.py <the same arguments> --check 79.18         # no GPU: would each run be refused?
      # (trainer/setup.py's config check and trainer.plan_check for GPUs of 79.18 GiB: H100; 139.8: H200)

Placements (trainer.use_ray=true, hf rollout engine, one worker process per GPU):
  colocated_dp2   trainer.n_gpus_per_node=2                                  actor DP=2, 2 rollout replicas
  colocated_tp2   trainer.n_gpus_per_node=2 actor.tensor_parallel_size=2     actor TP=2, 2 rollout replicas
  split_1p1       trainer.n_gpus_per_node=1 trainer.colocate=false           train GPU + rollout GPU, sync via driver
  pp2             trainer.n_gpus_per_node=2 actor.pipeline_parallel_size=2   actor PP=2 (stages merged for sync)
Other GPU counts (issue 22's scaling points; name them with --placements on a machine that has the GPUs):
  single               1 GPU: actor + rollout colocated
  colocated_dp2_tp1    2 GPUs: colocated_dp2 with --engine vllm at TP=1: one engine per GPU (issue 35)
  colocated_dp4_tp1    4 GPUs: actor DP=4, --engine vllm at TP=1: one engine per GPU
  colocated_tp2dp2     4 GPUs: actor TP=2 x DP=2 (--engine vllm: one vLLM engine at TP=4 over the 4)
  colocated_tp2dp2_r2  4 GPUs: the same actor, --engine vllm: two vLLM engines at TP=2 (docs/benchmarks/placements.md's layout)
  split_2p2            4 GPUs: actor TP=2 on 2, the rollout on the other 2 (--engine vllm: one engine at TP=2)
  colocated_tp2pp2dp2  8 GPUs: actor TP=2 x PP=2 x DP=2
Sections:
  nccl     all-reduce and broadcast bus bandwidth between --nccl-ranks GPUs (1 MiB .. 1 GiB), with each process
           seeing only its own GPU (as Ray workers do) and with both visible; NCCL's chosen transport.
  learn    grpo_tiny to the end in every placement: held-out accuracy before/after (done when it rises >= 0.3).
  qwen06b  GRPO steps of a Qwen3-0.6B-shaped model (--model: another preset's shape; random init, KL loss so the reference role is there, fused
           Triton head; as tools/gpu_smoke.py builds it) per placement: phase times, peak memory per GPU.
  roles    tiny PPO (GAE critic + KL reference + actor + rollout), one step per placement: every role runs.
One local Ray cluster (127.0.0.1) is started here and every run joins it (trainer.ray_address).
--engine vllm: rollout=vllm in every run; vLLM's tensor parallel size is the group's GPU count (colocated, its TP
group is the trainer's ranks; split, the rollout group's, one engine), except colocated_dp2_tp1 (one engine per
GPU). On a GPU each run's row carries `host_probe`: harness/probes.py's host facts and CPU probes, and a series of
16 pure-Python probes 0.3 s apart with the share that read slow, taken just before the run (the host's speed, for
docs/benchmarks/planner.md). Every run's log is checked: a line naming
`mnnvl` (NVLink multicast) fails the row; whether vLLM said `Using ['PYNCCL'] all-reduce backends` is recorded.
A run over --run-timeout is first asked for every process's Python stacks (SIGUSR1 to the driver and the Ray
workers, rltrain/utils/stacks.py), then killed; a failed run's row keeps each process's last 40 log lines
(`process_tails`): where each rank waited.
Scale runs (--runs NAME..., one run per device call; --plan: no GPU, each run's plan upserted as the row
`<run> plan` of its table, committed before the run): GRPO colocated with vLLM at 256 x (512 + 1024) tokens (32 prompts
of 511 random digits x 8 samples; a random model never stops early), random init made by the actor's own ranks
(model.init=engine). The command stays under --deadline (540 s) and writes after every step under --out: scale_runs.json
/ .md (the step table, tokens/s/GPU, the update's MFU on active parameters, memory per GPU, the allocator's and
nvidia-smi's, against the plan, the mismatch with replay on and off, the weight sync per step), <run>_metrics.jsonl,
<run>_run.log (its last 4 MiB) and results/<area>.jsonl (the row beside the plan's; `python tools/harness/results.py
merge` takes it in).
  qwen3_8b          actor DP=4 (sharded optimizer), no recompute, 8,192-token micro-batches, one vLLM engine per GPU
  qwen3_30b_a3b     actor EP=4 x DP=4, full recompute, vLLM TP=4 beside the actor's ~102 GiB with a fixed 6 GiB KV
                    cache and rollout.gpu_memory_utilization=0.15; routing replay on, the old log-probs also computed
                    without it (the mismatch both ways); the experts' sync through vLLM's loader for two syncs, then
                    written into its fused tensors (rollout.direct_expert_sync_after=2)
  qwen3_8b_offload  qwen3_8b with actor.offload_while_rollout=true
  python tools/gpu_placements.py --plan
  export PYTHONPATH=/tmp/site:$PWD; python tools/gpu_placements.py --out $OUT --results $OUT/results --runs qwen3_8b
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
from harness import log as harness_log
from harness import Deadline, device_name, md_table, report_header, run_rows, write_report
from harness.procs import dump_stacks, log_checks, process_tails, ray_worker_pids
from harness import results as tables
from harness.runs import step_row
from harness import run_trainer as run_trainer_child
from harness.cases import GRPO_06B_OVERRIDES

from rltrain.rollout.vllm import TP_MIN_HEAD_DIM  # the head_dim rule of vLLM TP > 1 on GPUs
from rltrain.workers.base import free_port

PLACEMENTS = {
    "colocated_dp2": ["trainer.n_gpus_per_node=2"],
    "colocated_dp2_tp1": ["trainer.n_gpus_per_node=2"],
    "colocated_tp2": ["trainer.n_gpus_per_node=2", "actor.tensor_parallel_size=2"],
    "split_1p1": ["trainer.n_gpus_per_node=1", "trainer.colocate=false"],
    "pp2": ["trainer.n_gpus_per_node=2", "actor.pipeline_parallel_size=2"],
    "single": ["trainer.n_gpus_per_node=1"],
    "split_2p2": ["trainer.n_gpus_per_node=2", "actor.tensor_parallel_size=2", "trainer.colocate=false"],
    "colocated_dp4_tp1": ["trainer.n_gpus_per_node=4"],
    "colocated_tp2dp2": ["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=2"],
    "colocated_tp2dp2_r2": ["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=2"],
    "colocated_tp2pp2dp2": ["trainer.n_gpus_per_node=8", "actor.tensor_parallel_size=2",
                            "actor.pipeline_parallel_size=2"],
}
TWO_GPUS = ["colocated_dp2", "colocated_tp2", "split_1p1", "pp2"]  # the default matrix
# --engine vllm: these placements' engines span this many GPUs each; any other placement's one engine, its group
ROLLOUT_TP = {"colocated_dp2_tp1": 1, "colocated_dp4_tp1": 1, "colocated_tp2dp2_r2": 2}
GPU = ["trainer.use_ray=true", "trainer.progress_bar=false", "trainer.plots=false",
       "trainer.logger=[console,jsonl]", "trainer.fused_linear_logprob_backend=auto"]
# harness/cases.py's Qwen3-0.6B GRPO run; the device and GPU count are the run's and the placement's
QWEN06B = [o for o in GRPO_06B_OVERRIDES if not o.startswith(("trainer.device=", "trainer.n_gpus_per_node="))]
QWEN06B.append("trainer.val_before_train=false")
ROLES = ["algorithm=gae", "actor.use_kl_loss=true", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "rollout.n=1", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.lr=1e-3"]
PHASES = ["gen", "gen_engine", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights",
          "step"]


def engine_overrides(engine: str, placement: str, tiny: bool = False) -> list[str]:
    """The rollout overrides of one run: vLLM's TP group is a whole worker group (ROLLOUT_TP: smaller engines):
    colocated, the trainer's group (or engines of ROLLOUT_TP workers each); split, the rollout group (as many GPUs
    as the training group, so one replica: placement.py refuses split vLLM with two replicas).
    `tiny` (grpo_tiny's model, head_dim 16): with vLLM TP > 1 the model gets the smallest head_dim such an engine
    starts with on GPUs (rollout/vllm.py: TP_MIN_HEAD_DIM; the config refuses 16)."""
    if engine == "hf":
        return []
    over = PLACEMENTS[placement]
    tp = ROLLOUT_TP.get(placement) or next(int(o.split("=")[1]) for o in over
                                           if o.startswith("trainer.n_gpus_per_node="))
    extra = [f"+model.overrides.head_dim={TP_MIN_HEAD_DIM}"] if tiny and tp > 1 else []
    return ["rollout=vllm", f"rollout.tensor_parallel_size={tp}", *extra]


def run_timeout_s(args: argparse.Namespace, sec: str) -> float:
    """--run-timeout, or by the run's model: 240 s, 480 s for a qwen06b run at a larger shape (a fresh machine took
    166-244 s before vLLM's first line for the 4B, 2026-11-26: docs/benchmarks/placements.md)."""
    if args.run_timeout is not None:
        return args.run_timeout
    return 480.0 if sec == "qwen06b" and args.model != "qwen3-0.6b" else 240.0


def run_overrides(sec: str, name: str, args: argparse.Namespace) -> list[str]:
    """The Hydra overrides of section `sec`'s run in placement `name` (after run_trainer's device and GPU ones)."""
    if sec == "learn":
        over = [*PLACEMENTS[name], f"trainer.total_steps={args.learn_steps}",
                f"trainer.test_freq={max(1, args.learn_steps // 2)}"]
    elif sec == "qwen06b":
        over = [*QWEN06B, f"model.builtin={args.model}", *PLACEMENTS[name], f"trainer.total_steps={args.qwen_steps}"]
    else:
        over = [*ROLES, *PLACEMENTS[name], "trainer.total_steps=1"]
    over += engine_overrides(args.engine, name, tiny=(sec != "qwen06b"))
    keys = {o.split("=", 1)[0] for o in args.overrides}
    return [o for o in over if o.split("=", 1)[0] not in keys] + list(args.overrides)


def check_runs(args: argparse.Namespace, gpu_memory_gib: float) -> list[dict]:
    """--check: every run's config through the trainer's own checks (rltrain/trainer/setup.py check_config, CUDA
    taken as visible) and its trainer.plan_check at `gpu_memory_gib`, here, starting nothing: a refusal costs no
    device time. One row per run: its overrides, the refusal (or None) and the plan's JSON (rltrain.plan)."""
    from unittest import mock

    from rltrain.config.entry import compose_config
    from rltrain.plan import make_plan
    from rltrain.plan.report import to_json
    from rltrain.data.lengths import data_lengths
    from rltrain.trainer.setup import check_config
    from rltrain.utils.errors import find_user_error

    rows = []
    for sec in (s for s in ("learn", "qwen06b", "roles") if s in args.only):
        for name in args.placements:
            over = ["trainer.device=cuda", *GPU, *run_overrides(sec, name, args)]
            row: dict = {"run": f"{sec}/{name}", "overrides": over, "error": None, "plan": None}
            try:
                cfg = compose_config("grpo_tiny", over)
                with mock.patch("torch.cuda.is_available", return_value=True):
                    check_config(cfg)
                plan = make_plan(cfg, gpu_memory_gib=gpu_memory_gib, prompts=data_lengths(cfg))
                row["plan"] = to_json(plan)
                if not plan.fits and cfg.trainer.plan_check == "error":
                    row["error"] = "trainer.plan_check refuses it: " + plan.refusal()
            except Exception as err:  # noqa: BLE001 - a refusal is the result
                row["error"] = str(find_user_error(err) or f"{type(err).__name__}: {err}")
            rows.append(row)
    return rows


TOOL = "gpu_placements"


def log(msg: str) -> None:
    harness_log(TOOL, msg)


def stacks_then_stop(name: str, timeout_s: float):
    """A run's on_timeout: every process's Python stacks asked for (SIGUSR1 to the driver and the Ray workers), a
    few seconds for Ray's log streaming to bring them, then the run tool's stop signals."""
    def over(_name: str, proc) -> None:
        dumped = dump_stacks([proc.pid, *ray_worker_pids()])
        log(f"{name}: over {timeout_s:.0f} s: Python stacks of {dumped} processes asked for, then stopped")
        time.sleep(5)
    return over


# --------------------------------------------------------------------------- nccl
def _nccl_child(rank: int, world: int, mode: str, port: int, sizes_mib: list[int], out_path: str) -> None:
    if mode == "isolated":  # as a Ray worker: only its own GPU is visible, ordinal 0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0 if mode == "isolated" else rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = []
    for mib in sizes_mib:
        x = torch.ones(mib << 18, dtype=torch.float32, device="cuda")  # mib MiB of fp32
        for op in ("all_reduce", "broadcast"):
            fn = (lambda: dist.all_reduce(x)) if op == "all_reduce" else (lambda: dist.broadcast(x, src=0))
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            iters = 20 if mib <= 64 else 5
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / iters
            # bus bandwidth (nccl-tests' definition): all-reduce moves 2(n-1)/n of the buffer, broadcast 1x
            factor = 2 * (world - 1) / world if op == "all_reduce" else 1.0
            res.append({"op": op, "mib": mib, "ms": dt * 1e3, "ranks": world,
                        "busbw_gbps": factor * (mib << 20) / dt / 1e9})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def section_nccl(out_dir: str, world: int = 2) -> dict:
    out: dict = {}
    for mode in ("isolated", "shared"):
        port = free_port()
        path = os.path.join(out_dir, f"nccl_{mode}.json")
        env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--nccl-child", str(r), str(world), mode,
                                   str(port), path], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        logs = [p.communicate(timeout=120)[0] for p in procs]
        transports = sorted({line.split(" via ", 1)[1].strip() for line in "".join(logs).splitlines()
                             if "Channel" in line and " via " in line})
        with open(path) as f:
            out[mode] = {"results": json.load(f), "transports": transports,
                         "rc": [p.returncode for p in procs]}
        best = max(r["busbw_gbps"] for r in out[mode]["results"] if r["op"] == "all_reduce")
        log(f"nccl {mode}: all-reduce bus bandwidth up to {best:.0f} GB/s via {transports}")
    return out


# --------------------------------------------------------------------------- trainer runs
def run_trainer(name: str, overrides: list[str], out_dir: str, ray_address: str, timeout_s: float,
                device: str = "cuda") -> dict:
    """One `python -m rltrain.main` run joining the cluster; progress from its metrics.jsonl."""
    run_dir = os.path.join(out_dir, "runs", name)
    last_seen, t0 = [-1], time.time()

    def poll(_name: str) -> None:
        rows = run_rows(run_dir)
        step = max((r["step"] for r in rows), default=-1)
        if step != last_seen[0]:
            last_seen[0] = step
            acc = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
            log(f"{name}: step {step} after {time.time() - t0:.0f} s" + (f", val acc {acc[-1]:.3f}" if acc else ""))

    over_rides = [f"trainer.device={device}", *GPU, *overrides, f"trainer.ray_address={ray_address}"]
    run = run_trainer_child("grpo_tiny", over_rides, run_dir, timeout_s=timeout_s, poll_s=5.0, poll_every_s=0.0,
                            on_poll=poll, on_timeout=stacks_then_stop(name, timeout_s), stop=((signal.SIGKILL, 30),))
    with open(os.path.join(run_dir, "run.log"), errors="replace") as f:
        text = f.read()
    checks = log_checks(text)
    if checks["mnnvl_lines"]:
        log(f"{name}: NVLink multicast (mnnvl) in the log: {checks['mnnvl_lines'][0]}")
    return {"rc": run["rc"], "seconds": run["wall_s"], "rows": run["rows"], "log_tail": text[-1500:],
            "process_tails": process_tails(text) if run["rc"] != 0 else {},
            "command": " ".join(run["command"][1:]), "log_checks": checks}


def _multicast(run: dict) -> bool:
    return bool(run.get("log_checks", {}).get("mnnvl_lines"))


def learn_summary(run: dict) -> dict:
    acc = [(r["step"], r["val/accuracy"]) for r in run["rows"] if "val/accuracy" in r]
    out = {k: run[k] for k in ("rc", "seconds", "command", "log_checks") if k in run}
    if acc:
        out.update(acc_before=acc[0][1], acc_after=acc[-1][1], curve=acc, gain=acc[-1][1] - acc[0][1],
                   learned=acc[-1][1] - acc[0][1] >= 0.3 and acc[0][0] == 0 and not _multicast(run))
    if run["rc"] != 0:
        out["log_tail"], out["process_tails"] = run["log_tail"], run.get("process_tails", {})
    return out


def step_summary(run: dict) -> dict:
    rows = [r for r in run["rows"] if r.get("step", 0) >= 1]
    # the first step compiles kernels and allocates optimizer state; colocated TP=2 still warms up in the second; a
    # step run under the profiler (trainer.profile_steps) is not timed with the others
    timed = [r for r in rows if not r.get("perf/profiled")]
    steady = (timed[2:] if len(timed) >= 4 else timed[1:]) or timed
    out = {k: run[k] for k in ("rc", "seconds", "command", "log_checks") if k in run}
    if _multicast(run):
        out["error"] = "NVLink multicast (mnnvl) in the log"
    out["steps"] = len(rows)
    if steady:
        out["timing_s"] = {p: sum(r.get(f"timing_s/{p}", 0.0) for r in steady) / len(steady) for p in PHASES
                           if any(f"timing_s/{p}" in r for r in steady)}
        out["throughput_tok_s"] = sum(r["perf/throughput"] for r in steady) / len(steady)
        out["peak_gib_per_gpu"] = {k.split("/")[-1]: max(r.get(k, 0.0) for r in rows) for k in sorted(rows[-1])
                                   if k.startswith("perf/max_memory_allocated_gb/")}
        out["logprob_diff_max"] = max(r["rollout/logprob_diff_max"] for r in rows)
        out["finite"] = all(v == v and abs(v) != float("inf") for r in rows for v in r.values() if isinstance(v, float))
    if run["rc"] != 0:
        out["log_tail"], out["process_tails"] = run["log_tail"], run.get("process_tails", {})
    return out


def table_row(sec: str, name: str, run: dict, over: list[str], args: argparse.Namespace) -> tuple[str, dict] | None:
    """A finished run as (area, results row): a GRPO step of the qwen06b section (scope "step": the steady steps'
    means and the memory counters, as tools/planlab reads them; an MoE model's in the moe table) or a learning run
    (held-out accuracy before and after); None for a run that failed or logged no step."""
    if run["rc"] != 0 or not run["rows"]:
        return None
    gpus = int(next((o.split("=", 1)[1] for o in reversed(over) if o.startswith("trainer.n_gpus_per_node=")), 1))
    device = tables.device_kind(device_name(), gpus) if args.device == "cuda" else "cpu"
    variant = name + (f" ({args.tag})" if args.tag else "")
    date = time.strftime("%Y-%m-%d")
    if sec == "learn":
        acc = [(r["step"], r["val/accuracy"]) for r in run["rows"] if "val/accuracy" in r]
        if not acc:
            return None
        m = {"acc_before": acc[0][1], "acc_after": acc[-1][1], "gain": acc[-1][1] - acc[0][1], "steps": acc[-1][0],
             "seconds": run["seconds"]}
        return "placements", tables.row(TOOL, "tiny", device, f"learn {variant}", m, date=date, config=over)
    timed = [r for r in run["rows"] if r.get("step", 0) >= 1 and not r.get("perf/profiled")]
    row = tables.row(TOOL, args.model, device, variant, step_row(timed, 2 if len(timed) >= 4 else 1),
                     date=date, config=over)
    row["scope"] = "step"
    return ("moe" if any(o.startswith("actor.expert_parallel_size=") and not o.endswith("=1") for o in over)
            else "placements"), row


# --------------------------------------------------------------------------- report
def to_markdown(res: dict) -> str:
    lines = [f"# Placement matrix ({res['date']}, {res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`", ""]
    if "nccl" in res and "error" not in res["nccl"]:
        rows = [(mode, ", ".join(v["transports"])[:40], op,
                 *(f"{bw.get(m, float('nan')):.1f}" for m in (1, 16, 256, 1024)))
                for mode, v in res["nccl"].items() for op in ("all_reduce", "broadcast")
                for bw in [{r["mib"]: r["busbw_gbps"] for r in v["results"] if r["op"] == op}]]
        lines += ["## NCCL between the GPUs (bus bandwidth, GB/s)", "",
                  md_table(["visibility", "transport", "op", "1 MiB", "16 MiB", "256 MiB", "1 GiB"], rows)]
        lines += ["", "isolated: each process sees only its own GPU (CUDA_VISIBLE_DEVICES, as Ray workers); "
                  "shared: both visible (torchrun).", ""]
    if res.get("learn"):
        rows = [(name, v["curve"][-1][0], f"{v['acc_before']:.3f}", f"{v['acc_after']:.3f}", f"{v['gain']:+.3f}",
                 v["learned"], f"{v['seconds']:.0f}") if "acc_before" in v else
                (name, "-", "-", "-", "-", v.get("skipped") or f"failed rc={v['rc']}", f"{v['seconds']:.0f}")
                for name, v in res["learn"].items()]
        lines += ["## grpo_tiny to the end under Ray (held-out greedy accuracy)", "",
                  md_table(["placement", "steps", "before", "after", "gain", "learned (>= +0.3)", "seconds"], rows), ""]
    for sec, title in (("qwen06b", "Qwen3-0.6B-shaped GRPO steps (KL loss: actor + reference + rollout)"),
                       ("roles", "tiny PPO: actor + reference + critic + rollout")):
        if not res.get(sec):
            continue
        phases = [p for p in PHASES if any(p in v.get("timing_s", {}) for v in res[sec].values())]
        rows = [(name, v.get("skipped") or "failed rc=" + str(v["rc"])) if "timing_s" not in v else
                (name, *(f"{v['timing_s'].get(p, 0.0):.2f}" for p in phases), f"{v['throughput_tok_s']:.0f}",
                 ", ".join(f"{k}: {g:.1f}" for k, g in v["peak_gib_per_gpu"].items()), f"{v['logprob_diff_max']:.2g}")
                for name, v in res[sec].items()]
        lines += [f"## {title}, mean s/step after the warm-up (steps 3.. when 4 or more ran, else 2..)", "",
                  md_table(["placement", *phases, "tok/s", "peak GiB per GPU (rank: GiB)", "logprob diff"], rows), ""]
    checked = [(f"{sec}/{name}", v["log_checks"]) for sec in ("learn", "qwen06b", "roles")
               for name, v in (res.get(sec) or {}).items() if "log_checks" in v]
    if checked:
        lines += ["Multi-GPU safety, from each run's log: "
                  + "; ".join(f"{run}: {'MNNVL FOUND' if c['mnnvl_lines'] else 'no mnnvl'}"
                              + (", PYNCCL all-reduce" if c["pynccl_all_reduce"] else "") for run, c in checked), ""]
    for k, v in res.get("errors", {}).items():
        lines.append(f"- {k} failed: {v[:300]}")
    return "\n".join(lines) + "\n"


def save(res: dict, out_dir: str) -> None:
    write_report(out_dir, TOOL, res, to_markdown(res))


# --------------------------------------------------------------------------- scale runs (--runs, --plan)
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
REPORT = "scale_runs"  # the report's file name under --out
SCALE_PHASES = ["gen", "rollout_sleep", "old_log_prob", "old_log_prob_no_replay", "update_actor", "rollout_wake",
          "update_weights"]  # timing_s/<phase>; the table's step_s is timing_s/step
# Every process on the GPU machine (NVLink multicast off; vLLM's TP all-reduce on plain NCCL); set here too, so a
# command line that forgot one still runs safely.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
           "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
LOG_KEEP_BYTES = 4 << 20


def write_prompts(path: str, n: int = 256, length: int = 511, seed: int = 0) -> None:
    """n prompts of `length` random digits (the character tokenizer: one token each; the model adds none)."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": "".join(rng.choice("0123456789") for _ in range(length)),
                                "answer": str(i % 10)}) + "\n")


def scale_overrides(name: str, data: str) -> list[str]:
    return [*COMMON, f"data.train_files=[{data}]", *RUNS[name]]


def scale_plan(name: str, data: str, gib: float = H200_GIB) -> dict:
    """The planner's JSON for run `name` on GPUs of `gib`: `python -m rltrain.plan --json`, as a user runs it."""
    cmd = [sys.executable, "-m", "rltrain.plan", "--config-name", "grpo_tiny", *scale_overrides(name, data), "--device",
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
                      config=[*COMMON, *RUNS[name]], note="python tools/gpu_placements.py --plan (python -m rltrain.plan "
                      f"--json): {predicted['summary'].split(' at H200 rates')[0]}")


def committed_plan(name: str) -> dict[str, float] | None:
    """Run `name`'s plan as committed before the run (its `<name> plan` row in tools/results/), None if absent."""
    for r in tables.read(AREA[name]):
        if (r["tool"], r["device"], r["variant"]) == (TOOL, DEVICE, f"{name} plan"):
            return r["metrics"]
    return None


def scale_summary(name: str, rows: list[dict], planned: dict[str, float] | None) -> dict:
    """The step table and the run's numbers (steps 2.. are steady: the first compiles and allocates)."""
    from rltrain.config.presets import BUILTINS
    from rltrain.utils import flops

    cfg = argparse.Namespace(**dict(BUILTINS[SHAPE[name]]))
    steps = [r for r in rows if r.get("step", 0) >= 1 and "timing_s/step" in r]
    table = [{"step": r["step"], "step_s": r["timing_s/step"], **{p: r.get(f"timing_s/{p}") for p in SCALE_PHASES},
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
    for p in SCALE_PHASES:
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
        s = scale_summary(self.name, rows, self.planned)
        s.update(nvidia_smi_peak_gib=self.smi_peak, nvidia_smi_samples=self.smi_samples)
        self.entry.update(seconds=round(time.time() - self.t0, 1), summary=s)
        write_report(self.args.out, REPORT, self.res, scale_markdown(self.res))
        e = self.entry
        note = ((f"rc {e['rc']}" + (", stopped at the deadline" if e["timed_out"] else "")) if final
                else f"partial: written at step {self.step} while it ran")
        row = measured_row(self.name, s, self.res["date"], note + "; data: tools/gpu_placements.py's scale prompts")
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


def run_scale(name: str, data: str, args, res: dict, planned: dict[str, float] | None, timeout_s: float) -> dict:
    run_dir = os.path.join(tempfile.mkdtemp(prefix=f"scale-{name}-"), "run")  # not under --out: it has many files
    prog = Progress(name, run_dir, args, res, planned)
    out = prog.entry
    try:
        r = run_trainer_child("grpo_tiny", scale_overrides(name, data), run_dir, timeout_s=timeout_s, poll_s=5.0,
                              poll_every_s=0.0, on_poll=prog.poll, on_timeout=stacks_then_stop(name, timeout_s),
                              stop=((signal.SIGKILL, 20),),
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


def scale_markdown(res: dict) -> str:
    lines = [f"# Scale runs ({res['date']}, {res['device']}, torch {res['torch']})", "", f"`{res['command']}`", ""]
    for name, r in res["runs"].items():
        s = r.get("summary", {})
        lines += [f"## {name}: rc {r.get('rc')}, {r.get('seconds', 0):.0f} s", ""]
        if s.get("steps"):
            cols = ["step", "step_s", *SCALE_PHASES, "tokens", "mismatch", "mismatch_no_replay", "diff_max",
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


def main_scale(args: argparse.Namespace) -> int:
    """--runs / --plan: the scale runs, one after the other, within --deadline (540 s by default)."""
    start, deadline = time.time(), args.deadline or 540.0
    data = os.path.join(tempfile.mkdtemp(prefix="scale-runs-"), DATA)  # not under --out: only results come back
    write_prompts(data)
    date = datetime.date.today().isoformat()
    if args.plan:
        for name in args.runs:
            predicted = scale_plan(name, data)
            tables.upsert(AREA[name], [plan_row(name, predicted, date)], args.results)
            log(f"{name}: {predicted['summary']}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.results == tables.DEFAULT_DIR:  # a run's rows stay under --out (a device machine's checkout does not return)
        args.results = os.path.join(args.out, "results")
    for k, v in GPU_ENV.items():
        os.environ.setdefault(k, v)
    res = {**report_header(TOOL, gpu_names()), "runs": {}}
    for name in args.runs:
        planned = committed_plan(name)  # the prediction committed before the run (no time spent planning here)
        if planned is None:
            log(f"{name}: no committed plan in tools/results/{AREA[name]}.jsonl (python tools/gpu_placements.py --plan)")
        left = deadline - (time.time() - start) - 40  # a poll late, stacks (5 s), the kill (<= 20 s), the writes
        if left < 120:
            log(f"{name}: not started, {left:.0f} s left before the deadline")
            continue
        log(f"{name}: starting, {left:.0f} s at most ({' '.join(RUNS[name])})")
        r = run_scale(name, data, args, res, planned, left)
        brief = {k: v for k, v in r.get("summary", {}).items() if k not in ("steps", "nvidia_smi_samples")}
        log(f"{name}: rc {r.get('rc')} after {r.get('seconds', 0):.0f} s; {json.dumps(brief)[:800]}")
    return 0


# --------------------------------------------------------------------------- the command
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_placements_out"))
    ap.add_argument("--only", nargs="*", default=["nccl", "learn", "qwen06b", "roles"],
                    choices=["nccl", "learn", "qwen06b", "roles"])
    ap.add_argument("--placements", nargs="*", default=TWO_GPUS, choices=list(PLACEMENTS))
    ap.add_argument("--nccl-ranks", type=int, default=2, help="GPUs in the nccl section's group")
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                    help="rollout engine of every trainer run (vllm: TP = the group's GPUs, colocated or split)")
    ap.add_argument("--model", default="qwen3-0.6b", choices=["qwen3-0.6b", "qwen3-4b", "qwen3-8b"],
                    help="model.builtin of the qwen06b section (the shape; random init)")
    ap.add_argument("--overrides", nargs="*", default=[],
                    help="Hydra overrides for every trainer run, after the section's own (same key: this one wins)")
    ap.add_argument("--learn-steps", type=int, default=150,
                    help="grpo_tiny steps (the CPU default run gains +0.32 by step 50 and +0.57 by step 100; split 1+1 "
                         "with vLLM rises later: +0.26 by step 75, +0.80 by step 150 on CPU, +0.59 by 150 on two H200s)")
    ap.add_argument("--qwen-steps", type=int, default=5,
                    help="GRPO steps of the qwen06b section; the first two are warm-up (colocated TP=2's second step "
                         "still ran 2.4x its third on two H200s) and left out of the means when there are 4 or more")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="most seconds per trainer run (default: run_timeout_s, by the section's model)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run of the orchestration
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which no new run starts (and a running one is cut): the results so far stay "
                         "(default 520; the scale runs: 540 for the whole command)")
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=None,
                    help="the scale runs instead of the placement matrix (default with --plan: qwen3_8b qwen3_30b_a3b)")
    ap.add_argument("--plan", action="store_true",
                    help="no GPU: upsert each scale run's plan as its row '<run> plan' (committed before the runs)")
    ap.add_argument("--check", type=float, default=None, metavar="GPU_GIB",
                    help="check every run's config and plan for GPUs of this many GiB (79.18: H100, 139.8: H200) "
                         "without running anything; exit 1 if one would be refused")
    tables.add_arguments(ap, "each finished run's row (placements, or moe for an MoE model)", tag=True)
    ap.add_argument("--check-json", metavar="PATH", default=None,
                    help="with --check: also write every run's overrides, refusal and full plan (JSON) to PATH (the "
                         "prediction to compare the run with, written before it runs)")
    args = ap.parse_args(argv)
    if args.plan and not args.runs:
        args.runs = ["qwen3_8b", "qwen3_30b_a3b"]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--nccl-child"]:
        rank, world, mode, port, path = int(argv[1]), int(argv[2]), argv[3], int(argv[4]), argv[5]
        _nccl_child(rank, world, mode, port, [1, 16, 256, 1024], path)
        return 0
    args = parse_args(argv)
    if args.runs:
        return main_scale(args)
    if args.check is not None:
        rows = check_runs(args, args.check)
        for r in rows:
            p = r["plan"] or {}
            print(f"{r['run']}: {r['error'] or 'ok'}; plan peak {p.get('peak_gib')} GiB, step "
                  f"{p.get('phase_seconds', {}).get('step')} s\n  {' '.join(r['overrides'])}")
        if args.check_json:
            with open(args.check_json, "w") as f:
                json.dump({"gpu_memory_gib": args.check, "engine": args.engine, "model": args.model,
                           "runs": rows}, f, indent=1)
        return 1 if any(r["error"] for r in rows) else 0
    return main_matrix(args)


def main_matrix(args: argparse.Namespace) -> int:
    """The placement matrix: its sections, each run joining one local Ray cluster, within --deadline (520 s)."""
    os.makedirs(args.out, exist_ok=True)
    import torch

    from rltrain.utils.distenv import apply_no_multicast
    from rltrain.workers.group import init_ray

    apply_no_multicast()
    device = f"{torch.cuda.device_count()} x {device_name()}" if args.device == "cuda" else "cpu (dry run)"
    res: dict = {**report_header(TOOL, device), "seconds": {}, "errors": {}}
    t_all, deadline = time.time(), Deadline(args.deadline or 520.0)
    if "nccl" in args.only:
        t = time.time()
        try:
            res["nccl"] = section_nccl(args.out, args.nccl_ranks)
        except Exception as err:  # noqa: BLE001 - a failed section is a result
            res["errors"]["nccl"] = f"{type(err).__name__}: {err}"
        res["seconds"]["nccl"] = round(time.time() - t, 1)
        save(res, args.out)
    runs = [s for s in ("learn", "qwen06b", "roles") if s in args.only]
    if runs:
        import ray

        init_ray(None, num_cpus=os.cpu_count() if args.device == "cuda" else 4)
        address = ray.get_runtime_context().gcs_address
        log(f"local Ray cluster at {address}: {ray.cluster_resources()}")
        for sec in runs:
            res[sec] = {}
            for name in args.placements:
                over = run_overrides(sec, name, args)
                left = deadline.left()
                if left < 20:
                    res[sec][name] = {"rc": None, "seconds": 0.0, "skipped": "--deadline reached"}
                    log(f"{sec}/{name}: skipped (deadline)")
                    save(res, args.out)
                    continue
                probe = None
                if args.device == "cuda":  # the host's speed just before the run (harness/probes.py, ~8 s)
                    from harness.probes import cpu_probes, host_facts, series_probe

                    probe = {"host": host_facts(), "cpu": cpu_probes(5), "series": series_probe(16, 0.3)}
                log(f"{sec}/{name}: start" + (f" (host probe: {json.dumps(probe['cpu'])}, slow share "
                                               f"{probe['series']['slow_share']:.2f})" if probe else ""))
                run = run_trainer(f"{sec}_{name}", over, args.out, address, min(run_timeout_s(args, sec), left),
                                  args.device)
                res[sec][name] = learn_summary(run) if sec == "learn" else step_summary(run)
                done = table_row(sec, name, run, over, args) if sec in ("learn", "qwen06b") else None
                if done is not None:
                    tables.upsert(done[0], [done[1]], args.results)
                if probe:
                    res[sec][name]["host_probe"] = probe
                log(f"{sec}/{name}: rc={run['rc']} in {run['seconds']:.0f} s "
                    + json.dumps({k: v for k, v in res[sec][name].items()
                                  if k in ("acc_before", "acc_after", "timing_s", "peak_gib_per_gpu")}, default=str))
                save(res, args.out)
        ray.shutdown()
    res["seconds"]["total"] = round(time.time() - t_all, 1)
    save(res, args.out)
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
