"""A config's plan (`make_plan`; `check` refuses one that does not fit) and, when a GPU will not fit, the cheapest
config keys to change, each re-planned: single changes and pairs (each with the largest rollout.gpu_memory_utilization
that fits where vLLM shares the GPUs), then the most helpful extended a key at a time (a beam of planner.BEAM, up to
planner.MAX_KEYS keys), then doubling GPU counts up to planner.MAX_GPUS (one node grows to 8, then nodes are added).
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Any

from rltrain.config.schema import RLConfig
from rltrain.plan import calibration as cal
from rltrain.plan.calibration import GIB
from rltrain.plan.inputs import DataLengths, Inputs, PlanInputError, read
from rltrain.plan.planner import (BEAM, MAX_GPUS, MAX_KEYS, Lengths, Plan, PlanError, Suggestion, _plan, device_of,
                                  placement_problems)
from rltrain.utils.errors import UserError


def _apply(cfg: RLConfig, ov: dict[str, Any]) -> RLConfig:
    """A copy of `cfg` with each dotted key of `ov` (actor.tensor_parallel_size) set to its value."""
    out = copy.deepcopy(cfg)
    for key, value in ov.items():
        *path, last = key.split(".")
        setattr(functools.reduce(getattr, path, out), last, value)
    return out


def _candidates(c: RLConfig, x: Inputs) -> list[dict[str, Any]]:
    """Every single change that lowers some GPU's peak, cheapest kinds first."""
    out: list[dict[str, Any]] = []
    if not x.recompute:
        out.append({"actor.recompute_activations": True})
        out.append({"actor.recompute_activations": True, "actor.recompute_granularity": "selective"})
    elif x.recompute_granularity == "selective":
        out.append({"actor.recompute_granularity": "full"})
    out += [{"actor.max_tokens_per_micro_batch": x.mb_tokens // d} for d in (2, 4, 8) if x.mb_tokens // d >= x.seq_len]
    if x.fwd_mb_tokens != x.mb_tokens:  # the forward passes' own budget (actor.log_prob_max_tokens_per_micro_batch)
        out += [{"actor.log_prob_max_tokens_per_micro_batch": x.fwd_mb_tokens // d} for d in (2, 4, 8)
                if x.fwd_mb_tokens // d >= x.seq_len]
    if x.use_critic:
        out += [{"critic.max_tokens_per_micro_batch": x.critic_mb_tokens // d} for d in (2, 4)
                if x.critic_mb_tokens // d >= x.seq_len]
    out += [{"actor.tensor_parallel_size": tp} for tp in (2, 4, 8) if tp > x.tp]
    out += [{"actor.pipeline_parallel_size": pp} for pp in (2, 4, 8) if pp > x.pp]
    if x.shape.moe:
        out += [{"actor.expert_parallel_size": ep} for ep in (2, 4, 8, 16) if ep > x.ep]
    if not x.fused_head:
        out.append({"trainer.fused_linear_logprob": True})
    # offload (models/megatron/offload.py): state to the host while the engine is awake, the reference streamed, a
    # share of the optimizer state on the host for good (each costs copies: timing.py)
    if x.colocated and x.free_cache_engine and not x.offload_while_rollout:
        out.append({"actor.offload_while_rollout": True})
    if x.use_ref and not x.ref_offload:
        out.append({"ref.offload": True})
    out += [{"actor.optimizer_offload_fraction": f} for f in (0.5, 1.0) if f > x.optimizer_offload_fraction]
    if x.engine != "vllm" and x.max_batch_size > 32:
        out.append({"rollout.max_batch_size": x.max_batch_size // 4})
    if x.engine == "vllm":  # the rollout's share: its weights split over more GPUs, asleep while training, one engine
        out += [{"rollout.tensor_parallel_size": tp} for tp in (2, 4, 8) if tp > x.rollout_tp]
        if x.colocated and not x.free_cache_engine:
            out.append({"rollout.free_cache_engine": True})
        if x.engines_per_gpu > 1:
            out.append({"rollout.engines_per_gpu": 1})
    return out


def _sized_by_share(x: Inputs) -> bool:
    """Whether the GPU's rollout.gpu_memory_utilization sizes a colocated vLLM engine (no fixed KV cache)."""
    return x.engine == "vllm" and x.kv_cache_memory_gb is None and x.colocated


def _memory_shares(c: RLConfig, x: Inputs) -> list[dict[str, Any]]:
    """Lower rollout.gpu_memory_utilization values (colocated vLLM sized by the fraction), for deeper searches."""
    if not _sized_by_share(x):
        return []
    return [{"rollout.gpu_memory_utilization": u} for u in (0.4, 0.3, 0.2, 0.15, 0.1)
            if u < x.gpu_memory_utilization - 0.01]


def _try(c: RLConfig, ov: dict[str, Any], dev: str, total: float, lengths: Lengths) -> tuple[Plan, RLConfig] | None:
    cc = _apply(c, ov)
    try:
        x = lengths.apply(read(cc))
    except UserError:
        return None
    if placement_problems(x):
        return None
    return _plan(x, dev, total), cc


def _record(c: RLConfig, ov: dict[str, Any], dev: str, total: float, lengths: Lengths,
            tried: dict[str, Suggestion]) -> Suggestion | None:
    """`ov` planned on top of `c` as a Suggestion, kept in `tried` (None: tried before, or impossible)."""
    key = repr(sorted(ov.items()))
    if key in tried:
        return None
    r = _try(c, ov, dev, total, lengths)
    if r is None:
        return None
    p = r[0]
    tried[key] = Suggestion(ov, p.peak_gib, p.seconds["step"], p.fits, p.inputs.world)
    return tried[key]


def _with_best_u(c: RLConfig, ov: dict[str, Any], dev: str, total: float, lengths: Lengths) -> dict[str, Any] | None:
    """`ov` plus the largest rollout.gpu_memory_utilization (in steps of 0.05 below the current) that fits."""
    x = read(c)
    if not _sized_by_share(x):
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
    """The cheapest changes (by predicted step time) that make `c` fit, each re-planned (the module's search)."""
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
            _record(c, v, dev, total, lengths, tried)

    consider({})
    for ov in singles:
        consider(ov)
    for a, b in itertools.combinations(singles, 2):  # pairs too: two cheap changes can beat one expensive one
        if not set(a) & set(b):
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
    # none fits: the most helpful extended a key at a time (up to MAX_KEYS), else those that lower the peak most
    helpful = sorted((s for s in tried.values() if s.overrides and s.peak_gib < plan.peak_gib - 0.05),
                     key=lambda s: s.peak_gib)
    deeper = _extend(c, helpful, singles + _memory_shares(c, x), dev, total, lengths, tried)
    if deeper:
        return _finish(c, deeper, dev, total, lengths, limit)
    return helpful[:limit]


def _extend(c: RLConfig, start: list[Suggestion], keys: list[dict[str, Any]], dev: str, total: float, lengths: Lengths,
            tried: dict[str, Suggestion]) -> list[Suggestion]:
    """Beam search: the BEAM lowest-peak of `start`, each extended by one more change of `keys`, repeated up to
    MAX_KEYS keys; returns the first round's combinations that fit (none: [])."""
    frontier = sorted(start, key=lambda s: s.peak_gib)[:BEAM]
    while frontier:
        new: list[Suggestion] = []
        for base in frontier:
            for ov in keys:
                if set(ov) & set(base.overrides) or len(base.overrides) + len(ov) > MAX_KEYS:
                    continue
                got = _record(c, {**base.overrides, **ov}, dev, total, lengths, tried)
                if got is not None:
                    new.append(got)
        fits = [s for s in new if s.fits]
        if fits:
            return fits
        frontier = sorted(new, key=lambda s: s.peak_gib)[:BEAM]
    return []


def _finish(c: RLConfig, fits: list[Suggestion], dev: str, total: float, lengths: Lengths,
            limit: int) -> list[Suggestion]:
    """The cheapest of `fits` (by step time), each with the largest rollout.gpu_memory_utilization that still fits."""
    out = []
    for s in sorted(fits, key=lambda s: (s.step_s, len(s.overrides), s.peak_gib))[:limit]:
        best = _with_best_u(c, {k: v for k, v in s.overrides.items() if k != "rollout.gpu_memory_utilization"},
                            dev, total, lengths)
        r = _try(c, best, dev, total, lengths) if best and best != s.overrides else None
        out.append(Suggestion(best, r[0].peak_gib, r[0].seconds["step"], True, r[0].inputs.world)
                   if r is not None and r[0].fits else s)
    return sorted(out, key=lambda s: (s.step_s, len(s.overrides), s.peak_gib))


def _layouts(x: Inputs):
    """Larger GPU counts to try (doubling up to MAX_GPUS): (GPUs, the trainer keys that give them); one node grows
    to 8 GPUs first, then nodes are added."""
    world = x.world * 2
    while world <= MAX_GPUS:
        if x.nnodes == 1 and world <= max(8, x.n_gpus_per_node):
            yield world, {"trainer.n_gpus_per_node": world}
        else:
            per_node = max(x.n_gpus_per_node, 8) if x.nnodes == 1 else x.n_gpus_per_node
            yield world, {"trainer.n_gpus_per_node": per_node, "trainer.nnodes": world // per_node}
        world *= 2


def more_gpus(c: RLConfig, x: Inputs, dev: str, total: float, lengths: Lengths) -> tuple[Suggestion | None, int]:
    """The fewest GPUs (doubling) on which some change fits with the cheapest such change, and the count searched."""
    searched = 0
    for world, keys in _layouts(x):
        searched = world
        cc = _apply(c, keys)
        try:
            xx = lengths.apply(read(cc))
        except UserError:
            continue
        tried: dict[str, Suggestion] = {}
        plain = [s for s in (_record(cc, ov, dev, total, lengths, tried) for ov in [{}] + _candidates(cc, xx)) if s]
        fits = [s for s in plain if s.fits] or _extend(cc, plain, _candidates(cc, xx) + _memory_shares(cc, xx), dev,
                                                         total, lengths, tried)
        if fits:
            best = _finish(cc, fits, dev, total, lengths, 1)[0]
            return Suggestion({**keys, **best.overrides}, best.peak_gib, best.step_s, True, world), searched
    return None, searched


def make_plan(cfg: RLConfig, *, gpu_memory_gib: float | None = None, device: str | None = None,
              prompt_tokens: int | None = None, response_tokens: int | None = None,
              prompts: DataLengths | None = None, suggest: bool = True) -> Plan:
    """Plan the typed RLConfig `cfg`. gpu_memory_gib: each GPU's memory (default: the device kind's); device: h100 |
    h200 (default h100, or h200 above 100 GiB); prompt_tokens / response_tokens, or prompts (the data's lengths:
    memory at the longest, time at the mean): the lengths to plan for (default: the config's bounds, the worst case)."""
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
        if not any(s.fits for s in plan.suggestions):
            plan.more_gpus, plan.searched_gpus = more_gpus(cfg, x, dev, total, lengths)
    return plan


def check(cfg: Any, *, gpu_memory_gib: float | None = None, device: str | None = None,
          prompts: DataLengths | None = None) -> Plan:
    """Plan `cfg` and raise PlanError (a UserError: the entry points print it and exit 2) when a GPU will not fit,
    with the GPU, the phase, the overflowing parts and the cheapest keys to change. Returns the Plan when it fits.
    prompts: the data's prompt lengths (make_plan). Imports no GPU library and starts nothing."""
    plan = make_plan(cfg, gpu_memory_gib=gpu_memory_gib, device=device, prompts=prompts)
    if not plan.fits:
        raise PlanError("the plan does not fit the GPUs (rltrain.plan): " + plan.refusal())
    return plan
