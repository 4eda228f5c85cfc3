"""Tests for the hf rollout engine against a tiny random Qwen3 model, with references computed by hand
(plain forward loops, teacher-forced forwards). No downloads, CPU, fp32."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rltrain.rollout import (MultiTurnRollout, RolloutOutput, RolloutResponse, SamplingParams, build_rollout_engine,
                             engine_class)
from rltrain.rollout.hf import HFEngine, filter_top_k_top_p, sample_next_token
from _tiny_models import VOCAB, UnicodeTokenizer, tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def greedy_by_hand(model, prompt: list[int], max_tokens: int, eos: int | None = None):
    """Argmax decoding with a full forward per step (no cache, no padding)."""
    ids, logprobs = list(prompt), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].double()
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
        if tok == eos:
            break
    return ids[len(prompt):], logprobs


@torch.no_grad()
def teacher_forced_logprobs(model, prompt, tokens, temperature) -> torch.Tensor:
    full = torch.tensor([prompt + tokens])
    logits = model(full).logits[0, len(prompt) - 1:-1].double() / temperature  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 1, 9, 3], seed=7)  # awkward lengths: left padding matters


def test_generate_returns_n_samples_per_prompt_prompt_major(model, prompts):
    engine = HFEngine(model, eos_token_id=[], max_batch_size=5)  # 12 rows -> chunks of 5, 5, 2
    out = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=3))
    assert [r.prompt_index for r in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for r in out:
        assert len(r.token_ids) == 6 and r.finish_reason == "length" and r.stop_reason is None
        assert all(0 <= t < VOCAB for t in r.token_ids)
        assert all(lp <= 0 for lp in r.logprobs) and r.loss_mask == [1] * 6
        assert r.num_turns == 1 and r.tool_calls == 0


def test_greedy_equals_argmax_decoding_by_hand(model, prompts):
    full = [greedy_by_hand(model, p, max_tokens=8) for p in prompts]
    eos = full[2][0][3]  # make at least one row stop early on EOS: cut each reference at its first eos
    cut = [tokens.index(eos) + 1 if eos in tokens else len(tokens) for tokens, _ in full]
    expected = [(tokens[:c], logprobs[:c]) for (tokens, logprobs), c in zip(full, cut)]
    engine = HFEngine(model, eos_token_id=eos, max_batch_size=3)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=8))
    assert len(out) == 2 * len(prompts)
    for r in out:
        tokens, logprobs = expected[r.prompt_index]
        assert r.token_ids == tokens
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), torch.tensor(logprobs, dtype=torch.float64),
                                   atol=1e-4, rtol=0)
        assert r.finish_reason == ("stop" if tokens[-1] == eos else "length")
    assert any(r.finish_reason == "stop" for r in out)


def test_max_tokens_respected_with_finish_length(model, prompts):
    engine = HFEngine(model, eos_token_id=[])
    for max_tokens in (1, 4):
        out = engine.generate(prompts, SamplingParams(n=2, temperature=0.9, max_tokens=max_tokens, seed=0))
        assert all(len(r.token_ids) == max_tokens and r.finish_reason == "length" for r in out)


def _first_fresh_position(tokens: list[int], start: int) -> int:
    """First position >= start whose token did not occur before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_token_id_ends_response_and_is_kept(model, prompts):
    engine = HFEngine(model, eos_token_id=[])
    greedy = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
    k = _first_fresh_position(greedy, 2)
    out = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy[k]]))[0]
    assert out.token_ids == greedy[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == greedy[k]
    # The same id as the engine's EOS: also kept, stop_reason None (vLLM convention).
    out = HFEngine(model, eos_token_id=greedy[k]).generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.token_ids == greedy[:k + 1] and out.finish_reason == "stop" and out.stop_reason is None


def test_stop_string_ends_response_after_completing_token(model, prompts):
    tokenizer = UnicodeTokenizer()
    engine = HFEngine(model, tokenizer=tokenizer, eos_token_id=[])
    greedy = engine.generate(prompts[2:3], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
    text = tokenizer.decode(greedy)
    k = next(k for k in range(1, 10) if text.find(text[k:k + 2]) == k)  # a 2-token string first seen at k
    stop = text[k:k + 2]
    sampling = SamplingParams(temperature=0.0, max_tokens=12, stop=("never-occurs", stop))
    out = engine.generate(prompts[2:3], sampling)[0]
    assert out.token_ids == greedy[:k + 2]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_without_tokenizer_is_a_clear_error(model, prompts):
    with pytest.raises(ValueError, match="tokenizer"):
        HFEngine(model).generate(prompts, SamplingParams(stop=("x",), max_tokens=2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9), (1.3, 5, 1.0)])
def test_sampler_logprobs_equal_teacher_forced_forward(model, prompts, temperature, top_k, top_p):
    engine = HFEngine(model, eos_token_id=[], max_batch_size=16)
    sampling = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=10, seed=11)
    for r in engine.generate(prompts, sampling):
        reference = teacher_forced_logprobs(model, prompts[r.prompt_index], r.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), reference, atol=1e-4, rtol=0)


