"""actor.off_policy (issue #37) wired into config, loss and metrics: the legacy actor.tis keys map in one place
(OffPolicyConfig.effective) onto the same correction, a config setting both is refused, bad arguments are reported
with their key, and a tiny in-process run with a correction logs rollout/is_* and finishes."""

import math

import pytest
import torch

from rltrain.algorithms import OFF_POLICY_MODES, TIS_MODES, off_policy_weights, truncated_is_weights
from rltrain.config import ConfigError
from rltrain.config.schema import OffPolicyConfig
from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics
from rltrain.workers.actor import PolicyLoss


def _effective(cfg_for, *overrides):
    cfg = cfg_for(*overrides)
    return OffPolicyConfig.effective(cfg.actor, async_rollout=cfg.trainer.async_rollout)


def test_effective_setting_maps_actor_tis_and_defaults_to_none(cfg_for):
    assert _effective(cfg_for).mode == "none"
    op = _effective(cfg_for, "actor.tis.enable=true", "actor.tis.cap=3.0")
    assert (op.mode, op.cap) == ("token_tis", 3.0)
    op = _effective(cfg_for, "actor.tis.enable=true", "actor.tis.mode=sequence", "actor.tis.cap=1.5")
    assert (op.mode, op.cap) == ("seq_tis", 1.5)
    op = _effective(cfg_for, "actor.off_policy.mode=token_mis", "actor.off_policy.low=0.25", "actor.off_policy.high=4")
    assert (op.mode, op.low, op.high) == ("token_mis", 0.25, 4.0)
    op = _effective(cfg_for, "actor.tis.mode=sequence")  # tis.mode alone (tis.enable=false) changes nothing
    assert op.mode == "none"


def test_the_null_mode_is_geo_tis_only_for_an_asynchronous_rollout(cfg_for):
    """actor.off_policy.mode=null (the default): none when synchronous, geo_tis with its cap when asynchronous; a
    named mode or actor.tis.enable wins either way, and a null mode's arguments are checked as geo_tis's."""
    split = ["trainer.colocate=false", "trainer.use_ray=true"]
    assert cfg_for().actor.off_policy.mode is None
    op = _effective(cfg_for, *split, "trainer.async_rollout=true", "actor.off_policy.cap=3")
    assert (op.mode, op.cap) == ("geo_tis", 3.0)
    assert _effective(cfg_for, *split, "trainer.async_rollout=true", "actor.off_policy.mode=none").mode == "none"
    assert _effective(cfg_for, *split, "trainer.async_rollout=true", "actor.tis.enable=true").mode == "token_tis"
    with pytest.raises(ConfigError, match="actor.off_policy.cap"):
        cfg_for(*split, "trainer.async_rollout=true", "actor.off_policy.cap=0.5")
    cfg_for("actor.off_policy.cap=0.5")  # synchronous: null is none, which takes no cap


