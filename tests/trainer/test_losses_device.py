"""The actor/critic loss functions take model outputs on the engine's device and the micro-batch on the host
(a bug only a GPU run showed: policy_loss mixed cuda and cpu tensors). The `meta` device stands in for CUDA."""

import torch

from rltrain.workers.actor import PolicyLoss, on_device
from rltrain.workers.critic import ValueLoss


def _mb(b=2, s=5):
    mask = torch.ones(b, s)
    mask[:, 0] = 0
    return {"loss_mask_full": mask, "old_logprobs_full": torch.randn(b, s), "advantages_full": torch.randn(b, s),
            "ref_logprobs_full": torch.randn(b, s), "old_values_full": torch.randn(b, s),
            "returns_full": torch.randn(b, s), "seq_lens": torch.tensor([s, s]), "loss_scale": 1.0}


def test_policy_loss_accepts_outputs_on_another_device():
    loss = PolicyLoss(mode="ppo", clip_low=0.2, clip_high=0.28, dual_clip=None, agg="token-mean", entropy_coef=0.01,
                      use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    out = {"logprobs": torch.zeros(2, 5, device="meta"), "entropy": torch.zeros(2, 5, device="meta")}
    value, metrics = loss(out, _mb())
    assert value.device.type == "meta" and "actor/kl_loss" in metrics and "actor/entropy" in metrics


def test_value_loss_accepts_outputs_on_another_device():
    value, metrics = ValueLoss(clip=0.5, agg="token-mean")({"values": torch.zeros(2, 5, device="meta")}, _mb())
    assert value.device.type == "meta" and "critic/vf_clipfrac" in metrics


def test_on_device_keeps_non_tensors():
    mb = on_device({"a": torch.ones(1), "loss_scale": 0.5}, torch.device("meta"))
    assert mb["a"].device.type == "meta" and mb["loss_scale"] == 0.5
