"""Device placement, one rule in one place: how many worker processes each group has and where they go (one
placement bundle per node, or per rollout replica), which device ordinal each process uses, and which workers
answer for a data-parallel rank or a rollout replica. Pure Python: no Ray, no torch (group.py applies it).

The rules (docs/multinode.md shows them on a cluster):

- Devices. `trainer.n_gpus_per_node` devices on each of `trainer.nnodes` nodes; one worker process per device.
  On CPU a "device" is a worker process (so `n_gpus_per_node=4` runs 4 gloo ranks per node).
- Colocated (`trainer.colocate=true`): one group of n_gpus_per_node * nnodes workers holds every role (actor,
  ref, critic, rollout); each `rollout.tensor_parallel_size` consecutive workers are one rollout replica (with
  vLLM: one engine, its TP group; 1: one engine per device, each generating its share of the prompts). Split:
  the training group has n_gpus_per_node * nnodes workers and the rollout group `rollout.num_replicas` replicas of
  `rollout.tensor_parallel_size` workers (default: as many devices as the training group), each on devices of its
  own.
- Bundles. The training group asks Ray for one bundle per node (STRICT_SPREAD: nnodes distinct nodes, each
  with n_gpus_per_node workers); the rollout group for one bundle per replica (PACK: a replica never spans
  nodes). Ranks are numbered bundle by bundle, so the ranks of a node are consecutive.
- Megatron mesh. megatron-core orders ranks TP fastest, then DP, then PP ("tp-cp-ep-dp-pp"), so a tensor-parallel
  group is consecutive ranks: it stays inside a node when the TP size divides n_gpus_per_node (required
  with nnodes > 1). Which worker is which data-parallel rank is not computed here: each worker reports its
  (tp, pp, dp) coordinates from megatron's parallel_state after setup and `train_dispatch` builds the table.
- Device ordinal. Under Ray every worker actor sees only the GPUs Ray gave it (Ray sets CUDA_VISIBLE_DEVICES
  per actor), numbered from 0, so the ordinal is the position of Ray's GPU id in CUDA_VISIBLE_DEVICES (0 by
  default; the physical id when Ray was told not to set the variable). Without Ray (torchrun, one process)
  every GPU of the node is visible and the ordinal is LOCAL_RANK. The worker publishes that ordinal as
  LOCAL_RANK, the variable torch-style code (megatron setup, vLLM's external launcher) reads the device from.
  NCCL moves data between such processes over NVLink/P2P either way (its CUMEM P2P transport does not need
  the peer GPU to be visible); `tools/gpu_placements.py` measures it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rltrain.config.parallel import ParallelDims, ParallelDimsError
from rltrain.config.parallel import rollout_replicas
from rltrain.config.schema import RLConfig, TeacherConfig
from rltrain.utils.errors import UserError

TRAIN_ROLES = ("actor", "ref", "critic", "teacher")  # the roles with a megatron mesh (data-parallel dispatch)


class PlacementError(UserError, ValueError):
    """A placement the config asks for cannot be built (names the keys to change)."""


@dataclass(frozen=True)
class GroupPlan:
    """One worker group: `bundles[b]` workers in placement bundle b (ranks numbered bundle by bundle), each
    with `gpus_per_worker` GPUs; `replica_size` consecutive ranks form one rollout replica."""

    name: str
    roles: tuple[str, ...]
    bundles: tuple[int, ...]
    gpus_per_worker: int
    strategy: str
    replica_size: int = 1

    @property
    def world_size(self) -> int:
        return sum(self.bundles)

    def bundle_of(self, rank: int) -> int:
        assert 0 <= rank < self.world_size, rank
        for b, size in enumerate(self.bundles):
            if rank < size:
                return b
            rank -= size
        raise AssertionError("unreachable")

    def has_training_roles(self) -> bool:
        return any(r in TRAIN_ROLES for r in self.roles)


def plan_groups(cfg: RLConfig, *, device: str, use_ref: bool, use_critic: bool) -> list[GroupPlan]:
    """The worker groups of a run: [hybrid] when colocated, [train, rollout] when split, then a [teacher] group
    with teacher.colocate=false (`device` is the resolved "cpu" or "cuda"). A colocated teacher is a role of the
    training workers. Raises PlacementError naming the keys to change."""
    errors = placement_errors(cfg, device=device)
    if errors:
        raise PlacementError("; ".join(errors))
    t, r, teacher = cfg.trainer, cfg.rollout, cfg.teacher
    gpus = 1 if device == "cuda" else 0
    per_node, nnodes = t.n_gpus_per_node, t.nnodes
    train_roles = ("actor",) + (("ref",) if use_ref else ()) + (("critic",) if use_critic else ()) \
        + (("teacher",) if TeacherConfig.enabled(teacher) and teacher.colocate else ())
    own_teacher = [GroupPlan("teacher", ("teacher",), (teacher.n_gpus_per_node,) * nnodes, gpus, "STRICT_SPREAD")] \
        if TeacherConfig.enabled(teacher) and not teacher.colocate else []
    rtp = r.tensor_parallel_size
    if t.colocate or not t.use_ray:
        return [GroupPlan("hybrid", train_roles + ("rollout",), (per_node,) * nnodes, gpus, "STRICT_SPREAD",
                          replica_size=rtp)] + own_teacher
    replicas = _replicas(cfg)
    return [GroupPlan("train", train_roles, (per_node,) * nnodes, gpus, "STRICT_SPREAD"),
            GroupPlan("rollout", ("rollout",), (rtp,) * replicas, gpus, "PACK", replica_size=rtp)] + own_teacher


def _replicas(cfg: RLConfig) -> int:
    """Split mode: `rollout.num_replicas`, or by default as many devices as the training group has."""
    t, r = cfg.trainer, cfg.rollout
    return rollout_replicas(world_size=t.n_gpus_per_node * t.nnodes, tensor_parallel_size=r.tensor_parallel_size,
                            num_replicas=r.num_replicas)


def placement_errors(cfg: RLConfig, *, device: str | None = None) -> list[str]:
    """Every reason the placement `cfg` asks for is impossible (empty when it is fine). `device` None checks what
    holds on any device."""
    t, a, r = cfg.trainer, cfg.actor, cfg.rollout
    e: list[str] = []
    per_node, nnodes = t.n_gpus_per_node, t.nnodes
    tp, pp, rtp = a.tensor_parallel_size, a.pipeline_parallel_size, r.tensor_parallel_size
    if min(per_node, nnodes, tp, pp, rtp, a.expert_parallel_size) < 1:
        return []  # the range checks of validate_config report these
    world = per_node * nnodes
    where = "trainer.n_gpus_per_node * trainer.nnodes" + (" (on CPU: worker processes)" if device != "cuda" else "")
    e.extend(teacher_placement_errors(cfg))
    if not t.use_ray:
        if world != 1 or tp * pp * a.expert_parallel_size != 1:
            e.append(f"trainer.use_ray=false runs one in-process worker, but the config asks for "
                     f"{max(world, tp * pp, a.expert_parallel_size)} (trainer.n_gpus_per_node / "
                     "actor.tensor_parallel_size / actor.pipeline_parallel_size / actor.expert_parallel_size); enable "
                     "Ray (trainer.use_ray=true) or use 1")
        return e
    try:  # the degrees' own rules (config/parallel.py), over the training group's devices
        ParallelDims.of(a, world_size=world)
    except ParallelDimsError as err:
        e.extend(f"{why} ({where} = {world} devices)" for why in err.problems)
    if nnodes > 1 and per_node % tp:
        e.append(f"actor.tensor_parallel_size={tp} does not divide trainer.n_gpus_per_node={per_node}: a "
                 "tensor-parallel group would span nodes; use a TP size that divides the GPUs of a node")
    if r.engine == "hf" and rtp != 1:
        e.append(f"rollout.tensor_parallel_size={rtp}: the hf engine runs a whole model per worker; use 1 "
                 "(or rollout.engine=vllm)")
    if t.colocate:
        why = replica_size_error(world, rtp, per_node=per_node)
        if why:
            e.append(why)
        if r.num_replicas:
            e.append("rollout.num_replicas applies to split placement (trainer.colocate=false); colocated, every "
                     "group of rollout.tensor_parallel_size workers is a replica: leave it null")
    elif r.num_replicas is not None and r.num_replicas < 1:
        e.append(f"rollout.num_replicas={r.num_replicas} is impossible; use a positive number or null")
    elif r.engine == "vllm" and _replicas(cfg) > 1:
        # the rollout group's processes share one torch.distributed world and workers/rollout.py builds one vLLM
        # engine over it: a second replica stops when the workers start (seen on CPU)
        e.append(f"rollout.engine=vllm on split placement builds one engine over the whole rollout group; "
                 f"{_replicas(cfg)} replicas of rollout.tensor_parallel_size={rtp} are not "
                 "supported yet: set rollout.num_replicas=1 (and rollout.tensor_parallel_size to the rollout GPUs), "
                 "or rollout.engine=hf")
    return e


def teacher_placement_errors(cfg) -> list[str]:
    """Why the teacher (teacher.*, on) cannot be placed as asked: colocated, it shares the training workers'
    megatron mesh (one per process), so its TP/PP are the actor's; a group of its own needs Ray and TP * PP
    dividing its teacher.n_gpus_per_node * trainer.nnodes devices."""
    t, a, teacher = cfg.trainer, cfg.actor, cfg.teacher
    if not TeacherConfig.enabled(teacher):
        return []
    tp = teacher.tensor_parallel_size or a.tensor_parallel_size
    pp = teacher.pipeline_parallel_size or a.pipeline_parallel_size
    if teacher.colocate:
        if (tp, pp) != (a.tensor_parallel_size, a.pipeline_parallel_size):
            return [f"teacher.tensor_parallel_size / pipeline_parallel_size = {tp} / {pp} differ from the actor's "
                    f"({a.tensor_parallel_size} / {a.pipeline_parallel_size}); a colocated teacher shares the "
                    "training workers' mesh: leave them null, or give the teacher its own devices "
                    "(teacher.colocate=false, teacher.n_gpus_per_node)"]
        return []
    if not t.use_ray:
        return ["teacher.colocate=false gives the teacher worker processes of its own, which needs Ray "
                "(trainer.use_ray=true); or set teacher.colocate=true"]
    world = teacher.n_gpus_per_node * t.nnodes
    if world % (tp * pp) or (t.nnodes > 1 and teacher.n_gpus_per_node % tp):
        return [f"teacher.n_gpus_per_node * trainer.nnodes = {world} devices cannot hold the teacher's tensor * "
                f"pipeline parallel = {tp} * {pp} ranks a whole number of times within a node; set "
                f"teacher.n_gpus_per_node to a multiple of {tp * pp}"]
    return []


def replica_size_error(world: int, tensor_parallel_size: int, *, per_node: int | None = None) -> str | None:
    """Why a group of `world` processes cannot be cut into rollout replicas of `tensor_parallel_size` consecutive
    ranks (None when it can). A replica lives on the devices of one node (`per_node`: the group's processes per node;
    None where the caller does not know it). With vLLM each replica is one engine: every process runs one vLLM
    worker in process (external launcher), and vLLM carves its tensor-parallel groups out of the torch.distributed
    world as consecutive ranks; the ranks beyond one TP group are its "external data parallel" dimension, in which
    each engine generates alone (no collective between engines; vLLM's `parallel_state.initialize_model_parallel`).
    The one copy of this rule: config checks (placement_errors) and the rollout worker (workers/rollout.py, with its
    WORLD_SIZE) both ask it."""
    if world % tensor_parallel_size == 0 and (per_node is None or per_node % tensor_parallel_size == 0):
        return None
    where = (f"trainer.n_gpus_per_node={per_node}" if per_node is not None
             else f"the {world} processes of the rollout worker's group")
    return (f"rollout.tensor_parallel_size={tensor_parallel_size} must divide {where}: each "
            "rollout.tensor_parallel_size consecutive workers are one rollout replica (with vLLM one engine) on the "
            "devices of one node; set rollout.tensor_parallel_size to a divisor of it (1: one engine per device)")


def engines_per_gpu_error(k: int, *, engine: str, tensor_parallel_size: int, colocated: bool, device: str,
                          group_size: int = 1) -> str | None:
    """Why `rollout.engines_per_gpu=k` cannot be placed (None when it can): k > 1 runs k vLLM engines, each in its
    own process, on the GPU of a one-GPU colocated run, weights by CUDA IPC (a pool per GPU of a larger group is not
    built). `device`: "cpu", "cuda" or "auto" (config validation: not refused, the run resolves it); `group_size`:
    the processes of the colocated group. The one copy of this rule: config checks (trainer/setup.py) and the
    rollout worker (workers/rollout.py) both ask it."""
    if k <= 1 or (engine == "vllm" and tensor_parallel_size == 1 and colocated and device != "cpu"
                  and group_size == 1):
        return None
    return (f"rollout.engines_per_gpu={k} runs several vLLM engines on the GPU of a one-GPU colocated run "
            f"(rollout.engine=vllm, rollout.tensor_parallel_size=1, trainer.colocate=true, a CUDA device, "
            f"trainer.n_gpus_per_node * trainer.nnodes = 1: weights reach them by CUDA IPC; here engine {engine}, "
            f"tensor parallel {tensor_parallel_size}, colocated {colocated}, device {device}, {group_size} GPU(s) per "
            "group, where each GPU already runs an engine of its own); set rollout.engines_per_gpu=1")


def cpus_per_worker(plans: Sequence[GroupPlan], *, device: str, node_cpus: float, nnodes: int) -> float:
    """CPUs each worker reserves: 1 on GPU; on CPU the node's CPUs shared by the workers that land on a node
    (bundles of all groups spread over nnodes nodes), at most 1, rounded down to 1/100."""
    if device == "cuda":
        return 1.0
    workers = sum(p.world_size for p in plans)
    per_node = math.ceil(workers / max(1, nnodes))
    return max(0.01, min(1.0, math.floor(100 * node_cpus / per_node) / 100))


# ------------------------------------------------------------------ devices

def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of ids (None when unset: every device is visible)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    return [d.strip() for d in cvd.split(",") if d.strip()]


def device_ordinal(env: Mapping[str, str], *, accelerator_ids: Sequence[str] | None, device_count: int) -> int:
    """The CUDA ordinal this process uses (see the module doc). `accelerator_ids`: the GPU ids Ray assigned
    to this actor (None without Ray); `device_count`: the devices this process sees."""
    visible = visible_devices(env)
    if accelerator_ids is not None:
        if not accelerator_ids:
            raise PlacementError("this Ray worker was given no GPU; trainer.device=cuda needs GPU bundles "
                                 "(is the Ray cluster started with GPUs?)")
        gid = str(accelerator_ids[0])
        if visible is None:
            ordinal = int(gid)
        elif gid in visible:
            ordinal = visible.index(gid)
        else:
            raise PlacementError(f"Ray assigned GPU {gid} to this worker, but CUDA_VISIBLE_DEVICES="
                                 f"{env.get('CUDA_VISIBLE_DEVICES')!r} does not list it")
        source = f"Ray GPU id {gid}, CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}"
    else:
        ordinal = int(env.get("LOCAL_RANK", "0"))
        source = f"LOCAL_RANK={ordinal}"
    if not 0 <= ordinal < device_count:
        raise PlacementError(f"device ordinal {ordinal} (from {source}) but this process sees {device_count} "
                             f"CUDA device(s)")
    return ordinal


def node_local_ranks(node_of_rank: Sequence[str]) -> list[int]:
    """Position of each rank among the ranks on its node, in rank order."""
    seen: dict[str, int] = {}
    out = []
    for node in node_of_rank:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


# ------------------------------------------------------------------ dispatch

@dataclass(frozen=True)
class Dispatch:
    """Shard k of a call goes to every rank in `members[k]`; the result of `leaders[k]` is the answer."""

    members: tuple[tuple[int, ...], ...]
    leaders: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    def shard_of(self, world_size: int) -> list[int]:
        """shard index of every rank."""
        out = [-1] * world_size
        for k, ranks in enumerate(self.members):
            for r in ranks:
                out[r] = k
        assert min(out) >= 0, out
        return out


def train_dispatch(coords: Sequence[Mapping[str, int]]) -> Dispatch:
    """Data-parallel dispatch from each rank's reported megatron coordinates {"tp", "pp", "dp"} (rank order):
    shard k goes to the ranks of dp rank k; the answer is the one of its (tp 0, pp 0) rank (results of a
    model-parallel group are the same on its every rank)."""
    dp_size = max(c["dp"] for c in coords) + 1
    members: list[list[int]] = [[] for _ in range(dp_size)]
    leaders: list[int | None] = [None] * dp_size
    for rank, c in enumerate(coords):
        members[c["dp"]].append(rank)
        if c["tp"] == 0 and c["pp"] == 0:
            assert leaders[c["dp"]] is None, f"two (tp 0, pp 0) ranks in dp rank {c['dp']}: {coords}"
            leaders[c["dp"]] = rank
    sizes = {len(m) for m in members}
    assert len(sizes) == 1 and None not in leaders, f"uneven megatron mesh {coords}"
    return Dispatch(tuple(tuple(m) for m in members), tuple(leaders))  # type: ignore[arg-type]


def replica_dispatch(world_size: int, replica_size: int) -> Dispatch:
    """Rollout dispatch: replica k is ranks [k * replica_size, (k + 1) * replica_size), answered by its first."""
    assert world_size % replica_size == 0, (world_size, replica_size)
    members = tuple(tuple(range(k, k + replica_size)) for k in range(0, world_size, replica_size))
    return Dispatch(members, tuple(m[0] for m in members))
