"""ParallelDims (rltrain/config/parallel.py): the degrees, their rules, and the rank groups against megatron-core's own
RankGenerator (the groups `parallel_state.initialize_model_parallel` builds), for every layout of up to 16 ranks."""

from __future__ import annotations

import pickle

import pytest

from rltrain.config.parallel import ORDER, ParallelDims, ParallelDimsError, rollout_replicas
from rltrain.config.schema import ParallelConfig


def test_degrees_of_a_worked_example():
    # 16 ranks, TP 2, PP 2 -> DP 4; 8 ranks, TP 2, EP 2 -> DP 4, EDP = 8 / (2 * 2 * 1) = 2
    d = ParallelDims(world_size=16, tp=2, pp=2)
    assert (d.dp, d.etp, d.edp, d.model_parallel) == (4, 2, 4, 4)
    e = ParallelDims(world_size=8, tp=2, ep=2)
    assert (e.dp, e.etp, e.edp, e.model_parallel) == (4, 2, 2, 2)
    assert ParallelDims.of(ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2), world_size=8) == e


@pytest.mark.parametrize("kw,words", [
    (dict(world_size=6, tp=4), ["actor.tensor_parallel_size * actor.pipeline_parallel_size = 4 * 1", "6 ranks"]),
    (dict(world_size=4, tp=2, ep=4), ["actor.expert_parallel_size=4 must divide the data-parallel size 2"]),
    (dict(world_size=4, pp=2, ep=2), ["with actor.pipeline_parallel_size=2 is not supported"]),
    (dict(world_size=2, cp=2), ["context parallelism (CP=2) is not supported"]),
    (dict(world_size=2, tp=0), ["actor.tensor_parallel_size=0 must be a positive integer"]),
    (dict(world_size=2, tp=3, section="trainer"), ["trainer.tensor_parallel_size"]),
])
def test_impossible_degrees_are_refused_at_construction_naming_the_keys(kw, words):
    with pytest.raises(ParallelDimsError) as info:
        ParallelDims(**kw)
    for w in words:
        assert w in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))  # a Ray worker's error reaches the driver whole
    assert str(again) == str(info.value) and isinstance(again, ValueError)


def test_every_problem_is_listed():
    with pytest.raises(ParallelDimsError) as info:
        ParallelDims(world_size=6, tp=4, pp=2, ep=2, cp=2)
    assert len(info.value.problems) == 3  # CP, TP * PP, EP with PP


def test_model_problems():
    d = ParallelDims(world_size=8, tp=4, pp=2)
    assert d.model_problems(layers=4, heads=8, kv_heads=4) == []
    [heads] = d.model_problems(layers=4, heads=8, kv_heads=2)  # TP 4 > 2 kv heads: refused, as megatron's build
    assert "num_key_value_heads=2" in heads
    [layers] = d.model_problems(layers=3, heads=8, kv_heads=4)
    assert "num_hidden_layers=3" in layers
    e = ParallelDims(world_size=6, tp=2, ep=3)
    assert e.model_problems(layers=2, heads=4, kv_heads=2, experts=6, expert_ffn=8) == []
    assert "needs a Mixture-of-Experts model" in e.model_problems(layers=2, heads=4, kv_heads=2)[0]
    probs = e.model_problems(layers=2, heads=4, kv_heads=2, experts=4, expert_ffn=7)
    assert "num_experts=4" in probs[0] and "moe_intermediate_size=7" in probs[1]


def test_padded_vocab_is_the_next_multiple_of_tp_times_the_divisor():
    assert ParallelDims(world_size=2, tp=2).padded_vocab(151936, 1) == 151936
    assert ParallelDims(world_size=2, tp=2).padded_vocab(123, 1) == 124
    assert ParallelDims(world_size=4, tp=4).padded_vocab(123, 128) == 512
    assert ParallelDims(world_size=1).padded_vocab(64, 128) == 128


def test_rollout_replicas():
    assert rollout_replicas(world_size=4, tensor_parallel_size=2) == 2
    assert rollout_replicas(world_size=1, tensor_parallel_size=2) == 1
    assert rollout_replicas(world_size=4, tensor_parallel_size=2, num_replicas=3) == 3


def _layouts(max_world=16):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world + 1):
                for ep in range(1, world + 1):
                    try:
                        yield ParallelDims(world_size=world, tp=tp, pp=pp, ep=ep)
                    except ParallelDimsError:
                        continue


def test_rank_groups_are_megatrons():
    """Every valid layout of up to 16 ranks: each group kind equals megatron-core's RankGenerator's, built as
    parallel_state.initialize_model_parallel builds its dense and expert generators."""
    from megatron.core.parallel_state import RankGenerator

    layouts = list(_layouts())
    assert len(layouts) > 100 and any(d.ep > 1 and d.tp > 1 for d in layouts)
    for d in layouts:
        dense = RankGenerator(tp=d.tp, ep=1, dp=d.dp, pp=d.pp, cp=d.cp, order=ORDER)
        expert = RankGenerator(tp=d.etp, ep=d.ep, dp=d.edp, pp=d.pp, cp=1, order=ORDER)
        for ours, gen, theirs in [("tp", dense, "tp"), ("pp", dense, "pp"), ("dp", dense, "dp"),
                                  ("tp-pp", dense, "tp-pp"), ("tp-dp", dense, "tp-dp"), ("ep", expert, "ep"),
                                  ("edp", expert, "dp"), ("etp", expert, "tp"), ("etp-ep", expert, "tp-ep")]:
            assert d.rank_groups(ours) == gen.get_ranks(theirs), (d, ours)
        for rank in range(d.world_size):  # the coordinates place a rank in those groups
            c, x = d.coordinates(rank), d.coordinates(rank, expert=True)
            assert rank in d.rank_groups("dp")[c["tp"] + d.tp * c["pp"]]
            assert rank in d.rank_groups("edp")[x["tp"] + d.etp * (x["ep"] + d.ep * x["pp"])]


def test_rank_groups_refuse_a_mix_of_meshes():
    with pytest.raises(ValueError, match="mixes"):
        ParallelDims(world_size=4, ep=2).rank_groups("dp-ep")
