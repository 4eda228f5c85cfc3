"""The plan of one config: every GPU's peak by phase and part, seconds per step by phase, fits or not (made by
suggest.py's make_plan, with the cheapest keys to change when a GPU does not fit)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rltrain.config.parallel import ParallelDimsError
from rltrain.plan import calibration as cal
from rltrain.plan.calibration import GIB
from rltrain.plan.inputs import DataLengths, Inputs
from rltrain.plan.memory import GPU, grouped_gemm, host_bytes, plan_gpus
from rltrain.plan.timing import host_share, phase_seconds, step_range, tp_dp_factor
from rltrain.utils.errors import UserError

MAX_KEYS = 4  # the most keys one suggestion changes
MAX_GPUS = 64  # more_gpus searches GPU counts up to this
BEAM = 3  # combinations extended a key at a time when no single change or pair fits


class PlanError(UserError, ValueError):
    """A GPU will not fit this config (the message names the GPU, the phase, the parts and the keys to change)."""


@dataclass
class Suggestion:
    overrides: dict[str, Any]
    peak_gib: float  # the largest GPU peak after the change
    step_s: float
    fits: bool
    gpus: int = 0  # the GPUs it was planned on

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
    # when nothing tried on these GPUs fits: the fewest GPUs found that fit, with the keys (None: none up to
    # MAX_GPUS, or not searched)
    more_gpus: Suggestion | None = None
    searched_gpus: int = 0  # the largest GPU count more_gpus searched (0: not searched)

    @property
    def step_range(self) -> tuple[float, float]:
        """The step time across machines of one kind (timing.step_range)."""
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

    def verdict(self) -> str:
        """`fits: yes|NO (N x <GPU kind>, G GiB each)`: the answer beside the GPUs it was planned for."""
        dev = cal.DEVICES[self.device]
        other = next((k for k in cal.DEVICES if k != self.device), None)
        hint = f"; --device {other} plans for {cal.DEVICES[other].name}" if other else ""
        return (f"fits: {'yes' if self.fits else 'NO'} (planned for {self.inputs.world} x {dev.name}, "
                f"{self.gpu_memory_gib:.1f} GiB each{hint})")

    def refusal(self) -> str:
        """Why the plan does not fit ('' when it fits): the worst GPU and its parts, then the changes that fit."""
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
        lines = [f"  set {s.keys}: {self.peak_gib:.1f} -> {s.peak_gib:.1f} GiB, step {self.seconds['step']:.1f} "
                 f"-> {s.step_s:.1f} s" for s in self.suggestions if s.fits]
        if lines:
            return head + "\nChanges that fit (re-planned; cheapest step time first):\n" + "\n".join(lines)
        n = self.inputs.world
        out = head + f"\nNothing tried on these {n} GPU(s) fits (each change, pairs, and the most helpful extended " \
                     f"up to {MAX_KEYS} keys)"
        if self.suggestions:
            out += "; the ones that help most:\n" + "\n".join(
                f"  set {s.keys}: {self.peak_gib:.1f} -> {s.peak_gib:.1f} GiB" for s in self.suggestions)
        else:
            out += "."
        state = sum(v for k, v in ph.parts.items() if k.endswith(("weights", "fp32 master", "optimizer (AdamW)")))
        if state > g.total_bytes:
            out += (f"\nThe training roles' weights and optimizer state alone are {state / GIB:.1f} GiB on this GPU: "
                    "more GPUs are needed to split them (trainer.n_gpus_per_node / trainer.nnodes with "
                    "actor.tensor_parallel_size / pipeline_parallel_size"
                    + (", actor.expert_parallel_size up to the data-parallel size" if self.inputs.shape.moe else "")
                    + ").")
        m = self.more_gpus
        if m is not None:
            out += (f"\nMore GPUs are needed: {m.gpus} GPUs fit with: set {m.keys}: peak {m.peak_gib:.1f} GiB per GPU, "
                    f"step {m.step_s:.1f} s (re-planned).")
        elif self.searched_gpus:
            out += f"\nNothing tried fits on up to {self.searched_gpus} GPUs either (of this kind and size)."
        return out


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def device_of(device: str | None, gpu_memory_gib: float | None) -> str:
    if device:
        if device not in cal.DEVICES:
            raise PlanError(f"--device {device!r} is unknown; choose one of {', '.join(cal.DEVICES)}")
        return device
    if gpu_memory_gib is not None and gpu_memory_gib > 100:
        return "h200"
    return "h100"


def placement_problems(x: Inputs) -> list[str]:
    """Why a (re-planned) config's placement or model split is impossible: ParallelDims's rules (which placement and
    the model builder ask too), a TP group across nodes, a rollout TP that does not divide a node's GPUs."""
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
    """The sequence lengths to plan for: given ones first, then the data's (the longest prompt for memory, the mean
    for time), else the config's bounds (the worst case)."""

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
    host = sum(host_bytes(x, g.stage) for g in gpus if g.stage is not None) / max(1, x.nnodes)
    if host:
        warnings.append(f"offload: the state moved to the host takes {host / GIB:.0f} GiB of pinned host memory per "
                        "node (actor.optimizer_offload_fraction, actor.offload_while_rollout, ref.offload)")
    share = host_share(x, cal.DEVICES[dev].hbm_bytes_per_s, total, secs["step"])
    return Plan(x, dev, total / GIB, gpus, secs, warnings, host_share=share)
