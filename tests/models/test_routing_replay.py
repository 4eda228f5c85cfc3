"""Rollout routing replay: the hf rollout engine records the experts it routed each token to, and the Megatron
engine (megatron-core's RouterReplay, driven by moe.RoutingReplay) routes through given experts. On CPU in fp32,
against transformers' Qwen3-MoE forced to the same experts (its router's forward replaced), and against a
teacher-forced transformers forward for what the rollout engine records."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from rltrain.data.batch import Batch
from rltrain.rollout.base import SamplingParams
from rltrain.rollout.hf import HFEngine
from rltrain.workers.rollout import routing_fields
from _megatron_ref import (hf_logprobs, hf_loss_inputs, make_engine, ppo_batch, ppo_loss_with_entropy, random_batch,
                           random_moe_model)

V = 101
SHAPES = {  # top-k renormalized (softmax after top-k in megatron), not renormalized (before), a dense first layer
    "normalized": {},
    "unnormalized": dict(norm_topk_prob=False, num_experts=6, num_experts_per_tok=3),
    "dense_first": dict(mlp_only_layers=[0], num_hidden_layers=3),
}


def _engine(hf, **kw):
    eng = make_engine(hf.config, seed=0, make_vocab_size_divisible_by=128, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


def _routers(hf):
    return [m for m in hf.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]


@contextlib.contextmanager
def forced_routing(hf, forced: torch.Tensor):
    """transformers' routers pick the experts in `forced` [B, S, L, k] (batch-major tokens, as they flatten them);
    the weights are their own softmax at those experts, renormalized when norm_topk_prob."""
    routers = _routers(hf)
    assert forced.shape[2] == len(routers)

    def make(router, idx):
        def forward(hidden_states):
            h = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight)
            top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
            if router.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        return forward

    for i, router in enumerate(routers):
        router.forward = make(router, forced[:, :, i].reshape(-1, forced.shape[3]).long())
    try:
        yield
    finally:
        for router in routers:
            del router.forward


def _random_routing(hf, b: int, s: int, seed: int) -> torch.Tensor:
    """[b, s, L, k] distinct random experts per token and layer."""
    g = torch.Generator().manual_seed(seed)
    c = hf.config
    layers = len(_routers(hf))
    return torch.rand(b, s, layers, c.num_experts, generator=g).argsort(-1)[..., :c.num_experts_per_tok].to(torch.uint8)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_routes_through_the_given_experts_as_transformers_forced_to_them(shape):
    hf = random_moe_model(V, seed=3, **SHAPES[shape])
    ids, lens, mask = random_batch(V, [11, 7, 1 + 1, 9], seed=int(torch.randint(0, 1000, ())))
    forced = _random_routing(hf, *ids.shape, seed=int(torch.randint(0, 1000, ())))
    eng = _engine(hf, max_tokens_per_micro_batch=20)  # several micro-batches: each gets its rows' routing
    lp, ent = eng.forward_logprobs(ids, lens, mask, routed_experts=forced)
    with torch.no_grad(), forced_routing(hf, forced):
        ref_lp, ref_ent = hf_logprobs(hf, ids, mask)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=0)
    own_lp, _ = eng.forward_logprobs(ids, lens, mask)  # the replay is cleared: the router's own top-k again
    with torch.no_grad():
        torch.testing.assert_close(own_lp.double(), hf_logprobs(hf, ids, mask)[0], atol=1e-4, rtol=0)
    assert float((own_lp - lp).abs().max()) > 1e-2  # the forced routing changed the result


def test_train_step_with_replay_matches_transformers_forced_to_the_same_experts():
    hf = random_moe_model(V, seed=5, **SHAPES["dense_first"])
    lens = [12, 8, 5]
    batch, lens = ppo_batch(hf, V, lens, seed=9)
    forced = _random_routing(hf, *batch["input_ids"].shape, seed=2)
    eng = _engine(hf, lr=1e-3, grad_clip=1e6, max_tokens_per_micro_batch=24, recompute_activations=True)
    mbs = eng.make_micro_batches({**batch, "routed_experts": forced}, lens)
    assert len(mbs) >= 2 and all(mb.routed_experts is not None for mb in mbs)
    total = float(batch["label_mask"][:, 1:].sum())
    for mb in mbs:
        mb.loss_scale = float(mb.label_mask[:, 1:].sum()) / total
    metrics = eng.train_step(mbs, ppo_loss_with_entropy)  # recompute: the backward re-runs the routers

    hf.train()
    with forced_routing(hf, forced):
        loss, _ = ppo_loss_with_entropy(*hf_loss_inputs(hf, batch, lens))
        loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1e6))
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    router_grad = hf.model.layers[1].mlp.gate.weight.grad
    assert router_grad is not None and float(router_grad.abs().max()) > 0  # top-k weights keep the router's grad


def test_hf_rollout_engine_records_the_routing_of_a_teacher_forced_forward():
    hf = random_moe_model(V, seed=11, **SHAPES["dense_first"])  # its sharp routers leave no near-ties to flip
    prompts = [[5, 17, 33], [2], [40, 41, 42, 43, 44, 45]]
    eng = HFEngine(hf, eos_token_id=0, max_batch_size=2, return_routed_experts=True)
    responses = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=4))
    recorded: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, i, o: recorded.append(o[2])) for r in _routers(hf)]
    try:
        for resp in responses:
            seq = prompts[resp.prompt_index] + resp.token_ids
            with torch.no_grad():
                hf(torch.tensor([seq]))
            want = torch.stack(recorded, dim=1)  # [len(seq), L, k]
            recorded.clear()
            got = resp.routed_experts
            assert got.dtype == torch.uint8 and got.shape[1:] == want.shape[1:]
            assert len(seq) - 1 <= got.shape[0] <= len(seq)  # the last token may never have been fed
            torch.testing.assert_close(got.long(), want[:got.shape[0]].long(), rtol=0, atol=0)
    finally:
        for h in handles:
            h.remove()


def test_batch_carries_the_routing_onto_the_model_layout():
    """Worked example: routing_fields puts each response's prompt part left-padded and its response part
    right-padded; full_routed_experts lays them out as full_sequences does, experts 0..k-1 on padding and on a
    last token the engine never fed."""
    from rltrain.rollout.base import RolloutResponse

    def routed(n, base):  # token t of the sequence: experts (base + t, base + t + 1) in both layers
        t = torch.arange(n)[:, None, None] + base
        return torch.cat([t, t + 1], dim=2).expand(n, 2, 2).to(torch.uint8)

    responses = [RolloutResponse(0, [7, 8, 9], [0.0] * 3, "stop", routed_experts=routed(2 + 2, 10)),  # last unfed
                 RolloutResponse(1, [6], [0.0], "length", routed_experts=routed(3 + 1, 50))]
    fields = routing_fields(responses, prompt_lens=[2, 3], p=3, r=3)
    batch = Batch(prompt_ids=torch.tensor([[0, 1, 2], [3, 4, 5]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                  response_ids=torch.tensor([[7, 8, 9], [6, 0, 0]]), response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]),
                  loss_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]), **fields)
    full = batch.full_routed_experts()  # [2, 6, 2, 2]
    assert full.shape == (2, 6, 2, 2) and full.dtype == torch.long
    assert full[0, :, 0, 0].tolist() == [10, 11, 12, 13, 0, 0]  # prompt 2 + response 2 fed; last response token 0
    assert full[0, :, 0, 1].tolist() == [11, 12, 13, 14, 1, 1]
    assert full[1, :, 1, 0].tolist() == [50, 51, 52, 53, 0, 0]  # prompt 3 + response 1; padding 0..k-1
    both = Batch.concat([batch, batch.select([1])])
    torch.testing.assert_close(both.full_routed_experts(), torch.cat([full, full[1:]]))
    with pytest.raises(RuntimeError, match="routed experts of response 0"):
        routing_fields([RolloutResponse(0, [1], [0.0], "stop", routed_experts=routed(1, 0))], [2], p=2, r=1)


def test_the_run_decides_replay_once_from_the_key_and_the_model():
    """actor.moe_routing_replay: as set; null = on only for an MoE model served by vLLM on GPU; true with a dense
    model is the user's mistake, named."""
    from rltrain.config.schema import RLConfig
    from rltrain.models.megatron.tiny import tiny_qwen3_config
    from rltrain.utils.errors import UserError
    from rltrain.workers.hybrid import routing_replay
    from _megatron_ref import tiny_moe_config

    cfg = RLConfig()
    moe, dense = tiny_moe_config(), tiny_qwen3_config(V)
    assert cfg.actor.moe_routing_replay is None
    cfg.rollout.engine = "vllm"
    assert routing_replay(cfg, moe, "cuda") and not routing_replay(cfg, moe, "cpu")
    assert not routing_replay(cfg, dense, "cuda")
    cfg.rollout.true_on_policy = True  # the actor's router logits are the engine's bits: it routes as the engine did
    assert not routing_replay(cfg, moe, "cuda")
    cfg.rollout.true_on_policy = False
    cfg.rollout.engine = "hf"
    assert not routing_replay(cfg, moe, "cuda")
    cfg.actor.moe_routing_replay = True
    assert routing_replay(cfg, moe, "cpu")
    with pytest.raises(UserError, match="needs a Mixture-of-Experts model"):
        routing_replay(cfg, dense, "cpu")
    cfg.actor.moe_routing_replay = False
    cfg.rollout.engine = "vllm"
    assert not routing_replay(cfg, moe, "cuda")


