"""rollout.true_on_policy on CPU: the hf rollout engine (KV-cache decoding, left-padded batches, chunked partial
rollouts) and the Megatron actor (right-padded rows, full-sequence forward, token-budget micro-batches, the fused
head's batch-invariant mode) give every sampled token the same log-prob to the bit, dense and MoE (with and without
routing replay), at temperature 1 and with temperature / top-k / top-p; the training forward's log-probs too; the
engines' values stay those of the plain models (fp32 rounding)."""

from __future__ import annotations

import random

import pytest
import torch

from rltrain.models.engine_config import SampledDistribution
from rltrain.rollout.base import SamplingParams
from rltrain.rollout.hf import HFEngine
from rltrain.rollout.partial import generate_in_chunks
from _megatron_ref import hf_logprobs, make_engine, random_hf_model, random_moe_model

V = 53
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16], [3] * 9]


def _pair(hf, top_k=-1, top_p=1.0, routed=False, budget=30):
    """(the hf engine, the actor) on the same weights, both in true on-policy mode."""
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    actor = make_engine(hf.config, seed=0, true_on_policy=SampledDistribution(top_k, top_p),
                        max_tokens_per_micro_batch=budget, lr=1e-2)
    actor.load_hf_weights(sd)
    engine = HFEngine(hf, eos_token_id=[0], max_batch_size=4, true_on_policy=True, return_routed_experts=routed)
    return engine, actor


def _rows(responses, prompts=PROMPTS):
    """Right-padded full sequences of the responses: ids [B, S], seq_lens [B], response mask [B, S], and the
    sampler's log-probs on the same layout."""
    seqs = [prompts[r.prompt_index] + r.token_ids for r in responses]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    sampler = torch.zeros(len(seqs), width)
    for i, (r, s) in enumerate(zip(responses, seqs)):
        p = len(prompts[r.prompt_index])
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, p:len(s)] = True
        sampler[i, p:len(s)] = torch.tensor(r.logprobs)
    return ids, torch.tensor([len(s) for s in seqs]), mask, sampler


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 8, 0.9)])
def test_engine_and_actor_log_probs_are_the_same_bits(temperature, top_k, top_p):
    seed = random.randrange(2**31)
    hf = random_hf_model(V, seed=seed % 1000)
    engine, actor = _pair(hf, top_k, top_p)
    sampling = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=7, seed=seed)
    responses = engine.generate(PROMPTS, sampling)
    ids, lens, mask, sampler = _rows(responses)
    lp, ent = actor.forward_logprobs(ids, lens, mask, temperature=temperature)
    assert torch.equal(lp, sampler), seed
    assert torch.isfinite(ent[mask]).all()
    if top_k <= 0 and top_p >= 1.0:  # the plain transformers model's log-probs, to fp32 rounding
        with torch.no_grad():
            ref, _ = hf_logprobs(random_hf_model(V, seed=seed % 1000), ids, mask, temperature)
        torch.testing.assert_close(lp[mask].double(), ref[mask].detach(), rtol=0, atol=1e-4)

    seen = []  # the training forward computes the same bits (the update's ratio is exactly 1 on the first step)
    actor.train_step([dict(input_ids=ids, seq_lens=lens, label_mask=mask)],
                     lambda out, mb: (seen.append(out.logprobs.detach()) or -out.logprobs[mask].mean(), {}),
                     temperature=temperature)
    assert torch.equal(seen[0], sampler), seed


def test_partial_rollout_chunks_agree_with_the_actor():
    seed = random.randrange(2**31)
    engine, actor = _pair(random_hf_model(V, seed=seed % 1000))
    responses, versions = generate_in_chunks(engine, PROMPTS, SamplingParams(n=2, max_tokens=7, seed=seed),
                                             chunk_tokens=2)  # each chunk re-reads its prefix in another batch
    ids, lens, mask, sampler = _rows(responses)
    lp, _ = actor.forward_logprobs(ids, lens, mask)
    assert torch.equal(lp, sampler), seed


@pytest.mark.parametrize("shape", [{}, dict(norm_topk_prob=False, num_experts=6, num_experts_per_tok=3)])
def test_moe_engine_and_actor_agree_with_and_without_routing_replay(shape):
    seed = random.randrange(2**31)
    engine, actor = _pair(random_moe_model(V, seed=seed % 1000, **shape), routed=True)
    responses = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, seed=seed))
    ids, lens, mask, sampler = _rows(responses)
    routed = torch.zeros(*ids.shape, *responses[0].routed_experts.shape[1:], dtype=torch.long)
    for i, r in enumerate(responses):
        routed[i, :r.routed_experts.shape[0]] = r.routed_experts
    for replay in (routed, None):  # exact router logits pick the same experts even unreplayed
        lp, _ = actor.forward_logprobs(ids, lens, mask, routed_experts=replay)
        assert torch.equal(lp, sampler), (seed, replay is None)


def test_engine_refuses_what_cannot_be_exact():
    hf = random_hf_model(V)
    for kw, match in [(dict(elementwise_fusion="mcore"), "elementwise_fusion"),
                      (dict(fused_linear_logprob_backend="triton"), "torch backend"),
                      (dict(fused_linear_logprob=False), "fused head")]:
        with pytest.raises(ValueError, match=match):
            make_engine(hf.config, true_on_policy=SampledDistribution(), **kw)
