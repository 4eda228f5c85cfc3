"""MegatronEngine at TP=1 on CPU against transformers' Qwen3 with the same weights (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3ForTokenClassification

from rltrain.algorithms import policy_loss, value_loss
from rltrain.config.parallel import ParallelDims
from rltrain.models.megatron import tiny_qwen3_config
from _megatron_ref import hf_logprobs, hf_loss_inputs, make_engine, ppo_batch, random_batch, random_hf_model

V = 101  # not a multiple of 128: megatron pads to 128, the padded rows must not count


def _engine(hf, **kw):
    kw.setdefault("make_vocab_size_divisible_by", 128)  # the padded rows are what these tests check
    eng = make_engine(hf.config, seed=0, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_megatron_to_hf_round_trip_is_exact(tied, tmp_path):
    hf = random_hf_model(V, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path)  # load from the safetensors directory, as from model.path
    eng = make_engine(hf.config, role="ref")
    eng.load_hf_weights(str(tmp_path))
    sd = hf.state_dict()
    out = dict(eng.export_hf_weights(bucket_bytes=4096))
    expected = {k for k in sd if not (tied and k == "lm_head.weight")}
    assert set(out) == expected
    for k in expected:
        assert out[k].shape == sd[k].shape and torch.equal(out[k], sd[k]), k


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_forward_logprobs_and_entropy_match_transformers(fused, tied):
    hf = random_hf_model(V, seed=3, tie_word_embeddings=tied)
    ids, lens, mask = random_batch(V, [9, 5, 12, 3, 1], seed=int(torch.randint(0, 10**6, ())))
    eng = _engine(hf, role="ref", fused_linear_logprob=fused, logprobs_chunk_size=7,
                  max_tokens_per_micro_batch=24)
    for temperature in (1.0, 0.7):
        ref_lp, ref_ent = hf_logprobs(hf, ids, mask, temperature)
        lp, ent = eng.forward_logprobs(ids, lens, mask, temperature=temperature)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ids.shape
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-4, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-4, rtol=0)
        assert (lp[~mask] == 0).all() and (lp[:, 0] == 0).all()
    lp_only, none = eng.forward_logprobs(ids, lens, mask, with_entropy=False)
    assert none is None and torch.equal(lp_only, eng.forward_logprobs(ids, lens, mask)[0])


def test_fused_and_unfused_agree_in_values_and_grads():
    hf = random_hf_model(V, seed=5)
    ids, lens, mask = random_batch(V, [11, 7, 4], seed=9)
    w_lp, w_ent = torch.randn(ids.shape), torch.randn(ids.shape)
    results = []
    for fused in (True, False):
        eng = _engine(hf, fused_linear_logprob=fused, logprobs_chunk_size=5)
        lp, ent = eng._token_logprobs(ids, lens, mask, temperature=0.9, with_entropy=True, entropy_grad=True)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads = {n: p.grad.clone() for n, p in eng.model.named_parameters()}
        results.append((lp.detach(), ent.detach(), grads))
    (lp_f, ent_f, g_f), (lp_u, ent_u, g_u) = results
    torch.testing.assert_close(lp_f, lp_u, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_f, ent_u, atol=1e-5, rtol=0)
    assert g_f.keys() == g_u.keys()
    for n in g_f:
        torch.testing.assert_close(g_f[n], g_u[n], atol=1e-5, rtol=1e-4, msg=n)
    assert any(g.abs().sum() > 0 for g in g_f.values())


class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


class _PPOLoss:
    """token-mean PPO loss over the micro-batch minus an entropy bonus (entropy with grad)."""

    needs_entropy_grad = True

    def __call__(self, outputs, mb):
        loss, metrics = policy_loss(outputs.logprobs, mb.extras["old_logprobs"], mb.extras["advantages"],
                                    mb.label_mask, mode="ppo", clip_low=0.2, clip_high=0.28)
        m = mb.label_mask
        ent = (outputs.entropy * m).sum() / m.sum()
        return loss - 0.01 * ent, {**metrics, "entropy": ent.detach()}


def _ppo_batch(hf, seq_lens, seed):
    return ppo_batch(hf, V, seq_lens, seed)


def test_fused_loss_never_allocates_a_tokens_by_vocab_tensor():
    hf = random_hf_model(V, seed=2, intermediate_size=96)  # no activation dim equal to 101 or 128
    batch, lens = _ppo_batch(hf, [40, 33, 25], seed=4)
    n_rows = int(batch["label_mask"][:, 1:].sum())
    chunk = 8
    vocab_dims = {V, ParallelDims(world_size=1).padded_vocab(V, 128)}
    for fused in (True, False):
        eng = _engine(hf, fused_linear_logprob=fused, logprobs_chunk_size=chunk)
        mbs = eng.make_micro_batches(batch, lens)
        with _ShapeRecorder() as rec:
            eng.train_step(mbs, _PPOLoss())
        hidden = hf.config.hidden_size
        token_rows = [math.prod(s[:-1]) for s in rec.shapes
                      if len(s) >= 2 and s[-1] in vocab_dims and s[:-1] not in ((hidden,), (hidden + 1,))]
        if fused:
            # only [chunk, V] logits chunks ([H(+1), V] are the weight's transpose)
            assert token_rows and max(token_rows) <= chunk
        else:  # the detector works: the unfused path does build [b, s, V] logits
            assert max(token_rows) >= n_rows


@pytest.mark.parametrize("fused", [True, False])
def test_ppo_step_matches_the_same_step_on_transformers(fused):
    hf = random_hf_model(V, seed=7)
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

    # the same step on transformers, whole mini-batch at once
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    hf.train()
    loss, _ = _PPOLoss()(*hf_loss_inputs(hf, batch, lens))
    loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.5))
    opt.step()

    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert metrics["lr"] == lr
    assert ref_norm > 0.5  # clipping was active
    after = dict(eng.export_hf_weights())
    before = random_hf_model(V, seed=7).state_dict()
    # Adam's first step is ~lr * g / (|g| + eps): entries with |g| near eps amplify fp32 rounding
    # differences of the two models' grads, so compare at 5% of one step's size.
    for k, p in hf.state_dict().items():
        torch.testing.assert_close(after[k], p, atol=0.05 * lr, rtol=0, msg=k)
    assert max(float((hf.state_dict()[k] - before[k]).abs().max()) for k in before) > 0.9 * lr


def test_critic_values_match_token_classification_and_value_step_moves_toward_returns():
    hf = random_hf_model(V, seed=13)
    ids, lens, mask = random_batch(V, [10, 6, 8], seed=21)
    eng = make_engine(hf.config, role="critic", lr=1e-2, seed=0)
    eng.load_hf_weights(hf.model.state_dict())  # AutoModel names ("layers.0..."), no value head
    cls = Qwen3ForTokenClassification(tiny_qwen3_config(V, num_labels=1)).eval()
    missing = cls.load_state_dict(dict(eng.export_hf_weights()), strict=True)
    assert not missing.missing_keys
    values = eng.forward_values(ids, lens, mask)
    with torch.no_grad():
        ref = cls(ids).logits.squeeze(-1)  # [B, S], row t is V(x_<=t)
    ref = torch.cat([torch.zeros(3, 1), ref[:, :-1]], 1) * mask * (torch.arange(ids.shape[1]) >= 1)
    torch.testing.assert_close(values, ref, atol=1e-5, rtol=1e-5)

    returns = torch.randn(ids.shape) * mask

    def vf_loss(outputs, mb):
        return value_loss(outputs.values, mb.extras["old_values"], mb.extras["returns"], mb.label_mask, clip=None)

    batch = {"input_ids": ids, "label_mask": mask, "old_values": values, "returns": returns}
    losses = [eng.train_step(eng.make_micro_batches(batch, lens), vf_loss)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]


def test_nan_loss_raises_and_leaves_weights_unchanged():
    hf = random_hf_model(V, seed=1)
    batch, lens = _ppo_batch(hf, [6, 5], seed=3)
    eng = _engine(hf, lr=1e-2)
    before = {k: v.clone() for k, v in eng.export_hf_weights()}

    def nan_loss(outputs, mb):
        return outputs.logprobs.sum() * float("nan"), {}

    with pytest.raises(FloatingPointError, match="no optimizer step"):
        eng.train_step(eng.make_micro_batches(batch, lens), nan_loss)
    for k, v in eng.export_hf_weights():
        assert torch.equal(v, before[k]), k


def test_micro_batches_respect_the_token_budget_and_cover_every_row_once():
    hf = random_hf_model(V, seed=1, num_hidden_layers=1)
    eng = make_engine(hf.config, role="ref", max_tokens_per_micro_batch=20)
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    lens = torch.randint(1, 16, (11,), generator=g)
    ids, lens, mask = random_batch(V, lens.tolist())
    extra = torch.randn(len(lens), ids.shape[1])
    mbs = eng.make_micro_batches({"input_ids": ids, "label_mask": mask, "x": extra}, lens)
    seen = torch.cat([mb.sample_idx for mb in mbs])
    assert sorted(seen.tolist()) == list(range(len(lens)))
    for mb in mbs:
        b, w = mb.input_ids.shape
        assert w == int(mb.seq_lens.max())
        assert b * w <= 20 or b == 1
        torch.testing.assert_close(mb.extras["x"], extra[mb.sample_idx, :w])


def test_forward_passes_take_their_own_budget_and_give_the_same_log_probs():
    # actor.log_prob_max_tokens_per_micro_batch: the forward-only passes (old log-probs, reference, values) group
    # rows under their own budget, the update keeps max_tokens_per_micro_batch; the log-probs are the transformers
    # model's whatever the grouping
    hf = random_hf_model(V, seed=4)
    lens_list = [9, 5, 12, 3, 1, 7]
    ids, lens, mask = random_batch(V, lens_list, seed=int(torch.randint(0, 10**6, ())))
    eng = _engine(hf, role="ref", max_tokens_per_micro_batch=12, forward_max_tokens_per_micro_batch=200)
    assert eng.forward_max_tokens_per_micro_batch == 200 and eng.max_tokens_per_micro_batch == 12
    calls = []
    make = eng.make_micro_batches

    def spy(*a, **kw):
        mbs = make(*a, **kw)
        calls.append((kw.get("forward_only", False), len(mbs)))
        return mbs

    eng.make_micro_batches = spy
    lp, ent = eng.forward_logprobs(ids, lens, mask)
    assert calls == [(True, 1)]  # 6 rows x 12 = 72 tokens: one micro-batch under 200
    assert len(make({"input_ids": ids, "label_mask": mask}, lens)) > 1  # the update's budget of 12 splits them
    ref_lp, ref_ent = hf_logprobs(hf, ids, mask, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-4, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-4, rtol=0)
    # unset: the update's budget for both
    same = _engine(hf, role="ref", max_tokens_per_micro_batch=12)
    assert same.forward_max_tokens_per_micro_batch == 12
    with pytest.raises(ValueError, match="forward_max_tokens_per_micro_batch must be >= 1"):
        _engine(hf, role="ref", forward_max_tokens_per_micro_batch=0)


def test_cosine_schedule_warms_up_then_decays_to_min_ratio():
    hf = random_hf_model(V, seed=1, num_hidden_layers=1)
    eng = _engine(hf, lr=1.0, lr_warmup_steps=2, total_steps=6, lr_schedule="cosine", min_lr_ratio=0.1)
    batch, lens = _ppo_batch(hf, [5, 4], seed=2)
    lrs = [eng.train_step(eng.make_micro_batches(batch, lens), _PPOLoss())["lr"] for _ in range(7)]
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)] + [0.1]
    assert lrs == pytest.approx(expected)


def test_bf16_params_train_on_fp32_master_weights():
    hf = random_hf_model(V, seed=4, num_hidden_layers=1)
    eng = make_engine(hf.config, params_dtype=torch.bfloat16, lr=1e-3)
    eng.load_hf_weights(hf.state_dict())
    batch, lens = _ppo_batch(hf, [7, 5], seed=6)
    eng.train_step(eng.make_micro_batches(batch, lens), _PPOLoss())
    saved = eng.state_dict()["optimizer"]["params"]
    params = dict(eng.model.named_parameters())
    assert saved.keys() == params.keys()
    for name, entry in saved.items():  # one rank: each piece is the whole parameter
        m, p = entry["master"], params[name]
        assert m.dtype == torch.float32 and (entry["start"], entry["stop"]) == (0, p.numel())
        assert torch.equal(p.detach().reshape(-1), m.to(p.dtype))
    assert eng.model.decoder.layers[0].mlp.linear_fc1.weight.dtype == torch.bfloat16
    # the fp32 masters moved by less than one bf16 ulp for some entries: updates are not lost
    start = dict(hf.named_parameters())["model.layers.0.mlp.down_proj.weight"].detach()
    assert not torch.equal(saved["decoder.layers.0.mlp.linear_fc2.weight"]["master"].view_as(start), start)


def test_unknown_role_and_schedule_are_clear_errors():
    cfg = tiny_qwen3_config(V)
    with pytest.raises(ValueError, match="role must be one of"):
        make_engine(cfg, role="reward")
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        make_engine(cfg, lr_schedule="linear")


def test_engine_builds_again_after_its_world_was_destroyed_by_another_owner():
    """A process that ran one job keeps megatron's module-level groups; when the world they belonged to is
    destroyed (a vLLM engine that created the world closes it) the next engine rebuilds them instead of
    failing with "Group ... is not registered"; its log-probs equal a fresh transformers forward."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rltrain.models.megatron.compat import setup_parallel, teardown_parallel

    setup_parallel(seed=0)
    dist.destroy_process_group()
    assert parallel_state.model_parallel_is_initialized()  # stale: groups of a world that no longer exists
    hf = random_hf_model(V, seed=5)
    ids, lens, mask = random_batch(V, [7, 1, 4], seed=int(torch.randint(0, 10**6, ())))
    lp, _ = _engine(hf, role="ref").forward_logprobs(ids, lens, mask)
    torch.testing.assert_close(lp.double(), hf_logprobs(hf, ids, mask)[0].detach(), atol=1e-4, rtol=0)
    assert dist.get_rank(group=parallel_state.get_tensor_model_parallel_group()) == 0
    teardown_parallel()


