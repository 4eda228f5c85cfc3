"""Partial rollouts (rollout/partial.py) on the hf engine: chunked generation equals unchunked while the weights stay,
a weight load between two chunks continues from the tokens made (hand-checked tokens, per-token versions, and
log-probs of each chunk from the weights that sampled it, against teacher-forced forwards), stop strings across a
chunk boundary, and the runner's pause between two chunks. The vLLM engine's twin: tests/rollout/test_rollout_vllm.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from rltrain.rollout.base import SamplingParams
from rltrain.rollout.hf import HFEngine
from rltrain.rollout.partial import PartialRunner, generate_in_chunks
from _tiny_models import VOCAB, UnicodeTokenizer, tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NO_EOS = VOCAB + 1  # never sampled: responses end by length
PROMPTS = [[5, 17, 33], [9, 2, 41, 60, 7, 12], [70]]


@pytest.fixture(scope="module")
def models():
    return tiny_qwen3(1), tiny_qwen3(2)


def engine(model, eos=NO_EOS) -> HFEngine:
    fresh = tiny_qwen3(0)
    fresh.load_state_dict(model.state_dict())
    return HFEngine(fresh, tokenizer=UnicodeTokenizer(), eos_token_id=eos, pad_token_id=0)


@torch.no_grad()
def teacher_forced(model, prompt, tokens, temperature=1.0) -> torch.Tensor:
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def fields(responses):
    return [(r.prompt_index, r.token_ids, r.finish_reason, r.stop_reason) for r in responses]


def test_greedy_chunked_generation_equals_unchunked(models):
    old, _ = models
    # an EOS the model emits in some rows: responses end by stop and by length
    eos = engine(old).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))[1]
    eng = engine(old, eos=eos.token_ids[4])
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=12)
    want = eng.generate(PROMPTS, greedy)
    assert {r.finish_reason for r in want} == {"stop", "length"}
    for chunk in (1, 5, 12, 40):
        got, versions = generate_in_chunks(eng, PROMPTS, greedy, chunk_tokens=chunk)
        assert fields(got) == fields(want), chunk
        for g, w, v in zip(got, want, versions):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
            assert v == [0] * len(g.token_ids)


class LoadAt:
    """A gate that loads `model`'s weights into `eng` before chunk `at` (version 1 from then on)."""

    def __init__(self, eng, model, at):
        self.eng, self.model, self.at, self.calls = eng, model, at, 0

    def chunk(self):
        import contextlib

        if self.calls == self.at:
            self.eng.update_weights(self.model.state_dict().items())
        version = int(self.calls >= self.at)
        self.calls += 1
        return contextlib.nullcontext(version)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_weight_load_between_chunks_continues_from_the_tokens_made(models, temperature):
    """Hand-checked: 4-token chunks, max 10 tokens, the new weights loaded before the second chunk: tokens 0-3 come
    from the old weights (version 0), tokens 4-9 continue prompt + those 4 with the new ones (version 1); each
    token's log-prob is the teacher-forced one under the weights of its version."""
    old, new = models
    eng = engine(old)
    sampling = SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=7)
    got, versions = generate_in_chunks(eng, PROMPTS, sampling, chunk_tokens=4, gate=LoadAt(eng, new, 1))
    assert len(got) == 6 and versions == [[0] * 4 + [1] * 6] * 6
    t = temperature or 1.0
    for r in got:
        prompt, head, tail = PROMPTS[r.prompt_index], r.token_ids[:4], r.token_ids[4:]
        assert r.finish_reason == "length" and len(r.token_ids) == 10
        lp = torch.tensor(r.logprobs, dtype=torch.float64)
        torch.testing.assert_close(lp[:4], teacher_forced(old, prompt, head, t), atol=1e-4, rtol=0)
        torch.testing.assert_close(lp[4:], teacher_forced(new, prompt + head, tail, t), atol=1e-4, rtol=0)
        if temperature == 0.0:  # greedy: the continuation is the new model's greedy continuation of prompt + head
            cont = engine(new).generate([prompt + head], SamplingParams(temperature=0.0, max_tokens=6))[0]
            assert tail == cont.token_ids
            assert head == engine(old).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids


