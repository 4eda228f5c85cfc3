"""The plan of one config: every GPU's peak by phase and part, seconds per step by phase, fits or not, and, when a
GPU does not fit, the cheapest config keys to change, each found by re-planning the changed config."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

from rltrain.config.parallel import ParallelDimsError
from rltrain.config.schema import RLConfig
from rltrain.plan import calibration as cal
from rltrain.plan.calibration import GIB
from rltrain.plan.inputs import DataLengths, Inputs, PlanInputError, read
from rltrain.plan.memory import GPU, grouped_gemm, plan_gpus
from rltrain.plan.timing import host_share, phase_seconds, step_range, tp_dp_factor
from rltrain.utils.errors import UserError



class PlanError(UserError, ValueError):
    """A GPU will not fit this config (the message names the GPU, the phase, the parts and the keys to change)."""


@dataclass
class Suggestion:
    overrides: dict[str, Any]
    peak_gib: float  # the largest GPU peak after the change
    step_s: float
    fits: bool

    @property
    def keys(self) -> str:
        return " ".join(f"{k}={_fmt(v)}" for k, v in self.overrides.items())


@dataclass
class Plan:
    inputs: Inputs
    device: str
    gpu_memory_gib: float
    gpus: list[GPU]
    seconds: dict[str, float]
    warnings: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    prompts: DataLengths | None = None  # the data's prompt lengths the plan was made at (make_plan's prompts)
    host_share: float = 0.0  # of the planned step, the host's time (timing.host_share)

    @property
    def step_range(self) -> tuple[float, float]:
        """The step time this config took across machines of one kind: its host time at host_speed_low ..
        host_speed_high (timing.step_range)."""
        return step_range(self.seconds["step"], self.host_share)

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.gpus)

    @property
    def worst(self) -> GPU:
        bad = [g for g in self.gpus if not g.fits]
        return max(bad or self.gpus, key=lambda g: (bool(g.refusals), g.peak_bytes / g.total_bytes))

    @property
    def peak_gib(self) -> float:
        return max(g.peak_bytes for g in self.gpus) / GIB

    def lengths_note(self) -> str:
        """What the plan's sequences are: '5 + 64 tokens (...)', saying where the prompt length came from."""
        x = self.inputs
        head = f"{x.max_prompt_length} + {x.max_response_length} tokens"
        if x.lengths_from == "data" and self.prompts is not None:
            d = self.prompts
            return (f"{head} (prompts: the data's longest; time at their mean, {x.mean_prompt_length:.1f} tokens, of "
                    f"{d.count:,} prompts in {d.where})")
        if x.lengths_from == "given":
            return f"{head} (as given)"
        return f"{head} (data.max_prompt_length + rollout.max_response_length: the worst case)"

    def summary(self) -> str:
        """One line for a log: the largest peak, where and when, and the step time by phase."""
        g = max(self.gpus, key=lambda g: g.peak_bytes)
        s = self.seconds
        lo, hi = self.step_range
        return (f"rltrain.plan: peak {g.peak_bytes / GIB:.1f} of {g.total_bytes / GIB:.1f} GiB on GPU {g.index} in "
                f"'{g.peak().name}' ({'fits' if self.fits else 'DOES NOT FIT'}); step ~{s['step']:.1f} s, "
                f"{lo:.1f}-{hi:.1f} by machine (generation "
                f"{s['generation']:.1f}, log-probs {s['log-probs']:.1f}, update {s['update']:.1f}, weight sync "
                f"{s['weight sync']:.1f}) at {cal.DEVICES[self.device].name} rates; sequences of "
                f"{self.lengths_note()}")

    def refusal(self) -> str:
        """The message of a plan that does not fit ('' when it fits)."""
        if self.fits:
            return ""
        g = self.worst
        ph = g.peak()
        over = g.peak_bytes - g.total_bytes
        parts = sorted({**ph.parts, **ph.non_torch}.items(), key=lambda kv: -kv[1])
        top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts[:5] if v > 0)
        head = (f"GPU {g.index} ({', '.join(g.roles)}) does not fit: its peak, in phase '{ph.name}', is "
                f"{g.peak_bytes / GIB:.1f} GiB of {g.total_bytes / GIB:.1f} GiB"
                + (f" ({over / GIB:.1f} GiB over)" if over > 0 else "") + f"; the largest parts (GiB): {top}.")
        for r in g.refusals:
            head += " " + r.removeprefix("REFUSE: ") + "."
        state = sum(v for k, v in ph.parts.items() if k.endswith(("weights", "fp32 master", "optimizer (AdamW)")))
        more = ""
        if state > g.total_bytes:
            more = (f"\nThe training roles' weights and optimizer state alone are {state / GIB:.1f} GiB: more GPUs are "
                    "needed (trainer.n_gpus_per_node / trainer.nnodes" + (
                        ", with actor.expert_parallel_size up to the data-parallel size" if self.inputs.shape.moe
                        else "") + ").")
        if self.suggestions:
            lines = [f"  set {s.keys}: {self.peak_gib:.1f} -> {s.peak_gib:.1f} GiB, step {self.seconds['step']:.1f} "
                     f"-> {s.step_s:.1f} s" for s in self.suggestions if s.fits]
            if lines:
                return head + "\nChanges that fit (re-planned; cheapest step time first):\n" + "\n".join(lines)
            lines = [f"  set {s.keys}: {self.peak_gib:.1f} -> {s.peak_gib:.1f} GiB" for s in self.suggestions]
            return (head + "\nNo single change or pair of changes fits; the ones that help most:\n" + "\n".join(lines)
                    + more)
        return head + more


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _set(cfg: RLConfig, key: str, value: Any) -> RLConfig:
    """A copy of `cfg` with the dotted key `key` (actor.tensor_parallel_size) set to `value`."""
    out = copy.deepcopy(cfg)
    *path, last = key.split(".")
    setattr(functools.reduce(getattr, path, out), last, value)
    return out


