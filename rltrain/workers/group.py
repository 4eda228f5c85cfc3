"""Ray worker groups: place workers by placement groups (placement.py decides how), wire their torch.distributed
world, dispatch calls, and turn a worker that died into a clear error.

The only module (with main.py's init) that imports Ray. `run` calls a method on every rank; `run_split` slices a
Batch across data-parallel ranks (the model-parallel peers of a dp rank, as megatron's parallel_state reports
them, get the same slice) and gathers results; `run_per_replica` does the same over rollout replicas.
Every wait watches all ranks at once, so a worker killed mid-collective (SIGKILL, OOM killer) stops the call
at once with `WorkerLost` naming it, instead of leaving its peers blocked forever.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.compat.ray import init_local_ray, keep_auth_token_private, loopback_ray
from rltrain.data.batch import Batch
from rltrain.utils.distenv import LOOPBACK, rendezvous_host
from rltrain.utils.profiling import split_calls, take_calls
from rltrain.workers.placement import (
    Dispatch, GroupPlan, PlacementError, device_ordinal, node_local_ranks, replica_dispatch, train_dispatch,
)


# The driver's GIL hand-off (Python's default: 5 ms). While another thread of the driver runs Python, a call that lets
# the GIL go (a remote call's argument put, a tensor op) waits up to the interval to get it back: a remote call with a
# 256-row batch took 31-35 ms beside a busy thread at 5 ms, 11-13 at 0.5 ms, 6-10 alone (2 CPUs,
# docs/benchmarks/placements.md). On the GPU runs no Python thread of the driver was busy (their frames, sampled
# every 20 ms, sat in Ray's waits): the driver's slow slicing was its torch threads (DRIVER_TORCH_THREADS).
DRIVER_SWITCH_INTERVAL_S = 5e-4

# The driver's torch threads. It only slices, pads and gathers batches and sums metrics: the ranks do the work. At
# torch's default (a thread per core), each tensor op of the slicing ran on an OpenMP thread per core, and the ranks'
# and vLLM's processes keep some of them off their cores; every op waited for the last one: Batch.select took 9.6 ms a
# call at DP=2 on two H200s (32 vCPUs) and 43 ms at DP=4 on four (64), its CPU time nearly the same, against
# 0.23-0.25 ms at one thread; the DP=4 step 2.41 -> 1.94 s (docs/benchmarks/placements.md).
DRIVER_TORCH_THREADS = 1


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Connect to an existing cluster (`trainer.ray_address`: "auto" or host:port), or start a new local one
    (never another program's: address="local") whose services listen on and advertise 127.0.0.1 only, its Ray token
    file kept 0600 (compat/ray.py); no secret in the runtime_env (utils/distenv.forwarded_env: local workers inherit
    the driver's environment). The driver's GIL hand-off becomes DRIVER_SWITCH_INTERVAL_S and its torch threads
    DRIVER_TORCH_THREADS (a shorter interval or fewer threads set before are kept)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), DRIVER_SWITCH_INTERVAL_S))
    torch.set_num_threads(min(torch.get_num_threads(), DRIVER_TORCH_THREADS))
    if ray_initialized():
        return
    from rltrain.utils.distenv import apply_no_multicast, forwarded_env

    if not address or address.rsplit(":", 1)[0] in LOOPBACK:
        loopback_ray()  # a cluster on this machine (the multi-node test's) is reached over loopback too
    import ray

    apply_no_multicast()  # the driver too: it may start NCCL/vLLM in process (use_ray=false)
    env = {"env_vars": forwarded_env()}
    kw: dict[str, Any] = dict(runtime_env=env, include_dashboard=False, log_to_driver=True,
                              configure_logging=True, logging_level="WARNING")
    if address:
        ray.init(address=address, **kw)
    else:
        keep_auth_token_private()  # other local users reach the GCS port: its token must be ours only
        init_local_ray(ray.init, num_cpus=num_cpus, **kw)


def ray_initialized() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def cluster_nodes() -> list[dict]:
    """Alive nodes of the connected cluster: [{"id", "ip", "CPU", "GPU"}]."""
    import ray

    return [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "CPU": n["Resources"].get("CPU", 0.0),
             "GPU": n["Resources"].get("GPU", 0.0)} for n in ray.nodes() if n["Alive"]]


def check_cluster(*, nnodes: int, gpus_per_node: int) -> float:
    """Fail early, naming what to change, when the connected cluster has fewer nodes that can hold a
    node's share of the run than `trainer.nnodes`; returns the CPUs of the smallest such node."""
    nodes = cluster_nodes()
    usable = [n for n in nodes if n["GPU"] >= gpus_per_node and n["CPU"] > 0]
    if len(usable) < nnodes:
        have = ", ".join(f"{n['ip']} (CPU {n['CPU']:g}, GPU {n['GPU']:g})" for n in nodes) or "none"
        raise PlacementError(
            f"trainer.nnodes={nnodes} needs {nnodes} Ray nodes with {gpus_per_node} GPU(s) each, but the cluster has "
            f"{len(usable)} such node(s) (alive: {have}); start the missing workers with `ray start "
            "--address=<head>:6379` (docs/multinode.md) or lower trainer.nnodes")
    return min(n["CPU"] for n in usable)


