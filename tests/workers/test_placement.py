"""The placement rule (workers/placement.py) on simulated environments: device ordinals under Ray and torchrun,
group plans for every placement, dispatch tables from megatron coordinates (the trainer tests build them from
megatron's own parallel_state: tests/trainer/test_multinode.py, test_mesh.py)."""

from __future__ import annotations

import pytest

from rltrain.config.schema import RLConfig
from rltrain.workers.placement import (
    PlacementError, cpus_per_worker, device_ordinal, node_local_ranks, placement_errors, plan_groups,
    replica_dispatch, train_dispatch,
)

def cfg(**kw):
    """An RLConfig of the schema's defaults (one device, colocated, Ray, the hf engine) with `section__key=value`."""
    out = RLConfig()
    for key, value in kw.items():
        section, name = key.split("__")
        setattr(getattr(out, section), name, value)
    return out


# ------------------------------------------------------------------ device ordinal

def test_ray_actor_sees_only_its_gpu_so_its_ordinal_is_zero():
    # the crash: rank 1 of a DP=2 group got local_rank 1 while Ray showed it one GPU
    assert device_ordinal({"CUDA_VISIBLE_DEVICES": "1"}, accelerator_ids=["1"], device_count=1) == 0
    assert device_ordinal({"CUDA_VISIBLE_DEVICES": "6"}, accelerator_ids=["6"], device_count=1) == 0


