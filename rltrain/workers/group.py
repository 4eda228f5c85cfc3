"""Ray worker groups: place N workers (placement group), wire their torch.distributed world, dispatch calls.

The only module (with main.py's init) that imports Ray. `run` calls a method on every rank; `run_split`
slices a Batch across data-parallel ranks (tensor-parallel peers get the same slice) and gathers results.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rltrain.data.batch import Batch


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Connect to an existing cluster (`trainer.ray_address`) or start a local one."""
    import ray

    if ray.is_initialized():
        return
    from rltrain.utils.distenv import apply_no_multicast, forwarded_env

    apply_no_multicast()  # the driver too: it may start NCCL/vLLM in process (use_ray=false)
    env = {"env_vars": forwarded_env()}
    kw: dict[str, Any] = dict(runtime_env=env, include_dashboard=False, log_to_driver=True,
                              configure_logging=True, logging_level="WARNING")
    if address:
        ray.init(address=address, **kw)
    else:
        ray.init(num_cpus=num_cpus, **kw)


class WorkerGroup:
    """`world_size` Ray actors of `worker_cls`, one torch.distributed world, tensor-parallel size `tp_size`."""

    def __init__(self, worker_cls, world_size: int, *, tp_size: int = 1, num_cpus_per_worker: float = 1,
                 num_gpus_per_worker: float = 0, worker_kwargs: dict | None = None, name: str = "workers"):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if world_size % tp_size:
            raise ValueError(f"{name}: {world_size} workers cannot be split into tensor-parallel groups of {tp_size}")
        self.world_size, self.tp_size, self.dp_size = world_size, tp_size, world_size // tp_size
        bundle = {"CPU": num_cpus_per_worker}
        if num_gpus_per_worker:
            bundle["GPU"] = num_gpus_per_worker
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ray.get(self.pg.ready())
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker, name=f"{name}_{rank}_{os.getpid()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=rank),
            ).remote(rank=rank, world_size=world_size, **(worker_kwargs or {}))
            for rank in range(world_size)
        ]
        self._ray = ray

    def setup(self) -> list:
        """Rendezvous at rank 0's address, then build every rank's roles (collectively)."""
        addr, port = self._ray.get(self.workers[0].address.remote())
        gpus = 1 if any(b.get("GPU") for b in self.pg.bundle_specs) else 0
        return self._ray.get([w.setup.remote(addr, port, (rank % max(1, torch.cuda.device_count())) if gpus else 0)
                              for rank, w in enumerate(self.workers)])

    def run(self, method: str, *args, **kwargs) -> list:
        return self._ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def run_rank0(self, method: str, *args, **kwargs):
        """Call on every rank (collectives need all) and return rank 0's result."""
        return self.run(method, *args, **kwargs)[0]

    def run_split(self, method: str, batch: Batch, *args, **kwargs) -> list:
        """Slice `batch` over data-parallel ranks; returns the per-dp-rank results (tp rank 0 of each), in
        order, computed on slices padded with dummy rows: use `gather_rows` to cut them back."""
        shards = batch.pad_to_multiple(self.dp_size).split(self.dp_size)
        return self.run_per_dp(method, [(shard, *args) for shard in shards], **kwargs)

    def run_per_dp(self, method: str, per_dp_args: list[tuple], **kwargs) -> list:
        """Call `method(*per_dp_args[dp])` on every rank of data-parallel rank dp (tensor-parallel peers get the
        same arguments); returns the results of tp rank 0 of each dp rank, in order."""
        assert len(per_dp_args) == self.dp_size
        refs = [getattr(w, method).remote(*per_dp_args[rank // self.tp_size], **kwargs)
                for rank, w in enumerate(self.workers)]
        results = self._ray.get(refs)
        return [results[dp * self.tp_size] for dp in range(self.dp_size)]

    def shutdown(self) -> None:
        for w in self.workers:
            self._ray.kill(w)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


class LocalWorkerGroup:
    """One worker in this process, no Ray: the same API as WorkerGroup (`trainer.use_ray=false`), for a
    single device, debugging, and machines without Ray."""

    _ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    def __init__(self, worker_cls, *, worker_kwargs: dict | None = None):
        self.world_size = self.tp_size = self.dp_size = 1
        self._saved_env = {k: os.environ.get(k) for k in self._ENV}
        self.workers = [worker_cls(rank=0, world_size=1, **(worker_kwargs or {}))]

    def setup(self) -> list:
        w = self.workers[0]
        addr, port = w.address()
        return [w.setup("127.0.0.1", port, 0)]

    def run(self, method: str, *args, **kwargs) -> list:
        return [getattr(self.workers[0], method)(*args, **kwargs)]

    def run_rank0(self, method: str, *args, **kwargs):
        return self.run(method, *args, **kwargs)[0]

    def run_split(self, method: str, batch: Batch, *args, **kwargs) -> list:
        return self.run(method, batch, *args, **kwargs)

    def run_per_dp(self, method: str, per_dp_args: list[tuple], **kwargs) -> list:
        assert len(per_dp_args) == 1
        return self.run(method, *per_dp_args[0], **kwargs)

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
    ray = calls[0][0]._ray
    flat = ray.get([r for group_refs in refs for r in group_refs])
    out, i = [], 0
    for group_refs in refs:
        out.append(flat[i:i + len(group_refs)])
        i += len(group_refs)
    return out


def gather_rows(results: list, batch: Batch) -> Any:
    """Concatenate per-shard results (tensors [b, ...] or tuples of them) and drop pad_to_multiple rows."""
    padded_len = sum(_rows(r) for r in results)
    keep = torch.ones(padded_len, dtype=torch.bool)
    keep[len(batch):] = False  # dummy rows are appended at the end by pad_to_multiple

    def cat(parts):
        if parts[0] is None:
            return None
        return torch.cat(parts, dim=0)[keep]

    if isinstance(results[0], tuple):
        return tuple(cat([r[i] for r in results]) for i in range(len(results[0])))
    return cat(results)


def _rows(r) -> int:
    if isinstance(r, tuple):
        r = r[0]
    return r.shape[0]


def mean_metrics(results: list[dict]) -> dict[str, float]:
    keys = set().union(*results)
    return {k: sum(r[k] for r in results if k in r) / sum(1 for r in results if k in r) for k in keys}
