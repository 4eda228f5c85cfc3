"""The off-policy corrections registry (`off_policy_weights`, `OFF_POLICY_MODES`): a hand-worked example for
every mode, an fp64 reference computed another way (explicit loops over rows and tokens, ratios as quotients of
probabilities) on awkward shapes, overflow, the identity old == smp, empty masks, argument checks, and how the
weights act in `policy_loss`."""

import math

import pytest
import torch

from rltrain.algorithms import (
    OFF_POLICY_MODES,
    TIS_MODES,
    check_off_policy_args,
    off_policy_weights,
    policy_loss,
    truncated_is_weights,
)

LN2 = math.log(2.0)
NAN = float("nan")
ARGS = dict(cap=2.0, low=0.5, high=2.0)  # every mode's arguments; each mode reads only its own
MODES = [m for m in OFF_POLICY_MODES]


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def test_the_registry_names():
    assert OFF_POLICY_MODES == ("none", "token_tis", "seq_tis", "geo_tis", "token_mask", "seq_mask", "geo_mask",
                                "token_mis", "seq_mis", "geo_mis")
    assert TIS_MODES == ("token", "sequence")


# ----------------------------------------------------------------------------- hand-worked
def worked_example():
    """Per-token ratios pi_old / mu (smp = 0, so old = log ratio):
    row 0: 0.5, 3.0, padding            product 1.5   geometric mean sqrt(1.5) = 1.22474...
    row 1: 2.0, 2.0, padding            product 4     geometric mean 2
    row 2: empty, its padding holds garbage (NaN, a huge log-prob, -inf)
    row 3: 4.0, 0.125, 1.0              product 0.5   geometric mean 0.5^(1/3) = 0.79370..."""
    old = t([[math.log(0.5), math.log(3.0), NAN],
             [LN2, LN2, 50.0],
             [NAN, 900.0, -math.inf],
             [2 * LN2, -3 * LN2, 0.0]])
    smp = t([[0.0, 0.0, 3.0], [0.0, 0.0, NAN], [0.0, -900.0, 0.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1]])
    return old, smp, mask


S = math.sqrt(1.5)  # row 0's geometric mean
G3 = 0.5 ** (1 / 3)  # row 3's geometric mean
Z = [0.0, 0.0, 0.0]  # the empty row
GEO = dict(cap=1.2, low=0.8, high=1.25)  # bounds near 1, as geometric-mean corrections use