def device_of(device: str | None, gpu_memory_gib: float | None) -> str:
    if device:
        if device not in cal.DEVICES:
            raise PlanError(f"--device {device!r} is unknown; choose one of {', '.join(cal.DEVICES)}")
        return device
    if gpu_memory_gib is not None and gpu_memory_gib > 100:
        return "h200"
    return "h100"


def placement_problems(x: Inputs) -> list[str]:
    """Why a (re-planned) config's placement or model split is impossible: the rules of the degrees and of the shapes
    they split (config/parallel.py's ParallelDims, which placement, megatron's setup and the model builder ask too),
    a TP group across nodes, a rollout TP that does not divide a node's GPUs."""
    s = x.shape
    try:
        e = x.dims.model_problems(layers=s.num_hidden_layers, heads=s.num_attention_heads,
                                  kv_heads=s.num_key_value_heads, experts=s.num_experts if s.moe else 0,
                                  expert_ffn=s.moe_intermediate_size if s.moe else 0)
    except ParallelDimsError as err:
        e = list(err.problems)
    if x.nnodes > 1 and x.n_gpus_per_node % x.tp:
        e.append("TP spans nodes")
    if x.colocated and x.n_gpus_per_node % x.rollout_tp:
        e.append("rollout TP does not divide the GPUs of a node")
    return e


@dataclass(frozen=True)
class Lengths:
    """The sequence lengths to plan for: given ones (prompt_tokens / response_tokens) first, then the data's (its
    longest prompt for memory, its mean for time), else the config's bounds (data.max_prompt_length,
    rollout.max_response_length: the worst case)."""

    prompt_tokens: int | None = None
    response_tokens: int | None = None
    data: DataLengths | None = None

    def apply(self, x: Inputs) -> Inputs:
        if self.prompt_tokens is not None:
            x = dataclasses.replace(x, max_prompt_length=int(self.prompt_tokens), lengths_from="given")
        elif self.data is not None:
            longest = max(1, min(int(self.data.longest), x.max_prompt_length))
            x = dataclasses.replace(x, max_prompt_length=longest, lengths_from="data",
                                    mean_prompt_length=max(1.0, min(float(self.data.mean), longest)))
        if self.response_tokens is not None:
            x = dataclasses.replace(x, max_response_length=int(self.response_tokens))
        return x


