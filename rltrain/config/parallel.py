"""The degrees of parallelism of a trained model's ranks and all their arithmetic, in one place: `ParallelDims`.

Every degree (world size, tensor TP, pipeline PP, data DP, expert EP, expert-data EDP, expert-tensor ETP, and context
CP, which has its slot but is refused), the divisions between them, the model shapes they must divide and the rank
groups megatron-core builds from them. Validated at construction, pure Python (no torch, no process group): config
validation (workers/placement.py, through trainer/setup.py), the planner (plan/), megatron's setup
(models/megatron/compat.py) and the model builder (models/megatron/build.py) all ask it. Must not import anything
but config/ and utils/errors.

The rank layout is megatron-core 0.16.1's (`parallel_state.initialize_model_parallel`, order "tp-cp-ep-dp-pp",
first fastest): the dense layers' mesh is TP x CP x DP x PP; the expert layers' mesh is ETP x EP x EDP x PP over the
same ranks, ETP being megatron's `expert_tensor_parallel_size` (None there: the TP size, which is what rltrain
runs), so EDP = world / (ETP * EP * PP). A data-parallel group of the dense layers is EP expert-data groups side by
side: the gradients of an expert are averaged over its EDP group, the rest over the DP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from rltrain.utils.errors import UserError

# megatron-core's rank order (first fastest); the dense mesh has no "ep", the expert mesh no "cp"
ORDER = "tp-cp-ep-dp-pp"


class ParallelDimsError(UserError, ValueError):
    """Degrees of parallelism that cannot be arranged (each problem names the keys to change)."""

    def __init__(self, problems: Sequence[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)  # a str: unpickled
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one group of `world_size` ranks training one model. Invalid degrees raise ParallelDimsError
    at construction, listing every problem; messages name the keys of config section `section` (`actor` for the
    RL trainer, `trainer` for SFT)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallel: the slot is kept while it is refused (no attention here splits a sequence)
    section: str = field(default="actor", compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ParallelDimsError(problems)

    @classmethod
    def of(cls, parallel, *, world_size: int, section: str = "actor") -> ParallelDims:
        """The dims of a ParallelConfig (actor.tensor/pipeline/expert_parallel_size) over `world_size` ranks."""
        return cls(world_size=world_size, tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size,
                   ep=parallel.expert_parallel_size, section=section)

    # ------------------------------------------------------------------ the degrees
    @property
    def dp(self) -> int:
        """Data-parallel size of the dense layers: world / (TP * PP * CP)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size: each expert's matrices are split over this many ranks (megatron's
        expert_tensor_parallel_size, left at its default, the TP size)."""
        return self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks holding the same experts, over which their gradients are averaged:
        world / (ETP * EP * PP) (megatron-core's rule)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def model_parallel(self) -> int:
        """Ranks holding one copy of the dense layers: TP * PP (* CP)."""
        return self.tp * self.pp * self.cp

    # ------------------------------------------------------------------ the rules
    def _problems(self) -> list[str]:
        s, w = self.section, self.world_size
        degrees = {"world_size": w, f"{s}.tensor_parallel_size": self.tp, f"{s}.pipeline_parallel_size": self.pp,
                   f"{s}.expert_parallel_size": self.ep, "context parallel size": self.cp}
        bad = [f"{k}={v!r} must be a positive integer" for k, v in degrees.items()
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            return bad
        e = []
        if self.cp != 1:
            e.append(f"context parallelism (CP={self.cp}) is not supported yet: no attention here splits a sequence "
                     "over ranks; it must be 1")
        if w % self.model_parallel:
            e.append(f"{s}.tensor_parallel_size * {s}.pipeline_parallel_size = {self.tp} * {self.pp} model-parallel "
                     f"ranks do not fit a whole number of times in {w} ranks")
        elif w % (self.etp * self.ep * self.pp):
            e.append(f"{s}.expert_parallel_size={self.ep} must divide the data-parallel size {self.dp} ({w} ranks / "
                     f"{s}.tensor_parallel_size {self.tp} / {s}.pipeline_parallel_size {self.pp}): the experts are "
                     "split over data-parallel ranks; use an expert-parallel size that divides it")
        if self.ep > 1 and self.pp > 1:
            e.append(f"{s}.expert_parallel_size={self.ep} with {s}.pipeline_parallel_size={self.pp} is not supported "
                     "yet (the pipeline schedule does not pair the expert collectives of ranks with different "
                     "micro-batch counts); use one of the two")
        return e

    def model_problems(self, *, layers: int, heads: int, kv_heads: int, experts: int = 0,
                       expert_ffn: int = 0) -> list[str]:
        """Why a model of this shape cannot be split by these degrees (empty when it can): TP divides the attention
        and key/value heads, PP the layers; EP needs a Mixture-of-Experts model (`experts` > 0) whose experts it
        divides, and ETP divides each expert's FFN width (`expert_ffn`, moe_intermediate_size). The vocabulary
        needs no rule: it is padded (padded_vocab)."""
        s, e = self.section, []
        if heads % self.tp or kv_heads % self.tp:
            e.append(f"{s}.tensor_parallel_size={self.tp} must divide num_attention_heads={heads} and "
                     f"num_key_value_heads={kv_heads}")
        if layers % self.pp:
            e.append(f"{s}.pipeline_parallel_size={self.pp} must divide num_hidden_layers={layers}")
        if not experts:
            if self.ep > 1:
                e.append(f"{s}.expert_parallel_size={self.ep} needs a Mixture-of-Experts model; this one has no "
                         "sparse layers")
            return e
        if experts % self.ep:
            e.append(f"{s}.expert_parallel_size={self.ep} must divide num_experts={experts}")
        if expert_ffn % self.etp:
            e.append(f"{s}.tensor_parallel_size={self.etp} must divide moe_intermediate_size={expert_ffn} (experts "
                     "are split over the tensor-parallel ranks too)")
        return e

    def padded_vocab(self, vocab_size: int, divisible_by: int) -> int:
        """The vocabulary rows of the model: the smallest multiple of `divisible_by` * TP that holds `vocab_size`
        (megatron's padding; the padded rows are zero and masked out of the log-probs)."""
        if divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by must be >= 1, got {divisible_by}")
        multiple = divisible_by * self.tp
        return math.ceil(vocab_size / multiple) * multiple

    # ------------------------------------------------------------------ the rank layout
    def _mesh(self, expert: bool) -> list[tuple[str, int]]:
        sizes = ({"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp} if expert else
                 {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp})
        return [(name, sizes[name]) for name in ORDER.split("-")]

    def coordinates(self, rank: int, *, expert: bool = False) -> dict[str, int]:
        """Rank `rank`'s place in the dense mesh {"tp", "cp", "ep", "dp", "pp"} (ep 0), or with expert=True in the
        expert mesh (its "tp" is the ETP rank, its "dp" the EDP rank; cp 0)."""
        out, rest = {}, rank
        for name, size in self._mesh(expert):
            out[name], rest = rest % size, rest // size
        return out

    def rank_groups(self, dims: str) -> list[list[int]]:
        """The groups megatron builds for `dims`: names joined by '-' from tp, cp, dp, pp (the dense mesh) or ep,
        etp, edp (the expert mesh; e.g. "edp": each expert's gradient-averaging group, "ep": the ranks that split
        the experts). Groups are ordered by the other dims' coordinates, ranks in a group by the group's own dims
        (first fastest), as `RankGenerator.get_ranks` orders them."""
        names = dims.split("-")
        expert = any(n in ("ep", "etp", "edp") for n in names)
        if expert and any(n in ("tp", "cp", "dp") for n in names):
            raise ValueError(f"{dims!r} mixes the dense mesh (tp, cp, dp) and the expert mesh (ep, etp, edp)")
        wanted = {{"etp": "tp", "edp": "dp"}.get(n, n) for n in names}
        mesh = self._mesh(expert)
        unknown = wanted - {n for n, _ in mesh}
        if unknown:
            raise ValueError(f"unknown parallel dims {sorted(unknown)} in {dims!r}")
        stride, strides = 1, {}
        for name, size in mesh:
            strides[name], stride = stride, stride * size
        inner = [(strides[n], size) for n, size in mesh if n in wanted]
        outer = [(strides[n], size) for n, size in mesh if n not in wanted]

        def ranks(dims_: list[tuple[int, int]]) -> list[int]:  # offsets of every coordinate, first dim fastest
            out = [0]
            for st, size in dims_:
                out = [o + i * st for i in range(size) for o in out]
            return out

        return [[base + off for off in ranks(inner)] for base in ranks(outer)]


def rollout_replicas(*, world_size: int, tensor_parallel_size: int, num_replicas: int | None = None) -> int:
    """Rollout replicas (engines) of `tensor_parallel_size` devices each: `rollout.num_replicas` where split
    placement names it, else as many as the `world_size` devices of the training group hold (at least one)."""
    return int(num_replicas) if num_replicas else max(1, world_size // tensor_parallel_size)