# mode, arguments, expected weights, expected stats
HAND = [
    # none: weight 1 on every sampled token; the 7 token ratios 0.5 3 2 2 4 0.125 1 are still reported
    ("none", ARGS, [[1, 1, 0], [1, 1, 0], Z, [1, 1, 1]],
     dict(weight_mean=1, weight_max=1, ratio_max=4, ratio_min=0.125)),
    # token_tis, C = 2: 3 and 4 are truncated to 2 (2 == C is not): clipfrac 2/7
    ("token_tis", ARGS, [[0.5, 2, 0], [2, 2, 0], Z, [2, 0.125, 1]],
     dict(weight_mean=(0.5 + 2 + 2 + 2 + 2 + 0.125 + 1) / 7, weight_max=2, ratio_max=4, ratio_min=0.125,
          clipfrac=2 / 7)),
    # seq_tis: row ratios 1.5, 4 -> 2, 0.5 over 3 rows (the empty row is no unit)
    ("seq_tis", ARGS, [[1.5, 1.5, 0], [2, 2, 0], Z, [0.5, 0.5, 0.5]],
     dict(weight_mean=(1.5 + 2 + 0.5) / 3, weight_max=2, ratio_max=4, ratio_min=0.5, clipfrac=1 / 3)),
    # geo_tis, C = 2: geometric means 1.2247, 2 (== C, kept), 0.7937: nothing truncated
    ("geo_tis", ARGS, [[S, S, 0], [2, 2, 0], Z, [G3, G3, G3]],
     dict(weight_mean=(S + 2 + G3) / 3, weight_max=2, ratio_max=2, ratio_min=G3, clipfrac=0)),
    # geo_tis, C = 1.2: 1.2247 and 2 are truncated to 1.2
    ("geo_tis", GEO, [[1.2, 1.2, 0], [1.2, 1.2, 0], Z, [G3, G3, G3]],
     dict(weight_mean=(1.2 + 1.2 + G3) / 3, weight_max=1.2, ratio_max=2, ratio_min=G3, clipfrac=2 / 3)),
    # token_mask, [0.5, 2]: 0.5 and 2 are kept (inclusive), 3 and 4 dropped high, 0.125 dropped low
    ("token_mask", ARGS, [[1, 0, 0], [1, 1, 0], Z, [0, 0, 1]],
     dict(weight_mean=4 / 7, weight_max=1, ratio_max=4, ratio_min=0.125, masked_frac=3 / 7,
          masked_frac_low=1 / 7, masked_frac_high=2 / 7)),
    # seq_mask, [0.5, 2]: rows 1.5 and 0.5 (inclusive) kept, 4 dropped
    ("seq_mask", ARGS, [[1, 1, 0], [0, 0, 0], Z, [1, 1, 1]],
     dict(weight_mean=2 / 3, weight_max=1, ratio_max=4, ratio_min=0.5, masked_frac=1 / 3, masked_frac_low=0,
          masked_frac_high=1 / 3)),
    # geo_mask, [0.8, 1.25]: 1.2247 kept, 2 dropped high, 0.7937 dropped low
    ("geo_mask", GEO, [[1, 1, 0], [0, 0, 0], Z, [0, 0, 0]],
     dict(weight_mean=1 / 3, weight_max=1, ratio_max=2, ratio_min=G3, masked_frac=2 / 3, masked_frac_low=1 / 3,
          masked_frac_high=1 / 3)),
    # geo_mask, [0.5, 2]: all three geometric means inside
    ("geo_mask", ARGS, [[1, 1, 0], [1, 1, 0], Z, [1, 1, 1]],
     dict(weight_mean=1, weight_max=1, ratio_max=2, ratio_min=G3, masked_frac=0, masked_frac_low=0,
          masked_frac_high=0)),
    # token_mis (IcePop), [0.5, 2]: the kept tokens keep their ratio 0.5, 2, 2, 1
    ("token_mis", ARGS, [[0.5, 0, 0], [2, 2, 0], Z, [0, 0, 1]],
     dict(weight_mean=(0.5 + 2 + 2 + 1) / 7, weight_max=2, ratio_max=4, ratio_min=0.125, masked_frac=3 / 7,
          masked_frac_low=1 / 7, masked_frac_high=2 / 7)),
    # seq_mis, [0.5, 2]: rows 1.5 and 0.5 keep their ratio, 4 is dropped
    ("seq_mis", ARGS, [[1.5, 1.5, 0], [0, 0, 0], Z, [0.5, 0.5, 0.5]],
     dict(weight_mean=(1.5 + 0.5) / 3, weight_max=1.5, ratio_max=4, ratio_min=0.5, masked_frac=1 / 3,
          masked_frac_low=0, masked_frac_high=1 / 3)),
    # geo_mis, [0.8, 1.25]: only row 0 is kept, with weight sqrt(1.5)
    ("geo_mis", GEO, [[S, S, 0], [0, 0, 0], Z, [0, 0, 0]],
     dict(weight_mean=S / 3, weight_max=S, ratio_max=2, ratio_min=G3, masked_frac=2 / 3, masked_frac_low=1 / 3,
          masked_frac_high=1 / 3)),
]


def test_every_mode_has_a_hand_worked_case():
    assert {m for m, *_ in HAND} == set(OFF_POLICY_MODES)


@pytest.mark.parametrize("mode,kwargs,want,want_stats", HAND, ids=[f"{m}-{k['cap']}" for m, k, *_ in HAND])
def test_hand_worked(mode, kwargs, want, want_stats):
    old, smp, mask = worked_example()
    w, keep, st = off_policy_weights(old, smp, mask, mode=mode, **kwargs)
    torch.testing.assert_close(w, t(want), rtol=1e-14, atol=0)
    assert set(st) == set(want_stats)
    for k, v in want_stats.items():
        assert float(st[k]) == pytest.approx(v, rel=1e-12, abs=1e-15), k
        assert st[k].dtype == torch.float64 and st[k].dim() == 0
    # keep: the mask for none / tis; the mask minus the dropped units for mask / mis (here: the nonzero weights)
    want_keep = mask.bool() if mode == "none" or mode.endswith("_tis") else t(want) > 0
    assert torch.equal(keep, want_keep)


