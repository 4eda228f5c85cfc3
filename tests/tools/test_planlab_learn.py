"""tools/planlab/learn.py: the learning recipe's H100 estimates, worked by hand as examples/learn/README.md works them."""

from __future__ import annotations

import os
import sys

import pytest

from rltrain.config.schema import (DataConfig, ModelConfig, MultiTurnConfig, RLConfig, RolloutConfig, SFTConfig,  # noqa: E402
                                   SFTDataConfig, SFTTrainerConfig, TrainerConfig)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

from planlab import learn  # noqa: E402


def _grpo_cfg(multi_turn: bool, test_freq: int = 10) -> RLConfig:
    return RLConfig(trainer=TrainerConfig(total_steps=100, test_freq=test_freq),
                    data=DataConfig(train_batch_size=64),
                    rollout=RolloutConfig(n=8, max_response_length=72,
                                          multi_turn=MultiTurnConfig(enable=multi_turn, tool_max_workers=8)))


def _sft_cfg(total_steps: int, batch_size: int) -> SFTConfig:
    return SFTConfig(trainer=SFTTrainerConfig(total_steps=total_steps), data=SFTDataConfig(batch_size=batch_size))


def test_sft_is_overhead_bound_at_the_recipe_size():
    cfg = _sft_cfg(1500, 64)
    # 6 N T / (10% x peak) is ~0.3 ms: each step costs the 40 ms overhead; + 40 s start-up + 20 s evaluation
    assert learn.estimate_seconds(True, cfg, params=55_400_000, layers=14, seq_tokens=71) == pytest.approx(
        40 + 1500 * 0.04 + 20)


def test_grpo_step_is_decode_plus_flops_plus_overhead():
    params, layers, seq = 55_400_000, 14, 71
    decode = 72 * (14 * 1.1 + 2.0) / 1e3  # 1.25 s per rollout
    flops_s = 8 * params * 512 * seq / (0.1 * learn.PEAK_FLOPS)
    step = decode + flops_s + 0.5
    expected = 75 + 100 * step + 11 * decode + 15
    got = learn.estimate_seconds(False, _grpo_cfg(False), params=params, layers=layers, seq_tokens=seq)
    assert got == pytest.approx(expected)
    # three runs at once share the GPU: 1 + 0.25 per extra run
    assert learn.estimate_seconds(False, _grpo_cfg(False), params=params, layers=layers, seq_tokens=seq,
                                  runs=3) == pytest.approx(1.5 * expected)
    # ReTool: two model turns and 512 sandbox calls per step, 8 at a time
    tool = learn.estimate_seconds(False, _grpo_cfg(True, test_freq=-1), params=params, layers=layers, seq_tokens=seq)
    assert tool == pytest.approx(75 + 100 * (2 * decode + flops_s + 512 * 0.06 / 8 + 0.5) + 15)


def test_stage_estimate_counts_the_preset_at_the_recipe_vocabulary():
    small = learn.stage_estimate(True, _sft_cfg(10, 1), ModelConfig(builtin="small"), seq_tokens=71)
    assert small == round(40 + 10 * 0.04 + 20)  # overhead-bound
    big = _sft_cfg(10, 4096)
    a = learn.stage_estimate(True, big, ModelConfig(builtin="small"), seq_tokens=1000)
    b = learn.stage_estimate(True, big, ModelConfig(builtin="small", overrides={"num_hidden_layers": 28}),
                             seq_tokens=1000)
    assert b > a > 60  # FLOP-bound: more layers, more seconds
