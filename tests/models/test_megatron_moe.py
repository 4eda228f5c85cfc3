"""Mixture-of-Experts (Qwen3-MoE) on the Megatron engine, on CPU in fp32, against transformers' Qwen3MoeForCausalLM
with the same weights: log-probs and entropy, a PPO step, the router statistics and aux losses, the weight round
trip in both HF layouts (per-expert checkpoint, fused in-memory), the HF export reloading, and the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltrain.models.hf_experts import CheckpointLayout, checkpoint_names
from rltrain.models.megatron.build import UnsupportedModelError, moe_layer_pattern
from _megatron_ref import (hf_logprobs, hf_loss_inputs, make_engine, ppo_batch, random_batch, random_moe_model,
                           tiny_moe_config)

V = 101  # not a multiple of 128: megatron pads to 128, the padded rows must not count

# name -> Qwen3-MoE config overrides: every layer sparse; a dense first layer with tied embeddings; top-k not
# renormalized with sparse layers every second layer (decoder_sparse_step)
SHAPES = {
    "all_sparse": {},
    "dense_first_tied": dict(mlp_only_layers=[0], tie_word_embeddings=True, num_hidden_layers=3),
    "unnormalized_step2": dict(norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=4, num_experts=6,
                               num_experts_per_tok=3),
}


def _engine(hf, **kw):
    kw.setdefault("make_vocab_size_divisible_by", 128)
    eng = make_engine(hf.config, seed=0, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


def test_layer_pattern_follows_mlp_only_layers_and_sparse_step():
    assert moe_layer_pattern(tiny_moe_config(num_hidden_layers=4)) == [1, 1, 1, 1]
    assert moe_layer_pattern(tiny_moe_config(num_hidden_layers=4, mlp_only_layers=[0, 3])) == [0, 1, 1, 0]
    assert moe_layer_pattern(tiny_moe_config(num_hidden_layers=4, decoder_sparse_step=2)) == [0, 1, 0, 1]
    hf = random_moe_model(V, **SHAPES["dense_first_tied"])
    kinds = [type(layer.mlp).__name__ for layer in hf.model.layers]
    assert kinds == ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock"]  # transformers agrees


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_logprobs_and_entropy_match_transformers(shape, fused):
    hf = random_moe_model(V, seed=3, **SHAPES[shape])
    ids, lens, mask = random_batch(V, [9, 5, 12, 3, 1], seed=int(torch.randint(0, 10**6, ())))
    eng = _engine(hf, role="ref", fused_linear_logprob=fused, logprobs_chunk_size=7, max_tokens_per_micro_batch=24)
    for temperature in (1.0, 0.7):
        ref_lp, ref_ent = hf_logprobs(hf, ids, mask, temperature)
        lp, ent = eng.forward_logprobs(ids, lens, mask, temperature=temperature)
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-4, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-4, rtol=0)
        assert (lp[~mask] == 0).all()


@pytest.mark.parametrize("source", ["saved_directory", "state_dict"])
def test_weights_round_trip_exactly_in_the_checkpoint_layout(source, tmp_path):
    hf = random_moe_model(V, seed=4, **SHAPES["dense_first_tied"])
    eng = make_engine(hf.config, role="ref")
    if source == "saved_directory":
        hf.save_pretrained(tmp_path)  # transformers 5 writes one tensor per expert
        eng.load_hf_weights(str(tmp_path))
    else:
        eng.load_hf_weights(hf.state_dict())  # fused gate_up_proj / down_proj, as held in memory
    out = dict(eng.export_hf_weights(bucket_bytes=4096))
    ckpt = CheckpointLayout(hf.state_dict())
    expected = set(checkpoint_names((k, v.shape) for k, v in hf.state_dict().items())) - {"lm_head.weight"}
    assert set(out) == expected == set(ckpt) - {"lm_head.weight"}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in out and "model.layers.0.mlp.gate_proj.weight" in out
    for k in expected:
        assert torch.equal(out[k], ckpt[k]), k


def test_hf_export_reloads_in_transformers_with_identical_logprobs(tmp_path):
    from rltrain.models.hf_export import save_hf_checkpoint

    hf = random_moe_model(V, seed=5, **SHAPES["unnormalized_step2"])
    eng = _engine(hf, role="ref")
    save_hf_checkpoint(str(tmp_path / "export"), hf.config, eng.export_hf_weights())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(again).__name__ == "Qwen3MoeForCausalLM"
    ids, lens, mask = random_batch(V, [11, 6, 2], seed=9)
    ref_lp, ref_ent = hf_logprobs(hf, ids, mask)
    got_lp, got_ent = hf_logprobs(again, ids, mask)
    assert torch.equal(got_lp, ref_lp) and torch.equal(got_ent, ref_ent)


class _PPOLoss:
    needs_entropy_grad = True

    def __call__(self, outputs, mb):
        from rltrain.algorithms import policy_loss

        loss, metrics = policy_loss(outputs.logprobs, mb.extras["old_logprobs"], mb.extras["advantages"],
                                    mb.label_mask, mode="ppo", clip_low=0.2, clip_high=0.2)
        m = mb.label_mask
        return loss - 0.01 * (outputs.entropy * m).sum() / m.sum(), metrics


def _ppo_batch(hf, lens, seed):
    return ppo_batch(hf, V, lens, seed)


def _hf_loss(hf, batch, lens, loss_fn):
    return loss_fn(*hf_loss_inputs(hf, batch, lens))[0]


def _switch_statistic(hf, ids, lens):
    """The load-balancing statistic per MoE layer from transformers' own router logits over the real tokens,
    computed as transformers' load_balancing_loss_func does (E * sum_e f_e P_e with f_e over top-k slots),
    divided by k (megatron's normalization: 1.0 when balanced); and tokens per expert per layer."""
    out = hf(ids, output_router_logits=True)
    real = (torch.arange(ids.shape[1])[None] < torch.as_tensor(lens)[:, None]).reshape(-1)
    k, e = hf.config.num_experts_per_tok, hf.config.num_experts
    stats, loads = [], []
    for logits in out.router_logits:
        probs = torch.softmax(logits.double()[real], -1)
        chosen = torch.nn.functional.one_hot(probs.topk(k, -1).indices, e).double()  # [T, k, E]
        f = chosen.mean(0)  # [k, E]
        stats.append(float(e * (f * probs.mean(0)[None]).sum()) / k)
        loads.append(chosen.sum((0, 1)))
    return stats, loads


@pytest.mark.parametrize("fused", [True, False])
def test_ppo_step_matches_the_same_step_on_transformers_and_logs_router_statistics(fused):
    hf = random_moe_model(V, seed=7, **SHAPES["dense_first_tied"])
    batch, lens = _ppo_batch(hf, [13, 9, 6, 4], seed=11)
    lr = 1e-3
    eng = _engine(hf, fused_linear_logprob=fused, lr=lr, weight_decay=0.01, grad_clip=0.5,
                  max_tokens_per_micro_batch=26)
    mbs = eng.make_micro_batches(batch, lens)
    assert len(mbs) >= 2
    total = float(batch["label_mask"][:, 1:].sum())
    for mb in mbs:
        mb.loss_scale = float(mb.label_mask[:, 1:].sum()) / total
    metrics = eng.train_step(mbs, _PPOLoss())

    with torch.no_grad():
        stats, loads = _switch_statistic(hf, batch["input_ids"], lens)
    assert metrics["moe_aux_loss"] == pytest.approx(sum(stats) / len(stats), rel=1e-5)
    worst = max(float(n.max() / n.mean()) for n in loads)
    assert metrics["moe_load_max_over_mean"] == pytest.approx(worst, rel=1e-6)

    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    hf.train()
    _hf_loss(hf, batch, lens, _PPOLoss()).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.5))
    opt.step()
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4) and ref_norm > 0.5
    after = dict(eng.export_hf_weights())
    ckpt = CheckpointLayout(hf.state_dict())
    for k in after:  # Adam's first step: compare at 5% of one step's size (see the dense test)
        torch.testing.assert_close(after[k], ckpt[k], atol=0.05 * lr, rtol=0, msg=k)
    moved = after["model.layers.2.mlp.experts.0.gate_proj.weight"] - \
        CheckpointLayout(random_moe_model(V, seed=7, **SHAPES["dense_first_tied"]).state_dict())[
            "model.layers.2.mlp.experts.0.gate_proj.weight"]
    assert float(moved.abs().max()) > 0.9 * lr  # the experts trained