# ----------------------------------------------------------------------------- fp64 reference, by loops
def _reference(old, smp, mask, mode, cap, low, high):
    """Weights [B][L] and stats by explicit loops in Python floats: ratios as exp(old) / exp(smp), a row's
    ratio as the running product, its geometric mean as the product ** (1 / n)."""
    unit, _, corr = mode.partition("_")
    if mode == "none":
        unit, corr = "token", "none"
    b, n = len(old), len(old[0])

    def correct(r):  # -> (weight, truncated, below, above)
        if corr == "none":
            return 1.0, False, False, False
        if corr == "tis":
            return min(r, cap), r > cap, False, False
        inside = low <= r <= high
        return (1.0 if corr == "mask" else r) if inside else 0.0, not inside, r < low, r > high

    weights = [[0.0] * n for _ in range(b)]
    units = []  # (ratio, weight, truncated or masked, below, above)
    for i in range(b):
        toks = [j for j in range(n) if mask[i][j]]
        ratios = {j: math.exp(old[i][j]) / math.exp(smp[i][j]) for j in toks}
        if unit == "token":
            for j in toks:
                c = correct(ratios[j])
                weights[i][j] = c[0]
                units.append((ratios[j],) + c)
        elif toks:
            prod = 1.0
            for j in toks:
                prod *= ratios[j]
            r = prod if unit == "seq" else prod ** (1.0 / len(toks))
            c = correct(r)
            for j in toks:
                weights[i][j] = c[0]
            units.append((r,) + c)
    if not units:
        return weights, None
    k = len(units)
    stats = {"weight_mean": sum(u[1] for u in units) / k, "weight_max": max(u[1] for u in units),
             "ratio_max": max(u[0] for u in units), "ratio_min": min(u[0] for u in units)}
    if corr == "tis":
        stats["clipfrac"] = sum(u[2] for u in units) / k
    elif corr in ("mask", "mis"):
        stats.update(masked_frac=sum(u[2] for u in units) / k, masked_frac_low=sum(u[3] for u in units) / k,
                     masked_frac_high=sum(u[4] for u in units) / k)
    return weights, stats