def test_ray_without_setting_visible_devices_uses_the_physical_id():
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the node's list (or nothing) is visible
    assert device_ordinal({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, accelerator_ids=["6"], device_count=4) == 2
    assert device_ordinal({}, accelerator_ids=["3"], device_count=8) == 3


def test_multi_gpu_actor_uses_its_first_gpu():
    assert device_ordinal({"CUDA_VISIBLE_DEVICES": "2,3"}, accelerator_ids=["2", "3"], device_count=2) == 0


def test_torchrun_uses_local_rank():
    assert device_ordinal({"LOCAL_RANK": "3"}, accelerator_ids=None, device_count=8) == 3
    assert device_ordinal({}, accelerator_ids=None, device_count=1) == 0


@pytest.mark.parametrize("env,ids,count,match", [
    ({"LOCAL_RANK": "1"}, None, 1, "sees 1 CUDA device"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, ["1"], 1, "does not list it"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, [], 1, "no GPU"),
    ({}, ["5"], 2, "sees 2 CUDA device"),
])
def test_impossible_ordinal_is_a_clear_error(env, ids, count, match):
    with pytest.raises(PlacementError, match=match):
        device_ordinal(env, accelerator_ids=ids, device_count=count)


def test_node_local_ranks_count_per_node_in_rank_order():
    assert node_local_ranks(["a", "a", "b", "a", "b"]) == [0, 1, 0, 2, 1]


# ------------------------------------------------------------------ plans

def test_colocated_two_gpus_is_one_group_of_two_with_every_role():
    [hybrid] = plan_groups(cfg(trainer__n_gpus_per_node=2), device="cuda", use_ref=True, use_critic=True)
    assert hybrid.roles == ("actor", "ref", "critic", "rollout")
    assert hybrid.bundles == (2,) and hybrid.gpus_per_worker == 1 and hybrid.strategy == "STRICT_SPREAD"
    assert [hybrid.bundle_of(r) for r in range(2)] == [0, 0]


def test_split_one_plus_one_puts_rollout_on_its_own_gpu():
    train, rollout = plan_groups(cfg(trainer__colocate=False), device="cuda", use_ref=True, use_critic=False)
    assert train.roles == ("actor", "ref") and train.world_size == 1
    assert rollout.roles == ("rollout",) and rollout.world_size == 1 and rollout.gpus_per_worker == 1


def test_multi_node_train_group_is_one_bundle_per_node_and_replicas_pack():
    c = cfg(trainer__n_gpus_per_node=4, trainer__nnodes=2, trainer__colocate=False, actor__tensor_parallel_size=2,
            rollout__engine="hf", rollout__tensor_parallel_size=1, rollout__num_replicas=3)
    train, rollout = plan_groups(c, device="cuda", use_ref=False, use_critic=False)
    assert train.bundles == (4, 4) and train.strategy == "STRICT_SPREAD"
    assert [train.bundle_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rollout.bundles == (1, 1, 1) and rollout.strategy == "PACK" and rollout.replica_size == 1


@pytest.mark.parametrize("replicas", [3, None])
def test_split_vllm_refuses_more_than_one_engine(replicas):
    """Split vLLM builds one engine over the rollout group (one torch.distributed world): several replicas, named
    or implied by null (as many rollout devices as training devices, over the engine's TP), are refused with the
    keys to change; one replica plans."""
    c = cfg(trainer__n_gpus_per_node=4, trainer__colocate=False, actor__tensor_parallel_size=2,
            rollout__engine="vllm", rollout__tensor_parallel_size=2, rollout__num_replicas=replicas)
    with pytest.raises(PlacementError, match="rollout.num_replicas=1"):
        plan_groups(c, device="cuda", use_ref=False, use_critic=False)
    one = cfg(trainer__n_gpus_per_node=4, trainer__colocate=False, actor__tensor_parallel_size=2,
              rollout__engine="vllm", rollout__tensor_parallel_size=2, rollout__num_replicas=1)
    _, rollout = plan_groups(one, device="cuda", use_ref=False, use_critic=False)
    assert rollout.bundles == (2,) and rollout.replica_size == 2


def test_cpu_devices_are_processes():
    [hybrid] = plan_groups(cfg(trainer__n_gpus_per_node=4, actor__tensor_parallel_size=2,
                               actor__pipeline_parallel_size=2), device="cpu", use_ref=False, use_critic=False)
    assert hybrid.world_size == 4 and hybrid.gpus_per_worker == 0


@pytest.mark.parametrize("over,keys", [
    (dict(actor__pipeline_parallel_size=2), ["actor.pipeline_parallel_size", "trainer.n_gpus_per_node"]),
    (dict(trainer__n_gpus_per_node=6, actor__tensor_parallel_size=4), ["actor.tensor_parallel_size"]),
    (dict(trainer__n_gpus_per_node=2, trainer__nnodes=2, actor__tensor_parallel_size=4), ["span nodes"]),
    (dict(rollout__tensor_parallel_size=2), ["rollout.tensor_parallel_size", "hf engine"]),
    (dict(rollout__num_replicas=2), ["rollout.num_replicas"]),
    (dict(trainer__use_ray=False, trainer__n_gpus_per_node=2), ["trainer.use_ray"]),
    (dict(trainer__n_gpus_per_node=4, actor__tensor_parallel_size=2, actor__expert_parallel_size=4),
     ["actor.expert_parallel_size=4 must divide the data-parallel size 2"]),
    # colocated: a replica (a vLLM engine) is rollout.tensor_parallel_size consecutive workers of one node
    (dict(trainer__n_gpus_per_node=2, rollout__engine="vllm", rollout__tensor_parallel_size=4),
     ["rollout.tensor_parallel_size=4 must divide trainer.n_gpus_per_node=2"]),
    (dict(trainer__n_gpus_per_node=6, actor__tensor_parallel_size=2, rollout__engine="vllm",
          rollout__tensor_parallel_size=4), ["rollout.tensor_parallel_size=4 must divide trainer.n_gpus_per_node=6"]),
    (dict(trainer__n_gpus_per_node=2, trainer__nnodes=2, rollout__engine="vllm", rollout__tensor_parallel_size=4),
     ["must divide trainer.n_gpus_per_node=2", "one node"]),
])
def test_impossible_placements_name_the_keys(over, keys):
    errors = placement_errors(cfg(**over), device="cuda")
    assert errors, over
    for key in keys:
        assert key in " ".join(errors)
    with pytest.raises(PlacementError):
        plan_groups(cfg(**over), device="cuda", use_ref=False, use_critic=False)


@pytest.mark.parametrize("per_node,nnodes,rtp,replicas", [
    (2, 1, 1, ((0,), (1,))),  # issue #35: one TP=1 engine per GPU
    (4, 1, 2, ((0, 1), (2, 3))),  # two TP=2 engines
    (2, 2, 1, ((0,), (1,), (2,), (3,))),  # two nodes, an engine per GPU
    (2, 2, 2, ((0, 1), (2, 3))),  # an engine per node
    (1, 1, 1, ((0,),)),  # one engine
])
def test_colocated_vllm_makes_one_engine_per_tensor_parallel_group(per_node, nnodes, rtp, replicas):
    from rltrain.workers.placement import replica_size_error

    c = cfg(trainer__n_gpus_per_node=per_node, trainer__nnodes=nnodes, rollout__engine="vllm",
            rollout__tensor_parallel_size=rtp)
    assert placement_errors(c, device="cuda") == []
    [hybrid] = plan_groups(c, device="cuda", use_ref=False, use_critic=False)
    assert hybrid.replica_size == rtp and hybrid.world_size == per_node * nnodes
    assert replica_dispatch(hybrid.world_size, hybrid.replica_size).members == replicas
    # the rollout worker asks the same rule of its group's WORLD_SIZE: accepted here, refused where tp does not divide
    assert replica_size_error(per_node * nnodes, rtp) is None
    assert "rollout.tensor_parallel_size=2 must divide the 3 processes" in replica_size_error(3, 2)


def test_engine_pools_are_refused_on_a_group_of_several_gpus():
    from rltrain.workers.placement import engines_per_gpu_error

    kw = dict(engine="vllm", tensor_parallel_size=1, colocated=True, device="cuda")
    assert engines_per_gpu_error(2, **kw) is None and engines_per_gpu_error(1, **kw, group_size=2) is None
    why = engines_per_gpu_error(2, **kw, group_size=2)
    assert "rollout.engines_per_gpu=1" in why and "2 GPU(s) per group" in why


def test_vllm_engines_that_match_their_group_are_placed():
    for over in (dict(rollout__engine="vllm"), dict(trainer__n_gpus_per_node=2, rollout__engine="vllm",
                                                    rollout__tensor_parallel_size=2),
                 dict(trainer__n_gpus_per_node=2, trainer__colocate=False, rollout__engine="vllm",
                      rollout__num_replicas=1)):
        assert placement_errors(cfg(**over), device="cuda") == [], over


def test_cpu_share_fits_the_node():
    plans = plan_groups(cfg(trainer__n_gpus_per_node=8, trainer__colocate=False, actor__tensor_parallel_size=2,
                            actor__pipeline_parallel_size=2, rollout__num_replicas=2),
                        device="cpu", use_ref=False, use_critic=False)
    per = cpus_per_worker(plans, device="cpu", node_cpus=2, nnodes=1)
    assert per == 0.2 and per * sum(p.world_size for p in plans) <= 2
    assert cpus_per_worker(plans, device="cuda", node_cpus=2, nnodes=1) == 1.0
    assert cpus_per_worker(plans[:1], device="cpu", node_cpus=64, nnodes=1) == 1.0


def test_replica_dispatch_groups_consecutive_ranks():
    d = replica_dispatch(6, 2)
    assert d.members == ((0, 1), (2, 3), (4, 5)) and d.leaders == (0, 2, 4)
    assert d.shard_of(6) == [0, 0, 1, 1, 2, 2]


def test_train_dispatch_tp2_pp2_dp2_worked_example():
    # megatron-core's documented order "tp-cp-ep-dp-pp": rank = pp * (dp_size * tp_size) + dp * tp_size + tp
    coords = [{"tp": r % 2, "dp": (r // 2) % 2, "pp": r // 4} for r in range(8)]
    d = train_dispatch(coords)
    assert d.members == ((0, 1, 4, 5), (2, 3, 6, 7)) and d.leaders == (0, 2)
    with pytest.raises(AssertionError, match="uneven"):
        train_dispatch(coords[:7])