def test_seed_makes_sampling_reproducible(model, prompts):
    engine = HFEngine(model, eos_token_id=[])
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=123)
    first = [r.token_ids for r in engine.generate(prompts, sampling)]
    assert first == [r.token_ids for r in engine.generate(prompts, sampling)]
    other = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=124)
    assert first != [r.token_ids for r in engine.generate(prompts, other)]


def test_filter_top_k_top_p_hand_worked():
    logits = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).log()
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_top_k_top_p(logits, top_k=2, top_p=1.0)) == [True, True, False, False, False]
    # mass before token 2 is 0.70 < 0.75 (kept); before token 3 it is 0.85 (dropped)
    assert keep(filter_top_k_top_p(logits, top_k=-1, top_p=0.75)) == [True, True, True, False, False]
    assert keep(filter_top_k_top_p(logits, top_k=-1, top_p=0.3)) == [True, False, False, False, False]
    assert keep(filter_top_k_top_p(logits[:, [3, 0, 4, 2, 1]], top_k=3, top_p=0.6)) == [False, True, False, False, True]


def test_sample_next_token_draws_only_from_filtered_set_with_right_frequencies():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log().expand(20000, 5)
    tokens, logprobs = sample_next_token(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {0, 1}
    frac0 = (tokens == 0).double().mean().item()
    assert abs(frac0 - 0.5 / 0.7) < 0.02  # renormalised over the top-2
    # reported log-probs are the unfiltered temperature-1 ones
    torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_update_weights_switches_outputs_to_the_new_model(prompts):
    old, new = tiny_qwen3(seed=1), tiny_qwen3(seed=2)
    engine = HFEngine(tiny_qwen3(seed=1), eos_token_id=[])
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = [r.token_ids for r in engine.generate(prompts, greedy)]
    assert before == [greedy_by_hand(old, p, 8)[0] for p in prompts]

    consumed = []

    def stream():  # a generator: the engine must take tensors one at a time
        for name, tensor in new.state_dict().items():
            consumed.append(name)
            yield name, tensor.clone()

    loaded = engine.update_weights(stream())
    assert loaded == len(consumed) == len(new.state_dict())
    after = [r.token_ids for r in engine.generate(prompts, greedy)]
    assert after == [greedy_by_hand(new, p, 8)[0] for p in prompts]
    assert after != before


def test_update_weights_rejects_unknown_names_and_shapes(model):
    engine = HFEngine(tiny_qwen3(seed=1))
    with pytest.raises(ValueError, match="not a parameter"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_sleep_and_wake_up_keep_results(prompts):
    engine = HFEngine(tiny_qwen3(seed=1), eos_token_id=[])
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = [r.token_ids for r in engine.generate(prompts, greedy)]
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}

    engine.sleep(level=1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, greedy)
    engine.wake_up()
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == before

    engine.sleep(level=2)  # weights dropped
    assert all(p.is_meta for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.update_weights(saved.items())
    engine.wake_up()
    with pytest.raises(RuntimeError, match="never loaded"):
        engine.generate(prompts, greedy)
    engine.update_weights(saved.items())
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == before
    with pytest.raises(ValueError, match="level"):
        engine.sleep(level=3)


def test_level2_wake_keeps_tied_embeddings_tied(prompts):
    """Qwen3-0.6B ties lm_head to the embeddings: after sleep(level=2) + wake_up the two must again be one
    tensor, so an update naming the shared weight once (as named_parameters() does) fills both. Found on an
    H100 (tools/bench_rollout.py's colocated cycle); the same happens on CPU."""
    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    engine = HFEngine(Qwen3ForCausalLM(cfg), eos_token_id=[])
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    before = engine.generate(prompts, greedy)
    shared = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    assert "lm_head.weight" not in shared  # named once, under the embeddings' name
    engine.sleep(level=2)
    engine.wake_up()
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    engine.update_weights(shared.items())
    after = engine.generate(prompts, greedy)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert [r.logprobs for r in after] == [r.logprobs for r in before]


def test_engine_registry_builds_hf_and_rejects_unknown(model, prompts):
    assert engine_class("hf") is HFEngine
    engine = build_rollout_engine("hf", model=model, eos_token_id=[])
    assert len(engine.generate(prompts[:1], SamplingParams(max_tokens=2, seed=0))) == 1
    with pytest.raises(ValueError, match="hf"):
        engine_class("sglang")
    with pytest.raises(ValueError, match="not an Engine"):
        engine_class("rltrain.rollout.base:SamplingParams")


def test_hf_engine_loads_a_saved_model_path(tmp_path, model, prompts):
    model.save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path), eos_token_id=[])
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    assert engine.generate(prompts, greedy)[2].token_ids == greedy_by_hand(model, prompts[2], 5)[0]
    with pytest.raises(ValueError, match="rollout model path"):
        HFEngine(str(tmp_path / "missing"))


