"""Parity of the fused and logits log-prob/entropy paths with the fp64 reference, rows, entropy flags,
chunk picker and error messages. Single process, CPU; fresh random inputs (the seed is in the failure id).
"""

from __future__ import annotations

import random

import pytest
import torch

from rltrain.ops import logprobs_from_hidden, logprobs_from_logits, pick_chunk_size
from rltrain.ops import logprob_torch
from rltrain.ops.logprob import resolve_backend
from rltrain.ops.reference import reference_logprobs_fp64

# dtype -> (rtol, atol as a fraction of the reference's max |value|) for values and for gradients.
# Values are fp32 math on the exact input values, so even bf16 inputs give fp32-level log-probs; bf16
# gradients are rounded to bf16 when cast back to the input dtype.
TOLERANCES = {
    torch.float32: {"values": (1e-5, 1e-5), "grads": (1e-5, 5e-5)},  # grads: sums over V terms
    torch.bfloat16: {"values": (1e-5, 1e-5), "grads": (1e-2, 1e-2)},
}

# (T, H, V, chunk_size): T=1, T not a multiple of the chunk, V = 5, 123, not multiples of 64/128/1024,
# a Qwen3-sized vocabulary, and the budget picker (None).
SHAPES = [
    (1, 8, 5, None),
    (7, 16, 123, 3),
    (33, 24, 1000, 8),
    (50, 32, 1031, 16),
    (129, 16, 130, 64),
    (5, 8, 151_936, None),
]


def _seed() -> int:
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    return seed


def _inputs(t, h, v, dtype, logit_scale=2.0):
    hidden = torch.randn(t, h).to(dtype)
    weight = (torch.randn(v, h) * (logit_scale / h**0.5)).to(dtype)
    labels = torch.randint(0, v, (t,))
    return hidden, weight, labels


def _reference(hidden, weight, labels, temperature, grad_lp, grad_ent):
    """fp64 values and grads (hidden, weight) for upstream grads on both outputs."""
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    lp, ent = reference_logprobs_fp64(h64, w64, labels, temperature)
    (lp * grad_lp.double() + ent * grad_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), h64.grad, w64.grad


def _close(actual, expected, dtype, kind, what, seed, vocab=1):
    """assert_close with the dtype's tolerance; atol is relative to the reference's max |value| and,
    for gradients, grows with the GEMM reduction length V (blocked fp32 accumulation, as in any
    materialized fp32 path)."""
    rtol, atol_frac = TOLERANCES[dtype][kind]
    scale = max(expected.abs().max().item(), 1e-12)
    if kind == "grads":
        atol_frac *= max(1.0, vocab / 16384)
    else:  # log-probs / entropy in nats: entropy = lse - E[z] cancels, so its error scales with |z| ~ 1
        scale = max(scale, 1.0)
    atol = atol_frac * scale
    torch.testing.assert_close(
        actual.double(), expected, rtol=rtol, atol=atol, msg=lambda m: f"{what} (seed {seed}): {m}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{t}_H{h}_V{v}_c{c}" for t, h, v, c in SHAPES])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_torch_values_and_grads_match_fp64(shape, dtype, temperature):
    seed = _seed()
    t, h, v, chunk = shape
    hidden, weight, labels = _inputs(t, h, v, dtype)
    grad_lp, grad_ent = torch.randn(t), torch.randn(t)
    ref_lp, ref_ent, ref_gh, ref_gw = _reference(hidden, weight, labels, temperature, grad_lp, grad_ent)

    hidden.requires_grad_()
    weight.requires_grad_()
    lp, ent = logprobs_from_hidden(
        hidden, weight, labels, backend="torch", chunk_size=chunk, temperature=temperature
    )
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (t,)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    _close(lp, ref_lp, dtype, "values", "logprobs", seed)
    _close(ent, ref_ent, dtype, "values", "entropy", seed)
    _close(hidden.grad, ref_gh, dtype, "grads", "grad hidden", seed, vocab=v)
    _close(weight.grad, ref_gw, dtype, "grads", "grad weight", seed, vocab=v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=[f"T{t}_H{h}_V{v}_c{c}" for t, h, v, c in SHAPES[:5]])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_logits_path_values_and_grads_match_fp64(shape, dtype, temperature):
    seed = _seed()
    t, h, v, chunk = shape
    hidden, weight, labels = _inputs(t, h, v, dtype)
    logits = (hidden.double() @ weight.double().T).to(dtype)  # the input the path is given
    grad_lp, grad_ent = torch.randn(t), torch.randn(t)
    logits64 = logits.double().requires_grad_()
    logp = torch.log_softmax(logits64 / temperature, dim=-1)
    ref_lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp * grad_lp.double() + ref_ent * grad_ent.double()).sum().backward()

    logits.requires_grad_()
    lp, ent = logprobs_from_logits(logits, labels, chunk_size=chunk, temperature=temperature)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    assert logits.grad.dtype == dtype
    _close(lp, ref_lp.detach(), dtype, "values", "logprobs", seed)
    _close(ent, ref_ent.detach(), dtype, "values", "entropy", seed)
    _close(logits.grad, logits64.grad, dtype, "grads", "grad logits", seed)


