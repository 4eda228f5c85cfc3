"""The learning recipe's driver (examples/learn/README.md): from random init to SFT to GRPO / ReTool, measured.

Stages; each runs alone, starts from what the earlier stages wrote under --out, and fits one 10-minute
device command on one H100 at --scale gpu:

  data         task files (rltrain/data/arithmetic.py) + a byte-level BPE tokenizer (rltrain/data/train_tokenizer.py)
  sft          SFT cold start (`python -m rltrain.sft`) of the random-init model on the addition traces
  grpo         GRPO runs from the SFT model, several at once in separate processes (default: fused head
               seed 1, fused seed 2, materialized logits seed 1), then fused vs unfused against seed noise;
               `lora:SEED` runs (LoRA rank 32, LORA_LR_X times the lr) against full fine-tuning the same way;
               `top:SEED` runs (rollout.true_on_policy) against the fused runs the same way
  retool_sft   SFT cold start on the tool-use traces (products: call the Python tool or estimate)
  retool_grpo  GRPO with the multi-turn tool loop and the real sandbox, from the ReTool SFT model
  eval         held-out accuracy of every model under --out, one table (summary.md)
  plots        redraw every plot from the run directories

Every stage writes held-out accuracy before and after it (greedy decoding on the val split, which no SFT
or RL step sees), curves as PNGs under <out>/plots (CSV where matplotlib is missing), <out>/<stage>/summary.json
merged into <out>/summary.json, <out>/summary.md and <out>/benchmarks.md (rows for docs/benchmarks.md);
--export DIR copies those as at most 8 flat files (what the device machine returns from $OUT).

Made for 10-minute device commands: --deadline S stops the trainers in time to evaluate and export; a stage
that is done is skipped when named again, a GRPO run that was stopped resumes from its last checkpoint
(trainer.save_freq) when the same command runs again (exit code 3 says so), and a stage whose prerequisite
is missing (e.g. a fresh machine) says which stage to run first. examples/learn/gpu.sh has one command per step:

  bash examples/learn/gpu.sh sft | grpo_fused | grpo_unfused | grpo_seed2 | grpo_lora | retool
  python tools/learn_gpu.py data sft grpo --runs fused:1 --out outputs/learn --deadline 540 --export $OUT
  python tools/learn_gpu.py data sft grpo --scale cpu --in-process --out outputs/learn_cpu   # 2 CPU cores, ~2 min
  python tools/learn_gpu.py data sft grpo retool_sft retool_grpo --tiny --out outputs/learn_tiny   # GPU path on CPU

GPU path: Megatron actor in bf16 with fp32 master weights, fused Triton LM head, trainer.use_ray=true,
colocated HF rollout (--engine vllm for vLLM). --set STAGE:key=value passes any Hydra override to one stage
(e.g. --set grpo:actor.lr=1e-5); --runs picks the GRPO runs, run at once as child processes
(e.g. --runs fused:1 unfused:1 fused:2 lora:1). --tiny runs the GPU configs shrunk onto the CPU (Ray, child
processes, deadline, resume: the plumbing, not the learning).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import log as harness_log
from harness import REPO, Deadline, device_name, md_table, run_child, run_children, run_rows
from harness import trainer_command, write_json, write_report

from rltrain.config.convert import as_dict
from rltrain.trainer.evaluate import RUN_KINDS, TRAIN_S_KEY, compare_runs, curve, evaluate, fmt_eval  # noqa: F401
from rltrain.trainer.evaluate import phase_timing, run_key
from rltrain.utils.plotting import plot_lines

STAGES = ("data", "sft", "grpo", "retool_sft", "retool_grpo", "eval", "plots")
TASK_OF = {"sft": "add", "grpo": "add", "retool_sft": "mul_tool", "retool_grpo": "mul_tool"}
CONFIG_OF = {"sft": "learn_add_sft", "grpo": "learn_add_grpo", "retool_sft": "learn_tool_sft",
             "retool_grpo": "learn_tool_grpo"}
SFT_OF = {"grpo": "sft", "retool_grpo": "retool_sft"}


class UsageError(Exception):
    """A mistake the user can fix (missing earlier stage, bad --runs/--set): exit code 2, no traceback."""


def time_left(args) -> float:
    """Seconds until --deadline (inf without one)."""
    return args.t_end.left()


@dataclass
class Scale:
    """Sizes of one scale of the recipe. The trainer settings live in configs/learn_*{suffix}.yaml."""

    suffix: str  # config-name suffix
    add: dict  # rltrain.data.arithmetic.make_splits kwargs, task add
    mul_tool: dict  # same, task mul_tool
    vocab_size: int
    runs: list[str]  # default GRPO runs
    retool_runs: list[str]
    eval_batch: int
    seq_tokens: dict  # task -> prompt + response tokens per sequence (measured by the data stage), for estimates
    tool_workers: int = 8
    # seconds kept free of a --deadline after a stage's trainers stop: the held-out evaluation of each finished
    # model, plots, summaries and the export (reserve_s + reserve_per_run_s x runs)
    reserve_s: float = 30.0
    reserve_per_run_s: float = 15.0
    # Hydra overrides of this scale, by stage (after the config's own settings, before --set)
    overrides: dict = field(default_factory=dict)


SCALES = {
    # One H100. Estimates (README "Timing"): data 0.5 min, sft 3 min, grpo 8 min, retool_sft 2 min, retool_grpo 6 min.
    "gpu": Scale(suffix="",
                 add=dict(digits=5, sft_size=50000, train_size=20000, val_size=256, drop_carry_p=0.6),
                 mul_tool=dict(digits=4, short_digits=2, sft_size=20000, train_size=20000, val_size=256,
                               tool_p_long=0.8, tool_p_short=0.2),
                 vocab_size=512, runs=["fused:1", "fused:2", "unfused:1"], retool_runs=["fused:1", "fused:2"],
                 eval_batch=512, seq_tokens={"add": 71, "mul_tool": 52}),
    # Two CPU cores (CI): a smaller model, 2-digit problems, fewer steps; same stages, same code path.
    "cpu": Scale(suffix="_cpu",
                 add=dict(digits=2, sft_size=4000, train_size=4000, val_size=128, drop_carry_p=0.65),
                 mul_tool=dict(digits=2, short_digits=1, sft_size=2000, train_size=2000, val_size=64,
                               tool_p_long=0.8, tool_p_short=0.2),
                 vocab_size=512, runs=["fused:1"], retool_runs=["fused:1"], eval_batch=256,
                 seq_tokens={"add": 37, "mul_tool": 38}, tool_workers=2, reserve_s=15, reserve_per_run_s=5),
    # The GPU configs (Ray, concurrent child processes, checkpoints, --deadline and resume) shrunk to run on
    # CPU in a few minutes: exercises the driver's GPU code paths, learns nothing worth reporting.
    "tiny": Scale(suffix="",
                  add=dict(digits=2, sft_size=400, train_size=400, val_size=32, drop_carry_p=0.65),
                  mul_tool=dict(digits=2, short_digits=1, sft_size=300, train_size=300, val_size=16,
                                tool_p_long=0.8, tool_p_short=0.2),
                  vocab_size=512, runs=["fused:1", "unfused:1"], retool_runs=["fused:1"], eval_batch=64,
                  seq_tokens={"add": 37, "mul_tool": 38}, tool_workers=2, reserve_s=15, reserve_per_run_s=5,
                  overrides={
                      "sft": ["model.builtin=tiny", "+model.overrides.hidden_size=64",
                              "+model.overrides.intermediate_size=192", "+model.overrides.head_dim=16",
                              "data.batch_size=16", "trainer.total_steps=20", "optim.lr_warmup_steps=2"],
                      "grpo": ["trainer.total_steps=4", "trainer.test_freq=2", "trainer.save_freq=2",
                               "data.train_batch_size=8", "data.val_batch_size=32", "rollout.n=4",
                               "actor.ppo_mini_batch_size=8", "rollout.max_response_length=40"],
                      "retool_grpo": ["rollout.multi_turn.tool_max_workers=2", "rollout.multi_turn.max_total_tokens=64",
                                      "rollout.max_response_length=32"]}),
}
SCALES["tiny"].overrides["retool_sft"] = SCALES["tiny"].overrides["sft"]
SCALES["tiny"].overrides["retool_grpo"] = SCALES["tiny"].overrides["grpo"] + SCALES["tiny"].overrides["retool_grpo"]
for _stage in CONFIG_OF:  # the tiny scale runs where there is no GPU: fp32, torch head, CPU
    SCALES["tiny"].overrides[_stage] = ["model.dtype=float32", "trainer.device=cpu",
                                        "trainer.fused_linear_logprob_backend=torch",
                                        *SCALES["tiny"].overrides[_stage]]


def log(msg: str) -> None:
    harness_log("learn", msg)


# ---------------------------------------------------------------------------- layout
class Layout:
    """Where each stage reads and writes under --out."""

    def __init__(self, out: str):
        self.out = os.path.abspath(out)
        self.data = os.path.join(self.out, "data")
        self.tokenizer = os.path.join(self.data, "tokenizer")
        self.plots = os.path.join(self.out, "plots")

    def task_file(self, task: str, split: str) -> str:
        return os.path.join(self.data, task, f"{split}.jsonl")

    def stage_dir(self, stage: str) -> str:
        return os.path.join(self.out, stage)

    def sft_model(self, stage: str) -> str:
        return os.path.join(self.out, stage, "hf")

    def run_dir(self, stage: str, run: str) -> str:
        return os.path.join(self.out, stage, run)

    def summary(self, stage: str) -> str:
        return os.path.join(self.out, stage, "summary.json")


def require(args, path: str, what: str, stage: str) -> None:
    """A clear error when an earlier stage's output is missing (not checked by --dry-run)."""
    if not args.dry_run and not os.path.exists(path):
        raise UsageError(f"{what} is missing ({path}); run the `{stage}` stage first "
                         f"(python tools/learn_gpu.py {stage} --out ...)")


