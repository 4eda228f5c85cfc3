"""Builds what the driver loop needs from the config: the checks before anything starts, tokenizer, datasets +
sampler, reward fn, worker groups.

Construction only; the loop itself is in ppo.py. `check_config` is where a run's config is checked: config/'s pure
rules, then the rules that belong to a room config/ may not import (rollout/: engine names, tool patterns, the vLLM
head_dim rules; workers/placement.py: placement, rollout.engines_per_gpu; the device), in one report.
`plan_check` then runs rltrain.plan on a GPU run (trainer.plan_check) at the training data's prompt lengths
(rltrain/data/lengths.py), after the datasets and before Ray or any worker; `plan_metrics` gives its per-GPU
prediction to each step's metrics.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

from rltrain.config.schema import RLConfig


def check_config(cfg: RLConfig) -> None:
    """Raise ConfigError listing every problem of the typed RLConfig `cfg` before anything starts."""
    from rltrain.config.validate import config_errors, raise_errors

    raise_errors(config_errors(cfg) + room_errors(cfg))


def room_errors(cfg: RLConfig) -> list[str]:
    """The rules the rooms own, asked of them: names and rules config/ cannot import (see the module docstring)."""
    from rltrain.rollout import ENGINES, TOOL_PATTERNS
    from rltrain.workers.placement import engines_per_gpu_error, placement_errors

    r, t, m = cfg.rollout, cfg.trainer, cfg.model
    e: list[str] = []
    if r.engine not in ENGINES:
        e.append(f"rollout.engine={r.engine!r} is not allowed; choose one of {', '.join(ENGINES)}")
    mt = r.multi_turn
    if mt.enable and mt.tool_pattern not in TOOL_PATTERNS and "(" not in mt.tool_pattern:
        e.append(f"rollout.multi_turn.tool_pattern={mt.tool_pattern!r}: choose one of "
                 f"{', '.join(TOOL_PATTERNS)} or a regex with one capture group")
    why = engines_per_gpu_error(r.engines_per_gpu, engine=r.engine, tensor_parallel_size=r.tensor_parallel_size,
                                colocated=t.colocate, device=t.device, group_size=t.n_gpus_per_node * t.nnodes)
    if why:
        e.append(why)
    if r.engine == "vllm":
        e.extend(_vllm_head_dim_errors(m, r, t))
    e.extend(placement_errors(cfg, device=t.device if t.device != "auto" else None))
    if t.device == "cuda" and not torch.cuda.is_available():
        e.append("trainer.device=cuda but no CUDA device is visible here; use trainer.device=cpu (or auto)")
    return e


def _vllm_head_dim_errors(m, r, t) -> list[str]:
    """vLLM's head_dim limits for a built-in preset (its shapes are known before any download): on GPUs with
    tensor parallel > 1 (rollout/vllm.py tp_head_dim_error), on CPU its attention kernels' head sizes."""
    from types import SimpleNamespace

    from rltrain.config.presets import BUILTINS
    from rltrain.utils import flops

    if m.builtin not in BUILTINS:
        return []
    head_dim = flops.head_dim(SimpleNamespace(**{**BUILTINS[m.builtin], **(m.overrides or {})}))
    on_gpu = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    if on_gpu:
        from rltrain.rollout.vllm import tp_head_dim_error  # the rule and its measurement live with the engine

        why = tp_head_dim_error(head_dim, r.tensor_parallel_size)
        return [f"model.builtin={m.builtin} has head_dim {head_dim}: {why}"] if why else []
    try:
        from rltrain.compat.vllm import cpu_attention_head_sizes

        sizes = cpu_attention_head_sizes()
    except ImportError:  # no vLLM here: the engine's start says so
        return []
    if head_dim in sizes:
        return []
    fit = min((s for s in sizes if s >= head_dim), default=max(sizes))
    return [f"model.builtin={m.builtin} has head_dim {head_dim}, and vLLM's CPU build has no attention kernel for it "
            f"(it takes {sorted(sizes)}): give the model one (+model.overrides.head_dim={fit}) or use "
            "rollout.engine=hf"]


