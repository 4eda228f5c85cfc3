"""rollout/pool.py against a single engine: shares of a batch, prompt order, per-request seeds that do not depend
on which engine serves a request, and weight buckets streamed once to every engine."""

from __future__ import annotations

import random

import pytest
import torch

from rltrain.rollout import SamplingParams
from rltrain.rollout.base import Engine, RolloutResponse
from rltrain.rollout.pool import EnginePool, shares


def test_shares_are_contiguous_and_differ_by_at_most_one():
    assert shares(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shares(2, 4) == [(0, 1), (1, 2)]  # empty shares dropped
    assert shares(0, 2) == []
    for _ in range(50):
        n, k = random.randrange(0, 300), random.randrange(1, 9)
        parts = shares(n, k)
        assert [i for a, b in parts for i in range(a, b)] == list(range(n))
        assert not parts or max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1
    with pytest.raises(ValueError):
        shares(3, 0)


class SeededEngine(Engine):
    """Request j of a call samples from seed + j alone (as vLLM's per-request seeds do); records what it got."""

    def __init__(self, vocab: int = 50):
        self.vocab, self.calls, self.buckets, self.state = vocab, [], [], []

    @property
    def eos_token_ids(self):
        return (2,)

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling.seed))
        out = []
        for j, p in enumerate(prompts):
            for i in range(sampling.n):
                g = torch.Generator().manual_seed((sampling.seed or 0) + j)
                g.manual_seed(g.initial_seed() * 1000 + i)
                toks = torch.randint(3, self.vocab, (sampling.max_tokens,), generator=g).tolist()
                out.append(RolloutResponse(prompt_index=j, token_ids=[sum(p) % 7, *toks],
                                           logprobs=[0.0] * (1 + len(toks)), finish_reason="length"))
        return out

    def start_weight_update(self):
        self.state.append("start")

    def send_ipc_bucket(self, bucket):
        self.buckets.append([name for name, _ in bucket])

    def finish_weight_update(self):
        self.state.append("finish")

    def update_weights(self, named):
        raise AssertionError("a pool streams buckets")

    def sleep(self, level=1):
        self.state.append(f"sleep{level}")

    def wake_up(self):
        self.state.append("wake")


def test_pool_generates_what_one_engine_does_in_prompt_order():
    g = torch.Generator().manual_seed(random.randrange(2**31))
    prompts = [torch.randint(3, 50, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
               for _ in range(11)]
    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=int(torch.randint(0, 10**6, (), generator=g)))
    want = SeededEngine().generate(prompts, sampling)
    engines = [SeededEngine() for _ in range(3)]
    pool = EnginePool(engines)
    got = pool.generate(prompts, sampling)
    assert [(r.prompt_index, r.token_ids) for r in got] == [(r.prompt_index, r.token_ids) for r in want]
    assert [e.calls[0] for e in engines] == [(4, sampling.seed), (4, sampling.seed + 4), (3, sampling.seed + 8)]
    unseeded = pool.generate(prompts[:2], SamplingParams(max_tokens=2, seed=None))  # one prompt each, no seed
    assert [r.prompt_index for r in unseeded] == [0, 1] and engines[2].calls[-1] == (3, sampling.seed + 8)
    pool.close()


def test_pool_streams_each_bucket_once_to_every_engine_and_fans_out_sleep():
    engines = [SeededEngine(), SeededEngine()]
    pool = EnginePool(engines, bucket_bytes=3 * 4 * 10)  # three 10-float tensors per bucket
    named = ((f"w{i}", torch.zeros(10)) for i in range(7))  # a stream, consumed once
    assert pool.update_weights(named) == 7
    for e in engines:
        assert e.buckets == [["w0", "w1", "w2"], ["w3", "w4", "w5"], ["w6"]]
        assert e.state == ["start", "finish"]
    pool.sleep(level=2)
    pool.wake_up()
    assert all(e.state[-2:] == ["sleep2", "wake"] for e in engines)
    pool.close()


def test_engines_take_each_bucket_and_sleep_at_once():
    """The engines load a bucket in their own processes: the pool hands it to all of them before any returns (a
    barrier every engine must reach within the call times out if they are served one after another)."""
    import threading

    barrier = threading.Barrier(3, timeout=10)

    class Waiting(SeededEngine):
        def send_ipc_bucket(self, bucket):
            barrier.wait()
            super().send_ipc_bucket(bucket)

        def sleep(self, level=1):
            barrier.wait()
            super().sleep(level)

    engines = [Waiting() for _ in range(3)]
    pool = EnginePool(engines, bucket_bytes=2 * 4 * 5)
    assert pool.update_weights((f"w{i}", torch.ones(5)) for i in range(5)) == 5
    assert all(e.buckets == [["w0", "w1"], ["w2", "w3"], ["w4"]] for e in engines)
    pool.sleep(level=1)
    assert all(e.state == ["start", "finish", "sleep1"] for e in engines)
    pool.close()


def test_an_engines_error_reaches_the_caller():
    class Broken(SeededEngine):
        def generate(self, prompts, sampling):
            raise RuntimeError("engine 1 died")

    pool = EnginePool([SeededEngine(), Broken()])
    with pytest.raises(RuntimeError, match="engine 1 died"):
        pool.generate([[1], [2], [3]], SamplingParams(max_tokens=2, seed=1))
    with pytest.raises(ValueError):
        EnginePool([])
    pool.close()