def check_shared_dir(path: str, groups: list[WorkerGroup]) -> None:
    """Every worker of `groups` must read a file the driver wrote under `path` and the driver must read what
    each worker wrote there: checkpoints are written by all ranks into one directory. Raises PlacementError
    naming the first worker (and its node) that cannot."""
    os.makedirs(path, exist_ok=True)
    probe = f".rltrain_shared_probe_{uuid.uuid4().hex[:12]}"
    token = f"{os.uname().nodename}:{os.getpid()}:{time.time()}"
    with open(os.path.join(path, probe), "w") as f:
        f.write(token)
    try:
        for g in groups:
            for rank, err in enumerate(g.run("check_shared_dir", path, probe, token)):
                if err is None and not os.path.exists(os.path.join(path, f"{probe}.rank{rank}")):
                    err = "the driver does not see the file it wrote there"
                if err is not None:
                    fact = g.facts[rank]
                    raise PlacementError(
                        f"trainer.ckpt_dir={path} is not shared: worker {g.name} rank {rank} on node {fact['ip']} {err}. "
                        "Every node writes its part of a checkpoint into this directory: set trainer.ckpt_dir to a "
                        "path all nodes mount (NFS, a cluster file system; docs/multinode.md)")
                os.remove(os.path.join(path, f"{probe}.rank{rank}"))
    finally:
        for name in os.listdir(path):
            if name.startswith(probe):
                os.remove(os.path.join(path, name))


class WorkerLost(RuntimeError):
    """A worker process of a group died (killed, out of memory, node lost): names the worker and its node."""

    def __init__(self, group: str, rank: int, roles: tuple[str, ...], node: str, pid: int | None, cause: str):
        self.group, self.rank, self.roles, self.node, self.pid = group, rank, roles, node, pid
        super().__init__(f"worker {group} rank {rank} (roles {'+'.join(roles)}; node {node}, pid {pid}) died: {cause}")


def _death_errors() -> tuple:
    import ray

    return (ray.exceptions.RayActorError,)  # ActorDiedError and ActorUnavailableError


def _short_cause(err: Exception) -> str:
    """The reason Ray gives for a death, on one line (it writes paragraphs)."""
    text = " ".join(str(err).split())
    for marker in ("The actor died because of an error raised in its creation task",
                   "The actor is dead because", "The actor died unexpectedly", "Worker exit type"):
        if marker in text:
            text = text[text.index(marker):]
            break
    if len(text) > 500:  # end at a sentence
        text = text[:text.rfind(". ", 0, 500) + 1]
    return text or type(err).__name__