def test_aux_and_z_losses_add_their_gradients_to_the_router():
    """With the load-balancing and z-loss coefficients on, one micro-batch without padding: the router's grad is
    the PPO loss's plus coeff x grad of megatron's aux loss (transformers' / k) plus z_coeff x mean(lse^2)."""
    aux_c, z_c = 0.3, 0.05
    hf = random_moe_model(V, seed=8)
    batch, lens = _ppo_batch(hf, [10, 10, 10], seed=12)
    eng = _engine(hf, lr=1e-3, grad_clip=1e9, moe_aux_loss_coeff=aux_c, moe_z_loss_coeff=z_c)
    seen = {}
    clip = eng._clip
    eng._clip = lambda grads, norm: seen.setdefault("g", [None if g is None else g.clone()
                                                          for g in grads]) and clip(grads, norm)
    eng.train_step(eng.make_micro_batches(batch, lens), _PPOLoss())
    router = [n for n, _ in eng.model.named_parameters()].index("decoder.layers.1.mlp.router.weight")

    hf.train()
    out = hf(batch["input_ids"], output_router_logits=True)
    loss = _hf_loss(hf, batch, lens, _PPOLoss())
    k, e = hf.config.num_experts_per_tok, hf.config.num_experts
    for logits in out.router_logits:
        probs = torch.softmax(logits.float(), -1)
        f = torch.nn.functional.one_hot(probs.topk(k, -1).indices, e).float().mean(0)  # not differentiable
        loss = loss + aux_c * e * (f * probs.mean(0)[None]).sum() / k
        loss = loss + z_c * torch.logsumexp(logits.float(), -1).pow(2).mean()
    loss.backward()
    hf_grad = hf.model.layers[1].mlp.gate.weight.grad  # one data-parallel rank: each piece a whole parameter
    torch.testing.assert_close(seen["g"][router].view_as(hf_grad), hf_grad, atol=1e-5, rtol=1e-4)


