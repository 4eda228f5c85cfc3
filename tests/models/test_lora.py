"""LoRA on the Megatron actor (TP=1, CPU, fp32) against the transformers model computed another way: the adapted
weights W + (alpha / r) B A built explicitly on the HF model (and PEFT's own LoRA where peft is installed), random
nonzero B; the reference role as the base; only the adapters train; checkpoints resume exactly; the PEFT export
loads back with the same log-probs. TP=2 and PP=2: test_lora_tp2.py."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.func import functional_call

from _megatron_ref import hf_logprobs, make_engine, ppo_batch, ppo_loss_with_entropy, random_batch, random_hf_model
from rltrain.models.hf import is_peft_adapter, load_merged_adapter
from rltrain.models.hf_export import save_peft_adapter
from rltrain.models.lora import LORA_TARGETS, resolve_targets
from rltrain.models.megatron.build import UnsupportedModelError
from rltrain.models.loss_protocol import MicroBatch

V = 101  # not a multiple of the vocab padding
HAVE_PEFT = importlib.util.find_spec("peft") is not None


def _engine(hf, **kw):
    kw = {"rank": 4, "alpha": 6.0, "logprobs_chunk_size": 7, **kw}
    eng = make_engine(hf.config, seed=0, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


def _random_adapters(eng, seed):
    """Random nonzero A and B (PEFT names -> full tensors), loaded into the engine."""
    g = torch.Generator().manual_seed(seed)
    ad = {n: torch.randn(t.shape, generator=g) * 0.2 for n, t in eng.lora.export()}
    eng.lora.load(ad)
    return ad


def _explicit(hf, ad, scale):
    """{HF weight name: W + scale * B @ A} for every adapted weight (leaf A/B in `ad` keep their autograd)."""
    params = dict(hf.named_parameters())
    out = {}
    for n, a in ad.items():
        if ".lora_A." in n:
            w = n.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            out[w] = params[w].detach() + scale * ad[n.replace("lora_A", "lora_B")] @ a
    return out


def _adapter_grads(eng):
    return {name: p.grad for a in eng.lora.linears for name, _, p in a.local_named()}


def test_targets_resolve_peft_names():
    assert resolve_targets(["all"]) == LORA_TARGETS
    assert resolve_targets(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="qkv"):
        resolve_targets(["qkv"])


@pytest.mark.parametrize("targets", [["all"], ["v_proj", "down_proj", "up_proj"]])
def test_forward_and_adapter_grads_match_the_explicitly_adapted_hf_model(targets):
    """Log-probs, entropy and every adapter's gradient (under full activation recompute) equal those of the HF model
    whose weights are W + (alpha / r) B A, with A and B the autograd leaves."""
    hf = random_hf_model(V, seed=3)
    eng = _engine(hf, target_modules=targets, recompute_activations=True)
    ad = _random_adapters(eng, seed=int(torch.randint(0, 10**6, ())))
    assert {n.split(".")[-3] for n in ad} == set(resolve_targets(targets))
    ids, lens, mask = random_batch(V, [9, 5, 2, 12], seed=int(torch.randint(0, 10**6, ())))  # a one-token response
    g = torch.Generator().manual_seed(1)
    w = torch.randn(ids.shape, generator=g)

    eng.model.train()
    out = eng._outputs(MicroBatch(input_ids=ids, seq_lens=lens, label_mask=mask), temperature=0.8, entropy_grad=True)
    (out.logprobs * w + 0.1 * out.entropy * w).sum().backward()
    got = _adapter_grads(eng)

    leaves = {n: t.clone().double().requires_grad_(True) for n, t in ad.items()}
    hf64 = hf.double()
    weights = {k: v.detach() for k, v in hf64.named_parameters()} | _explicit(hf64, leaves, 6.0 / 4)
    logits = functional_call(hf64, weights, (ids,)).logits / 0.8
    logp = torch.log_softmax(logits[:, :-1], -1)
    m = mask[:, 1:]
    lp = torch.where(m, logp.gather(-1, ids[:, 1:, None]).squeeze(-1), 0.0)
    ent = torch.where(m, -(logp.exp() * logp).sum(-1), 0.0)
    (lp * w[:, 1:] + 0.1 * ent * w[:, 1:]).sum().backward()
    torch.testing.assert_close(out.logprobs[:, 1:].double(), lp.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(out.entropy[:, 1:].double(), ent.detach(), atol=2e-5, rtol=0)
    assert set(got) == set(leaves)
    for n, leaf in leaves.items():
        ref = leaf.grad
        assert ref.abs().max() > 0, n
        assert (got[n].double() - ref).abs().max() <= 1e-4 * ref.abs().max(), n


@pytest.mark.skipif(not HAVE_PEFT, reason="peft is not installed (the explicit-merge tests above stand in for it)")
def test_forward_matches_peft_on_the_hf_model():
    from peft import LoraConfig, get_peft_model

    hf = random_hf_model(V, seed=4)
    eng = _engine(hf)
    ad = _random_adapters(eng, seed=7)
    peft_model = get_peft_model(random_hf_model(V, seed=4), LoraConfig(r=4, lora_alpha=6.0, target_modules=list(
        LORA_TARGETS), lora_dropout=0.0))
    state = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
             v for k, v in ad.items()}
    missing = set(state) - set(peft_model.state_dict())
    assert not missing, sorted(missing)[:3]
    peft_model.load_state_dict(state, strict=False)
    ids, lens, mask = random_batch(V, [8, 3, 6], seed=2)
    with torch.no_grad():
        ref, _ = hf_logprobs(peft_model, ids, mask)
    lp, _ = eng.forward_logprobs(ids, lens, mask)
    torch.testing.assert_close(lp.double(), ref, atol=1e-4, rtol=0)


def test_reference_is_the_base_and_a_step_trains_only_the_adapters():
    hf = random_hf_model(V, seed=5)
    eng = _engine(hf, lr=1e-2)
    _random_adapters(eng, seed=3)
    ids, lens, mask = random_batch(V, [7, 4, 10], seed=4)
    with eng.lora.disabled():
        base_lp, _ = eng.forward_logprobs(ids, lens, mask)
    with torch.no_grad():
        ref, _ = hf_logprobs(hf, ids, mask)
    torch.testing.assert_close(base_lp.double(), ref, atol=1e-5, rtol=0)
    assert (eng.forward_logprobs(ids, lens, mask)[0] - base_lp).abs().max() > 1e-3  # the adapters do act

    assert {id(p) for p in eng.optim.params} == {id(p) for a in eng.lora.linears for p in a.parameters()}
    # fp32 params: each master is a view of its adapter (no copy; bf16 adapters get fp32 masters), none of the base
    adapters = {p.untyped_storage().data_ptr() for a in eng.lora.linears for p in a.parameters()}
    assert {m.untyped_storage().data_ptr() for m in eng._masters} == adapters
    before = dict(eng.export_hf_weights())
    adapters_before = dict(eng.lora.export())
    batch, lens = ppo_batch(hf, V, [9, 6, 4], seed=11)
    eng.train_step(eng.make_micro_batches(batch, lens), ppo_loss_with_entropy)
    after = dict(eng.export_hf_weights())
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base is frozen
    assert all(not torch.equal(adapters_before[k], v) for k, v in eng.lora.export())
    assert len(eng.optimizer.state) == len(eng.optim.params)


def test_checkpoint_holds_the_adapters_and_resumes_exactly():
    hf = random_hf_model(V, seed=6)
    batches = [ppo_batch(hf, V, [8, 5, 7], seed=s) for s in (1, 2, 3)]

    def step(eng, i):
        batch, lens = batches[i]
        return eng.train_step(eng.make_micro_batches(batch, lens), ppo_loss_with_entropy)

    a = _engine(hf, lr=1e-2, lr_schedule="cosine", lr_warmup_steps=1, total_steps=5)
    step(a, 0), step(a, 1)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # as a checkpoint: no tensor shared with the running engine
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # a checkpoint holds data only (utils/plain.py)
    assert set(sd["model"]) == {n for n, p in a.model.named_parameters() if p.requires_grad}
    assert all(".lora." in k for k in sd["model"])
    b = _engine(hf, lr=1e-2, lr_schedule="cosine", lr_warmup_steps=1, total_steps=5)
    b.load_state_dict(sd)
    ma, mb = step(a, 2), step(b, 2)
    assert ma == mb
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.lora.export(), b.lora.export()))
    with pytest.raises(ValueError, match="actor.lora"):
        _engine(hf, rank=8).load_state_dict(sd)


def test_peft_export_loads_back_with_identical_logprobs(tmp_path):
    """The PEFT adapter directory, read back (with peft where installed, else by the adapter math on the HF model
    written out here), gives the engine's log-probs; so does its base directory with the adapters merged."""
    hf = random_hf_model(V, seed=8)
    eng = _engine(hf, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    ad = _random_adapters(eng, seed=5)
    spec = eng.lora.spec
    base = str(tmp_path / "base")
    hf.save_pretrained(base)
    save_peft_adapter(str(tmp_path), spec, dict(eng.lora.export()), base_model=base)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (4, 6.0, base)
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert set(tensors) == set(ad) and all(torch.equal(tensors[k], ad[k]) for k in ad)
    assert is_peft_adapter(tmp_path) and not is_peft_adapter(base)

    ids, lens, mask = random_batch(V, [9, 4, 6], seed=6)
    lp, _ = eng.forward_logprobs(ids, lens, mask)
    if HAVE_PEFT:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(random_hf_model(V, seed=8), str(tmp_path)).eval()
    else:
        loaded = random_hf_model(V, seed=8)
        with torch.no_grad():
            for name, w in _explicit(loaded, tensors, cfg["lora_alpha"] / cfg["r"]).items():
                loaded.get_parameter(name).copy_(w)
    with torch.no_grad():
        ref, _ = hf_logprobs(loaded, ids, mask)
        merged = load_merged_adapter(str(tmp_path))  # the base from its directory, merged (the recipe's evaluation)
        ref_merged, _ = hf_logprobs(merged.eval(), ids, mask)
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.double(), ref_merged, atol=1e-5, rtol=0)


def test_moe_mlp_targets_are_refused_and_attention_targets_build():
    from _megatron_ref import random_moe_model

    moe = random_moe_model(V, seed=1)
    with pytest.raises(UnsupportedModelError, match="Mixture-of-Experts.*q_proj,k_proj,v_proj,o_proj"):
        make_engine(moe.config, rank=4)
    eng = _engine(moe, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    ad = _random_adapters(eng, seed=2)
    ids, lens, mask = random_batch(V, [6, 3], seed=3)
    weights = {k: v.detach() for k, v in moe.named_parameters()} | _explicit(moe, ad, 6.0 / 4)
    with torch.no_grad():
        adapted = random_moe_model(V, seed=1)
        adapted.load_state_dict({**adapted.state_dict(), **weights})
        ref, _ = hf_logprobs(adapted, ids, mask)
    torch.testing.assert_close(eng.forward_logprobs(ids, lens, mask)[0].double(), ref, atol=1e-4, rtol=0)
