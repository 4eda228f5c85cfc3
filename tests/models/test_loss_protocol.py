"""The engine's train step and the caller's loss (models/loss_protocol.py, issue #32): typed micro-batches and
outputs, the temperature passed to train_step (never read off the loss), the flat dict layout still accepted."""

from __future__ import annotations

import pytest
import torch

from rltrain.models.loss_protocol import LossFn, MicroBatch, ModelOutputs, as_micro_batch
from _megatron_ref import make_engine, random_batch, random_hf_model

V = 101


class _Recorder:
    """A LossFn that keeps the log-probs it was given (detached) and returns their negative mean."""

    needs_entropy_grad = False

    def __init__(self):
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, outputs: ModelOutputs, mb: MicroBatch):
        assert isinstance(outputs, ModelOutputs) and isinstance(mb, MicroBatch)
        assert outputs.values is None and outputs.entropy is not None and not outputs.entropy.requires_grad
        self.seen.append((mb.sample_idx, outputs.logprobs.detach().clone()))
        m = mb.label_mask.float()
        return -(outputs.logprobs * m).sum() / m.sum(), {"tokens": m.sum()}


def _setup(lr=0.0):
    hf = random_hf_model(V, seed=5, num_hidden_layers=1)
    eng = make_engine(hf.config, seed=0, lr=lr, make_vocab_size_divisible_by=1, max_tokens_per_micro_batch=24)
    eng.load_hf_weights(hf.state_dict())
    ids, lens, mask = random_batch(V, [8, 6, 5, 3], seed=2)
    return eng, ids, lens, mask


def test_the_loss_classes_are_loss_fns():
    from rltrain.workers.actor import PolicyLoss
    from rltrain.workers.critic import ValueLoss

    pl = PolicyLoss(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean", entropy_coef=0.0,
                    use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1")
    assert isinstance(pl, LossFn) and isinstance(ValueLoss(clip=0.5, agg="token-mean"), LossFn)
    assert not hasattr(pl, "temperature")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_train_step_divides_the_logits_by_its_temperature_argument(temperature):
    eng, ids, lens, mask = _setup()
    want, _ = eng.forward_logprobs(ids, lens, mask, temperature=temperature, with_entropy=False)
    loss = _Recorder()
    loss.temperature = 3.0  # an attribute of the loss is not read (it was, before #32)
    eng.train_step(eng.make_micro_batches({"input_ids": ids, "label_mask": mask}, lens), loss,
                   temperature=temperature)
    assert len(loss.seen) >= 2
    for idx, lp in loss.seen:
        torch.testing.assert_close(lp, want[idx, : lp.shape[1]], atol=1e-5, rtol=1e-5)


def test_train_step_refuses_a_non_positive_temperature():
    eng, ids, lens, mask = _setup()
    with pytest.raises(ValueError, match="temperature"):
        eng.train_step(eng.make_micro_batches({"input_ids": ids, "label_mask": mask}, lens), _Recorder(),
                       temperature=0.0)


def test_flat_dict_micro_batches_train_like_typed_ones():
    runs = []
    for as_dict in (False, True):
        eng, ids, lens, mask = _setup(lr=1e-3)
        mbs = eng.make_micro_batches({"input_ids": ids, "label_mask": mask, "w": mask.float()}, lens)
        if as_dict:
            mbs = [{"input_ids": mb.input_ids, "seq_lens": mb.seq_lens, "label_mask": mb.label_mask,
                    "sample_idx": mb.sample_idx, **mb.extras} for mb in mbs]
        runs.append(eng.train_step(mbs, _Recorder(), temperature=0.9))
    assert runs[0] == runs[1]


def test_micro_batch_from_mapping_splits_fields_and_extras():
    ids = torch.zeros(2, 4, dtype=torch.long)
    mb = as_micro_batch({"input_ids": ids, "seq_lens": [4, 2], "loss_scale": 0.5, "old": torch.ones(2, 4)})
    assert mb.loss_scale == 0.5 and mb.seq_lens.tolist() == [4, 2] and mb.label_mask is None
    assert set(mb.extras) == {"old"} and as_micro_batch(mb) is mb
    with pytest.raises(TypeError):  # fields by attribute only (the name-access shim of #32's migration is gone)
        mb["loss_scale"]
    with pytest.raises(ValueError, match="seq_lens"):
        as_micro_batch({"input_ids": ids})