def run_directory() -> str:
    """Hydra's run dir when running under Hydra, else the current directory."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return os.getcwd()


def build_datasets(cfg: RLConfig):
    """(tokenizer, train dataset, val dataset or None, prompt sampler, reward fn) of a typed RLConfig."""
    from rltrain.data.build import prompt_datasets
    from rltrain.data.dataset import PromptSampler
    from rltrain.data.tokenizer import load_tokenizer
    from rltrain.rewards import get_reward_fn

    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    train, val = prompt_datasets(cfg, tokenizer)
    sampler = PromptSampler(train, batch_size=cfg.data.train_batch_size, seed=cfg.trainer.seed,
                            shuffle=cfg.data.shuffle)
    reward = get_reward_fn(cfg.reward.fn)
    return tokenizer, train, val, sampler, reward


def check_model(cfg: RLConfig, tokenizer) -> None:
    """On the driver before any worker starts, after the datasets (it needs the tokenizer): the model's HF config,
    so a wrong model.path fails now, and the distillation teacher's files and vocabulary (workers/teacher.py). The
    config itself was checked before any data or tokenizer work (`check_config`, then `plan_check`, at the top of
    PPOTrainer.__init__)."""
    from rltrain.config.schema import TeacherConfig
    from rltrain.models.presets import model_hf_config

    model_hf_config(cfg.model, tokenizer)
    if TeacherConfig.enabled(cfg.teacher):
        from rltrain.workers.teacher import check_teacher

        check_teacher(cfg.teacher, student=cfg.model, student_tokenizer=tokenizer, actor=cfg.actor)


def plan_check(cfg: RLConfig, *, device: str | None = None, gpu_memory_gib: float | None = None, dataset=None):
    """trainer.plan_check on a GPU run, before Ray, vLLM or any worker starts: rltrain.plan's prediction of every
    GPU's peak (docs/plan.md), printed once; a GPU that will not fit raises PlanError (a UserError: the entry
    point prints it and exits 2) with `error`, is a printed warning with `warn`; `off` plans nothing. Returns the
    Plan (None when nothing was planned). On CPU nothing is planned (said once at debug level).

    device: the resolved trainer.device (default: resolved as build_workers does); gpu_memory_gib: each GPU's
    memory (default: what torch reports for GPU 0, `gpu_memory_gib()`); dataset: the trainer's train dataset, whose
    prompt lengths (rltrain/data/lengths.py) are planned at in place of data.max_prompt_length."""
    from rltrain.plan import PlanError, make_plan
    from rltrain.plan.inputs import PlanInputError

    mode = cfg.trainer.plan_check
    if mode == "off":
        return None
    if device is None:
        device = _resolved_device(cfg.trainer.device)
    if device != "cuda":
        logging.getLogger(__name__).debug("trainer.plan_check: a CPU run (trainer.device=%s): nothing to plan",
                                          cfg.trainer.device)
        return None
    if gpu_memory_gib is None:
        gpu_memory_gib = gpu_memory()  # None (unreadable): the planner's H100 80GB
    prompts = None
    if dataset is not None:
        from rltrain.data.lengths import data_lengths

        prompts = data_lengths(cfg, dataset)
    try:
        plan = make_plan(cfg, gpu_memory_gib=gpu_memory_gib, prompts=prompts)
    except PlanInputError as err:  # a model whose shape the planner cannot read: the run is not refused for it
        print(f"rltrain: warning: trainer.plan_check: cannot plan this config ({err}); the run starts unchecked",
              file=sys.stderr, flush=True)
        return None
    print(plan.summary(), file=sys.stderr, flush=True)
    for w in plan.warnings:
        print(f"rltrain.plan: warning: {w}", file=sys.stderr, flush=True)
    if not plan.fits:
        message = "the plan does not fit the GPUs (rltrain.plan): " + plan.refusal()
        if mode == "error":
            raise PlanError(message + "\n(trainer.plan_check=warn starts the run anyway)")
        print(f"rltrain: warning: trainer.plan_check=warn: {message}\nThe run starts anyway.", file=sys.stderr,
              flush=True)
    return plan


def _resolved_device(device: str) -> str:
    """trainer.device resolved as build_workers resolves it ("auto": cuda when a GPU is visible)."""
    from rltrain.workers.hybrid import resolve_device

    return resolve_device(device)


def gpu_memory() -> float | None:
    """GPU 0's memory in GiB as torch reports it (`total_memory`, the planner's unit: 79.18 for an H100 80GB). Read
    in a child process unless this one already uses CUDA: the driver of a Ray run initializes no CUDA (its
    perf/ metrics stay the process's RSS, and no CUDA context of it lands on a worker's GPU). None (with a
    warning) when the child cannot read it."""
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    probe = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
        return int(out.stdout.strip().splitlines()[-1]) / 2**30
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        print(f"rltrain: warning: trainer.plan_check: cannot read GPU 0's memory ({type(err).__name__}); planning "
              "for an H100 80GB", file=sys.stderr, flush=True)
        return None


def plan_metrics(plan) -> dict[str, float]:
    """Each planned GPU k's prediction for the step metrics, beside the measured per-GPU peaks
    (perf/max_memory_allocated_gb/<group>_rank<r>; GPU k is rank k of the training group, then the rollout
    group's ranks under split placement): perf/plan_max_memory_allocated_gb/gpu<k> and
    perf/plan_max_memory_reserved_gb/gpu<k> (what torch.cuda.max_memory_allocated / _reserved will show, beside
    perf/max_memory_*_gb) and perf/plan_peak_gib/gpu<k> (its peak on the device; docs/plan.md says why the counters
    can exceed it with vLLM in the process)."""
    if plan is None:
        return {}
    out = {}
    for g in plan.gpus:
        out[f"perf/plan_max_memory_allocated_gb/gpu{g.index}"] = g.allocator_peak_bytes / 2**30
        out[f"perf/plan_max_memory_reserved_gb/gpu{g.index}"] = g.allocator_reserved_bytes / 2**30
        out[f"perf/plan_peak_gib/gpu{g.index}"] = g.peak_bytes / 2**30
    return out


def build_workers(cfg: RLConfig, *, use_ref: bool, use_critic: bool, ckpt_dir: str | None = None):
    """(train group, rollout group, teacher group): the first two the same object in colocated mode; the teacher's
    is the train group when the teacher is colocated (teacher.colocate), its own group otherwise, None without a
    teacher. Placement (how many workers, where, which device) is workers/placement.py's; under Ray, `ckpt_dir` is
    checked to be shared by every node."""
    from rltrain.config.schema import TeacherConfig
    from rltrain.workers.group import LocalWorkerGroup, WorkerGroup, check_cluster, check_shared_dir
    from rltrain.workers.hybrid import HybridWorker, resolve_device
    from rltrain.workers.placement import cpus_per_worker, plan_groups

    t = cfg.trainer
    device = resolve_device(t.device)
    plans = plan_groups(cfg, device=device, use_ref=use_ref, use_critic=use_critic)
    if not t.use_ray:
        group = LocalWorkerGroup(HybridWorker, worker_kwargs={"cfg": cfg, "roles": list(plans[0].roles)})
        group.setup()
        return group, group, group if TeacherConfig.enabled(cfg.teacher) else None
    node_cpus = check_cluster(nnodes=t.nnodes, gpus_per_node=t.n_gpus_per_node if device == "cuda" else 0)
    cpus = cpus_per_worker(plans, device=device, node_cpus=node_cpus, nnodes=t.nnodes)
    groups: list = []
    try:
        for plan in plans:
            groups.append(WorkerGroup(HybridWorker, plan, cpus_per_worker=cpus,
                                      worker_kwargs={"cfg": cfg, "roles": list(plan.roles)}))
        if ckpt_dir is not None:
            check_shared_dir(ckpt_dir, groups)
        for group in groups:
            group.setup()
    except BaseException:
        for group in groups:  # no actor or placement group outlives a failed start
            group.shutdown()
        raise
    rollout = next(g for g in groups if "rollout" in g.plan.roles)
    return groups[0], rollout, next((g for g in groups if "teacher" in g.plan.roles), None)