def make_plan(cfg: RLConfig, *, gpu_memory_gib: float | None = None, device: str | None = None,
              prompt_tokens: int | None = None, response_tokens: int | None = None,
              prompts: DataLengths | None = None, suggest: bool = True) -> Plan:
    """Plan the typed RLConfig `cfg`. gpu_memory_gib: each GPU's memory (default: the device
    kind's); device: h100 | h200 (default h100, or h200 above 100 GiB); prompt_tokens / response_tokens: the
    lengths to plan for (default data.max_prompt_length / rollout.max_response_length, the worst case); prompts:
    the training data's prompt lengths (rltrain.data.lengths.data_lengths), planned at in place of
    data.max_prompt_length when prompt_tokens is not given (memory at the longest, time at the mean)."""
    dev = device_of(device, gpu_memory_gib)
    total = (gpu_memory_gib if gpu_memory_gib is not None else cal.DEVICES[dev].total_gib) * GIB
    lengths = Lengths(prompt_tokens, response_tokens, prompts)
    x = lengths.apply(read(cfg))
    bad = placement_problems(x)
    if bad:
        raise PlanInputError(f"cannot plan this placement (actor.tensor_parallel_size={x.tp}, "
                             f"actor.pipeline_parallel_size={x.pp}, rollout.tensor_parallel_size={x.rollout_tp}, "
                             f"trainer.n_gpus_per_node={x.n_gpus_per_node}, trainer.nnodes={x.nnodes}, model "
                             f"{x.shape.name}): " + "; ".join(bad))
    plan = _plan(x, dev, total)
    plan.prompts = prompts
    if suggest and not plan.fits:
        plan.suggestions = suggestions(cfg, plan, dev, total, lengths)
    return plan


def _plan(x: Inputs, dev: str, total: float) -> Plan:
    gpus = plan_gpus(x, total)
    secs = phase_seconds(x, cal.DEVICES[dev].hbm_bytes_per_s, total)
    warnings = []
    if x.device == "cpu":
        warnings.append("trainer.device=cpu: planned as if every worker had a GPU of this size (CPU memory is not "
                        "modelled)")
    if grouped_gemm(x):
        warnings.append("actor.moe_grouped_gemm=true: the experts' time is their active FLOPs at the dense rate plus "
                        f"{cal.value('moe_grouped_layer_pass_s') * 1e3:.2f} ms per sparse layer and pass, fitted on "
                        "one run (the Qwen3-30B-A3B slice at EP=2); other shapes are extrapolated")
    if tp_dp_factor(x) != 1.0:
        warnings.append(f"actor TP={x.tp} x DP={x.dp}, colocated: the host's floors and the weight sync x "
                        f"{tp_dp_factor(x):.2f}, a factor "
                        "measured on TP=2 x DP=2 runs (the 0.6B and the 4B, four GPUs), not derived; other TP x DP "
                        "layouts are extrapolated (docs/plan.md, Limits)")
    share = host_share(x, cal.DEVICES[dev].hbm_bytes_per_s, total, secs["step"])
    return Plan(x, dev, total / GIB, gpus, secs, warnings, host_share=share)