def exported(hf: str) -> bool:
    """Whether a GRPO run exported its model to `hf` (a model directory; a LoRA run: a PEFT adapter directory)."""
    from rltrain.models.hf import is_peft_adapter

    return os.path.exists(os.path.join(hf, "config.json")) or is_peft_adapter(hf)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------- runs and overrides
# A `lora` run: the fused run with rank-32 adapters on every linear (alpha 32: scale alpha / r = 1) and LORA_LR_X
# times the stage's learning rate (--lora-lr-x). LoRA's best lr is ~10x full fine-tuning's at alpha 32 with PEFT's
# init (Schulman et al., "LoRA Without Regret", Thinking Machines 2025); the CPU recipe (docs/megatron_backend.md)
# learns with it as the full run does.
LORA_RANK, LORA_ALPHA, LORA_LR_X = 32, 32, 10.0


@dataclass(frozen=True)
class RunSpec:
    """One GRPO run: `fused:1` (fused LM head, seed 1), `unfused:2` (materialized logits, seed 2), `lora:1` (fused head,
    LoRA adapters: LORA_*), `top:1` (rollout.true_on_policy; the head's torch backend with the hf engine); a third
    field picks the rollout engine of that run alone (`fused:1:vllm`, `fused:1:hf`; default: --engine), so runs of
    both engines from the same SFT model go side by side in one command."""

    kind: str  # one of RUN_KINDS
    seed: int
    engine: str | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}_seed{self.seed}" + (f"_{self.engine}" if self.engine else "")

    @classmethod
    def from_name(cls, name: str) -> "RunSpec":
        """The spec a run directory's name (`name` above) was written from."""
        return cls(*run_key(name))

    @classmethod
    def parse(cls, text: str) -> "RunSpec":
        parts = text.split(":")
        head, seed, engine = (parts + [None])[:3] if len(parts) in (2, 3) else ("", "", None)
        if head not in RUN_KINDS or not seed.isdigit() or engine not in (None, "hf", "vllm"):
            raise UsageError(f"--runs entry {text!r}: expected fused:SEED, unfused:SEED, lora:SEED or top:SEED, "
                             "optionally :hf or :vllm (the run's rollout engine), e.g. fused:1, lora:2 or top:2:vllm")
        return cls(kind=head, seed=int(seed), engine=engine)

    def overrides(self) -> list[str]:
        ov = [f"trainer.fused_linear_logprob={str(self.kind != 'unfused').lower()}", f"trainer.seed={self.seed}"]
        if self.kind == "top":
            ov.append("rollout.true_on_policy=true")
        return ov


def user_overrides(sets: list[str], stage: str) -> list[str]:
    out = []
    for s in sets:
        st, sep, kv = s.partition(":")
        if not sep or st not in CONFIG_OF or "=" not in kv:
            raise UsageError(f"--set {s!r}: expected STAGE:key=value with STAGE one of {', '.join(CONFIG_OF)}")
        if st == stage:
            out.append(kv)
    return out