def test_logits_path_single_chunk_and_many_chunks_agree():
    seed = _seed()
    logits = torch.randn(40, 77, requires_grad=True)
    labels = torch.randint(0, 77, (40,))
    grad_lp, grad_ent = torch.randn(40), torch.randn(40)
    results = []
    for chunk in (None, 40, 1000, 7, 1):
        lp, ent = logprobs_from_logits(logits, labels, chunk_size=chunk)
        (grad,) = torch.autograd.grad((lp * grad_lp + ent * grad_ent).sum(), logits)
        results.append((lp, ent, grad))
    for lp, ent, grad in results[1:]:
        for a, b in zip((lp, ent, grad), results[0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


def test_logits_path_never_writes_into_saved_logits():
    # exp() saves its output for backward: an in-place write into `logits` would make autograd raise.
    seed = _seed()
    x = torch.randn(12, 33, requires_grad=True)
    logits = x.exp()
    before = logits.detach().clone()
    labels = torch.randint(0, 33, (12,))
    for chunk in (None, 5):
        lp, ent = logprobs_from_logits(logits, labels, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward(retain_graph=True)
    assert torch.equal(logits.detach(), before), f"seed {seed}"
    x64 = x.detach().double().requires_grad_()
    logp = torch.log_softmax(x64.exp(), -1)
    ref = logp.gather(-1, labels.unsqueeze(-1)).sum() - (logp.exp() * logp).sum()
    ref.backward()
    expected = 2 * x64.grad
    atol = 2e-5 * expected.abs().max().item()
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-5, atol=atol, msg=lambda m: f"seed {seed}: {m}")


def test_torch_backend_stats_match_fp64_with_off_shard_labels():
    # The backend interface directly: labels_local == -1 (label on another shard) gives z_label = 0.
    seed = _seed()
    hidden, weight, _ = _inputs(19, 12, 70, torch.float32)
    labels_local = torch.randint(-1, 70, (19,))
    labels_local[0] = -1
    inv_temp = 1 / 0.8
    m, s, t, z_label = logprob_torch.forward_stats(hidden, weight, labels_local, inv_temp, True, 4)
    z = hidden.double() @ weight.double().T * inv_temp
    ref_m = z.amax(-1)
    e = torch.exp(z - ref_m[:, None])
    ref_zl = torch.where(labels_local >= 0, z.gather(-1, labels_local.clamp(min=0)[:, None]).squeeze(-1), 0.0)
    for got, ref, name in ((m, ref_m, "m"), (s, e.sum(-1), "s"), (t, (e * z).sum(-1), "t"), (z_label, ref_zl, "z_label")):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5, msg=lambda msg: f"{name} seed {seed}: {msg}")
    _, _, t_off, _ = logprob_torch.forward_stats(hidden, weight, labels_local, inv_temp, False, 4)
    assert torch.count_nonzero(t_off) == 0


@pytest.mark.parametrize("as_bool", [True, False], ids=["bool", "index"])
@pytest.mark.parametrize("path", ["hidden", "logits"])
def test_rows_equal_full_computation_and_zero_elsewhere(as_bool, path):
    seed = _seed()
    t, h, v = 31, 16, 97
    hidden, weight, labels = _inputs(t, h, v, torch.float32)
    keep = torch.rand(t) < 0.4
    keep[3] = True
    labels_padded = torch.where(keep, labels, torch.full_like(labels, -100))  # junk outside the kept rows
    rows = keep if as_bool else keep.nonzero().squeeze(1)
    grad_lp, grad_ent = torch.randn(t), torch.randn(t)

    def run(labels_in, rows_in):
        hid = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        if path == "hidden":
            lp, ent = logprobs_from_hidden(hid, w, labels_in, rows=rows_in, chunk_size=4)
        else:
            lp, ent = logprobs_from_logits(hid @ w.T, labels_in, rows=rows_in, chunk_size=4)
        masked = keep.float()
        (lp * grad_lp * masked + ent * grad_ent * masked).sum().backward()
        return lp, ent, hid.grad, w.grad

    lp_r, ent_r, gh_r, gw_r = run(labels_padded, rows)
    lp_f, ent_f, gh_f, gw_f = run(labels, None)
    msg = lambda m: f"seed {seed}: {m}"  # noqa: E731
    torch.testing.assert_close(lp_r[keep], lp_f[keep], rtol=1e-6, atol=1e-6, msg=msg)
    torch.testing.assert_close(ent_r[keep], ent_f[keep], rtol=1e-6, atol=1e-6, msg=msg)
    assert torch.count_nonzero(lp_r[~keep]) == 0 and torch.count_nonzero(ent_r[~keep]) == 0
    torch.testing.assert_close(gh_r, gh_f, rtol=1e-5, atol=1e-6, msg=msg)
    torch.testing.assert_close(gw_r, gw_f, rtol=1e-5, atol=1e-6, msg=msg)
    assert torch.count_nonzero(gh_r[~keep]) == 0


def test_rows_grads_of_dropped_rows_are_zero_even_with_upstream_grad():
    hidden, weight, labels = _inputs(10, 8, 20, torch.float32)
    hidden.requires_grad_()
    rows = torch.tensor([1, 4, 7])
    lp, ent = logprobs_from_hidden(hidden, weight, labels, rows=rows)
    (lp.sum() + ent.sum()).backward()
    dropped = torch.ones(10, dtype=torch.bool)
    dropped[rows] = False
    assert torch.count_nonzero(hidden.grad[dropped]) == 0
    assert torch.count_nonzero(hidden.grad[rows]) > 0


@pytest.mark.parametrize("path", ["hidden", "logits"])
def test_entropy_grad_false_builds_no_graph_and_keeps_logprob_grads(path):
    seed = _seed()
    t, h, v = 23, 12, 61
    hidden, weight, labels = _inputs(t, h, v, torch.float32)
    grad_lp = torch.randn(t)
    _, ref_ent, ref_gh, ref_gw = _reference(hidden, weight, labels, 1.0, grad_lp, torch.zeros(t))
    hidden.requires_grad_()
    weight.requires_grad_()
    if path == "hidden":
        lp, ent = logprobs_from_hidden(hidden, weight, labels, entropy_grad=False, chunk_size=5)
    else:
        lp, ent = logprobs_from_logits(hidden @ weight.T, labels, entropy_grad=False, chunk_size=5)
    assert ent.grad_fn is None and not ent.requires_grad
    assert lp.requires_grad
    _close(ent, ref_ent, torch.float32, "values", "entropy", seed)
    (lp * grad_lp).sum().backward()
    _close(hidden.grad, ref_gh, torch.float32, "grads", "grad hidden", seed)
    _close(weight.grad, ref_gw, torch.float32, "grads", "grad weight", seed)


@pytest.mark.parametrize("path", ["hidden", "logits"])
def test_with_entropy_false_returns_none_and_same_logprobs(path):
    hidden, weight, labels = _inputs(9, 8, 40, torch.float32)
    if path == "hidden":
        lp, ent = logprobs_from_hidden(hidden, weight, labels, with_entropy=False)
        lp_full, _ = logprobs_from_hidden(hidden, weight, labels)
    else:
        lp, ent = logprobs_from_logits(hidden @ weight.T, labels, with_entropy=False)
        lp_full, _ = logprobs_from_logits(hidden @ weight.T, labels)
    assert ent is None
    torch.testing.assert_close(lp, lp_full, rtol=0, atol=0)


def test_entropy_only_upstream_grad_matches_fp64():
    seed = _seed()
    hidden, weight, labels = _inputs(14, 10, 45, torch.float32)
    grad_ent = torch.randn(14)
    _, _, ref_gh, ref_gw = _reference(hidden, weight, labels, 1.0, torch.zeros(14), grad_ent)
    hidden.requires_grad_()
    weight.requires_grad_()
    _, ent = logprobs_from_hidden(hidden, weight, labels, chunk_size=3)
    (ent * grad_ent).sum().backward()
    _close(hidden.grad, ref_gh, torch.float32, "grads", "grad hidden", seed)
    _close(weight.grad, ref_gw, torch.float32, "grads", "grad weight", seed)


def test_hidden_dtype_differs_from_weight_grad_cast_back():
    hidden, weight, labels = _inputs(6, 8, 30, torch.float32)
    hidden = hidden.to(torch.bfloat16).requires_grad_()
    lp, ent = logprobs_from_hidden(hidden, weight, labels)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.dtype == torch.bfloat16
    ref_lp, _ = reference_logprobs_fp64(hidden.detach(), weight, labels)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)