def test_refusals_name_the_problem():
    from transformers import MixtralConfig, Qwen2MoeConfig

    with pytest.raises(UnsupportedModelError, match="Mixtral.*qwen3_moe"):
        make_engine(MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2), role="ref")
    with pytest.raises(UnsupportedModelError, match="shared experts"):
        make_engine(Qwen2MoeConfig(vocab_size=V, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2), role="ref")
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=5"):
        make_engine(tiny_moe_config(V, num_experts_per_tok=5), role="ref")
    from rltrain.config.parallel import ParallelDims
    from rltrain.models.megatron.build import transformer_config_from_hf
    from rltrain.models.megatron.tiny import tiny_qwen3_config

    with pytest.raises(UnsupportedModelError, match="expert_parallel_size=3 must divide num_experts=4"):
        transformer_config_from_hf(tiny_moe_config(V), dims=ParallelDims(world_size=3, ep=3))
    with pytest.raises(UnsupportedModelError, match="needs a Mixture-of-Experts model"):
        transformer_config_from_hf(tiny_qwen3_config(V), dims=ParallelDims(world_size=2, ep=2))
    with pytest.raises(ValueError, match="expert_parallel_size=2 must divide the data-parallel size 1"):
        make_engine(tiny_moe_config(V), role="ref", expert_parallel_size=2)