def stage_overrides(stage: str, lay: Layout, args, run: RunSpec | None = None) -> list[str]:
    """The Hydra overrides of one trainer command of `stage` (paths, run variant, engine, user --set)."""
    task = TASK_OF[stage]
    if stage in ("sft", "retool_sft"):
        ov = [f"model.tokenizer={lay.tokenizer}", f"data.train_files=[{lay.task_file(task, 'sft')}]",
              f"trainer.output_dir={lay.sft_model(stage)}"]
    else:
        run_dir = lay.run_dir(stage, run.name)
        ov = [f"model.path={lay.sft_model(SFT_OF[stage])}", f"data.train_files=[{lay.task_file(task, 'train')}]",
              f"data.val_files=[{lay.task_file(task, 'val')}]", f"trainer.ckpt_dir={run_dir}/checkpoints",
              f"trainer.experiment_name={CONFIG_OF[stage]}_{run.name}", *run.overrides()]
        if run.kind == "top" and (run.engine or args.engine) != "vllm":  # the hf engine's exact head: torch's
            ov.append("trainer.fused_linear_logprob_backend=torch")
        if (run.engine or args.engine) == "vllm":
            runs = len(args.runs if stage == "grpo" else args.retool_runs)  # every run shares the one GPU
            ov += ["rollout.engine=vllm", f"rollout.gpu_memory_utilization={min(0.5, 0.7 / runs):.2f}"]
            if runs > 1:  # engines start while other runs change their GPU memory: no profiling, a fixed KV cache
                ov.append("rollout.kv_cache_memory_gb=2")  # ~150k tokens of the ~55M model; a step needs ~53k
        if args.allow_unisolated and stage == "retool_grpo":
            ov.append("sandbox.allow_unisolated=true")
    ov += SCALES[args.scale].overrides.get(stage, [])
    if args.device:
        ov.append(f"trainer.device={args.device}")
    ov += user_overrides(args.set, stage)
    if run is not None and run.kind == "lora":  # the fused run's config (--set included) with adapters, lr x LORA_LR_X
        full_lr = compose(stage, ov, SCALES[args.scale]).actor.lr
        ov += [f"actor.lora.rank={args.lora_rank}", f"actor.lora.alpha={LORA_ALPHA}",
               f"actor.lr={full_lr * args.lora_lr_x:.6g}"]
    return ov


def compose(stage: str, overrides: list[str], scale: Scale):
    """The typed config (SFTConfig or RLConfig) a trainer command of `stage` would run with."""
    from rltrain.config.entry import compose_config
    from rltrain.config.schema import RLConfig, SFTConfig

    schema = SFTConfig if stage in ("sft", "retool_sft") else RLConfig
    return compose_config(CONFIG_OF[stage] + scale.suffix, overrides, schema)


def validated(stage: str, overrides: list[str], scale: Scale):
    from rltrain.config import ConfigError
    from rltrain.config.validate import validate_config, validate_sft_config

    try:
        cfg = compose(stage, overrides, scale)
        (validate_sft_config if stage in ("sft", "retool_sft") else validate_config)(cfg)
    except ConfigError as err:
        raise UsageError(f"stage {stage}: {err}") from None
    return cfg


def command(stage: str, overrides: list[str], scale: Scale, run_dir: str) -> list[str]:
    module = "rltrain.sft" if stage in ("sft", "retool_sft") else "rltrain.main"
    return trainer_command(CONFIG_OF[stage] + scale.suffix, overrides, run_dir, module)


# ---------------------------------------------------------------------------- running trainers
def run_trainers(jobs: list[tuple[str, list[str], str]], *, timeout_s: float | None, in_process: bool,
                 stage: str, scale: Scale, progress: callable) -> dict[str, dict]:
    """Run trainer commands [(name, overrides, run_dir)], all at once in child processes (or one after another
    in this process with --in-process); print progress every ~30 s; kill what is still running at timeout_s.
    Returns name -> {"rc", "wall_s", "timed_out"}."""
    results: dict[str, dict] = {}
    if in_process:
        from rltrain.trainer.ppo import run_from_config
        from rltrain.trainer.sft import run_sft_from_config

        for name, ov, run_dir in jobs:
            t0 = time.time()
            cfg = compose(stage, ov, scale)
            os.makedirs(run_dir, exist_ok=True)
            (run_sft_from_config if stage in ("sft", "retool_sft") else run_from_config)(cfg, run_dir)
            results[name] = {"rc": 0, "wall_s": round(time.time() - t0, 1), "timed_out": False}
            progress(name)
        return results
    children = {}
    for name, ov, run_dir in jobs:
        os.makedirs(run_dir, exist_ok=True)
        cmd = command(stage, ov, scale, run_dir)
        with open(os.path.join(run_dir, "command.txt"), "w") as f:
            f.write(" ".join(cmd[1:]) + "\n")
        children[name] = (cmd, os.path.join(run_dir, "stdout.log"))
        log(f"{stage}/{name}: {' '.join(cmd[1:6])} ... (log: {os.path.relpath(children[name][1])})")

    def exited(name: str, res: dict) -> None:
        log(f"{stage}/{name}: exited {res['rc']} after {res['wall_s']:.0f} s")
        if res["rc"] != 0:
            with open(children[name][1]) as f:
                print(f.read()[-2500:], flush=True)

    def stopping(name: str, _proc) -> None:
        log(f"{stage}/{name}: still running at the {timeout_s:.0f} s stage limit; stopping it (run the "
            f"stage again to resume from its last checkpoint)")

    return run_children(children, timeout_s=timeout_s, env={"HYDRA_FULL_ERROR": "1"}, on_poll=progress,
                        on_exit=exited, on_timeout=stopping)


def progress_line(stage: str, run_dir: str, total: int) -> str:
    rows = run_rows(run_dir)
    if not rows:
        return f"{stage}: starting"
    last = rows[-1]
    parts = [f"step {last['step']}/{total}"]
    for key, label in (("sft/loss", "loss"), ("critic/score/mean", "reward"), ("timing_s/step", "s/step")):
        if key in last:
            parts.append(f"{label} {last[key]:.3f}")
    val = [r for r in rows if "val/accuracy" in r]
    if val:
        parts.append(f"val_acc {val[-1]['val/accuracy']:.3f} (step {val[-1]['step']})")
    return f"{stage}: " + ", ".join(parts)