def _random_case(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    b, n = shape
    old = -torch.rand(b, n, generator=g, dtype=torch.float64) * 3
    smp = old + 0.4 * torch.randn(b, n, generator=g, dtype=torch.float64)  # token ratios mostly in [0.3, 3]
    mask = (torch.rand(b, n, generator=g) < 0.75).double()
    mask[0, 0] = 1
    if b > 2:
        mask[1] = 0  # an empty response
    if b > 3 and n > 3:
        mask[2, n // 2:] = 0  # a response padded on the right
    old, smp = old.to(dtype), smp.to(dtype)
    pad = ~mask.bool()
    old = old.masked_fill(pad, NAN)  # garbage outside the mask must not matter
    smp = smp.masked_fill(pad, math.inf)
    return old, smp, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (5, 1), (3, 7), (6, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_fp64_loops(mode, shape, dtype):
    kwargs = dict(cap=1.7, low=0.6, high=1.6) if not mode.startswith("geo") else dict(cap=1.05, low=0.95, high=1.05)
    old, smp, mask = _random_case(shape, seed=OFF_POLICY_MODES.index(mode) * 97 + shape[0] * 7 + shape[1], dtype=dtype)
    w, keep, st = off_policy_weights(old, smp, mask, mode=mode, **kwargs)
    ref_w, ref_st = _reference(old.double().tolist(), smp.double().tolist(), mask.bool().tolist(), mode, **kwargs)
    assert w.dtype == dtype and not w.requires_grad
    # fp32 weights are the fp64 value rounded once: within one ulp (2^-23 relative) of the loop's
    tol = dict(rtol=1.2e-7, atol=0) if dtype == torch.float32 else dict(rtol=1e-12, atol=0)
    torch.testing.assert_close(w.double(), t(ref_w), **tol)
    for k, v in ref_st.items():
        assert float(st[k]) == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert set(st) == set(ref_st)
    if shape == (6, 33) and mode != "none":  # the draw exercises the correction: some units truncated / masked
        share = float(st["clipfrac"] if mode.endswith("_tis") else st["masked_frac"])
        assert 0 < share < 1
    assert not (keep & ~mask.bool()).any()


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_out_and_empty_batch(mode):
    for shape in [(3, 4), (0, 5), (2, 0)]:
        old, smp = torch.full(shape, NAN), torch.full(shape, 7.0)
        w, keep, st = off_policy_weights(old, smp, torch.zeros(shape), mode=mode, **ARGS)
        assert torch.equal(w, torch.zeros(shape)) and not keep.any() and w.shape == shape
        assert float(st["weight_mean"]) == 1.0 and float(st["weight_max"]) == 1.0
        assert float(st["ratio_max"]) == 1.0 and float(st["ratio_min"]) == 1.0
        for k in ("clipfrac", "masked_frac", "masked_frac_low", "masked_frac_high"):
            if k in st:
                assert float(st[k]) == 0.0


# ----------------------------------------------------------------------------- overflow and identity
@pytest.mark.parametrize("mode", MODES)
def test_ratios_of_e800_neither_overflow_nor_nan(mode):
    # row 0: token ratios e^800 and e^-800 (each beyond fp64); row 1: 4 tokens of e^400 (product e^1600,
    # geometric mean e^400); row 2: one ordinary token, ratio 1
    old = t([[800.0, 0.0, 0.0, 0.0], [400.0] * 4, [-1.0, 0.0, 0.0, 0.0]], torch.float32)
    smp = t([[0.0, 800.0, 0.0, 0.0], [0.0] * 4, [-1.0, 0.0, 0.0, 0.0]], torch.float32)
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    w, keep, st = off_policy_weights(old, smp, mask, mode=mode, **ARGS)
    assert torch.isfinite(w).all() and all(not math.isnan(float(v)) for v in st.values())
    assert w[2, 0] == 1.0  # the on-policy token is untouched in every mode
    if mode == "none":
        assert torch.equal(w, mask.float())
    elif mode == "token_tis":
        torch.testing.assert_close(w[:2], t([[2, 0, 0, 0], [2, 2, 2, 2]], torch.float32))  # e^-800 -> 0
    elif mode.endswith("_tis"):
        assert torch.equal(w[1], torch.full((4,), 2.0))  # e^1600 or e^400 -> cap
    elif mode.startswith("token"):
        assert torch.equal(w[:2], torch.zeros(2, 4))  # every far-off token is dropped
        assert float(st["masked_frac_high"]) == 5 / 7 and float(st["masked_frac_low"]) == 1 / 7
    else:  # row 0's ratios cancel (product and geometric mean exactly 1): kept; row 1 is dropped
        assert torch.equal(w[:2], t([[1, 1, 0, 0], [0, 0, 0, 0]], torch.float32))
        assert float(st["masked_frac_high"]) == 1 / 3 and float(st["masked_frac_low"]) == 0.0
    if mode.startswith(("token", "none")):
        assert math.isinf(float(st["ratio_max"])) and float(st["ratio_min"]) == 0.0
    elif mode.startswith("seq"):  # row 0's product is exactly 1: e^800 * e^-800
        assert math.isinf(float(st["ratio_max"])) and float(st["ratio_min"]) == 1.0
    else:  # geometric means 1, e^400, 1: finite in fp64
        assert float(st["ratio_max"]) == pytest.approx(math.exp(400.0), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_identity_when_sampler_equals_old(mode, dtype):
    g = torch.Generator().manual_seed(3)
    old = (-torch.rand(5, 17, generator=g) * 8).to(dtype)
    mask = (torch.rand(5, 17, generator=g) < 0.7).double()
    mask[4] = 0
    w, keep, st = off_policy_weights(old, old.clone(), mask, mode=mode, cap=1.0, low=1.0, high=1.0)  # tightest
    assert w.dtype == dtype and torch.equal(w, mask.to(dtype)) and torch.equal(keep, mask.bool())
    for k, v in st.items():
        assert float(v) == (0.0 if "frac" in k else 1.0), k


def test_weights_are_detached_and_do_not_read_grad():
    old = (-torch.rand(2, 3)).requires_grad_(True)
    w, _, st = off_policy_weights(old, torch.zeros(2, 3), torch.ones(2, 3), mode="seq_mis", low=0.1, high=10.0)
    assert not w.requires_grad and not any(v.requires_grad for v in st.values())


def test_nan_inside_the_mask_is_dropped_by_masking():
    old, smp, mask = t([[NAN, LN2]]), t([[0.0, 0.0]]), t([[1, 1]])
    w, keep, st = off_policy_weights(old, smp, mask, mode="token_mask", low=0.5, high=2.0)
    assert torch.equal(w, t([[0.0, 1.0]])) and torch.equal(keep, torch.tensor([[False, True]]))
    assert float(st["masked_frac"]) == 0.5  # counted as masked, neither below nor above
    assert float(st["masked_frac_low"]) == 0.0 and float(st["masked_frac_high"]) == 0.0


# ----------------------------------------------------------------------------- the TIS interface
@pytest.mark.parametrize("tis_mode,mode", [("token", "token_tis"), ("sequence", "seq_tis")])
def test_truncated_is_weights_is_the_registry_tis(tis_mode, mode):
    old, smp, mask = _random_case((6, 33), seed=7, dtype=torch.float32)
    w0, st0 = truncated_is_weights(old, smp, mask, cap=1.7, mode=tis_mode)
    w1, _, st1 = off_policy_weights(old, smp, mask, mode=mode, cap=1.7)
    assert torch.equal(w0, w1) and st0.keys() == st1.keys()
    assert all(torch.equal(st0[k], st1[k]) for k in st0)
    assert {"weight_mean", "ratio_max", "clipfrac"} <= set(st0)  # the keys trainer/ppo.py logs


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("mode,kwargs,match", [
    ("geometric", {}, "mode"),
    ("token", {}, "mode"),  # the TIS interface's names are not registry modes
    ("token_tis", dict(cap=None), "cap"),
    ("seq_tis", dict(cap=0.99), "cap"),
    ("geo_tis", dict(cap=NAN), "cap"),
    ("token_mask", dict(low=0.0, high=2.0), "low"),
    ("token_mask", dict(low=1.01, high=2.0), "low"),
    ("seq_mis", dict(low=None, high=2.0), "low"),
    ("geo_mask", dict(low=NAN, high=2.0), "low"),
    ("token_mis", dict(low=0.5, high=0.99), "high"),
    ("seq_mask", dict(low=0.5, high=None), "high"),
    ("geo_mis", dict(low=0.5, high=NAN), "high"),
])
def test_bad_arguments_name_the_parameter(mode, kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        off_policy_weights(x, x, torch.ones(1, 2), mode=mode, **kwargs)
    with pytest.raises(ValueError, match=match):
        check_off_policy_args(mode, **kwargs)


def test_unused_arguments_are_ignored_and_bounds_may_be_open():
    x = torch.zeros(1, 2)
    check_off_policy_args("none", cap=0.1, low=5.0, high=0.1)
    check_off_policy_args("token_tis", cap=1.0, low=-1.0)
    check_off_policy_args("seq_mask", cap=0.0, low=1.0, high=1.0)
    w, _, _ = off_policy_weights(x, x, torch.ones(1, 2), mode="seq_mis", low=1e-300, high=math.inf)
    assert torch.equal(w, torch.ones(1, 2))


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        off_policy_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), mode="none")
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        off_policy_weights(torch.zeros(3), torch.zeros(3), torch.zeros(3), mode="none")


# ----------------------------------------------------------------------------- in the loss
def test_masked_tokens_get_no_gradient_and_keep_the_normaliser():
    """token_mask through policy_loss (ppo, token-mean): a dropped token's loss and gradient are 0 and the
    mean still divides by every sampled token (IcePop's objective)."""
    old, smp, mask = worked_example()
    w, keep, _ = off_policy_weights(old, smp, mask, mode="token_mask", low=0.5, high=2.0)
    old = torch.where(mask.bool(), old, torch.zeros(()))
    lp = (old + 0.05).requires_grad_(True)  # ratio e^0.05 inside the clip range: loss -A r
    adv = torch.ones_like(old)
    loss, _ = policy_loss(lp, old, adv, mask, mode="ppo", clip_low=0.2, clip_high=0.2, agg="token-mean", weights=w)
    loss.backward()
    r = math.exp(0.05)
    assert float(loss.detach()) == pytest.approx(-4 * r / 7)  # 4 kept tokens of 7 sampled
    torch.testing.assert_close(lp.grad, -r * w / 7)
    assert torch.equal(lp.grad != 0, keep)