def test_token_ids_outside_the_vocabulary_are_named_before_the_head_runs():
    """Labels are checked on the host (the head then runs without device-side range checks)."""
    hf = random_hf_model(V, seed=2)
    eng = _engine(hf, role="ref")
    ids, lens, mask = random_batch(V, [6, 4], seed=int(torch.randint(0, 10**6, ())))
    ids[1, 2] = V + 3  # inside Megatron's padded vocabulary, outside the model's
    with pytest.raises(ValueError, match=rf"outside the model's vocabulary \[0, {V}\): \[{V + 3}\]"):
        eng.forward_logprobs(ids, lens, mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_head_and_loss_run_without_a_host_sync_on_gpu():
    """From host micro-batches to the loss, nothing waits for the GPU: torch's sync debug mode raises on any
    synchronizing call (a blocking copy, .item(), nonzero on a device tensor)."""
    hf = random_hf_model(V, seed=4)
    eng = _engine(hf, role="actor", device="cuda")
    ids, lens, mask = random_batch(V, [9, 5, 12], seed=int(torch.randint(0, 10**6, ())))
    lp_ref, _ = hf_logprobs(hf.cuda(), ids.cuda(), mask.cuda())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = eng._token_logprobs(ids, torch.as_tensor(lens), mask, temperature=1.0, with_entropy=True,
                                      entropy_grad=True)
        (lp.sum() + ent.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(lp.double().cpu(), lp_ref.detach().double().cpu(), atol=2e-3, rtol=0)