# ---------------------------------------------------------------------------- evaluation
def eval_cfg(stage: str, lay: Layout, args, scale: Scale, model_path: str | None):
    """The RL stage's config used for evaluating a model of `stage`'s task (model_path None: random init)."""
    import dataclasses

    rl = {"sft": "grpo", "retool_sft": "retool_grpo"}.get(stage, stage)
    cfg = validated(rl, stage_overrides(rl, lay, args, RunSpec("fused", 1)), scale)
    if model_path is None:  # the SFT stage's random-init model
        sft_cfg = validated(stage, stage_overrides(stage, lay, args), scale)
        cfg.model = dataclasses.replace(sft_cfg.model)
        cfg.trainer.seed = sft_cfg.trainer.seed
    else:
        cfg.model = dataclasses.replace(cfg.model, path=model_path, builtin=None, tokenizer=None)
    return cfg


def stage_estimate(stage: str, cfg, scale: Scale, runs: int = 1) -> int:
    """Seconds of the stage on one H100 (tools/planlab/learn.py); GRPO stages: at the SFT config's model."""
    from planlab.learn import stage_estimate as estimate

    from rltrain.config.schema import ModelConfig

    sft = stage in ("sft", "retool_sft")
    cpu = ModelConfig(builtin="tiny", overrides={"hidden_size": 128, "intermediate_size": 384, "head_dim": 32})
    model = cfg.model if sft else ModelConfig(builtin="small") if scale.suffix == "" else cpu
    return estimate(sft, cfg, model, scale.seq_tokens[TASK_OF[stage]], runs=runs)


# ---------------------------------------------------------------------------- stages
def stage_data(lay: Layout, args, scale: Scale) -> dict:
    from rltrain.data.arithmetic import write_splits

    t0 = time.time()
    if os.path.exists(lay.summary("data")) and not args.force:
        old = read_json(lay.summary("data"))
        same = old.get("data_seed") == args.data_seed and all(
            old["tasks"].get(t, {}).get("params") == getattr(scale, t) for t in ("add", "mul_tool"))
        if same and os.path.exists(os.path.join(lay.tokenizer, "tokenizer.json")):
            log("data: up to date (same sizes and seed); --force rebuilds it")
            return {**old, "reused": True}
    info: dict = {"tasks": {}, "data_seed": args.data_seed}
    for task in ("add", "mul_tool"):
        kw = getattr(scale, task)
        paths = write_splits(os.path.join(lay.data, task), task, seed=args.data_seed, **kw)
        info["tasks"][task] = {"params": kw, "files": paths}
        log(f"data: {task}: {kw['sft_size']} SFT demos, {kw['train_size']} RL prompts, {kw['val_size']} held out")
    from rltrain.data.tokenizer import load_tokenizer

    files = [lay.task_file(t, s) for t in ("add", "mul_tool") for s in ("sft", "train")]  # never val
    res = run_child([sys.executable, "-m", "rltrain.data.train_tokenizer", "--files", *files, "--out",
                     lay.tokenizer, "--vocab-size", str(scale.vocab_size)], os.path.join(lay.data, "tokenizer.log"),
                    poll_s=0.2)
    if res["rc"] != 0:
        raise RuntimeError(f"data: rltrain.data.train_tokenizer failed (exit {res['rc']}): {res['tail']}")
    tok = load_tokenizer(lay.tokenizer)
    info["tokenizer"] = {"dir": lay.tokenizer, "vocab_size": len(tok)}
    info["tokens"] = {task: _token_lengths(tok, lay.task_file(task, "sft")) for task in ("add", "mul_tool")}
    info["wall_s"] = round(time.time() - t0, 1)
    log(f"data: tokenizer {len(tok)} tokens -> {lay.tokenizer}; sequence tokens (prompt, response): "
        + ", ".join(f"{t} {v['prompt_mean']:.0f}+{v['response_mean']:.0f}" for t, v in info["tokens"].items()))
    return info


def _token_lengths(tok, sft_file: str, rows: int = 2000) -> dict:
    """Prompt and response token counts of the first `rows` SFT conversations."""
    from rltrain.data.dataset import read_rows
    from rltrain.data.sft_data import SFTDataset

    ds = SFTDataset([[r["messages"] for _, r in read_rows(sft_file)[:rows]]], tokenizer=tok, max_length=1 << 20)
    plen = [it["prompt_length"] for it in ds.items]
    rlen = [len(it["input_ids"]) - it["prompt_length"] for it in ds.items]
    return {"prompt_mean": sum(plen) / len(plen), "response_mean": sum(rlen) / len(rlen), "response_max": max(rlen),
            "response_min": min(rlen)}


class DeadlineReached(Exception):
    """Too little of --deadline is left to start (or finish) a stage: run the same command again."""


MIN_TRAIN_S = 20.0  # a trainer given less than this would only start up


def trainer_budget(args, scale: Scale, stage: str, runs: int) -> float | None:
    """Seconds the stage's trainers may run: --stage-timeout, and --deadline less what the evaluation of each
    finished model, plots and export need afterwards. None: unbounded. DeadlineReached when too little is left."""
    left = time_left(args) - scale.reserve_s - scale.reserve_per_run_s * runs
    budget = min(args.stage_timeout or float("inf"), left)
    if budget < MIN_TRAIN_S:
        raise DeadlineReached(f"stage {stage} not started: {max(time_left(args), 0):.0f} s of --deadline left")
    if budget != float("inf") and args.in_process:
        log(f"{stage}: --in-process cannot stop a trainer at the deadline; it runs to the end")
        return None
    return None if budget == float("inf") else budget


def check_sandbox(args) -> str:
    """The ReTool stages' tool calls need the sandbox's kernel isolation (rltrain/sandbox); fail before any
    training where it is missing, saying how to get it (the wheels) or to run without it knowingly."""
    from rltrain.sandbox import probe_isolation

    probe = probe_isolation()
    if not probe.isolated and not args.allow_unisolated:
        raise UsageError(f"the sandbox cannot isolate tool code here ({probe.isolation}). Where landlockpy/pyseccomp "
                         "are missing: make sandbox-wheels here, carry .whl-sandbox and pip install them there "
                         "(examples/learn/README.md); where the kernel refuses: --allow-unisolated runs the tool "
                         "code guarded only by an audit hook (recorded in the summary)")
    return probe.isolation


def previous(lay: Layout, stage: str) -> dict:
    return read_json(lay.summary(stage)) if os.path.exists(lay.summary(stage)) else {}


