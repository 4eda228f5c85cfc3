"""Speed levers of the actor update change speed and memory, not math (docs/benchmarks/update.md): bf16 norms, selective recompute, compiled layers, the one-sync train step."""

import warnings

import pytest
import torch
from transformers import Qwen3ForCausalLM

from rltrain.models.megatron import fusion as fusion_mod
from rltrain.models.megatron.tiny import tiny_qwen3_config
from _megatron_ref import make_engine

V = 97


def _hf(seed: int, **kw):
    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=V, **kw))
    with torch.no_grad():  # HF inits norms to 1: perturb them so a wrong norm weight shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    return hf


def _batch(seed: int, lens=(12, 9, 4)):
    g = torch.Generator().manual_seed(seed)
    s = max(lens)
    ids = torch.randint(0, V, (len(lens), s), generator=g)
    seq_lens = torch.tensor(lens)
    label_mask = torch.arange(s)[None] < seq_lens[:, None]
    label_mask[:, 0] = False
    return {"input_ids": ids, "seq_lens": seq_lens, "label_mask": label_mask, "loss_scale": 1.0}


def _loss_fn(out, mb):
    m = mb.label_mask.float()
    ent = (out.entropy * m).sum() / m.sum()
    return -(out.logprobs * m).sum() / m.sum() - 0.01 * ent, {"entropy": ent, "const": 2.0}


_loss_fn.needs_entropy_grad = True


def _step(hf, mb, **kw):
    """One train_step -> (metrics, grads the optimizer stepped with, by parameter name)."""
    eng = make_engine(hf.config, role="actor", seed=3, lr=1e-3, make_vocab_size_divisible_by=1, **kw)
    eng.load_hf_weights(hf.state_dict())
    names = {id(p): n for n, p in eng.model.named_parameters()}
    grads, step = {}, eng.optimizer.step

    def capturing_step(*a, **k):
        grads.update({names[id(p)]: p.grad.clone() for p in eng._params})
        return step(*a, **k)

    eng.optimizer.step = capturing_step
    metrics = eng.train_step([dict(mb)], _loss_fn)
    return metrics, grads


def _same_step(a, b, rtol=1e-5):
    (m0, g0), (m1, g1) = a, b
    assert m0.keys() == m1.keys() and g0.keys() == g1.keys() and len(g0) > 10
    for k in m0:
        assert m0[k] == pytest.approx(m1[k], rel=rtol, abs=1e-7), k
    for k in g0:
        torch.testing.assert_close(g0[k], g1[k], rtol=rtol, atol=rtol * g0[k].abs().max().item(), msg=k)


def test_bf16_model_keeps_norms_in_bf16_and_matches_fp32_within_bf16_rounding():
    hf = _hf(seed=int(torch.randint(0, 10**6, ())))
    mb = _batch(seed=int(torch.randint(0, 10**6, ())), lens=(16, 11, 1, 5))
    ref = make_engine(hf.config, role="ref", make_vocab_size_divisible_by=1)  # fp32 reference
    ref.load_hf_weights(hf.state_dict())
    eng = make_engine(hf.config, role="actor", params_dtype=torch.bfloat16, make_vocab_size_divisible_by=1)
    eng.load_hf_weights(hf.state_dict())
    assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in eng._masters} == {torch.float32}
    norms = [n for n, _ in eng.model.named_parameters() if "layernorm" in n]
    assert len(norms) == 4 * hf.config.num_hidden_layers + 1  # input, pre-mlp, q, k per layer + final
    args = (mb["input_ids"], mb["seq_lens"], mb["label_mask"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lp, ent = eng.forward_logprobs(*args)
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)]  # torch.rms_norm ran fused
    ref_lp, ref_ent = ref.forward_logprobs(*args)
    m = mb["label_mask"]
    assert (lp[~m] == 0).all()
    # bf16 params and activations vs fp32: rounding-sized differences (lp ~ -log V = -4.6 here)
    assert (lp - ref_lp)[m].abs().max() < 0.1 and (lp - ref_lp)[m].abs().mean() < 0.03
    assert (ent - ref_ent)[m].abs().max() < 0.1
    # the master weights hold the fp32 values; the export rounds the bf16 params only
    for k, v in eng.export_hf_weights():
        torch.testing.assert_close(v.float(), hf.state_dict()[k].bfloat16().float(), rtol=0, atol=0, msg=k)
    # a step updates the fp32 masters and refreshes every bf16 param (norms included) from them
    metrics = eng.train_step([dict(mb)], _loss_fn)
    assert metrics["grad_norm"] > 0
    for p, master in zip(eng._params, eng._masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, master.bfloat16().view_as(p))  # one piece a param
    assert any(not torch.equal(v.float(), hf.state_dict()[k].bfloat16().float()) for k, v in eng.export_hf_weights())


@pytest.mark.parametrize("modules", [("mlp",), ("mlp", "core_attn")])
def test_selective_recompute_gives_the_same_step(modules):
    hf = _hf(seed=5)
    mb = _batch(seed=int(torch.randint(0, 10**6, ())))
    _same_step(_step(hf, mb), _step(hf, mb, recompute_activations=True, recompute_granularity="selective",
                                    recompute_modules=modules))


def test_recompute_and_fusion_choices_are_checked():
    hf = _hf(seed=1)
    with pytest.raises(ValueError, match="recompute_granularity"):
        _step(hf, _batch(0), recompute_activations=True, recompute_granularity="some")
    with pytest.raises(ValueError, match="recompute_modules"):
        _step(hf, _batch(0), recompute_activations=True, recompute_granularity="selective",
              recompute_modules=("attention",))
    with pytest.raises(ValueError, match="elementwise_fusion"):
        _step(hf, _batch(0), elementwise_fusion="fast")


def test_compiled_layers_give_the_same_step_in_one_graph(monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(fusion_mod, "COMPILE_BACKEND", "aot_eager")  # inductor's CPU codegen: ~30 s
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    hf = _hf(seed=7, num_hidden_layers=3)
    mb = _batch(seed=int(torch.randint(0, 10**6, ())))
    _same_step(_step(hf, mb), _step(hf, mb, elementwise_fusion="compile"))
    # every layer ran compiled, without graph breaks, sharing one forward graph
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_nan_loss_in_a_later_micro_batch_raises_and_takes_no_step():
    hf = _hf(seed=2)
    eng = make_engine(hf.config, role="actor", lr=1e-2, make_vocab_size_divisible_by=1)
    eng.load_hf_weights(hf.state_dict())
    before = {k: v.clone() for k, v in eng.export_hf_weights()}
    calls = []

    def loss_fn(out, mb):
        calls.append(1)
        loss = -out.logprobs.sum()
        return (loss * float("inf") if len(calls) == 2 else loss), {}

    with pytest.raises(FloatingPointError, match="loss is (-)?inf in a micro-batch; no optimizer step"):
        eng.train_step([_batch(1), _batch(2), _batch(3)], loss_fn)
    for k, v in eng.export_hf_weights():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in eng.model.parameters())
    ok = eng.train_step([_batch(1)], lambda out, mb: (-out.logprobs.sum(), {"n": torch.tensor(3.0)}))
    assert ok["n"] == 3.0 and isinstance(ok["loss"], float) and ok["grad_norm"] > 0