def _ray_worker_class(worker_cls):
    """`worker_cls` as a Ray actor class, with the facts only Ray knows inside the actor (node, GPU ids)."""
    import ray

    class Hosted(worker_cls):
        def ray_facts(self) -> dict:
            ctx = ray.get_runtime_context()
            return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                    "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
                    "env": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ},
                    "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                    "cuda_device": torch.cuda.current_device() if torch.cuda.is_initialized() else None}

        def device_memory(self) -> dict:
            """Peak CUDA memory of this worker's device (GiB), {} on CPU."""
            if not torch.cuda.is_available():
                return {}
            return {"max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
                    "max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}

        def take_phase_calls(self) -> list:
            """This worker's phase calls since the last take (utils/profiling.take_calls)."""
            return take_calls()

    Hosted.__name__ = Hosted.__qualname__ = worker_cls.__name__  # the process title stays ray::HybridWorker
    return ray.remote(max_restarts=0, max_task_retries=0)(Hosted)


@dataclass
class Pending:
    """Calls started by `submit_per_replica` and not waited for yet: one result (a Ray object ref, or the
    result itself in-process) per rank; `wait` returns those of `leaders`."""

    refs: list
    method: str
    leaders: list = field(default_factory=lambda: [0])
    submitted: float = field(default_factory=time.time)  # wall clock
    # run_split's slicing of the batch for these calls: (wall-clock start, the driver thread's CPU seconds in it)
    slicing: tuple[float, float] | None = None


class WorkerGroup:
    """The workers of one GroupPlan as Ray actors in a placement group, one torch.distributed world."""

    def __init__(self, worker_cls, plan: GroupPlan, *, cpus_per_worker: float, worker_kwargs: dict | None = None,
                 ready_timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self.plan, self.name = ray, plan, plan.name
        # (method, wall-clock submit, results in hand, Pending.slicing) of waited calls
        self._timed: deque = deque(maxlen=512)
        self.world_size = plan.world_size
        bundles = [{"CPU": round(n * cpus_per_worker, 4),
                    **({"GPU": float(n * plan.gpus_per_worker)} if plan.gpus_per_worker else {})} for n in plan.bundles]
        self.pg = placement_group(bundles, strategy=plan.strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=ready_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise PlacementError(_unplaceable(plan, bundles, ready_timeout_s))
        remote_cls = _ray_worker_class(worker_cls)
        tag = uuid.uuid4().hex[:6]
        self.workers = [
            remote_cls.options(
                num_cpus=cpus_per_worker, num_gpus=plan.gpus_per_worker, name=f"{plan.name}_{rank}_{tag}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=plan.bundle_of(rank)),
            ).remote(rank=rank, world_size=self.world_size, **(worker_kwargs or {}))
            for rank in range(self.world_size)
        ]
        try:
            self.facts = self._get([w.ray_facts.remote() for w in self.workers], "start")
        except BaseException:
            self.shutdown()
            raise
        self.node_local_rank = node_local_ranks([f["node_id"] for f in self.facts])
        # before setup every worker answers for itself; setup replaces these with megatron's mesh
        self.train = self.rollout = replica_dispatch(self.world_size, 1)

    # ------------------------------------------------------------------ setup
    def setup(self) -> list:
        """Rendezvous at rank 0 (over loopback when the group is on one node), build every rank's roles
        (collectively), then read the mesh."""
        one_node = len({f["node_id"] for f in self.facts}) == 1
        addr = rendezvous_host(one_node, self.facts[0]["ip"])
        port = self._get([self.workers[0].address.remote()], "setup")[0][1]
        ordinals = [device_ordinal(f["env"], accelerator_ids=f["gpu_ids"], device_count=f["device_count"])
                    if self.plan.gpus_per_worker else 0 for f in self.facts]
        results = self._get([w.setup.remote(addr, port, ordinals[r]) for r, w in enumerate(self.workers)], "setup")
        if self.plan.has_training_roles():
            self.train = train_dispatch([res["mesh"] for res in results])
        self.rollout = replica_dispatch(self.world_size, self.plan.replica_size)
        return results

    @property
    def dp_size(self) -> int:
        return self.train.size

    @property
    def num_replicas(self) -> int:
        return self.rollout.size

    # ------------------------------------------------------------------ calls
    def run(self, method: str, *args, **kwargs) -> list:
        submitted = time.time()
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return self.wait(Pending(refs, method, list(range(len(refs))), submitted))  # every rank's result

    def run_rank0(self, method: str, *args, **kwargs):
        """Call on every rank (collectives need all) and return rank 0's result."""
        return self.run(method, *args, **kwargs)[0]

    def run_split(self, method: str, batch: Batch, *args, **kwargs) -> list:
        """Slice `batch` over data-parallel ranks; returns the per-dp-rank results, in order, computed on
        slices padded with dummy rows: use `gather_rows` to cut them back."""
        began, cpu = time.time(), time.thread_time()
        padded = batch.pad_to_multiple(self.dp_size)
        # one data-parallel rank takes the batch whole: no copy of its rows (select) on the driver's critical path
        shards = [padded] if self.dp_size == 1 else padded.split(self.dp_size)
        return self._dispatch(self.train, method, [(shard, *args) for shard in shards], kwargs,
                              (began, time.thread_time() - cpu))

    def run_per_dp(self, method: str, per_dp_args: list[tuple], **kwargs) -> list:
        """`method(*per_dp_args[k])` on every rank of data-parallel rank k; the results of the dp ranks, in order."""
        return self._dispatch(self.train, method, per_dp_args, kwargs)

    def run_per_replica(self, method: str, per_replica_args: list[tuple], **kwargs) -> list:
        """`method(*per_replica_args[k])` on every worker of rollout replica k; the replicas' results, in order."""
        return self._dispatch(self.rollout, method, per_replica_args, kwargs)

    def submit_per_replica(self, method: str, per_replica_args: list[tuple], **kwargs) -> Pending:
        """`run_per_replica` without blocking: the calls start at once; `wait` gives run_per_replica's result.
        A worker runs its calls in the order they were submitted."""
        return self._submit(self.rollout, method, per_replica_args, kwargs)

    def wait(self, pending: Pending) -> list:
        """Block until submitted calls finish (failing fast as every wait: a dead worker raises WorkerLost)."""
        results = self._get(pending.refs, pending.method)
        self._timed.append((pending.method, pending.submitted, time.time(), pending.slicing))
        return [results[leader] for leader in pending.leaders]

    def _dispatch(self, d: Dispatch, method: str, per_shard_args: list[tuple], kwargs: dict,
                  slicing: tuple[float, float] | None = None) -> list:
        return self.wait(self._submit(d, method, per_shard_args, kwargs, slicing))

    def _submit(self, d: Dispatch, method: str, per_shard_args: list[tuple], kwargs: dict,
                slicing: tuple[float, float] | None = None) -> Pending:
        assert len(per_shard_args) == d.size, (len(per_shard_args), d.size)
        shard = d.shard_of(self.world_size)
        submitted = time.time()
        per_shard_args = [self._put_shared(args) if len(members) > 1 else args
                          for args, members in zip(per_shard_args, d.members)]
        return Pending([getattr(w, method).remote(*per_shard_args[shard[r]], **kwargs)
                        for r, w in enumerate(self.workers)], method, list(d.leaders), submitted, slicing)

    def _put_shared(self, args: tuple) -> tuple:
        """A shard that several ranks take (a model-parallel group's, a replica's): its batch, tensors and lists go into
        Ray's object store once and each rank gets the reference (Ray hands the method the value), instead of
        pickling them once per rank."""
        return tuple(self._ray.put(a) if isinstance(a, (Batch, torch.Tensor, list, dict)) else a for a in args)

    def _get(self, refs: list, method: str) -> list:
        """ray.get of one ref per rank that fails fast (see `_get_fail_fast`)."""
        return _get_fail_fast([(self, rank, ref) for rank, ref in enumerate(refs)], method)

    def _lost(self, rank: int, method: str, err: Exception) -> WorkerLost:
        f = self.facts[rank] if hasattr(self, "facts") else {}
        node = f"{f.get('ip', '?')} (Ray node {f.get('node_id', '?')[:12]})"
        return WorkerLost(self.name, rank, self.plan.roles, node, f.get("pid"), f"in {method}: {_short_cause(err)}")

    def memory_metrics(self) -> dict[str, float]:
        """Per-GPU peak memory: perf/<stat>/<group>_rank<r> for every worker (nothing on CPU)."""
        if not self.plan.gpus_per_worker:
            return {}
        out = {}
        for rank, stats in enumerate(self.run("device_memory")):
            out.update({f"perf/{k}/{self.name}_rank{rank}": v for k, v in stats.items()})
        return out

    def call_metrics(self, since: float = 0.0) -> dict[str, float]:
        """The phase calls the driver waited for since the last call_metrics and submitted at or after `since` (wall
        clock: a step's start leaves out the validation between steps), split into the ranks' work, Ray's dispatch and
        the results' return, and for run_split's calls the driver's slicing and its CPU time (utils/profiling.
        split_calls): timing_s/{worker,dispatch,return,slice,slice_cpu}/<phase>."""
        driver = [c for c in self._timed if c[1] >= since]
        self._timed = deque(maxlen=512)
        ranks = self._get([w.take_phase_calls.remote() for w in self.workers], "take_phase_calls")
        return split_calls(driver, ranks)

    def placement_table(self) -> list[dict]:
        """Per rank: node address, node-local rank, pid, Ray GPU ids (for logs and tests)."""
        return [{"rank": r, "ip": f["ip"], "node_id": f["node_id"], "node_local_rank": self.node_local_rank[r],
                 "pid": f["pid"], "gpu_ids": f["gpu_ids"]} for r, f in enumerate(self.facts)]

    def shutdown(self) -> None:
        for w in self.workers:
            self._ray.kill(w)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def _unplaceable(plan: GroupPlan, bundles: list[dict], waited_s: float) -> str:
    nodes = cluster_nodes()
    have = ", ".join(f"{n['ip']} (CPU {n['CPU']:g}, GPU {n['GPU']:g})" for n in nodes) or "none"
    return (f"Ray could not place the {plan.name} group within {waited_s:.0f} s: it needs {len(bundles)} bundle(s) "
            f"{bundles} with strategy {plan.strategy} ({'one per node' if plan.strategy == 'STRICT_SPREAD' else 'packed'}"
            f"); the cluster's alive nodes: {have}. Check trainer.nnodes / trainer.n_gpus_per_node "
            "(and rollout.num_replicas in split mode) against the cluster, or add nodes (docs/multinode.md)")


class LocalWorkerGroup:
    """One worker in this process, no Ray: the same API as WorkerGroup (`trainer.use_ray=false`), for a
    single device, debugging, and machines without Ray."""

    _ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    def __init__(self, worker_cls, *, worker_kwargs: dict | None = None):
        self.world_size = self.dp_size = self.num_replicas = 1
        self.name = "local"
        self._saved_env = {k: os.environ.get(k) for k in self._ENV}
        self.workers = [worker_cls(rank=0, world_size=1, **(worker_kwargs or {}))]

    def setup(self) -> list:
        w = self.workers[0]
        _, port = w.address()
        cuda = torch.cuda.is_available()
        ordinal = device_ordinal(os.environ, accelerator_ids=None, device_count=torch.cuda.device_count()) if cuda else 0
        return [w.setup(rendezvous_host(True, ""), port, ordinal)]

    def run(self, method: str, *args, **kwargs) -> list:
        return [getattr(self.workers[0], method)(*args, **kwargs)]

    def run_rank0(self, method: str, *args, **kwargs):
        return self.run(method, *args, **kwargs)[0]

    def run_split(self, method: str, batch: Batch, *args, **kwargs) -> list:
        return self.run(method, batch, *args, **kwargs)

    def run_per_dp(self, method: str, per_dp_args: list[tuple], **kwargs) -> list:
        assert len(per_dp_args) == 1
        return self.run(method, *per_dp_args[0], **kwargs)

    run_per_replica = run_per_dp

    def submit_per_replica(self, method: str, per_replica_args: list[tuple], **kwargs) -> Pending:
        return Pending(self.run_per_replica(method, per_replica_args, **kwargs), method)  # in-process: runs now

    def wait(self, pending: Pending) -> list:
        return [pending.refs[leader] for leader in pending.leaders]

    def memory_metrics(self) -> dict[str, float]:
        return {}  # the driver's own memory_metrics() covers the in-process worker

    def call_metrics(self, since: float = 0.0) -> dict[str, float]:
        take_calls()  # in-process calls have no dispatch to time: the records are dropped
        return {}

    def shutdown(self) -> None:
        """Free the worker, its process group and the distributed env vars it set in this process."""
        for w in self.workers:
            w.close()
        self.workers = []
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_together(*calls: tuple) -> list[list]:
    """Call (group, method, args) on every worker of each group at once and wait for all of them: for
    collectives that span groups (split-mode weight sync: train rank 0 broadcasts to the rollout group)."""
    if not all(isinstance(g, WorkerGroup) for g, _, _ in calls):
        raise ValueError("run_together needs Ray worker groups (split placement runs with trainer.use_ray=true)")
    refs = [[getattr(w, method).remote(*args) for w in g.workers] for g, method, args in calls]
    flat = _get_fail_fast([(g, rank, ref) for (g, _, _), group_refs in zip(calls, refs)
                           for rank, ref in enumerate(group_refs)], "+".join(sorted({m for _, m, _ in calls})))
    out, i = [], 0
    for group_refs in refs:
        out.append(flat[i:i + len(group_refs)])
        i += len(group_refs)
    return out


def _get_fail_fast(entries: list[tuple], method: str) -> list:
    """ray.get of (group, rank, ref) entries in order, failing fast: the first dead worker raises WorkerLost
    naming it at once (its peers, in any of the groups, may be blocked in a collective with it forever)."""
    import ray

    death = _death_errors()
    owner = {ref: (g, rank) for g, rank, ref in entries}
    refs = [ref for _, _, ref in entries]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=None)
        for ref in done:
            try:
                ray.get(ref)
            except death as err:
                g, rank = owner[ref]
                raise g._lost(rank, method, err) from None
            except ray.exceptions.RayTaskError:
                # a peer's collective may fail first (gloo: connection closed): name the dead worker if any
                dead = _first_dead(pending, owner, method)
                if dead is not None:
                    raise dead from None
                raise
    return ray.get(refs)


def _first_dead(pending: list, owner: dict, method: str, grace_s: float = 10.0) -> WorkerLost | None:
    import ray

    if not pending:
        return None
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        try:
            ray.get(ref)
        except _death_errors() as err:
            g, rank = owner[ref]
            return g._lost(rank, method, err)
        except Exception:  # noqa: BLE001 - the other peers' errors are consequences of the first
            continue
    return None


def gather_rows(results: list, batch: Batch) -> Any:
    """Concatenate per-shard results (tensors [b, ...] or tuples of them) and drop pad_to_multiple rows."""
    n = len(batch)  # dummy rows are appended at the end by pad_to_multiple

    def cat(parts):
        if parts[0] is None:
            return None
        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return whole if whole.shape[0] == n else whole[:n]

    if isinstance(results[0], tuple):
        return tuple(cat([r[i] for r in results]) for i in range(len(results[0])))
    return cat(results)


def mean_metrics(results: list[dict]) -> dict[str, float]:
    keys = set().union(*results)
    return {k: sum(r[k] for r in results if k in r) / sum(1 for r in results if k in r) for k in keys}
