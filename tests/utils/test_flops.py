"""rltrain/utils/flops.py for Mixture-of-Experts: total parameters (memory, weight sync) hold every expert, the FLOP
count (and so MFU) goes through the k active ones; a tiny Qwen3-MoE shape worked by hand, the published Qwen3-30B-A3B
counts, and the MFU docs/benchmarks/moe.md reports."""

from types import SimpleNamespace

import pytest

from rltrain.config.presets import BUILTINS
from rltrain.utils.flops import (
    active_params,
    attention_flops,
    matmul_params,
    num_params,
    peak_flops,
    sparse_layers,
    train_flops,
)

# 2 layers (layer 0 dense by mlp_only_layers, layer 1 sparse), hidden 8, 2 query heads and 1 KV head of 4, dense MLP
# 12, 8 experts of width 6, top-2, vocab 10, untied LM head
TOY_MOE = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          intermediate_size=12, vocab_size=10, tie_word_embeddings=False, model_type="qwen3_moe",
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=6, decoder_sparse_step=1,
                          mlp_only_layers=[0])


def test_sparse_layer_rule():
    assert sparse_layers(TOY_MOE) == [0, 1]
    four = SimpleNamespace(**{**vars(TOY_MOE), "num_hidden_layers": 4, "decoder_sparse_step": 2,
                              "mlp_only_layers": [3]})
    assert sparse_layers(four) == [0, 1, 0, 0]  # (i + 1) % 2 == 0 -> layers 1 and 3; 3 is dense by mlp_only_layers
    dense = SimpleNamespace(**{**vars(TOY_MOE), "num_experts": 0})
    assert sparse_layers(dense) == [0, 0]
    assert sparse_layers({"num_hidden_layers": 3, "num_experts": 4}) == [1, 1, 1]  # a config.json dict too


def test_toy_moe_total_and_active_params_by_hand():
    # attention per layer: q, k, v = 8 x (8 + 4 + 4) = 128, o = 8 x 8 = 64 -> 192
    # dense layer 0: 192 + gate, up, down 3 x 8 x 12 = 288 -> 480
    # sparse layer 1: 192 + router 8 x 8 = 64 + experts: each 3 x 8 x 6 = 144; all 8 -> 1,152; active 2 -> 288
    #   total 1,408, active 544; LM head 10 x 8 = 80
    assert matmul_params(TOY_MOE, active=False) == 480 + 1408 + 80 == 1968
    assert matmul_params(TOY_MOE) == 480 + 544 + 80 == 1104
    # + input embedding 80 + per layer 2 norms of 8 and q/k norms of 4 (2 x 24) + final norm 8 = 136
    assert num_params(TOY_MOE) == 1968 + 136 == 2104
    assert active_params(TOY_MOE) == 1104 + 136 == 1240
    # FLOPs on the active weights: 3 tokens in sequences of 4; attention 2 (QK, PV) x 2 x 2 layers x 8 x 4/2 = 128
    assert train_flops(TOY_MOE, 3, 4) == 3 * 3 * (2 * 1104 + 128)
    assert attention_flops(TOY_MOE, 3, 4) == 3 * 3 * 128  # the attention's part alone
    assert attention_flops(TOY_MOE, 3, 8) == 2 * attention_flops(TOY_MOE, 3, 4)  # it grows with the sequence


def test_dense_model_active_equals_total():
    dense = SimpleNamespace(**{**vars(TOY_MOE), "num_experts": 0, "model_type": "qwen3"})
    assert matmul_params(dense) == matmul_params(dense, active=False) == 2 * 480 + 80
    assert active_params(dense) == num_params(dense) == 1040 + 136


def test_qwen3_30b_a3b_counts_match_the_published_ones():
    full = SimpleNamespace(**BUILTINS["qwen3-30b-a3b"])
    assert 30.4e9 < num_params(full) < 30.6e9  # "30.5B in total"
    assert 3.3e9 < active_params(full) < 3.4e9  # "3.3B activated"
    # the 8-layer slice of docs/benchmarks/moe.md: 5.60B parameters, 766M active with the head
    s = SimpleNamespace(**{**BUILTINS["qwen3-30b-a3b"], "num_hidden_layers": 8})
    assert num_params(s) == 5_607_297_024
    assert matmul_params(s) == 766_246_912
    # its update: 17,664 tokens per step (256 x 69) in 1.453 s on two GPUs: 2.8% MFU counted on active parameters
    mfu = train_flops(s, 256 * 69, 69) / (1.4532 * 2 * peak_flops("NVIDIA H200"))
    assert mfu == pytest.approx(0.028, abs=0.0006)