@pytest.mark.parametrize("kwargs,name", [
    ({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop": "abc"}, "stop"), ({"stop": ("",)}, "stop"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"),
])
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=f"SamplingParams.{name}"):
        SamplingParams(**kwargs)


def test_sampling_params_accept_lists_from_yaml():
    sp = SamplingParams(stop=["a", "b"], stop_token_ids=[3])
    assert sp.stop == ("a", "b") and sp.stop_token_ids == (3,)
    with pytest.raises(ValueError, match="empty"):
        HFEngine(tiny_qwen3(seed=1)).generate([[1], []], sp)


def test_rollout_output_pads_and_masks():
    responses = [
        RolloutResponse(0, [5, 6, 7], [-0.1, -0.2, -0.3], "stop", loss_mask=[1, 0, 1], num_turns=2, tool_calls=1),
        RolloutResponse(0, [8], [-0.5], "length"),
    ]
    out = RolloutOutput.from_responses(responses, pad_token_id=0)
    assert out.response_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out.loss_mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    torch.testing.assert_close(out.sampler_logprobs, torch.tensor([[-0.1, 0.0, -0.3], [-0.5, 0.0, 0.0]]))
    m = out.metrics()
    assert m["response_length/mean"] == 2.0 and m["rollout/num_turns/mean"] == 1.5
    assert m["rollout/tool_calls/mean"] == 0.5 and m["rollout/finish_stop_frac"] == 0.5
    assert m["rollout/model_tokens/mean"] == 1.5


def test_multiturn_on_hf_engine_keeps_ids_exact_and_logprobs_teacher_forced(model, prompts):
    """Tool turns in the middle of a real model's response: model-token log-probs still equal a
    teacher-forced forward over prompt + all response ids (tool ids included as context)."""
    tokenizer = UnicodeTokenizer()
    engine = HFEngine(model, tokenizer=tokenizer, eos_token_id=[])
    greedy = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
    close = tokenizer.decode([greedy[2]])  # a "tool call" is any character followed by this one
    calls = []

    def executor(codes):
        calls.append(list(codes))
        return [tokenizer.decode([3, 4, 3])] * len(codes)

    rollout = MultiTurnRollout(engine, tokenizer, tool_executor=executor, tool_pattern=f"(.){re.escape(close)}",
                               tool_stop=[close], max_turns=3, max_total_tokens=30, tool_output_template="{output}")
    out = rollout.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=10))
    assert calls and out[0].tool_calls >= 1
    for r in out:
        assert len(r.token_ids) <= 30 and r.num_turns in (r.tool_calls, r.tool_calls + 1)
        tool_ids = [t for t, m in zip(r.token_ids, r.loss_mask) if m == 0]
        assert tool_ids == [3, 4, 3] * r.tool_calls
        reference = teacher_forced_logprobs(model, prompts[r.prompt_index], r.token_ids, 1.0)
        mask = torch.tensor(r.loss_mask, dtype=torch.bool)
        got = torch.tensor(r.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got[mask], reference[mask], atol=1e-4, rtol=0)
        assert torch.all(got[~mask] == 0)


@pytest.mark.gpu
def test_gpu_level1_sleep_keeps_pinned_host_copies_and_restores_the_weights(prompts):
    """On a GPU, sleep(level=1) copies each weight into a page-locked host copy made at the first sleep and reused
    after (the engine's own 'update, sleep, wake' cycle), frees the GPU memory, and wake_up brings every weight
    back: the same tokens as before the sleep, tied weights still one tensor, and weights loaded while awake
    survive the next sleep (the outputs equal a fresh engine's with those weights)."""
    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    engine = HFEngine(Qwen3ForCausalLM(cfg), device="cuda", eos_token_id=[])
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    before = [r.token_ids for r in engine.generate(prompts, greedy)]
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    engine.sleep(level=1)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in engine.model.parameters())
    assert used - torch.cuda.memory_allocated() >= weights
    first = [h.data_ptr() for h in engine._host]
    engine.wake_up()
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == before
    # new weights loaded awake, then a sleep and a wake: the outputs are a fresh engine's with those weights
    torch.manual_seed(6)
    new = Qwen3ForCausalLM(cfg)
    engine.update_weights((k, v.cuda()) for k, v in new.named_parameters())
    engine.sleep(level=1)
    assert [h.data_ptr() for h in engine._host] == first  # the host copies are reused, not made again
    engine.wake_up()
    fresh = HFEngine(new, device="cuda", eos_token_id=[])
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == [r.token_ids for r in fresh.generate(prompts,
                                                                                                             greedy)]