def test_partial_rollouts_join_the_routing_of_their_chunks():
    """generate_in_chunks (rollout.partial): while the weights do not change, the routing joined over chunks of 1 and 3
    tokens is the one of unchunked generation; after a weight load between two chunks, the positions the second
    chunk fed first (the first chunk's last token onwards) carry the new weights' routing, the earlier ones the old."""
    from rltrain.rollout.partial import generate_in_chunks

    hf = random_moe_model(V, seed=13, **SHAPES["dense_first"])
    eng = HFEngine(hf, eos_token_id=0, return_routed_experts=True)
    prompts = [[5, 17, 33], [2, 9]]
    greedy = SamplingParams(temperature=0.0, max_tokens=7)
    whole = eng.generate(prompts, greedy)
    for chunk in (1, 3):
        parts, _ = generate_in_chunks(eng, prompts, greedy, chunk_tokens=chunk)
        for a, b in zip(parts, whole):
            assert a.token_ids == b.token_ids
            n = min(a.routed_experts.shape[0], b.routed_experts.shape[0])
            assert n >= len(prompts[a.prompt_index]) + len(a.token_ids) - 1
            torch.testing.assert_close(a.routed_experts[:n], b.routed_experts[:n], rtol=0, atol=0)

    class LoadAfterFirstChunk:  # the gate: version 0 for the first chunk, then new weights (version 1)
        def __init__(self):
            self.chunks = 0

        @contextlib.contextmanager
        def chunk(self):
            if self.chunks == 1:
                with torch.no_grad():
                    for r in _routers(hf):
                        r.weight.copy_(torch.randn_like(r.weight))
            self.chunks += 1
            yield min(self.chunks - 1, 1)

    old = eng.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    (got,), (versions,) = generate_in_chunks(eng, [prompts[0]], SamplingParams(temperature=0.0, max_tokens=6),
                                             chunk_tokens=3, gate=LoadAfterFirstChunk())
    assert versions == [0, 0, 0, 1, 1, 1]
    fed_first = len(prompts[0]) + 3 - 1  # the first chunk fed the prompt and its first 2 tokens
    torch.testing.assert_close(got.routed_experts[:fed_first], old.routed_experts[:fed_first], rtol=0, atol=0)
    new = eng.generate([prompts[0] + got.token_ids[:3]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    torch.testing.assert_close(got.routed_experts[fed_first:], new.routed_experts[fed_first:], rtol=0, atol=0)