def _candidates(c: RLConfig, x: Inputs) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not x.recompute:
        out.append({"actor.recompute_activations": True})
        out.append({"actor.recompute_activations": True, "actor.recompute_granularity": "selective"})
    elif x.recompute_granularity == "selective":
        out.append({"actor.recompute_granularity": "full"})
    b = x.mb_tokens
    for div in (2, 4, 8):
        if b // div >= x.seq_len:
            out.append({"actor.max_tokens_per_micro_batch": b // div})
    if x.fwd_mb_tokens != x.mb_tokens:  # the forward passes' own budget (actor.log_prob_max_tokens_per_micro_batch)
        for div in (2, 4, 8):
            if x.fwd_mb_tokens // div >= x.seq_len:
                out.append({"actor.log_prob_max_tokens_per_micro_batch": x.fwd_mb_tokens // div})
    if x.use_critic:
        for div in (2, 4):
            if x.critic_mb_tokens // div >= x.seq_len:
                out.append({"critic.max_tokens_per_micro_batch": x.critic_mb_tokens // div})
    for tp in (2, 4, 8):
        if tp > x.tp:
            out.append({"actor.tensor_parallel_size": tp})
    for pp in (2, 4):
        if pp > x.pp:
            out.append({"actor.pipeline_parallel_size": pp})
    if x.shape.moe:
        for ep in (2, 4, 8, 16):
            if ep > x.ep:
                out.append({"actor.expert_parallel_size": ep})
    if not x.fused_head:
        out.append({"trainer.fused_linear_logprob": True})
    if x.engine != "vllm" and x.max_batch_size > 32:
        out.append({"rollout.max_batch_size": x.max_batch_size // 4})
    return out


def _apply(c: RLConfig, ov: dict[str, Any]) -> RLConfig:
    for k, v in ov.items():
        c = _set(c, k, v)
    return c


def _try(c: RLConfig, ov: dict[str, Any], dev: str, total: float, lengths: Lengths) -> tuple[Plan, RLConfig] | None:
    cc = _apply(c, ov)
    try:
        x = lengths.apply(read(cc))
    except UserError:
        return None
    if placement_problems(x):
        return None
    return _plan(x, dev, total), cc


def _with_best_u(c: RLConfig, ov: dict[str, Any], dev: str, total: float, lengths: Lengths) -> dict[str, Any] | None:
    """`ov` plus the largest rollout.gpu_memory_utilization (in steps of 0.05 below the current) that fits."""
    x = read(c)
    if x.engine != "vllm" or x.kv_cache_memory_gb is not None or not x.colocated:
        return None
    u = round(x.gpu_memory_utilization - 0.05, 2)
    while u >= 0.05:
        r = _try(c, {**ov, "rollout.gpu_memory_utilization": u}, dev, total, lengths)
        if r is not None and r[0].fits:
            return {**ov, "rollout.gpu_memory_utilization": u}
        u = round(u - 0.05, 2)
    return None


def suggestions(c: RLConfig, plan: Plan, dev: str, total: float, lengths: Lengths | None = None,
                limit: int = 4) -> list[Suggestion]:
    """The cheapest changes (by predicted step time) that make `c` fit: single keys, then pairs, each with the
    largest rollout.gpu_memory_utilization that fits where vLLM shares the GPUs; each re-planned."""
    x = plan.inputs
    lengths = lengths or Lengths()
    singles = _candidates(c, x)
    tried: dict[str, Suggestion] = {}

    def consider(ov: dict[str, Any]) -> None:
        variants = [ov]
        best_u = _with_best_u(c, ov, dev, total, lengths)
        if best_u is not None:
            variants.append(best_u)
        for v in variants:
            key = repr(sorted(v.items()))
            if key in tried:
                continue
            r = _try(c, v, dev, total, lengths)
            if r is None:
                continue
            p = r[0]
            tried[key] = Suggestion(v, p.peak_gib, p.seconds["step"], p.fits)

    consider({})
    for ov in singles:
        consider(ov)
    if True:  # pairs too: two cheap changes can beat one expensive one
        for a, b in itertools.combinations(singles, 2):
            if set(a) & set(b):
                continue
            consider({**a, **b})
    fits = sorted((s for s in tried.values() if s.fits and s.overrides),
                  key=lambda s: (s.step_s, len(s.overrides), s.peak_gib))
    if fits:
        # keep the cheapest, and drop a suggestion that merely adds keys to a cheaper one already listed
        out: list[Suggestion] = []
        for s in fits:
            if any(set(o.overrides.items()) <= set(s.overrides.items()) for o in out):
                continue
            out.append(s)
            if len(out) == limit:
                break
        return out
    # none fits: those that lower the peak most (a change that lowers nothing is no help)
    helpful = sorted((s for s in tried.values() if s.overrides and s.peak_gib < plan.peak_gib - 0.05),
                     key=lambda s: s.peak_gib)
    return helpful[:limit]


def check(cfg: RLConfig, *, gpu_memory_gib: float | None = None, device: str | None = None,
          prompts: DataLengths | None = None) -> Plan:
    """Plan `cfg` and raise PlanError (a UserError: the entry points print it and exit 2) when a GPU will not fit,
    with the GPU, the phase, the overflowing parts and the cheapest keys to change. Returns the Plan when it fits.
    prompts: the data's prompt lengths (make_plan). Imports no GPU library and starts nothing."""
    plan = make_plan(cfg, gpu_memory_gib=gpu_memory_gib, device=device, prompts=prompts)
    if not plan.fits:
        raise PlanError("the plan does not fit the GPUs (rltrain.plan): " + plan.refusal())
    return plan