def test_a_stop_string_across_a_chunk_boundary_ends_the_row_where_unchunked_does(models):
    old, _ = models
    eng = engine(old)
    plain = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    stop = UnicodeTokenizer().decode(plain.token_ids[2:4])  # completed by token 3, spanning the chunks [0, 1, 2] | [3, ..]
    sampling = SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,))
    want = eng.generate([PROMPTS[0]], sampling)
    got, versions = generate_in_chunks(eng, [PROMPTS[0]], sampling, chunk_tokens=3, decode=UnicodeTokenizer().decode)
    assert fields(got) == fields(want) == [(0, plain.token_ids[:4], "stop", stop)]
    assert versions == [[0] * 4]


class HoldSecondChunk:
    """Wraps an engine: `second` is set when the second chunk starts, which returns only once a pause is requested,
    so the weight load lands after exactly two chunks."""

    def __init__(self, eng, runner):
        self.eng, self.runner, self.second, self.calls = eng, runner, threading.Event(), 0

    def generate(self, prompts, sampling):
        self.calls += 1
        if self.calls == 2:
            self.second.set()
            deadline = time.monotonic() + 30
            while not self.runner._pauses and time.monotonic() < deadline:  # the test thread's paused() is waiting
                time.sleep(0.001)
        return self.eng.generate(prompts, sampling)


def test_the_runner_pauses_between_two_chunks_while_weights_load(models):
    """A job runs in the runner's thread; a weight load under paused() lands between two chunks (here after the
    second): the tokens before it are version 0 with the old weights' log-probs, the ones after version 1 with the
    new weights'."""
    old, new = models
    eng = engine(old)
    runner = PartialRunner()
    held = HoldSecondChunk(eng, runner)
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    runner.submit("job", lambda: generate_in_chunks(held, [PROMPTS[1]], sampling, chunk_tokens=3, gate=runner))
    assert held.second.wait(30)
    with runner.paused():
        eng.update_weights(new.state_dict().items())
        runner.version = 1
    (r,), (versions,) = runner.result("job")
    runner.close()
    assert versions == [0] * 6 + [1] * 6
    lp = torch.tensor(r.logprobs, dtype=torch.float64)
    prompt, head, tail = PROMPTS[1], r.token_ids[:6], r.token_ids[6:]
    torch.testing.assert_close(lp[:6], teacher_forced(old, prompt, head), atol=1e-4, rtol=0)
    torch.testing.assert_close(lp[6:], teacher_forced(new, prompt + head, tail), atol=1e-4, rtol=0)


def test_runner_jobs_run_in_order_and_errors_reach_result():
    runner = PartialRunner()
    order = []
    runner.submit(1, lambda: order.append(1) or "a")
    runner.submit(2, lambda: 1 / 0)
    runner.submit(3, lambda: order.append(3) or "c")
    assert runner.result(3) == "c" and runner.result(1) == "a" and order == [1, 3]
    with pytest.raises(ZeroDivisionError):
        runner.result(2)
    runner.close()


def test_a_chunk_the_engine_ends_short_by_length_ends_the_row():
    """vLLM ends a request at its max_model_len with 'length' before max_tokens: the row ends there, not continued."""
    from rltrain.rollout.base import RolloutResponse

    class Capped:  # the model's length: prompt + 5 tokens
        def generate(self, prompts, sampling):
            return [RolloutResponse(prompt_index=i, token_ids=[7] * min(sampling.max_tokens, 5 - (len(p) - 1)),
                                    logprobs=[-1.0] * min(sampling.max_tokens, 5 - (len(p) - 1)),
                                    finish_reason="length") for i, p in enumerate(prompts)]

    got, versions = generate_in_chunks(Capped(), [[1]], SamplingParams(max_tokens=12), chunk_tokens=3)
    assert [(r.token_ids, r.finish_reason) for r in got] == [([7] * 5, "length")] and versions == [[0] * 5]
