"""The trained engine's optimizer side: AdamW over this rank's pieces of the parameters (fp32 master copies when the
params are not fp32), sharded over data parallelism (shards.py: dense parameters over the data-parallel group, MoE
experts over their expert-data-parallel group), its lr schedule, the gradient reductions after the backward
(reduce-scatter of data-parallel buckets, TP partial sums, tied embeddings across pipeline stages), the global grad
norm, clipping, the step and the all-gather of the updated parameters; and where the optimizer state lives
(offload.py: a fraction of it on the host for good, or all of it while the rollout engine is awake). No forward math
and no loss here (engine.py).

Only parameters with requires_grad train: a frozen one (a LoRA base) has no master, no optimizer state, no grad
reduction. With one data-parallel rank every piece is a whole parameter and the step is an unsharded AdamW's,
number for number.

Speed (docs/benchmarks/update.md): grad norm, clipping and the master -> param copy are multi-tensor
(`torch._foreach_*`) ops; AdamW is the fused CUDA kernel on GPU; data-parallel grads are reduce-scattered in buckets
started during the last backward (shards.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rltrain.utils.lr_schedule import LR_SCHEDULES
from rltrain.models.megatron import pipeline as pipeline_mod
from rltrain.models.megatron.offload import HostOptimizer
from rltrain.models.megatron.shards import ShardedParams, Slice


# bf16 params: the optimizer step casts its pieces' grads to fp32 and steps AdamW this many bytes of them at a time
# (each piece's bf16 grad freed as it is cast): the step's peak is the bf16 grads plus one chunk, not 4 B a parameter
STEP_CHUNK_BYTES = 1 << 30


def expert_units(names: list[str]) -> list[list[int]]:
    """Indices of `names` grouped so that each MoE layer's local experts' fc1 (and fc2) weights form one unit in
    expert order (shards.py keeps a unit contiguous: moe.py's grouped GEMM then reads them as one [E, ...] block);
    every other parameter a unit alone."""
    import re

    stacks: dict[tuple[str, str], list[tuple[int, int]]] = {}
    units: list[list[int]] = []
    for i, n in enumerate(names):
        m = re.match(r"^(.*\.experts\.local_experts)\.(\d+)\.(linear_fc[12]\.weight)$", n)
        if m is None:
            units.append([i])
        else:
            stacks.setdefault((m[1], m[3]), []).append((int(m[2]), i))
    units += [[i for _, i in sorted(members)] for members in stacks.values()]
    return units


class EngineOptimizer:
    """AdamW + schedule over this rank's pieces of `model`'s trainable params, and the grad plumbing around its step."""

    def __init__(self, model, *, params_dtype: torch.dtype, device: torch.device, pp_size: int, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, grad_clip: float, warmup_steps: int,
                 total_steps: int, lr_schedule: str, min_lr_ratio: float, grad_reduce_bucket_mb: float,
                 overlap_grad_reduce: bool, offload_fraction: float = 0.0):
        self.model, self.device, self.pp_size, self.grad_clip = model, device, pp_size, grad_clip
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # MoE experts under expert parallelism (megatron marks them allreduce=False) are distinct per expert-parallel
        # rank: their grads are summed and their state sharded over the expert-data-parallel group only
        dense = [(n, p) for n, p in named if getattr(p, "allreduce", True)]
        experts = [(n, p) for n, p in named if not getattr(p, "allreduce", True)]
        dp = parallel_state.get_data_parallel_world_size()
        # under pipeline parallelism megatron's schedule runs the backward: no hook knows which is the last
        # micro-batch's, so the buckets start after it
        bucketing = dict(bucket_bytes=int(grad_reduce_bucket_mb * 2**20), overlap=overlap_grad_reduce and pp_size == 1)
        self.groups: list[tuple[ShardedParams, list[str], bool]] = []  # (shards, names, experts?)
        for members, group, divisor, is_expert in (
                (dense, parallel_state.get_data_parallel_group(), None, False),
                (experts, parallel_state.get_expert_data_parallel_group() if experts else None, dp, True)):
            if members:
                names = [n for n, _ in members]
                shards = ShardedParams([p for _, p in members], group, divisor=divisor, units=expert_units(names),
                                       **bucketing)
                self.groups.append((shards, names, is_expert))
        self.params = [p for _, p in named]
        # this rank's pieces, group by group, each with its master (a view of the param when the params are fp32)
        self.pieces: list[tuple[ShardedParams, Slice, str, bool]] = [
            (shards, s, names[s.param], is_expert) for shards, names, is_expert in self.groups for s in shards.slices]
        self.fp32 = params_dtype == torch.float32
        self.masters = [self._master(shards, s) for shards, s, _, _ in self.pieces]
        # Replicated params whose grads are per-rank partial sums under TP (megatron's
        # finalize_model_grads sums them): q/k layer norms (each rank sees its own heads) and,
        # with sequence parallelism, the norms marked `sequence_parallel`.
        tp_partial = {id(p) for n, p in named
                      if "q_layernorm" in n or "k_layernorm" in n
                      or (model.config.sequence_parallel and getattr(p, "sequence_parallel", False))}
        self._tp_partial = [i for i, (shards, s, _, _) in enumerate(self.pieces)
                            if id(shards.params[s.param]) in tp_partial]
        # the first `offload_fraction` of this rank's state (by elements) steps on the host (offload.py)
        self.host = HostOptimizer(self.masters, offload_fraction, device)
        # one fused CUDA kernel per step on GPU (torch's default there is foreach: ~10 passes over the fp32
        # state); CPU keeps the default implementation (the tiny runs' numbers stay as they were)
        fused = {"fused": True} if device.type == "cuda" else {}
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        # one group, perhaps empty (everything on the host, or nothing trainable): the schedule drives its lr
        self.optimizer = torch.optim.AdamW([{"params": self.host.device_masters}], **hyper, **fused)
        self.host.build(hyper)
        schedule = LR_SCHEDULES[lr_schedule]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: schedule(step, warmup_steps, total_steps, min_lr_ratio)
        )
        self.grads: list[torch.Tensor | None] = []  # this rank's pieces' reduced grads (reduce_grads)
        self._coef = 1.0  # the clip's factor, applied as bf16 grads are cast for the step

    @classmethod
    def from_config(cls, model, c, *, params_dtype: torch.dtype, device: torch.device) -> "EngineOptimizer":
        """The optimizer of an engine config `c` (models/engine_config.py EngineConfig)."""
        o, par = c.optim, c.parallel
        return cls(model, params_dtype=params_dtype, device=device, pp_size=par.pipeline_parallel_size, lr=o.lr,
                   weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps, grad_clip=o.grad_clip,
                   warmup_steps=o.lr_warmup_steps, total_steps=c.total_steps, lr_schedule=o.lr_schedule,
                   min_lr_ratio=o.min_lr_ratio, grad_reduce_bucket_mb=par.grad_reduce_bucket_mb,
                   overlap_grad_reduce=par.overlap_grad_reduce, offload_fraction=o.optimizer_offload_fraction)

    def _master(self, shards: ShardedParams, s: Slice) -> torch.Tensor:
        piece = shards.param_piece(s)
        return piece if self.fp32 else piece.float().clone()

    @property
    def dp_reducer(self) -> ShardedParams | None:
        """The dense parameters' shards (tests and tools read their buckets)."""
        return next((shards for shards, _, is_expert in self.groups if not is_expert), None)

    def arm(self) -> None:
        """The next backward is the step's last: data-parallel buckets start as their grads complete."""
        for shards, _, _ in self.groups:
            shards.arm()

    def zero_grad(self) -> None:
        self.grads = []
        for m in self.masters:
            m.grad = None
        for shards, _, _ in self.groups:
            shards.drop_grads()
        self.model.zero_grad(set_to_none=True)

    def reduce_grads(self) -> list[torch.Tensor | None]:
        """After the backward passes: sum the tied embedding over pipeline stages, reduce-scatter over data-parallel
        ranks (the average of this rank's pieces), sum TP partial grads. Returns this rank's pieces' grads in the
        params' dtype, flat (None: no grad), in the order of `pieces` / `masters` (step() casts bf16 ones to fp32
        a chunk at a time: the fp32 grads of every piece are never all there at once)."""
        if self.pp_size > 1:  # before the data-parallel reduction: the stages' buckets differ
            pipeline_mod.reduce_tied_embedding_grads(self.model)
        for shards, _, _ in self.groups:
            shards.finish()
        self.grads = [shards.grad(s) for shards, s, _, _ in self.pieces]
        self._coef = 1.0
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            for i in self._tp_partial:  # every TP rank of this data-parallel rank holds the same pieces
                if self.grads[i] is not None:
                    dist.all_reduce(self.grads[i], group=group)
        return self.grads

    def grad_norm(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Global L2 grad norm over the data-parallel shards, the TP group (replicated params counted once) and
        pipeline stages, as a 0-dim fp32 tensor on the device (no host sync)."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sq = {}
        for is_expert in (False, True):
            mine = [g.detach() for (shards, s, _, e), g in zip(self.pieces, grads)
                    if e == is_expert and g is not None
                     and not (self.pp_size > 1 and pipeline_mod.is_stage_duplicate(shards.params[s.param]))
                     and (e or getattr(shards.params[s.param], "tensor_model_parallel", False) or tp_rank == 0)]
            sq[is_expert] = self._sq_norm(mine)
        total = sq[False]
        for shards, _, is_expert in self.groups:
            if shards.world > 1:
                dist.all_reduce(sq[is_expert], group=shards.group)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
        if any(is_expert for _, _, is_expert in self.groups):
            # each expert shard lives on one rank of its expert-tensor x expert-parallel group
            group = parallel_state.get_expert_tensor_and_model_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(sq[True], group=group)
            total = total + sq[True]
        if self.pp_size > 1:
            pipeline_mod.all_reduce_over_stages(total)
        return total.sqrt()

    def _sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:  # bf16 grads: each norm accumulated in fp32 (the norm of their fp32 casts)
            norms = torch._foreach_norm(grads) if self.fp32 else torch._foreach_norm(grads, 2, dtype=torch.float32)
            sq = sq + torch.stack(norms).float().pow(2).sum()
        return sq

    def clip(self, grads: list[torch.Tensor | None], norm: float) -> None:
        """Scale the grads to norm grad_clip when above it: fp32 grads in place, bf16 ones as step() casts them."""
        if self.grad_clip and self.grad_clip > 0:
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0 and not self.fp32:
                self._coef = coef
                return
            grads = [g for g in grads if g is not None]
            if coef < 1.0 and grads:
                torch._foreach_mul_(grads, coef)

    def step(self) -> float:
        """AdamW + scheduler step on the (clipped) grads of this rank's pieces (the host's share on the host), the
        pieces written into the params, the params all-gathered over the data-parallel shards, grads cleared.
        Returns the lr of this step."""
        lr = self.optimizer.param_groups[0]["lr"]
        coef, self._coef = self._coef, 1.0
        self.host.start_step(lr, self.grads, coef)  # the host share's grads on their way, before the device's step
        mine = [i for i, g in enumerate(self.grads) if g is not None and not self.host.is_host(i)]
        for chunk in self._chunks(mine):  # fp32 params: one chunk (an unsharded AdamW's one step)
            for i in chunk:
                g = self.grads[i]
                if not self.fp32:  # the fp32 grad of this piece; its bf16 one goes (at one rank: the param's .grad)
                    g = g.float() if coef == 1.0 else g.float().mul_(coef)
                    self.grads[i] = None
                    if self.pieces[i][0].world == 1:
                        self.pieces[i][0].params[self.pieces[i][1].param].grad = None
                self.masters[i].grad = g
            self.optimizer.step()  # AdamW steps the masters with a grad: this chunk's
            for i in chunk:
                self.masters[i].grad = None
        self.host.finish_step()  # its AdamW, while the device's kernels run
        self.scheduler.step()
        with torch.no_grad():
            pieces = [shards.param_piece(s) for shards, s, _, _ in self.pieces]
            same = [(p, m) for i, (p, m) in enumerate(zip(pieces, self.masters))
                    if not self.host.is_host(i) and p.data_ptr() != m.data_ptr()]
            if same:
                torch._foreach_copy_([p for p, _ in same], [m for _, m in same])
            for i in self.host.index:  # the host's masters back into the params (from pinned memory)
                pieces[i].copy_(self.masters[i], non_blocking=True)
        for shards, _, _ in self.groups:
            shards.gather()
        self.zero_grad()
        return lr

    def _chunks(self, idx: list[int]) -> list[list[int]]:
        """`idx` in runs of about STEP_CHUNK_BYTES of fp32 grads (fp32 params: one run; their grads exist anyway)."""
        if self.fp32:
            return [idx] if idx else []
        out: list[list[int]] = []
        size = STEP_CHUNK_BYTES
        for i in idx:
            if size >= STEP_CHUNK_BYTES:
                out.append([])
                size = 0
            out[-1].append(i)
            size += 4 * self.masters[i].numel()
        return out

    def masters_from_params(self) -> None:
        """Refresh the fp32 masters after the params were loaded."""
        with torch.no_grad():
            for (shards, s, _, _), m in zip(self.pieces, self.masters):
                piece = shards.param_piece(s)
                if m.data_ptr() != piece.data_ptr():
                    m.copy_(piece)

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """{"optimizer": {"param_groups": AdamW's hyperparameters, "params": {name: this rank's piece: "start",
        "stop", "numel" (the whole parameter's), AdamW's state ("step", "exp_avg", "exp_avg_sq") and "master"
        (bf16 params)}}, "scheduler": ...}: tensors and plain values only, keyed by parameter name and element range,
        so that a run with another data-parallel size can take its pieces from them (load_state_dict)."""
        params: dict[str, dict[str, Any]] = {}
        for i, ((shards, s, name, _), m) in enumerate(zip(self.pieces, self.masters)):
            entry: dict[str, Any] = {"start": s.start, "stop": s.stop, "numel": shards.params[s.param].numel()}
            for k, v in self.host.state_of(i, m, self.optimizer).items():
                entry[k] = v.detach() if torch.is_tensor(v) else v
            if not self.fp32:  # fp32 params are their own masters (the model's state holds them)
                entry["master"] = m.detach()
            params[name] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"optimizer": {"param_groups": groups, "params": params}, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, sd: dict[str, Any], pieces: list[tuple[dict[str, Any], bool]] | None = None) -> None:
        """Load `sd` (state_dict's). pieces: when the checkpoint was written at another data-parallel size, every
        rank's `sd["optimizer"]["params"]` of the same tensor- and pipeline-parallel coordinates, each with whether
        it is of this rank's expert-parallel rank (only those hold this rank's experts: local expert names repeat
        across expert-parallel ranks); this rank takes its pieces from them."""
        if "optimizer" not in sd:
            raise KeyError("checkpoint has no optimizer state (was it saved by a 'ref' engine?)")
        saved = sd["optimizer"]
        if "params" not in saved:
            raise ValueError("checkpoint's optimizer state is not sharded by parameter name (written before the "
                             "sharded optimizer); it cannot be resumed by this version")
        dense_sources = [saved["params"], *(p for p, _ in pieces or [])]
        expert_sources = [saved["params"], *(p for p, same_expert_rank in pieces or [] if same_expert_rank)]
        states: list[dict[str, torch.Tensor]] = []
        for (shards, s, name, is_expert), m in zip(self.pieces, self.masters):
            state = _assemble(name, s.start, s.stop, expert_sources if is_expert else dense_sources)
            master = state.pop("master", None)
            if master is not None and not self.fp32:
                with torch.no_grad():
                    m.copy_(master)
            elif not self.fp32:  # saved from fp32 params: the masters are the loaded params
                with torch.no_grad():
                    m.copy_(shards.param_piece(s))
            states.append(state)
        self.host.load_states(self.optimizer, self.masters, states, saved["param_groups"])
        self.scheduler.load_state_dict(sd["scheduler"])


def _assemble(name: str, start: int, stop: int, sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The saved state of elements [start, stop) of parameter `name`, put together from every saved piece that
    overlaps them (0-dim entries such as AdamW's step taken from any)."""
    out: dict[str, Any] = {}
    covered = 0
    seen: set[tuple[int, int]] = set()
    for src in sources:
        e = src.get(name)
        if e is None or (e["start"], e["stop"]) in seen:
            continue
        lo, hi = max(start, e["start"]), min(stop, e["stop"])
        if lo >= hi:
            continue
        seen.add((e["start"], e["stop"]))
        covered += hi - lo
        for k, v in e.items():
            if k in ("start", "stop", "numel"):
                continue
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == e["stop"] - e["start"]:
                if k not in out:
                    out[k] = torch.empty(stop - start, dtype=v.dtype)
                out[k][lo - start:hi - start].copy_(v[lo - e["start"]:hi - e["start"]])
            else:
                out.setdefault(k, v)
    if covered != stop - start:
        raise ValueError(f"the checkpoint's optimizer state covers {covered} of elements [{start}, {stop}) of "
                         f"{name}: some data-parallel ranks' files are missing")
    return out


class OptimizerSide:
    """MegatronEngine's optimizer side as it exposes it (a mixin: it reads the engine's optim, state_offload and
    device): the optimizer's parts (tests and tools read them; a tool may swap the AdamW), offload and the
    data-parallel mesh."""

    optimizer = property(lambda self: None if self.optim is None else self.optim.optimizer,
                         lambda self, opt: setattr(self.optim, "optimizer", opt))
    scheduler = property(lambda self: None if self.optim is None else self.optim.scheduler)
    _masters = property(lambda self: None if self.optim is None else self.optim.masters)
    _params = property(lambda self: None if self.optim is None else self.optim.params)
    _dp_reducer = property(lambda self: None if self.optim is None else self.optim.dp_reducer)

    def offload(self, *, params: bool = True, state: bool = True) -> None:
        """The params (params) and the optimizer's device state (state) to pinned host memory until onload();
        every method that computes brings them back first (offload.py)."""
        self.state_offload.offload(params=params, state=state)

    def onload(self, *, state: bool = True) -> None:
        """Back on the device: the params, and the optimizer's state unless state=False."""
        self.state_offload.onload(state=state)

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size) of the engine's mesh."""
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def data_parallel_sum(self, values: list[float]) -> list[float]:
        """Sum floats over the data-parallel group (identity with one rank). Collective over that group."""
        if parallel_state.get_data_parallel_world_size() == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return t.tolist()
