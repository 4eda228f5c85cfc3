"""workers/hybrid.initial_hf_model: where a built-in preset's random init runs (init_device) and what it returns."""

from unittest import mock

import pytest
import torch

from rltrain.config.schema import ModelConfig
from rltrain.workers.hybrid import init_device, initial_hf_model

TINY = ModelConfig(builtin="tiny")


class _Tok:
    vocab_size = 64


def _model(seed, device="cpu", dtype=torch.float32):
    return initial_hf_model(TINY, _Tok(), seed, dtype, device)[1]


def test_init_device_cpu_unless_training_on_a_gpu_with_room():
    assert init_device("cpu", 10) == "cpu"
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert init_device("cuda", 10) == "cpu"  # no GPU visible: the CPU, not an error here
    gib = 2**30
    card = mock.Mock(total_memory=60 * gib)
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.current_device", return_value=1), \
            mock.patch("torch.cuda.get_device_properties", return_value=card) as props, \
            mock.patch("torch.cuda.mem_get_info", side_effect=AssertionError("free memory differs by rank")):
        # 4.0e9 parameters x 6 bytes = 22.4 GiB <= half of the card's 60 GiB: the GPU this process uses
        assert init_device("cuda", 4_000_000_000) == "cuda:1"
        # 6.0e9 x 6 = 33.5 GiB > 30 GiB: the CPU
        assert init_device("cuda", 6_000_000_000) == "cpu"
        props.assert_called_with(1)


def test_cpu_init_is_seeded_and_returns_the_cpu_model_in_the_asked_dtype():
    a, b, c = _model(3), _model(3), _model(4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # every rank and role gets the same weights
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    bf = _model(3, dtype=torch.bfloat16)
    assert {p.device.type for p in bf.parameters()} == {"cpu"}
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    # bf16 is the fp32 init rounded: the same stream, whatever the dtype asked for
    assert all(torch.equal(sa[k].to(torch.bfloat16), v) for k, v in bf.state_dict().items())


def _check_init(model):
    mats = torch.cat([p.detach().float().flatten() for p in model.parameters() if p.dim() >= 2])
    assert mats.std().item() == pytest.approx(0.02, rel=0.05)
    assert abs(mats.mean().item()) < 2e-3
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            assert torch.all(p == 1), name  # RMSNorm weights start at one
    # rotary buffers were computed, not left uninitialised
    for name, buf in model.named_buffers():
        assert torch.isfinite(buf.float()).all(), name


def test_cpu_init_distribution():
    _check_init(_model(0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_init_is_seeded_on_the_cpu_and_distributed_as_the_cpu_init():
    a, b = _model(3, "cuda", torch.bfloat16), _model(3, "cuda", torch.bfloat16)
    assert {p.device.type for p in a.parameters()} == {"cpu"}
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16}
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    _check_init(a)
    cpu = _model(3, dtype=torch.bfloat16)  # the same dtype: model.to(dtype) casts the rotary buffers too
    ref = cpu.state_dict()  # the CPU generator's stream differs from the GPU's
    assert any(not torch.equal(ref[k], sa[k]) for k in sa)
    cpu_buffers = dict(cpu.named_buffers())
    for name, buf in a.named_buffers():  # buffers computed on the GPU match the CPU's, to bf16's rounding
        assert buf.dtype == cpu_buffers[name].dtype, name
        torch.testing.assert_close(buf, cpu_buffers[name])
