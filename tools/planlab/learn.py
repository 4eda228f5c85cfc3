"""Wall seconds of one stage of the learning recipe (examples/learn: SFT or GRPO, tools/learn_gpu.py) on one H100,
from FLOP counts and a few calibration points. Must not run anything: it reads a composed config as a dict.
"""

from __future__ import annotations

from rltrain.config.schema import ModelConfig, RLConfig, SFTConfig
from rltrain.plan.inputs import model_shape
from rltrain.utils.flops import active_params, peak_flops

# Calibration points from docs/benchmarks/update.md (one H100, tools/gpu_smoke.py): the HF rollout decoded
# 256 rows x 64 tokens of a 28-layer Qwen3-0.6B in 2.233 s (35 ms per decode step, launch-bound: ~1.1 ms per
# layer plus the 151,936-column head), and the actor update reached 11.9% MFU on 69-token sequences.
DECODE_MS_PER_LAYER = 1.1
DECODE_MS_FIXED = 2.0  # sampling + the per-row Python loop of the hf engine
MFU = 0.10  # short sequences, small matrices: a little under the 0.6B model's 11.9%
PEAK_FLOPS = peak_flops("H100")  # dense bf16 (rltrain/utils/flops.py)
STEP_OVERHEAD_S = {"sft": 0.04, "grpo": 0.5}  # optimizer step, Python, Ray round trips, weight sync per step
STARTUP_S = {"sft": 40, "grpo": 75}  # imports, model build, Triton compile; + Ray start for GRPO
TOOL_CALL_S = 0.06  # one sandboxed interpreter (CPU seconds), run tool_max_workers at a time
VOCAB = 300  # the recipe's byte-level BPE tokenizer, about


def estimate_seconds(sft: bool, cfg: RLConfig | SFTConfig, *, params: int, layers: int, seq_tokens: float,
                     runs: int = 1) -> float:
    """Predicted wall seconds of one stage on one H100 from FLOP counts and the calibration above.

    SFT: steps x max(6 N T / (MFU x peak), overhead), T = batch x sequence tokens. GRPO: per step, decoding
    max_response_length steps per model turn x (layers x 1.1 ms + 2 ms) (the batch waits for its longest row),
    8 N T FLOPs of log-probs + update, sandbox calls, and a fixed overhead; validation every test_freq steps;
    concurrent runs share the GPU, counted as 1 + 0.25 per extra run (decoding leaves the GPU mostly idle)."""
    t = cfg.trainer
    if sft:
        tokens = cfg.data.batch_size * seq_tokens
        step = max(6 * params * tokens / (MFU * PEAK_FLOPS), STEP_OVERHEAD_S["sft"])
        return STARTUP_S["sft"] + t.total_steps * step + 20
    r = cfg.rollout
    mt = r.multi_turn
    turns = 2 if mt.enable else 1
    decode = turns * r.max_response_length * (layers * DECODE_MS_PER_LAYER + DECODE_MS_FIXED) / 1e3
    rows = cfg.data.train_batch_size * r.n
    flops = 8 * params * rows * seq_tokens
    tools = rows * TOOL_CALL_S / mt.tool_max_workers if mt.enable else 0.0
    step = decode + flops / (MFU * PEAK_FLOPS) + tools + STEP_OVERHEAD_S["grpo"]
    n_val = (t.total_steps // max(t.test_freq, 1) + 1) if t.test_freq > 0 else 0
    val = n_val * (decode + (256 * TOOL_CALL_S / mt.tool_max_workers if mt.enable else 0.0))
    return (STARTUP_S["grpo"] + t.total_steps * step + val + 15) * (1 + 0.25 * (runs - 1))


def stage_estimate(sft: bool, cfg: RLConfig | SFTConfig, model: ModelConfig, seq_tokens: float,
                   runs: int = 1) -> int:
    """estimate_seconds of a stage whose model is `model` (a builtin preset: a GRPO stage's SFT model does not exist
    before its run), its parameters counted at the recipe's vocabulary (a Mixture-of-Experts model's active ones: the
    FLOPs go through k experts), rounded."""
    shape = model_shape(ModelConfig(builtin=model.builtin, overrides={**model.overrides, "vocab_size": VOCAB}))
    return round(estimate_seconds(sft, cfg, params=active_params(shape), layers=shape.num_hidden_layers,
                                  seq_tokens=seq_tokens, runs=runs))