def test_exported_weights_reach_the_hf_rollout_engine_and_a_fused_state_dict_saves(tmp_path):
    """The engine's per-expert export loads into a transformers MoE model holding fused experts (the hf rollout
    engine's weight update): it then generates as a model built from those weights; and a fused in-memory state
    dict saves as a checkpoint that transformers reloads exactly."""
    from rltrain.data.tokenizer import CharTokenizer
    from rltrain.models.hf_export import save_hf_checkpoint
    from rltrain.rollout.base import SamplingParams
    from rltrain.rollout.hf import HFEngine

    tok = CharTokenizer()
    target = random_moe_model(tok.vocab_size, seed=12, **SHAPES["dense_first_tied"])
    eng = _engine(target, role="ref")
    rollout = HFEngine(random_moe_model(tok.vocab_size, seed=13, **SHAPES["dense_first_tied"]), tokenizer=tok,
                       eos_token_id=tok.eos_token_id)
    assert rollout.update_weights(eng.export_hf_weights(bucket_bytes=4096)) == len(dict(eng.export_hf_weights()))
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    prompts = [[1, 5, 20, 31], [1], [9, 10, 11]]
    want = HFEngine(target, tokenizer=tok, eos_token_id=tok.eos_token_id).generate(prompts, greedy)
    assert [r.token_ids for r in rollout.generate(prompts, greedy)] == [r.token_ids for r in want]

    save_hf_checkpoint(str(tmp_path / "fused"), target.config, target.state_dict())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", dtype=torch.float32)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in again.state_dict().items())


def test_grouped_expert_gemm_trains_as_megatrons_loop_over_experts():
    """moe_grouped_gemm (default): the experts' GEMMs as torch._grouped_mm over all local experts give megatron's
    SequentialMLP loop's log-probs, grad norm and updated weights, reading each layer's experts as one block (no
    stacked copy; each expert's grad a view of one block too); widths the grouped GEMM cannot take keep the loop."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from rltrain.models.megatron.moe import adjacent, stacked, use_grouped_expert_gemm

    hf = random_moe_model(V, seed=int(torch.randint(0, 1000, ())), **SHAPES["dense_first_tied"])
    batch, lens = _ppo_batch(hf, [14, 9, 1 + 1, 5], seed=3)
    out = {}
    for grouped in (True, False):
        eng = _engine(hf, moe_grouped_gemm=grouped, lr=1e-3, max_tokens_per_micro_batch=28)
        experts = [m for m in eng.model.modules() if isinstance(m, SequentialMLP)]
        assert len(experts) == 2 and all(hasattr(m, "_rltrain_loop_forward") == grouped for m in experts)
        copies = stacked.copies
        lp, _ = eng.forward_logprobs(batch["input_ids"], lens, batch["label_mask"])
        if grouped:  # the backward's expert grads: views of one [E, ...] grad block per projection
            eng.optim.zero_grad = lambda: None  # keep the grads for a look after the step
            fc1 = [e.linear_fc1.weight for e in experts[0].local_experts]
        metrics = eng.train_step(eng.make_micro_batches(batch, lens), _PPOLoss())
        if grouped:
            assert stacked.copies == copies and adjacent(fc1) and adjacent([w.grad for w in fc1])
        out[grouped] = lp, metrics["grad_norm"], dict(eng.export_hf_weights())
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=0)
    assert out[True][1] == pytest.approx(out[False][1], rel=1e-5)
    for name, w in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], w, atol=1e-6, rtol=0, msg=name)
    odd = _engine(random_moe_model(V, seed=1, moe_intermediate_size=30), moe_grouped_gemm=False)
    assert use_grouped_expert_gemm(odd.model) == 0  # 2 x 30 fp32 columns: rows not a multiple of 16 bytes