def test_auto_backend_is_torch_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) is logprob_torch
    assert resolve_backend("torch", torch.device("cpu")) is logprob_torch


def test_pick_chunk_size_follows_documented_formula():
    # bf16, V_local = 76,032, 256 MiB: 268,435,456 // (76,032 * 10) = 353 -> 320 (multiple of 64)
    assert pick_chunk_size(10**6, 76_032, torch.bfloat16) == 320
    assert pick_chunk_size(10**6, 76_032, torch.bfloat16, device="cuda") == 2816  # 2 GiB -> 2,824 -> 2,816
    # fp32, V = 32,768: 268,435,456 // (32,768 * 12) = 682 -> 640
    assert pick_chunk_size(10**6, 32_768, torch.float32) == 640
    assert pick_chunk_size(100, 32_768, torch.float32) == 100  # never more than the rows
    assert pick_chunk_size(10**6, 10**9, torch.float32) == 1  # at least one row
    assert pick_chunk_size(10**6, 1000, torch.float32, budget_bytes=12_000 * 50) == 50  # < 64: not rounded
    assert pick_chunk_size(0, 1000) == 1


def _base():
    hidden, weight, labels = _inputs(4, 8, 10, torch.float32)
    return hidden, weight, labels


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda h, w, l: dict(hidden=h[:, :5]), "disagree on H"),
        (lambda h, w, l: dict(hidden=h[0]), r"hidden must be \[T, H\]"),
        (lambda h, w, l: dict(labels=l[:3]), r"labels must have shape \[T\] = \[4\]"),
        (lambda h, w, l: dict(labels=l.float()), "labels must be an integer tensor"),
        (lambda h, w, l: dict(labels=torch.tensor([0, 1, 10, 2])), r"labels must be token ids in \[0, 10\)"),
        (lambda h, w, l: dict(labels=torch.tensor([0, -100, 1, 2])), r"got min -100"),
        (lambda h, w, l: dict(rows=torch.tensor([0, 4])), r"rows out of range.*\[0, 4\)"),
        (lambda h, w, l: dict(rows=torch.tensor([-1])), "rows out of range"),
        (lambda h, w, l: dict(rows=torch.ones(5, dtype=torch.bool)), r"bool rows must have shape \[T\]"),
        (lambda h, w, l: dict(rows=torch.tensor([0.5])), "rows must be a 1-D integer"),
        (lambda h, w, l: dict(backend="cuda"), r"backend must be one of \['auto', 'torch', 'triton', 'cute'\]"),
        (lambda h, w, l: dict(backend="triton"), "backend='triton' needs CUDA tensors"),
        (lambda h, w, l: dict(weight=w.to("meta")), "move them to one device"),
        (lambda h, w, l: dict(temperature=0.0), "temperature must be > 0"),
        (lambda h, w, l: dict(chunk_size=0), "chunk_size must be None or a positive int"),
    ],
)
def test_fused_errors_name_the_argument(change, match):
    hidden, weight, labels = _base()
    kwargs = dict(hidden=hidden, weight=weight, labels=labels)
    kwargs.update(change(hidden, weight, labels))
    with pytest.raises(ValueError, match=match):
        logprobs_from_hidden(**kwargs)


