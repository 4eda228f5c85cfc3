"""trainer/rollout_source.py on a recording fake rollout group: prompt shards, group ids and seeds per replica, the
seed of each try, DAPO refills until enough informative groups (dropped groups and tries counted), the metrics of
the batch, and the data position a checkpoint carries."""

import pytest
import torch

from rltrain.config.schema import DynamicSamplingConfig
from rltrain.data.batch import Batch
from rltrain.data.dataset import PromptSampler
from rltrain.trainer.rollout_source import RolloutSource


class FakeGroup:
    """Two replicas; replica k's call is recorded and answered with one row per prompt (2 response tokens, the
    group id from its offset)."""

    num_replicas = 2

    def __init__(self):
        self.calls = []

    def submit_per_replica(self, method, args):
        assert method == "generate"
        self.calls.append(args)
        return args

    def wait(self, handle):
        out = []
        for prompts, offset, validate, seed in handle:
            n = len(prompts)
            if n == 0:  # an empty shard: its answer is dropped by the source
                out.append((None, {}))
                continue
            batch = Batch(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                          response_ids=torch.ones(n, 2, dtype=torch.long),
                          response_mask=torch.tensor([[1, 1]] * n), loss_mask=torch.tensor([[1, 1]] * n),
                          group_ids=torch.arange(n) + offset,
                          non_tensor={"id": [p["id"] for p in prompts]})
            out.append((batch, {"seed": float(seed)}))
        return out


def _source(score, *, enable=False, max_tries=4, want=2):
    sampler = PromptSampler([{"prompt_ids": [i], "id": i} for i in range(40)], 4, seed=0, shuffle=False)
    return RolloutSource(FakeGroup(), sampler, seed=7, score=score, want_groups=want,
                         dynamic_sampling=DynamicSamplingConfig(enable=enable, max_tries=max_tries),
                         max_response_length=2, multi_turn=False)


def _score_by_id(values):
    def score(batch):
        return batch.replace(scores=torch.tensor([float(values(i)) for i in batch.non_tensor["id"]])), {"reward/x": 1.0}
    return score


def test_prompts_are_sharded_over_replicas_with_their_group_ids_and_seeds():
    src = _source(_score_by_id(lambda i: i))
    m = {}
    batch, gm = src.next_batch(3, m)
    (first, second), = src.rollout_group.calls
    seed = 7 * 100_003 + 3 * 101 + 1  # try 1 of step 3
    assert [p["id"] for p in first[0]] == [0, 1] and first[1:] == (0, False, seed)
    assert [p["id"] for p in second[0]] == [2, 3] and second[1:] == (2, False, seed + 2)  # seed + its first prompt
    assert batch.group_ids.tolist() == [0, 1, 2, 3] and src.next_group_id == 4
    assert gm["seed"] == seed + 1 and gm["reward/x"] == 1.0  # the replicas' metrics averaged
    assert gm["critic/score/mean"] == 1.5 and gm["response_length/clip_ratio"] == 1.0
    assert "timing_s/reward" in m and "dynamic_sampling/tries" not in gm
    val, _ = src.generate([{"prompt_ids": [9], "id": 9}], validate=True, seed=5)  # validation numbers groups too
    assert val.group_ids.tolist() == [4] and src.next_group_id == 5


@pytest.mark.parametrize("n,replicas,want", [
    (5, 2, [(0, 3), (3, 5)]),  # uneven: sizes differ by one, the larger first
    (3, 4, [(0, 1), (1, 2), (2, 3), (3, 3)]),  # fewer prompts than replicas: the last one idles
    (4, 1, [(0, 4)]),  # one replica: the whole batch, seed unchanged
    (1, 2, [(0, 1), (1, 1)]),
])
def test_shares_are_contiguous_seeded_by_their_first_prompt_and_joined_in_prompt_order(n, replicas, want):
    src = _source(_score_by_id(lambda i: i))
    src.rollout_group.num_replicas = replicas
    src.next_group_id = 10
    prompts = [{"prompt_ids": [i], "id": i} for i in range(n)]
    batch, _ = src.generate(prompts, validate=False, seed=100)
    [args] = src.rollout_group.calls
    assert [[p["id"] for p in a[0]] for a in args] == [list(range(start, stop)) for start, stop in want]
    assert [a[1] for a in args] == [10 + start for start, _ in want]  # group offsets
    assert [a[3] for a in args] == [100 + start for start, _ in want]  # request j's seed is 100 + j on any replica
    assert batch.non_tensor["id"] == list(range(n)) and batch.group_ids.tolist() == list(range(10, 10 + n))
    assert src.next_group_id == 10 + n


def test_dynamic_sampling_refills_until_enough_groups_differ():
    # one row per prompt, so every group holds one score: make the groups of prompts 0-3 "informative" only from
    # the second draw on by scoring per (id, draw): ids < 4 are the first draw
    src = _source(_score_by_id(lambda i: 0.0), enable=True, max_tries=3, want=2)
    with pytest.raises(RuntimeError, match="no group with differing scores in 3 tries"):
        src.next_batch(1, {})
    assert len(src.rollout_group.calls) == 3

    draws = []

    def score(batch):  # the first draw all equal (dropped), the second draw two groups that differ within
        draws.append(1)
        n = len(batch)
        s = torch.zeros(n) if len(draws) == 1 else torch.tensor([0.0, 1.0] * (n // 2))
        gids = batch.group_ids if len(draws) == 1 else torch.tensor([g // 2 for g in batch.group_ids.tolist()])
        return batch.replace(scores=s, group_ids=gids), {}

    src = _source(score, enable=True, max_tries=4, want=2)
    batch, gm = src.next_batch(1, {})
    assert gm["dynamic_sampling/tries"] == 2 and gm["dynamic_sampling/dropped_groups"] == 4
    assert len(batch) == 4 and sorted(set(batch.group_ids.tolist())) == [2, 3]
    seeds = [calls[0][3] for calls in src.rollout_group.calls]
    assert seeds == [7 * 100_003 + 101 + 1, 7 * 100_003 + 101 + 2]  # one seed per try


def test_state_dict_round_trip_restores_the_data_position():
    src = _source(_score_by_id(lambda i: i))
    src.next_batch(1, {})
    state = src.state_dict()
    assert state["next_group_id"] == 4 and "async_rollout" not in state
    again = _source(_score_by_id(lambda i: i))
    again.load_state_dict(state, step=1)
    a, _ = src.next_batch(2, {})
    b, _ = again.next_batch(2, {})
    assert a.non_tensor["id"] == b.non_tensor["id"] == [4, 5, 6, 7] and torch.equal(a.group_ids, b.group_ids)
