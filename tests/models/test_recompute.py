"""Full activation recomputation changes memory, not math: same loss, grads and step as without it."""

import torch

from rltrain.models.megatron.tiny import tiny_qwen3_config
from _megatron_ref import make_engine


def _step(recompute: bool):
    cfg = tiny_qwen3_config(vocab_size=97)
    eng = make_engine(cfg, role="actor", seed=3, lr=1e-3, recompute_activations=recompute,
                         make_vocab_size_divisible_by=1)
    torch.manual_seed(0)
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(cfg)
    eng.load_hf_weights(hf.state_dict())
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor([12, 9, 4])
    label_mask = torch.arange(12)[None] < seq_lens[:, None]
    label_mask[:, 0] = False
    mb = {"input_ids": ids, "seq_lens": seq_lens, "label_mask": label_mask, "loss_scale": 1.0}

    def loss_fn(out, mb):
        m = mb.label_mask.float()
        return -(out.logprobs * m).sum() / m.sum() - 0.01 * (out.entropy * m).sum() / m.sum(), {}

    loss_fn.needs_entropy_grad = True
    metrics = eng.train_step([mb], loss_fn)
    return metrics, dict(eng.export_hf_weights())


def test_recompute_gives_the_same_step():
    m0, w0 = _step(False)
    m1, w1 = _step(True)
    assert abs(m0["loss"] - m1["loss"]) < 1e-6 and abs(m0["grad_norm"] - m1["grad_norm"]) < 1e-5 * m0["grad_norm"]
    for k in w0:
        torch.testing.assert_close(w0[k], w1[k], rtol=1e-5, atol=1e-6)