def test_logits_errors_name_the_argument():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"logits must be \[T, V_local\]"):
        logprobs_from_logits(logits[0], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 10\)"):
        logprobs_from_logits(logits, torch.tensor([0, 1, 2, 11]))
    with pytest.raises(ValueError, match="rows out of range"):
        logprobs_from_logits(logits, torch.zeros(4, dtype=torch.long), rows=torch.tensor([9]))


def test_unchecked_index_rows_give_the_checked_result_and_match_fp64():
    """check_bounds=False (the engine validated rows and labels on the host) skips only the checks."""
    t, h, v = 13, 8, 37  # vocab not a multiple of any tile
    hidden = torch.randn(t, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64)
    labels = torch.randint(0, v, (t,))
    rows = torch.tensor(sorted(random.sample(range(t), 5)))
    got = {}
    for check in (True, False):
        lp, ent = logprobs_from_hidden(hidden, weight, labels, rows=rows, chunk_size=4, check_bounds=check)
        lq, eq = logprobs_from_logits(hidden @ weight.T, labels, rows=rows, check_bounds=check)
        torch.testing.assert_close((lq, eq), (lp, ent))
        got[check] = (lp, ent)
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))
    ref_lp, ref_ent = reference_logprobs_fp64(hidden.detach(), weight, labels)
    torch.testing.assert_close(got[False][0][rows], ref_lp[rows].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[False][1][rows], ref_ent[rows].float(), atol=1e-5, rtol=0)
    outside = torch.ones(t, dtype=torch.bool)
    outside[rows] = False
    assert (got[False][0][outside] == 0).all()