def stage_sft(stage: str, lay: Layout, args, scale: Scale) -> dict:
    require(args, lay.tokenizer, "the tokenizer", "data")
    require(args, lay.task_file(TASK_OF[stage], "sft"), "the SFT data", "data")
    ov = stage_overrides(stage, lay, args)
    cfg = validated(stage, ov, scale)
    run_dir = os.path.join(lay.stage_dir(stage), "run")
    if args.dry_run:
        return {"command": command(stage, ov, scale, run_dir), "estimate_s_h100": stage_estimate(stage, cfg, scale)}
    old = previous(lay, stage)
    if "after" in old and os.path.exists(os.path.join(lay.sft_model(stage), "config.json")) and not args.force:
        log(f"{stage}: done earlier (held-out {fmt_eval(old['after'])}); --force retrains it")
        return {**old, "reused": True}
    if stage == "retool_sft":
        check_sandbox(args)  # its evaluation and the retool_grpo stage after it call the tool
    timeout_s = trainer_budget(args, scale, stage, runs=1)
    from rltrain.data.tokenizer import load_tokenizer
    from rltrain.workers.hybrid import initial_hf_model, resolve_device

    import torch

    # before: the random-init model the SFT starts from (same preset, tokenizer, seed and init device)
    tok = load_tokenizer(lay.tokenizer)
    _, init_model = initial_hf_model(cfg.model, tok, cfg.trainer.seed, torch.float32,
                                     resolve_device(cfg.trainer.device))
    params = sum(p.numel() for p in init_model.parameters())
    before = evaluate(eval_cfg(stage, lay, args, scale, None), init_model.to(
        torch.float32 if cfg.trainer.device == "cpu" else getattr(torch, cfg.model.dtype)),
        batch=scale.eval_batch, tool_workers=scale.tool_workers)
    del init_model
    log(f"{stage}: random init ({params / 1e6:.1f}M parameters): held-out {fmt_eval(before)}")
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        os.remove(os.path.join(run_dir, "metrics.jsonl"))  # SFT restarts from scratch: a fresh curve
    total = cfg.trainer.total_steps
    if os.path.exists(lay.sft_model(stage)):
        shutil.rmtree(lay.sft_model(stage))  # a model of an earlier, stopped or forced, run must not pass as this one
    res = run_trainers([(stage, ov, run_dir)], timeout_s=timeout_s, in_process=args.in_process,
                       stage=stage, scale=scale,
                       progress=lambda name: log(progress_line(stage, run_dir, total)))[stage]
    if res["timed_out"]:
        raise DeadlineReached(f"stage {stage}: SFT stopped at the deadline after {res['wall_s']:.0f} s (SFT does "
                              "not checkpoint: it starts over); give it a longer --deadline")
    if res["rc"] != 0 or not os.path.exists(os.path.join(lay.sft_model(stage), "config.json")):
        raise RuntimeError(f"stage {stage}: the SFT run failed (exit {res['rc']}); see {run_dir}/stdout.log")
    after = evaluate(eval_cfg(stage, lay, args, scale, lay.sft_model(stage)), batch=scale.eval_batch,
                     tool_workers=scale.tool_workers)
    log(f"{stage}: after SFT: held-out {fmt_eval(after)}")
    rows = run_rows(run_dir)
    steady = rows[len(rows) // 10:] or rows  # the first steps compile kernels and warm up
    seq_tokens = read_json(lay.summary("data"))["tokens"][TASK_OF[stage]] if os.path.exists(lay.summary("data")) else None
    step_s = sum(r["timing_s/step"] for r in steady) / len(steady)
    out = {"before": before, "after": after, "parameters": params, "steps": len(rows), "wall_s": res["wall_s"],
           "trainer_command": command(stage, ov, scale, run_dir)[1:],
           "final_loss": rows[-1]["sft/loss"], "step_s_mean": step_s,
           "assistant_tokens_per_s": sum(r["sft/tokens"] for r in steady) / sum(r["timing_s/step"] for r in steady)}
    if seq_tokens:
        out["tokens_per_s"] = cfg.data.batch_size * (seq_tokens["prompt_mean"] + seq_tokens["response_mean"]) / step_s
    plot_sft(lay)
    return out


def stage_grpo(stage: str, lay: Layout, args, scale: Scale) -> dict:
    sft = SFT_OF[stage]
    require(args, os.path.join(lay.sft_model(sft), "config.json"), f"the {sft} model", sft)
    specs = [RunSpec.parse(r) for r in (args.runs if stage == "grpo" else args.retool_runs)]
    if len({s.name for s in specs}) != len(specs):
        raise UsageError(f"--runs has duplicates: {[s.name for s in specs]}")
    jobs, cfgs = [], {}
    for spec in specs:
        ov = stage_overrides(stage, lay, args, spec)
        cfgs[spec.name] = validated(stage, ov, scale)
        jobs.append((spec.name, ov, lay.run_dir(stage, spec.name)))
    if args.dry_run:
        return {"commands": {n: command(stage, ov, scale, d) for n, ov, d in jobs},
                "estimate_s_h100": stage_estimate(stage, next(iter(cfgs.values())), scale, runs=len(jobs))}
    old = previous(lay, stage)
    done = {n: r for n, r in old.get("runs", {}).items()
            if "after" in r and r["steps_done"] == r["total_steps"] and not args.force}
    for name in done:
        log(f"{stage}/{name}: done earlier (held-out {fmt_eval(done[name]['after'])}); --force reruns it")
    jobs = [j for j in jobs if j[0] not in done]
    isolation = check_sandbox(args) if stage == "retool_grpo" else None
    before_path = lay.summary(sft)
    if os.path.exists(before_path) and "after" in read_json(before_path):
        before = read_json(before_path)["after"]
    else:
        before = evaluate(eval_cfg(sft, lay, args, scale, lay.sft_model(sft)), batch=scale.eval_batch,
                          tool_workers=scale.tool_workers)
    log(f"{stage}: starting point ({sft} model): held-out {fmt_eval(before)}; runs: {', '.join(cfgs)}")
    total = next(iter(cfgs.values())).trainer.total_steps
    if args.force:
        for name, _, run_dir in jobs:
            if os.path.isdir(run_dir):
                shutil.rmtree(run_dir)  # no resume from the earlier run's checkpoints
    for name, _, run_dir in jobs:
        steps = run_rows(run_dir)
        if steps:
            log(f"{stage}/{name}: resuming (logged up to step {steps[-1]['step']}; the trainer restarts from its "
                "last checkpoint)")
    timeout_s = trainer_budget(args, scale, stage, runs=len(jobs)) if jobs else None
    results = run_trainers(jobs, timeout_s=timeout_s, in_process=args.in_process, stage=stage, scale=scale,
                           progress=lambda name: log(progress_line(f"{stage}/{name}", lay.run_dir(stage, name), total)))
    runs = {n: r for n, r in old.get("runs", {}).items() if n not in results}  # earlier calls' runs stay
    for name, ov, run_dir in jobs:
        rows = run_rows(run_dir)
        prev_wall = 0.0 if args.force else old.get("runs", {}).get(name, {}).get("wall_s", 0.0)
        wall = results[name]["wall_s"] + prev_wall  # summed over the calls that resumed the run
        info = {**results[name], "wall_s": round(wall, 1), "before": before,
                "steps_done": rows[-1]["step"] if rows else 0,
                "total_steps": total, "curve": curve(rows), "timing": phase_timing(rows, samples=cfgs[name].data.train_batch_size * cfgs[name].rollout.n),
                "trainer_command": command(stage, ov, scale, run_dir)[1:], "lr": cfgs[name].actor.lr,
                "lora_rank": cfgs[name].actor.lora.rank}
        hf = os.path.join(run_dir, "hf")
        if exported(hf) and info["steps_done"] == total:
            info["after"] = evaluate(eval_cfg(stage, lay, args, scale, hf), batch=scale.eval_batch,
                                     tool_workers=scale.tool_workers)
            log(f"{stage}/{name}: after {total} GRPO steps: held-out {fmt_eval(info['after'])} "
                f"(from {before['accuracy']:.3f})")
        else:
            log(f"{stage}/{name}: not finished ({info['steps_done']}/{total} steps, exit {info['rc']}); "
                "run the same command again to resume from its last checkpoint")
            args.unfinished.append(f"{stage}/{name}")
        runs[name] = info
    out = {"before": before, "runs": runs, "comparison": compare_runs(runs, before["n"], args.engine)}
    if isolation:
        out["sandbox_isolation"] = isolation
    for line in comparison_lines(out["comparison"]):
        log(f"{stage}: {line}")
    plot_grpo(lay, stage, runs, before)
    return out


def stage_eval(lay: Layout, args, scale: Scale) -> dict:
    """Held-out accuracy of every model under --out (random init comes from the sft summaries)."""
    if args.dry_run:  # the evaluation configs are the RL stages'
        return {st: sorted(as_dict(validated(st, stage_overrides(st, lay, args, RunSpec("fused", 1)), scale)))
                for st in ("grpo", "retool_grpo")}
    models = {}
    for stage in ("sft", "grpo", "retool_sft", "retool_grpo"):
        if stage in SFT_OF:
            for run in sorted(os.listdir(lay.stage_dir(stage))) if os.path.isdir(lay.stage_dir(stage)) else []:
                hf = os.path.join(lay.run_dir(stage, run), "hf")
                if exported(hf):
                    models[f"{stage}/{run}"] = (stage, hf)
        elif os.path.exists(os.path.join(lay.sft_model(stage), "config.json")):
            models[stage] = (stage, lay.sft_model(stage))
    if not models:
        raise UsageError(f"no trained model under {lay.out}; run the `sft` stage first")
    out = {}
    for name, (stage, path) in models.items():
        out[name] = evaluate(eval_cfg(stage, lay, args, scale, path), batch=scale.eval_batch,
                             tool_workers=scale.tool_workers)
        log(f"eval: {name}: held-out {fmt_eval(out[name])}")
    return out


# ---------------------------------------------------------------------------- plots and report
def _plotted(path: str) -> None:
    if path.endswith(".csv"):
        log(f"plots: matplotlib is not installed: written as {os.path.relpath(path)} instead of a PNG "
            "(pip install matplotlib, then `python tools/learn_gpu.py plots --out ...` draws it)")


def plot_sft(lay: Layout) -> None:
    """plots/sft_loss.png: the SFT loss curve of every SFT stage under --out."""
    curves = {st: [(r["step"], r["sft/loss"]) for r in run_rows(os.path.join(lay.stage_dir(st), "run"))]
              for st in ("sft", "retool_sft") if os.path.exists(os.path.join(lay.stage_dir(st), "run", "metrics.jsonl"))}
    if curves:
        _plotted(plot_lines(os.path.join(lay.plots, "sft_loss.png"), [
            {"title": "SFT loss (assistant tokens)", "xlabel": "step", "ylabel": "loss", "logy": True, "series": curves}]))


def plot_grpo(lay: Layout, stage: str, runs: dict, before: dict) -> None:
    """plots/<stage>_curves.png: held-out accuracy and training reward per run (+ tool-call rates for ReTool)."""
    panels = [("val/accuracy", "held-out accuracy (greedy)"), ("critic/score/mean", "training reward (mean)")]
    if stage == "retool_grpo":
        panels += [("val/reward/correct_tool_call/mean", "held-out correct tool calls"),
                   ("reward/tool_call/mean", "training tool-call rate")]
    panels.append((TRAIN_S_KEY, "held-out accuracy by training seconds"))
    _plotted(plot_lines(os.path.join(lay.plots, f"{stage}_curves.png"), [
        {"title": title, "xlabel": "training s (sum of step times)" if key == TRAIN_S_KEY else "GRPO step",
         "ylim": (-0.02, 1.02) if key.startswith("val/") else None,
         "series": {name: info["curve"].get(key, []) for name, info in runs.items()}} for key, title in panels],
        suptitle=f"{stage}: from the SFT model (held-out accuracy {before['accuracy']:.3f} at step 0)"))


def stage_plots(lay: Layout) -> dict:
    """Redraw every plot from the run directories (e.g. after installing matplotlib)."""
    plot_sft(lay)
    for stage in ("grpo", "retool_grpo"):
        s = previous(lay, stage)
        if s.get("runs"):
            plot_grpo(lay, stage, s["runs"], s["before"])
    return {"plots": sorted(os.listdir(lay.plots)) if os.path.isdir(lay.plots) else []}


def results(summary: dict, stages=("sft", "retool_sft", "grpo", "retool_grpo")):
    """(stage, name, entry, before, after) of every finished SFT stage (entry: its summary; name: its parameters)
    and every GRPO run (entry: the run's summary) of `stages`: the rows of summary.md and benchmarks.md."""
    for stage in stages:
        s = summary.get(stage) or {}
        if "runs" in s:
            yield from ((stage, n + (f" (LoRA rank {r['lora_rank']}, lr {r['lr']:g})" if r.get("lora_rank") else ""),
                         r, r.get("before", s["before"]), r.get("after")) for n, r in s["runs"].items())
        elif "after" in s:
            yield stage, f"{s['parameters'] / 1e6:.1f}M", s, s["before"], s["after"]


def _tool_calls(e: dict | None) -> str:
    return f"{e['correct_tool_call']:.3f}" if e and "correct_tool_call" in e else "-"


def comparison_lines(comparison: dict | None) -> list[str]:
    """The rollout-engine, fused-vs-materialized and LoRA-vs-full comparisons of a GRPO stage against seed noise, as
    sentences."""
    out, e, c = [], (comparison or {}).get("engines"), comparison or {}
    if e:
        out.append(f"Rollout engines: mean |held-out accuracy gap| {e['gap_engines']:.3f} ({e['reference']} vs "
                   f"{e['engine']}); seed noise {e['gap_seeds']:.3f} ({e['seed_a']} vs {e['seed_b']}); 2 SE "
                   f"{e['two_se']:.3f}; within noise: {e['within_noise']}")
    if c.get("gap_fused_unfused") is not None:
        out.append(f"Fused vs materialized logits: mean |held-out accuracy gap| {c['gap_fused_unfused']:.3f} "
                   f"({c['fused']} vs {c['unfused']}); seed noise {c['gap_seeds']:.3f} ({c['fused']} vs "
                   f"{c['other_seed']}); 2 SE {c['two_se']:.3f}; within noise: {c['within_noise']}")
    for kind, title, gap_key in (("lora", "LoRA vs full fine-tuning", "gap_lora"),
                                 ("top", "rollout.true_on_policy vs the fused run", "gap_true_on_policy")):
        if c.get(kind):
            v, sec = c[kind], {n: f"{t:.2f}" if t else "?" for n, t in c[kind]["step_s"].items()}
            out.append(f"{title}: mean |held-out accuracy gap| {v[gap_key]:.3f} ({v['full']} vs {v[kind]}); seed "
                       f"noise {v['gap_seeds']:.3f} ({v['seed_a']} vs {v['seed_b']}); 2 SE {v['two_se']:.3f}; within "
                       f"noise: {v['within_noise']}; seconds per step: "
                       + ", ".join(f"{n} {t}" for n, t in sec.items()))
    return out


def report(summary: dict) -> str:
    """summary.md: one table of held-out accuracy before/after each stage, and the timing per phase."""
    rows = [(stage, f"{name} random init -> SFT" if "runs" not in summary[stage] else
             f"{name} ({e['steps_done']}/{e['total_steps']} steps)", f"{b['accuracy']:.3f}",
             f"{a['accuracy'] if a else float('nan'):.3f}", _tool_calls(b), _tool_calls(a), f"{e['wall_s']:.0f}")
            for stage, name, e, b, a in results(summary)]
    lines = [f"# Learning recipe ({summary.get('device', '?')}, scale {summary.get('scale')}, {summary.get('date')})", "",
             md_table(["stage", "model", "held-out accuracy before", "after", "correct tool calls before", "after",
                       "wall s"], rows)]
    for stage in ("grpo", "retool_grpo"):
        s = summary.get(stage)
        if s and s.get("runs"):
            lines += ["", f"## {stage}: seconds per step and tokens/s per phase (mean over steps >= 2)", "", md_table(
                ["run", "gen s", "old_log_prob s", "update_actor s", "update_weights s", "step s", "gen resp tok/s",
                 "log-prob tok/s", "update tok/s", "end-to-end tok/s"],
                [(name, f"{t.get('gen_s', 0):.2f}", f"{t.get('old_log_prob_s', 0):.2f}", f"{t.get('update_actor_s', 0):.2f}",
                  f"{t.get('update_weights_s', 0):.2f}", f"{t['step_s']:.2f}", f"{t['gen_response_tokens_per_s']:.0f}",
                  f"{t['old_log_prob_tokens_per_s']:.0f}", f"{t['update_actor_tokens_per_s']:.0f}",
                  f"{t['tokens_per_s_end_to_end']:.0f}") for name, r in s["runs"].items() for t in [r["timing"]] if t])]
            lines += [x for line in comparison_lines(s.get("comparison")) for x in ("", line)]
    return "\n".join(lines) + "\n"


def bench_table(summary: dict) -> str:
    """benchmarks.md: the rows for docs/benchmarks.md's "Learning recipe" section (command, device, wall time,
    tokens/s per phase, held-out accuracy before -> after)."""
    rows = []
    for stage, name, e, b, a in results(summary, ("sft", "grpo", "retool_sft", "retool_grpo")):
        t, sft = e.get("timing") or {}, "runs" not in summary[stage]
        tok = (f"gen {t['gen_response_tokens_per_s']:.0f} (response), log-prob {t['old_log_prob_tokens_per_s']:.0f}, "
               f"update {t['update_actor_tokens_per_s']:.0f}, end-to-end {t['tokens_per_s_end_to_end']:.0f}" if t
               else f"train {e['tokens_per_s']:.0f}" if "tokens_per_s" in e else "-")
        rows.append((stage, f"{name} from random init" if sft else name, f"`{summary[stage].get('command', '?')}`",
                     f"{e['wall_s']:.0f}", e["steps"] if sft else f"{e['steps_done']}/{e['total_steps']}", tok,
                     f"{b['accuracy']:.3f} -> " + (f"{a['accuracy']:.3f}" if a else "(unfinished)"),
                     f"{b['correct_tool_call']:.3f} -> {a['correct_tool_call']:.3f}"
                     if a and "correct_tool_call" in a else "-"))
    compared = [x for st in ("grpo", "retool_grpo") for line in comparison_lines((summary.get(st) or {}).get(
        "comparison")) for x in ("", f"{st}: {line}")]
    return "\n".join([f"Device: {summary.get('device', '?')}; date {summary.get('date', '?')}; scale "
                      f"{summary.get('scale')}.", "", md_table(
                          ["stage", "run", "driver command", "wall s", "steps", "tokens/s per phase",
                           "held-out accuracy", "correct tool calls"], rows), *compared]) + "\n"


EXPORT_FILES = ("summary.md", "summary.json", "benchmarks.md")


def export(lay: Layout, dest: str) -> list[str]:
    """Copy the small outputs to dest as at most 8 flat files (the device machine returns no more from $OUT):
    summary.md, summary.json, benchmarks.md, the PNGs, and learn_logs.tar.gz with every stage's summary,
    metrics.jsonl, command.txt, stdout.log (last 200 kB), the trainer's own plots and any CSV curves. Models and
    checkpoints stay behind."""
    import io
    import tarfile

    os.makedirs(dest, exist_ok=True)
    written = []
    for f in EXPORT_FILES:
        if os.path.exists(os.path.join(lay.out, f)):
            shutil.copy2(os.path.join(lay.out, f), os.path.join(dest, f))
            written.append(f)
    pngs = sorted(f for f in os.listdir(lay.plots) if f.endswith(".png")) if os.path.isdir(lay.plots) else []
    for f in pngs[:8 - len(written) - 1]:
        shutil.copy2(os.path.join(lay.plots, f), os.path.join(dest, f))
        written.append(f)
    tmp = os.path.join(dest, "learn_logs.tar.gz.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for root, dirs, files in os.walk(lay.out):
            rel_root = os.path.relpath(root, lay.out)
            dirs[:] = [d for d in dirs if d not in ("checkpoints", "hf", "tokenizer") and
                       not (rel_root == "." and d == "data")]
            for f in files:
                path = os.path.join(root, f)
                if f == "stdout.log":
                    with open(path, "rb") as fh:
                        fh.seek(max(0, os.path.getsize(path) - 200_000))
                        data = fh.read()
                    info = tarfile.TarInfo(os.path.relpath(path, lay.out))
                    info.size, info.mtime = len(data), int(os.path.getmtime(path))
                    tar.addfile(info, io.BytesIO(data))
                elif f.endswith((".json", ".jsonl", ".md", ".png", ".txt", ".csv")):
                    tar.add(path, arcname=os.path.relpath(path, lay.out))
        if os.path.exists(lay.summary("data")):
            tar.add(lay.summary("data"), arcname="data/summary.json")
    os.replace(tmp, os.path.join(dest, "learn_logs.tar.gz"))
    return written + ["learn_logs.tar.gz"]


# ---------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", nargs="+", choices=STAGES, metavar="STAGE", help=" | ".join(STAGES))
    p.add_argument("--out", default="outputs/learn", help="where every stage reads and writes (default %(default)s)")
    p.add_argument("--scale", choices=sorted(SCALES), default="gpu",
                   help="gpu: the recipe (one H100); cpu: scaled to 2 cores (CI); tiny: the GPU configs shrunk to "
                        "run on CPU (exercises Ray, child processes, deadline, resume)")
    p.add_argument("--tiny", action="store_const", const="tiny", dest="scale", help="same as --scale tiny")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="trainer.device of every stage (default: the scale's configs)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout engine of the GRPO stages")
    p.add_argument("--runs", nargs="+", default=None, help="grpo runs, e.g. fused:1 fused:2 unfused:1")
    p.add_argument("--retool-runs", nargs="+", default=None, help="retool_grpo runs, e.g. fused:1")
    p.add_argument("--lora-rank", type=int, default=LORA_RANK, help="actor.lora.rank of the lora:SEED runs "
                   f"(alpha {LORA_ALPHA}, every linear; default %(default)s)")
    p.add_argument("--lora-lr-x", type=float, default=LORA_LR_X,
                   help="the lora:SEED runs' actor.lr as a multiple of the stage's (default %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="STAGE:KEY=VALUE",
                   help="a Hydra override for one stage's trainer, e.g. grpo:actor.lr=1e-5 (repeatable)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="this command's wall-clock budget in seconds: trainers still running when only the time "
                        "for evaluation and export is left are stopped (GRPO resumes from its last checkpoint when "
                        "the command is run again; a stage with too little time left is not started)")
    p.add_argument("--stage-timeout", type=float, default=None, help="seconds before one stage's trainers are stopped")
    p.add_argument("--force", action="store_true",
                   help="redo the named stages from scratch (default: skip what is done, resume what is not)")
    p.add_argument("--allow-unisolated", action="store_true",
                   help="retool_grpo: run tool code where the kernel cannot isolate it (sandbox.allow_unisolated)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true",
                   help="run trainers in this process one after another (CPU tests; no concurrency)")
    p.add_argument("--dry-run", action="store_true", help="compose and validate every stage's config, run nothing")
    p.add_argument("--export", default=None, help="copy summaries, plots and a log archive here after each stage")
    args = p.parse_args(argv)
    scale = SCALES[args.scale]
    args.runs = args.runs or scale.runs
    args.retool_runs = args.retool_runs or scale.retool_runs
    args.t_end = Deadline(args.deadline)
    args.unfinished = []
    return args, scale


EXIT_UNFINISHED = 3  # the deadline stopped something: run the same command again to continue


def main(argv=None) -> int:
    from rltrain.utils.errors import UserError

    args, scale = parse_args(argv)
    lay = Layout(args.out)
    summary_path = os.path.join(lay.out, "summary.json")
    summary = read_json(summary_path) if os.path.exists(summary_path) else {}
    summary.update(scale=args.scale, date=datetime.date.today().isoformat())
    driver_cmd = "python tools/learn_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        for stage in args.stages:
            t0 = time.time()
            log(f"stage {stage} ({args.scale} scale, out {lay.out}"
                + (f", {time_left(args):.0f} s of --deadline left)" if args.deadline else ")"))
            try:
                if stage == "data":
                    if args.dry_run:
                        continue
                    res = stage_data(lay, args, scale)
                elif stage in ("sft", "retool_sft"):
                    res = stage_sft(stage, lay, args, scale)
                elif stage in ("grpo", "retool_grpo"):
                    res = stage_grpo(stage, lay, args, scale)
                elif stage == "plots":
                    if args.dry_run:
                        continue
                    res = stage_plots(lay)
                else:
                    res = stage_eval(lay, args, scale)
            except DeadlineReached as why:
                log(f"{why}; run the same command again to continue")
                args.unfinished.append(stage)
                continue
            if args.dry_run:
                print(json.dumps({stage: res}, indent=1))
                continue
            if not res.pop("reused", False):
                res["stage_wall_s"] = round(time.time() - t0, 1)
                res["command"] = driver_cmd
            write_json(lay.summary(stage), res)
            summary[stage] = res
            summary["device"] = device_name()
            write_report(lay.out, "summary", summary, report(summary))  # summary.json, summary.md
            with open(os.path.join(lay.out, "benchmarks.md"), "w") as f:
                f.write(bench_table(summary))
            if args.export:
                export(lay, args.export)
            log(f"stage {stage} done in {time.time() - t0:.0f} s")
    except (UsageError, UserError) as err:
        print(f"learn_gpu: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        return 0
    print(report(summary), flush=True)
    if args.unfinished:
        log(f"unfinished: {', '.join(args.unfinished)}: run the same command again (exit {EXIT_UNFINISHED})")
        return EXIT_UNFINISHED
    return 0


if __name__ == "__main__":
    sys.exit(main())