@pytest.mark.parametrize("tis_mode", TIS_MODES)
def test_the_mapped_mode_is_the_owner_truncated_is(tis_mode, cfg_for):
    """effective()'s actor.tis.mode -> mode table says what algorithms/off_policy.truncated_is_weights does."""
    op = _effective(cfg_for, "actor.tis.enable=true", f"actor.tis.mode={tis_mode}", "actor.tis.cap=1.3")
    g = torch.Generator().manual_seed(0)
    old, smp = -torch.rand(3, 7, generator=g), -torch.rand(3, 7, generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    w, st = truncated_is_weights(old, smp, mask, cap=1.3, mode=tis_mode)
    corr = off_policy_weights(old, smp, mask, mode=op.mode, cap=op.cap, low=op.low, high=op.high)
    assert torch.equal(w, corr.weights) and st.keys() == corr.stats.keys()


def test_actor_tis_and_off_policy_token_tis_give_the_same_loss(cfg_for):
    g = torch.Generator().manual_seed(3)
    b, s = 3, 8
    mask = torch.ones(b, s)
    mask[:, :2] = 0
    mb = {"input_ids": torch.zeros(b, s, dtype=torch.long), "seq_lens": torch.full((b,), s),
          "loss_mask_full": mask, "old_logprobs_full": -torch.rand(b, s, generator=g),
          "advantages_full": torch.randn(b, s, generator=g), "sampler_logprobs_full": -2 * torch.rand(b, s, generator=g)}
    lp = -torch.rand(b, s, generator=g)
    losses = {}
    for name, ov in {"tis": ["actor.tis.enable=true", "actor.tis.cap=1.2"],
                     "off_policy": ["actor.off_policy.mode=token_tis", "actor.off_policy.cap=1.2"],
                     "none": []}.items():
        loss = PolicyLoss.from_config(cfg_for(*ov).actor)
        losses[name], _ = loss({"logprobs": lp}, mb)
        assert loss.needs_sampler_logprobs == (name != "none")
    assert torch.equal(losses["tis"], losses["off_policy"])
    assert not torch.equal(losses["tis"], losses["none"])  # the weights were applied (some ratios exceed 1.2)


def test_mask_modes_keep_dropped_tokens_in_the_denominator(cfg_for):
    """token_mask: a dropped token's loss is 0 but the token-mean still divides by every loss-mask token."""
    b, s = 1, 4
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    old = torch.zeros(b, s)
    smp = torch.tensor([[0.0, 0.0, 0.0, -5.0]])  # the last token's ratio e^5 > high=2: dropped
    mb = {"loss_mask_full": mask, "old_logprobs_full": old, "advantages_full": torch.ones(b, s),
          "sampler_logprobs_full": smp}
    loss = PolicyLoss.from_config(cfg_for("actor.off_policy.mode=token_mask", "actor.off_policy.high=2.0").actor)
    got, _ = loss({"logprobs": torch.zeros(b, s)}, mb)  # ratio 1: per-token loss -A = -1 on kept tokens
    assert float(got) == pytest.approx(-2.0 / 3.0)


def test_both_actor_tis_and_off_policy_are_refused_naming_both_keys(cfg_for, capsys):
    with pytest.raises(ConfigError, match=r"actor\.tis\.enable=true and actor\.off_policy\.mode='seq_mask'"):
        cfg_for("actor.tis.enable=true", "actor.off_policy.mode=seq_mask")
    from hydra import compose, initialize_config_dir

    from rltrain.config import validate_config
    from rltrain.main import CONFIG_DIR, run_entry

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="grpo_tiny", overrides=["actor.tis.enable=true", "actor.off_policy.mode=token_tis"])
    with pytest.raises(SystemExit) as exit_info:
        run_entry(cfg, validate_config, lambda c: pytest.fail("the run must not start"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "actor.tis.enable=true" in err and "actor.off_policy.mode" in err and "Traceback" not in err


@pytest.mark.parametrize("overrides,match", [
    (["actor.off_policy.mode=token_ratio"], r"actor\.off_policy\.mode='token_ratio' is not allowed"),
    (["actor.off_policy.mode=seq_tis", "actor.off_policy.cap=0.5"], r"actor\.off_policy\.cap: "),
    (["actor.off_policy.mode=geo_mask", "actor.off_policy.low=0"], r"actor\.off_policy\.low: "),
    (["actor.off_policy.mode=token_mis", "actor.off_policy.high=0.9"], r"actor\.off_policy\.high: "),
    (["actor.off_policy.mode=token_mask", "actor.off_policy.high=inf"], r"actor\.off_policy\.high=inf"),
])
def test_bad_off_policy_settings_are_reported_with_their_key(cfg_for, overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for(*overrides)


def test_arguments_a_mode_does_not_use_are_not_checked(cfg_for):
    # cfg_for validates: a cap below 1 under a *_mask mode (cap is the *_tis modes' only) and a low of 0 under a
    # *_tis mode (low is the mask and mis modes') pass, and are carried as given, unused
    op = _effective(cfg_for, "actor.off_policy.mode=token_mask", "actor.off_policy.cap=0.5")
    assert (op.mode, op.cap) == ("token_mask", 0.5)
    op = _effective(cfg_for, "actor.off_policy.mode=seq_tis", "actor.off_policy.low=0")
    assert (op.mode, op.low) == ("seq_tis", 0.0)
    with pytest.raises(ConfigError, match="actor.off_policy.cap"):  # the argument the mode uses is checked
        cfg_for("actor.off_policy.mode=token_tis", "actor.off_policy.cap=0.5")


def test_every_mode_is_accepted(cfg_for):
    for mode in OFF_POLICY_MODES:
        assert _effective(cfg_for, f"actor.off_policy.mode={mode}").mode == mode


@pytest.mark.parametrize("setting,share", [("actor.off_policy.mode=token_mask", "masked_frac"),
                                           ("actor.off_policy.mode=seq_tis", "clipfrac"),
                                           ("actor.tis.enable=true", "clipfrac")])  # the legacy keys
def test_tiny_in_process_run_with_a_correction_logs_its_stats(tmp_path, cfg_for, setting, share):
    run_dir = str(tmp_path / setting.split("=")[0])
    cfg = cfg_for("trainer.use_ray=false", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
                  "trainer.save_freq=-1", "trainer.plots=false", setting)
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    keys = ["weight_mean", "weight_max", "ratio_max", "ratio_min", share]
    for row in rows:
        for k in keys:
            v = row[f"rollout/is_{k}"]
            assert isinstance(v, (int, float)) and math.isfinite(v), (k, v)
        assert math.isfinite(row["actor/pg_loss"])
        assert 0.0 <= row[f"rollout/is_{share}"] <= 1.0
