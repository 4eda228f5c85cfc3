"""rltrain.plan on CPU: the arithmetic on hand-worked examples, the JSON output, the refusal and its suggestions."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from rltrain.config import as_config
from rltrain.config.convert import as_dict
from rltrain.config.entry import compose_config as compose
from rltrain.config.schema import ModelConfig
from rltrain.plan import PlanError, check, make_plan
from rltrain.plan.planner import _fmt
from rltrain.plan import calibration as cal
from rltrain.plan.__main__ import main
from rltrain.plan.inputs import PlanInputError, model_shape, read
from rltrain.plan.memory import (activation_bytes, host_bytes, kv_bytes_per_token, micro_batch_tokens,
                                 n_micro_batches, plan_gpus, role_params, train_static, update_phase)
from rltrain.utils.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30

# The example: Qwen3-4B, full fine-tuning, 16k-token micro-batches without recompute, 80 GiB GPUs.
TOO_BIG = ["model=qwen3_4b", "actor.max_tokens_per_micro_batch=16384", "actor.recompute_activations=false"]


# tools/gpu_smoke.py's GRPO run of the Qwen3-0.6B shape on one GPU (32 x 8 samples, 64-token responses)
GRPO_06B = ["model=qwen3_0.6b_random", "trainer.device=cuda", "trainer.n_gpus_per_node=1",
            "trainer.fused_linear_logprob_backend=triton", "data.train_batch_size=32", "rollout.n=8",
            "rollout.max_response_length=64", "data.max_prompt_length=64", "actor.ppo_mini_batch_size=16",
            "actor.use_kl_loss=true", "actor.max_tokens_per_micro_batch=16384", "rollout.max_batch_size=256",
            "trainer.use_ray=false"]


def qwen06b(*extra: str):
    return compose("grpo_qwen3", ["model=qwen3_0.6b_random", "trainer.n_gpus_per_node=1", *extra])


# ------------------------------------------------------------------ arithmetic, worked by hand

def test_qwen3_06b_parameters_by_hand():
    s = model_shape(ModelConfig(builtin="qwen3-0.6b"))
    # one layer: q/k/v/o 1024 x (2048 + 2 x 1024) + 2048 x 1024, MLP 3 x 1024 x 3072, norms 2 x 1024 + 2 x 128
    layer = 1024 * 4096 + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    assert layer == 15_730_944
    total = 28 * layer + 151_936 * 1024 + 1024  # tied head: the embedding once; the final norm
    assert total == 596_049_920  # bench_rollout reported 596.04992 M parameters for the shape
    assert role_params(s, 1, 1, 0) == total
    # TP=2: the matrices and the embedding split, the norms whole
    assert role_params(s, 2, 1, 0) == 28 * (15_728_640 // 2 + 2304) + 151_936 * 1024 // 2 + 1024 == 298_057_728
    # PP=2: 14 layers each; the embedding on stage 0, the tied head's copy and the final norm on stage 1
    assert role_params(s, 1, 2, 0) == 14 * layer + 151_936 * 1024
    assert role_params(s, 1, 2, 1) == 14 * layer + 151_936 * 1024 + 1024


def test_static_bytes_weights_master_adam_by_hand():
    x = read(qwen06b("actor.use_kl_loss=true"))
    P = 596_049_920
    parts = train_static(x, 0)
    assert parts == {"actor weights": 2 * P, "actor fp32 master": 4 * P, "actor optimizer (AdamW)": 8 * P,
                     "reference weights": 2 * P}
    # fp32 params: no masters; the optimizer state is sharded over the data-parallel ranks (DP=2: half each)
    x32 = read(qwen06b("model.dtype=float32", "actor.use_kl_loss=false", "trainer.n_gpus_per_node=2",
                       "rollout.tensor_parallel_size=2"))
    assert x32.dp == 2
    assert train_static(x32, 0) == {"actor weights": 4 * P, "actor optimizer (AdamW)": 8 * P / 2}
    # DP=4, a quarter of the host's optimizer state on the host; ref.offload: the embedding (tied: also the head)
    # and the final norm, and two of the 28 layers stay
    x4 = read(qwen06b("actor.use_kl_loss=true", "trainer.n_gpus_per_node=4", "actor.optimizer_offload_fraction=0.25",
                      "ref.offload=true"))
    layer = (596_049_920 - 151_936 * 1024 - 1024) / 28
    assert train_static(x4, 0) == pytest.approx({
        "actor weights": 2 * P, "actor fp32 master": 4 * P / 4 * 0.75, "actor optimizer (AdamW)": 8 * P / 4 * 0.75,
        "reference weights": 2 * (151_936 * 1024 + 1024 + 2 * layer)})
    assert host_bytes(x4, 0) == pytest.approx(12 * P / 4 * 0.25 + 2 * P)  # the host share + the reference


def test_critic_adds_a_trunk_with_a_value_head():
    x = read(qwen06b("algorithm=gae", "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false"))
    assert x.use_critic and not x.use_ref
    Pc = 596_049_920 + 1024 + 1  # no LM head of its own (tied), a value head h -> 1
    assert train_static(x, 0)["critic optimizer (AdamW)"] == 8 * Pc


def test_optimizer_step_holds_the_grads_when_activations_are_small():
    # one 1,024-token micro-batch with full recompute: the optimizer step is the peak: 14 bytes of state per
    # parameter, its bf16 grad and one GiB chunk of fp32 grads (the engine before issue 59: all fp32 grads, 4 B)
    x = read(qwen06b("actor.use_kl_loss=false", "actor.recompute_activations=true", "data.max_prompt_length=512",
                     "rollout.max_response_length=512", "actor.max_tokens_per_micro_batch=1024",
                     "actor.ppo_mini_batch_size=1", "rollout.n=1"))
    P = 596_049_920
    ph = update_phase(x, 0, train_static(x, 0), critic=False)
    assert ph.name == "update (actor), optimizer step"
    assert ph.torch_bytes == 16 * P + 2**30
    old = dataclasses.replace(x, legacy_engine=True)
    assert update_phase(old, 0, train_static(old, 0), critic=False).torch_bytes == 18 * P


def test_activation_formulas_by_hand():
    x = read(qwen06b("actor.recompute_activations=true", "actor.max_tokens_per_micro_batch=65536"))
    T = 65536
    W = 1024 + (2048 + 1024 + 3072)  # h + (q + kv + ffn) / TP
    act, how = activation_bytes(x, T, 0)
    assert how == "full recompute"
    assert act == pytest.approx(2 * 1024 * T * 28 + cal.value("act_full_working") * W * T)
    x2 = read(qwen06b("actor.elementwise_fusion=compile"))
    act2, _ = activation_bytes(x2, 8192, 0)
    assert act2 == pytest.approx(cal.value("act_none_fusion_compile") * W * 8192 * 28)


def test_micro_batch_tokens_rule():
    x = read(qwen06b("actor.max_tokens_per_micro_batch=4096", "data.max_prompt_length=512",
                     "rollout.max_response_length=7680"))
    assert micro_batch_tokens(x, x.mb_tokens, x.seq_len) == 8192  # a longer sequence gets its own micro-batch
    x = read(qwen06b("actor.max_tokens_per_micro_batch=65536", "actor.ppo_mini_batch_size=1", "rollout.n=2"))
    assert micro_batch_tokens(x, x.mb_tokens, x.seq_len) == 2 * x.seq_len  # at most the mini-batch's tokens
    # whole rows (models/megatron/micro_batch.py): 16,384 tokens hold one 8,197-token sequence, so 32 rows take 32
    # micro-batches of 8,197 tokens, not 17 of 16,384
    x = read(qwen06b("actor.max_tokens_per_micro_batch=16384", "data.max_prompt_length=5",
                     "rollout.max_response_length=8192", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                     "rollout.n=8"))
    assert x.seq_len == 8197
    assert micro_batch_tokens(x, x.mb_tokens, x.seq_len) == 8197
    assert n_micro_batches(x, x.mb_tokens, x.seq_len) == 32
    x = read(qwen06b("actor.max_tokens_per_micro_batch=16384", "data.max_prompt_length=5",
                     "rollout.max_response_length=2048", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
                     "rollout.n=8"))
    assert micro_batch_tokens(x, x.mb_tokens, x.seq_len) == 7 * 2053  # 7 rows of 2,053 (14,371 tokens) fit
    assert n_micro_batches(x, x.mb_tokens, x.seq_len) == math.ceil(128 / 7)


def test_kv_cache_bytes_match_the_engine_rule():
    s = model_shape(ModelConfig(builtin="qwen3-0.6b"))
    assert kv_bytes_per_token(s, 1, 2) == 2 * 28 * 8 * 128 * 2 == 114_688
    assert kv_bytes_per_token(s, 16, 2) == 2 * 28 * 1 * 128 * 2  # at least one KV head per rank
    from types import SimpleNamespace

    from rltrain.config.presets import BUILTINS
    from rltrain.rollout.vllm_args import kv_cache_need_bytes

    hf = SimpleNamespace(**BUILTINS["qwen3-4b"])
    s4 = model_shape(ModelConfig(builtin="qwen3-4b"))
    for tp in (1, 2, 16):
        assert kv_cache_need_bytes(hf, tensor_parallel_size=tp, dtype_bytes=2, max_num_seqs=1) == (
            kv_bytes_per_token(s4, tp, 2) * s4.max_position_embeddings)


def test_shape_from_hub_name_local_dir_and_unknown(tmp_path):
    assert model_shape(ModelConfig(path="Qwen/Qwen3-4B")).hidden_size == 2560  # the preset copies its config.json
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}))
    s = model_shape(ModelConfig(path=str(d), overrides={"num_hidden_layers": 5}))
    assert (s.hidden_size, s.head_dim, s.num_hidden_layers) == (256, 64, 5)
    with pytest.raises(PlanInputError, match="model.path"):
        model_shape(ModelConfig(path=str(tmp_path / "nothing")))


def test_a_config_read_back_from_its_config_json_plans_the_same():
    cfg = compose("grpo_qwen3", [])
    a = make_plan(cfg, suggest=False)
    b = make_plan(as_config(json.loads(json.dumps(as_dict(cfg)))), suggest=False)
    assert a.peak_gib == b.peak_gib and a.seconds == b.seconds


def test_allocator_peak_counts_in_process_vllm_share():
    # measured: 63.6 GiB = 0.5 x 79.18 (vLLM, in process) + 23.8 (the actor's update) on one H100
    cfg = qwen06b("rollout.gpu_memory_utilization=0.5")
    p = make_plan(cfg, device="h100", suggest=False)
    g = p.gpus[0]
    train = max(ph.torch_bytes - ph.parts.get("vllm (weights + KV cache)", 0) for ph in g.phases)
    assert g.allocator_peak_bytes == pytest.approx(0.5 * 79.18 * GIB + train)


def test_colocated_counters_add_vllm_share_the_card_peak_does_not():
    # 2026-11-26, one H200, the 0.6B GRPO step at 5 + 64 tokens: max_memory_allocated 93.95 = 69.90 (0.5 x 139.80,
    # vLLM) + 24.05 (the update), max_memory_reserved 95.78; the card never holds both (sleep unmaps vLLM's pool
    # below torch's counters), so the plan's card peak (vLLM awake: generation or weight sync) is below both
    cfg = compose("grpo_tiny", [*GRPO_06B, "rollout=vllm", "trainer.use_ray=true"])
    g = make_plan(cfg, device="h200", prompt_tokens=5, response_tokens=64, suggest=False).gpus[0]
    slack = cal.value("allocator_slack")
    train = max(ph.torch_bytes - ph.parts.get("vllm (weights + KV cache)", 0) for ph in g.phases)
    assert g.allocator_reserved_bytes == pytest.approx(0.5 * 139.80 * GIB + train * (1 + slack))
    assert g.allocator_peak_bytes / GIB == pytest.approx(93.95, rel=0.02)
    assert g.allocator_reserved_bytes / GIB == pytest.approx(95.78, rel=0.02)
    assert g.peak().name in ("generation", "weight sync") and g.peak_bytes < g.allocator_peak_bytes


def test_reload_counts_checkpoint_tensors_not_bytes():
    from rltrain.plan.timing import sync_seconds, weight_tensors
    # Qwen3-0.6B: 28 layers x (q, k, v, o, gate, up, down, 2 RMSNorms, q/k norms) + embedding + final norm (tied head)
    x06 = read(qwen06b("rollout=vllm"))
    assert weight_tensors(x06.shape) == 28 * 11 + 2 == 310
    x4 = read(qwen06b("rollout=vllm", "model.builtin=qwen3-4b"))
    assert weight_tensors(x4.shape) == 36 * 11 + 2
    # measured 2026-11-26 on H200s: 0.16 s to reload the 4B's 8 GB, 0.09-0.16 s for the 0.6B's 1.2 GB
    assert ((sync_seconds(x4) - _sleep_wake(x4)) / (sync_seconds(x06) - _sleep_wake(x06))
            == pytest.approx(398 / 310))


def _sleep_wake(x, engine_gb=None) -> float:
    """vLLM's level-2 sleep and wake on one GPU, by hand: fixed + per GB of the engine's bf16 weights on the GPU."""
    from rltrain.plan.memory import full_params
    gb = 2 * full_params(x.shape) / 1e9 if engine_gb is None else engine_gb
    return cal.value("vllm_sleep_s") + cal.value("vllm_wake_s") + gb * cal.value("vllm_wake_s_per_gb")


def test_colocated_vllm_sleep_and_wake_grow_with_the_weights_and_the_hosts_gpus():
    from rltrain.plan.memory import full_params
    from rltrain.plan.timing import sync_seconds
    f, per_tensor = cal.value("vllm_rank_sync_factor"), cal.value("reload_s_per_tensor")
    tp2 = ("trainer.n_gpus_per_node=2", "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2")
    x4 = read(qwen06b("rollout=vllm", "model.builtin=qwen3-4b", *tp2))
    gb = 2 * full_params(x4.shape) / 1e9
    # two GPUs sleep and wake at once, a TP=2 engine holds half the weights on each; the reload is per tensor
    assert sync_seconds(x4) == pytest.approx(_sleep_wake(x4, gb / 2) * (1 + f) + 398 * per_tensor)
    # measured 0.54 and 0.61 s (the 4B colocated TP=2 runs, two H200s, 2026-11-26); one sleep and wake planned 0.37
    assert 0.45 < sync_seconds(x4) < 0.65
    # four GPUs, two TP=2 engines: x (1 + 3 f)
    x4x4 = read(qwen06b("rollout=vllm", "model.builtin=qwen3-4b", "trainer.n_gpus_per_node=4",
                        "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2"))
    assert sync_seconds(x4x4) == pytest.approx(_sleep_wake(x4, gb / 2) * (1 + 3 * f) + 398 * per_tensor)
    # the hf engine's pinned copies: its DP=2 weight sync is its one-GPU one's
    hf1 = read(qwen06b("rollout.engine=hf", "trainer.device=cuda"))
    hf2 = read(qwen06b("rollout.engine=hf", "trainer.device=cuda", "trainer.n_gpus_per_node=2"))
    assert sync_seconds(hf2) == pytest.approx(sync_seconds(hf1))


def test_split_sync_is_a_cost_per_tensor_plus_the_bytes_at_nccl_bandwidth():
    from rltrain.plan.memory import full_params
    from rltrain.plan.timing import sync_seconds
    x4 = read(qwen06b("rollout=vllm", "model.builtin=qwen3-4b", "trainer.colocate=false"))
    gb = 2 * full_params(x4.shape) / 1e9  # bf16 bytes of the 4B checkpoint, about 8.0 GB
    by_hand = 398 * cal.value("split_sync_s_per_tensor") + gb / cal.value("nccl_broadcast_gb_s")
    assert sync_seconds(x4) == pytest.approx(by_hand)
    # 0.26 s planned; the 4B split 2+2 measured 0.39 s on four H100s (2026-11-26), a per-GB rule 1.30 s
    assert 0.2 < sync_seconds(x4) < 0.35


def test_pipeline_forward_pays_the_fill_and_drain_of_its_schedule():
    import math

    from rltrain.plan.timing import step_seqs, train_seconds
    one = read(qwen06b())
    two = read(qwen06b("trainer.n_gpus_per_node=2", "actor.pipeline_parallel_size=2"))
    assert (one.dp, two.dp, two.pp) == (1, 1, 2)
    # forward micro-batches of whole rows (budget // seq_len rows each), the same on both
    m = math.ceil(step_seqs(one) / max(1, one.mb_tokens // one.seq_len))
    # each stage does half the layers, but m micro-batches through 2 stages take m + 1 stage slots:
    # (F / 2 + m L c / 2) (m + 1) / m against F + m L c on one GPU
    ratio = train_seconds(two)["old_log_prob"] / train_seconds(one)["old_log_prob"]
    assert ratio == pytest.approx((m + 1) / (2 * m))


def test_generation_host_cost_grows_with_the_wave():
    from rltrain.plan.timing import gen_seconds
    # host-bound decode (short sequences): each of the 64 steps costs a fixed part and a part per sequence of the wave,
    # so twice the sequences take less than twice the time, and an engine of a quarter of them more than a quarter
    # (measured on one H200: 1.27 s for 512 sequences, 0.46 s for 256; on four H200s 0.36 s for 128 sequences an
    # engine and 0.24 s for 64: the two runs vllm_step_s is solved from)
    a = read(qwen06b("rollout=vllm", "data.max_prompt_length=5", "rollout.max_response_length=64",
                     "data.train_batch_size=32"))
    b = read(qwen06b("rollout=vllm", "data.max_prompt_length=5", "rollout.max_response_length=64",
                     "data.train_batch_size=64"))
    d4 = read(qwen06b("rollout=vllm", "data.max_prompt_length=5", "rollout.max_response_length=64",
                      "data.train_batch_size=32", "trainer.n_gpus_per_node=4", "rollout.tensor_parallel_size=1"))
    fixed, per_seq = cal.value("vllm_step_s"), cal.value("vllm_seq_step_s")
    assert fixed > 0 and per_seq > 0
    ta, tb = gen_seconds(a, 4.8e12, 139.8 * GIB), gen_seconds(b, 4.8e12, 139.8 * GIB)
    td4 = gen_seconds(d4, 4.8e12, 139.8 * GIB)
    assert ta == pytest.approx(64 * (fixed + 256 * per_seq), rel=0.02)  # the prefill of 5-token prompts: tiny
    assert tb == pytest.approx(64 * (fixed + 512 * per_seq), rel=0.02)
    assert td4 == pytest.approx(64 * (fixed + 64 * per_seq), rel=0.02)
    assert 1.5 < tb / ta < 2.0 and ta / td4 < 4.0


def test_update_rate_by_width_not_by_tp():
    from rltrain.plan.timing import update_rate
    x06 = read(qwen06b())
    x4 = read(qwen06b("model.builtin=qwen3-4b"))
    r06 = update_rate(x06)
    assert r06 == pytest.approx(cal.value("update_tflops_none_none") * 1e12)
    # unfused (the default), the width's own exponent: the 4B's one-GPU GRPO update ran 26% above the compiled
    # layers' exponent's rate (2026-11-27); compiled, the bench rows' exponent
    assert update_rate(x4) / r06 == pytest.approx((2560 / 1024) ** cal.value("update_rate_width_exponent_none"))
    x4c, x06c = (read(qwen06b(*m, "actor.elementwise_fusion=compile")) for m in (("model.builtin=qwen3-4b",), ()))
    assert update_rate(x4c) / update_rate(x06c) == pytest.approx(
        (2560 / 1024) ** cal.value("update_rate_width_exponent"))
    # the unfused layers lose less to their elementwise kernels at the 4B's width than at the 0.6B's
    assert update_rate(x4) / update_rate(x4c) > update_rate(x06) / update_rate(x06c)
    # TP's loss is a cost per all-reduce (tests/plan/test_timing.py), not a fraction of the rate
    for fusion in ("none", "compile"):
        x1 = read(qwen06b("model.builtin=qwen3-4b", f"actor.elementwise_fusion={fusion}"))
        x2 = read(qwen06b("model.builtin=qwen3-4b", f"actor.elementwise_fusion={fusion}",
                          "actor.tensor_parallel_size=2", "trainer.n_gpus_per_node=2"))
        assert update_rate(x2) == pytest.approx(update_rate(x1))


# ------------------------------------------------------------------ the command line

def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_output(capsys):
    rc, out, _ = run_main(capsys, "--config-name", "grpo_qwen3", "trainer.n_gpus_per_node=1", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["fits"] is True and d["suggestions"] == [] and d["message"] == ""
    assert set(d["phase_seconds"]) == {"generation", "log-probs", "update", "weight sync", "step"}
    assert d["phase_seconds"]["step"] == pytest.approx(sum(d["phase_seconds"][k] for k in
                                                           ("generation", "log-probs", "update", "weight sync")),
                                                       rel=1e-3)
    g = d["gpus"][0]
    assert g["roles"] == ["actor", "ref", "rollout"] and g["fits"] is True
    assert g["peak_phase"] in g["phases"] and g["peak_gib"] == max(p["device_gib"] for p in g["phases"].values())
    assert g["phases"]["generation"]["parts_gib"]["vllm (weights + KV cache)"] == pytest.approx(0.5 * 79.18, abs=1e-3)
    assert "vllm (weights + KV cache)" not in g["phases"]["update (actor)"]["parts_gib"]  # asleep while training


def test_table_output(capsys):
    rc, out, _ = run_main(capsys, "--config-name", "grpo_qwen3", "trainer.n_gpus_per_node=1")
    assert rc == 0
    assert "GPU 0 (actor, ref, rollout): peak" in out and "seconds per step:" in out and "fits: yes" in out
    assert "across machines of one kind: " in out
    rc, out, _ = run_main(capsys, "--config-name", "grpo_qwen3", "trainer.n_gpus_per_node=1", "--json")
    d = json.loads(out)
    lo, hi = d["step_s_range"]
    assert 0.0 < d["host_share"] < 1.0 and lo < d["phase_seconds"]["step"] < hi
    assert f"{lo:.1f}-{hi:.1f} by machine" in d["summary"]


def test_refusal_names_gpu_phase_parts_and_keys_then_the_keys_fit(capsys):
    rc, out, err = run_main(capsys, "--config-name", "grpo_qwen3", *TOO_BIG, "--gpu-memory-gib", "80", "--json")
    assert rc == 2
    d = json.loads(out)
    assert d["fits"] is False
    msg = d["message"]
    assert msg.startswith("GPU 0 (actor, ref, rollout) does not fit") and "phase 'update (actor)'" in msg
    assert "actor activations" in msg and "set " in msg
    assert "rltrain: the plan does not fit" in err and "set " not in err  # the changes are in the JSON, once
    fitting = [s for s in d["suggestions"] if s["fits"]]
    assert fitting, d["suggestions"]
    assert all(s["peak_gib"] <= 80 for s in fitting)
    # each suggestion was re-planned: applying its keys plans as fitting, at the peak it announced
    for s in fitting:
        rc2, out2, _ = run_main(capsys, "--config-name", "grpo_qwen3", *TOO_BIG, *s["overrides"],
                                "--gpu-memory-gib", "80", "--json")
        assert rc2 == 0, s
        assert json.loads(out2)["peak_gib"] == pytest.approx(s["peak_gib"], abs=1e-3)


def test_check_raises_a_user_error_with_the_message():
    cfg = compose("grpo_qwen3", TOO_BIG)
    with pytest.raises(PlanError) as e:
        check(cfg, gpu_memory_gib=80)
    assert isinstance(e.value, UserError)
    assert "does not fit" in str(e.value) and "set actor." in str(e.value)
    plan = check(compose("grpo_qwen3", ["trainer.n_gpus_per_node=1"]), gpu_memory_gib=80)
    assert plan.fits


def test_one_gpu_fits_the_4b_beside_vllm_only_with_its_state_offloaded():
    # one 80 GiB GPU with vLLM beside the 4B actor: every change that fits moves optimizer state to the host
    p = make_plan(compose("grpo_qwen3", TOO_BIG + ["trainer.n_gpus_per_node=1"]), gpu_memory_gib=80)
    fitting = [s for s in p.suggestions if s.fits]
    assert not p.fits and fitting
    assert all({"actor.offload_while_rollout", "actor.optimizer_offload_fraction"} & set(s.overrides) for s in fitting)


def test_one_gpu_that_nothing_cheap_rescues_says_so():
    # the whole Qwen3-30B-A3B on one 80 GiB GPU beside vLLM: no single change or pair fits; the most helpful listed
    p = make_plan(compose("grpo_qwen3", ["trainer.n_gpus_per_node=1", "model.path=null",
                                         "model.builtin=qwen3-30b-a3b"]), gpu_memory_gib=80)
    assert not p.fits and p.suggestions and not any(s.fits for s in p.suggestions)
    m = p.more_gpus  # the fewest GPUs that fit, re-planned: its keys on top of the config fit at the peak announced
    assert m is not None and m.gpus >= 2
    assert m.overrides["trainer.n_gpus_per_node"] * m.overrides.get("trainer.nnodes", 1) == m.gpus
    assert "Nothing tried on these 1 GPU(s) fits" in p.refusal()
    assert f"More GPUs are needed: {m.gpus} GPUs fit with: set {m.keys}: peak {m.peak_gib:.1f} GiB" in p.refusal()
    again = make_plan(compose("grpo_qwen3", ["trainer.n_gpus_per_node=1", "model.path=null",
                                             "model.builtin=qwen3-30b-a3b"]
                              + [f"{k}={_fmt(v)}" for k, v in m.overrides.items()]), gpu_memory_gib=80)
    assert again.fits and again.peak_gib == pytest.approx(m.peak_gib, abs=1e-3)


SMALL_4B = ["model.builtin=qwen3-4b", "trainer.n_gpus_per_node=2", "actor.tensor_parallel_size=2",
            "rollout.gpu_memory_utilization=0.2"]


def test_nothing_on_up_to_the_searched_gpus_is_said_too(monkeypatch):
    import rltrain.plan.suggest as suggest

    # the 4B on 2 x 32 GiB: no key on 2 GPUs fits it, offload included; 4 GPUs do
    monkeypatch.setattr(suggest, "MAX_GPUS", 2)  # the search stops at 2 GPUs; this config needs 4
    p = make_plan(compose("grpo_qwen3", SMALL_4B), gpu_memory_gib=32, prompt_tokens=64, response_tokens=256)
    assert p.more_gpus is None and p.searched_gpus == 0  # already on 2: no larger count under the bound
    assert not any(s.fits for s in p.suggestions)
    monkeypatch.setattr(suggest, "MAX_GPUS", 4)
    p = make_plan(compose("grpo_qwen3", SMALL_4B), gpu_memory_gib=32, prompt_tokens=64, response_tokens=256)
    assert p.more_gpus.gpus == 4 and "More GPUs are needed: 4 GPUs" in p.refusal()
    # the 8B's weights and optimizer state alone (~130 GB) are more than 4 x 16 GiB hold
    p = make_plan(compose("grpo_qwen3", [*SMALL_4B, "model.builtin=qwen3-8b"]), gpu_memory_gib=16,
                  prompt_tokens=64, response_tokens=256)
    assert p.more_gpus is None and p.searched_gpus == 4 and "more GPUs are needed to split them" in p.refusal()
    assert "Nothing tried fits on up to 4 GPUs either" in p.refusal()


def test_rollout_keys_are_among_the_fixes():
    # the 8B's vLLM weights (16 GB) in a fifth of a 40 GiB GPU: the rollout's tensor parallelism is what fits
    cfg = ["model.builtin=qwen3-8b", "trainer.n_gpus_per_node=8", "actor.tensor_parallel_size=8"]
    p = make_plan(compose("grpo_qwen3", cfg), gpu_memory_gib=40, prompt_tokens=64, response_tokens=256)
    fitting = [s for s in p.suggestions if s.fits]
    assert fitting and all("rollout.tensor_parallel_size" in s.overrides for s in fitting)
    assert "set " + fitting[0].keys in p.refusal() and "rollout.tensor_parallel_size=" in p.refusal()
    again = make_plan(compose("grpo_qwen3", cfg + [f"{k}={_fmt(v)}" for k, v in fitting[0].overrides.items()]),
                      gpu_memory_gib=40, prompt_tokens=64, response_tokens=256)
    assert again.fits and again.peak_gib == pytest.approx(fitting[0].peak_gib, abs=1e-3)


def test_cli_prints_each_fix_once_beside_the_gpu_kind_and_takes_flags_anywhere(capsys):
    cfg = ["model.builtin=qwen3-8b", "trainer.n_gpus_per_node=8", "actor.tensor_parallel_size=8"]
    flags = ["--gpu-memory-gib", "40", "--prompt-tokens", "64", "--response-tokens", "256"]
    rc, out, err = run_main(capsys, "--config-name", "grpo_qwen3", *cfg, *flags)
    assert rc == 2
    fixes = [line for line in out.splitlines() if line.startswith("  set ")]
    assert fixes and len(set(fixes)) == len(fixes) and out.count("Changes that fit") == 1
    assert "set " not in err and len(err.strip().splitlines()) == 1 and "8 x H100 80GB HBM3 (40.0 GiB each)" in err
    assert "fits: NO (planned for 8 x H100 80GB HBM3, 40.0 GiB each; --device h200 plans for H200)" in out
    # flags after and between the overrides: the same plan (of a config that fits: no search for changes)
    fit = flags[2:] + ["--device", "h200"]
    rc2, out2, _ = run_main(capsys, "--config-name", "grpo_qwen3", *cfg, *fit)
    assert rc2 == 0
    assert "fits: yes (planned for 8 x H200, 139.8 GiB each; --device h100 plans for H100 80GB HBM3)" in out2
    assert run_main(capsys, "--config-name", "grpo_qwen3", cfg[0], *fit[:2], *cfg[1:], *fit[2:])[:2] == (rc2, out2)


def test_a_forward_budget_too_large_is_refused_naming_its_key():
    # actor.log_prob_max_tokens_per_micro_batch at 4M tokens: the forward passes' working memory (one layer's, at
    # every token of the step at once) is the peak; halving that key is what fits, the update's budget does not help
    big = ["data.train_batch_size=256", "rollout.n=16", "data.max_prompt_length=512",
           "rollout.max_response_length=1024", "actor.log_prob_max_tokens_per_micro_batch=4000000"]
    p = make_plan(qwen06b(*big), gpu_memory_gib=80)
    assert not p.fits and "phase 'log-probs (forward)'" in p.refusal() and "forward working memory" in p.refusal()
    fitting = [s for s in p.suggestions if s.fits]
    # (pairs with it may follow; every change that fits includes it)
    assert fitting and all("actor.log_prob_max_tokens_per_micro_batch" in s.overrides for s in fitting), \
        [s.overrides for s in p.suggestions]
    assert any(set(s.overrides) == {"actor.log_prob_max_tokens_per_micro_batch"} for s in fitting)
    assert all(s.overrides["actor.log_prob_max_tokens_per_micro_batch"] < 4_000_000 for s in fitting)


def test_kv_cache_too_small_is_refused():
    p = make_plan(qwen06b("rollout.gpu_memory_utilization=0.05"), gpu_memory_gib=80, suggest=False)
    assert not p.fits
    assert "cannot hold one sequence" in p.refusal()


def test_bad_key_and_bad_value_exit_2(capsys):
    rc, _, err = run_main(capsys, "--config-name", "grpo_qwen3", "actor.no_such_key=1")
    assert rc == 2 and err.startswith("rltrain:") and "no_such_key" in err
    rc, _, err = run_main(capsys, "--config-name", "grpo_qwen3", "rollout.n=0")
    assert rc == 2 and "rollout.n=0 is impossible" in err


@pytest.mark.parametrize("reads_data", [False, True])
def test_imports_no_gpu_library_and_starts_nothing(reads_data):
    """--worst-case reads no data: not even transformers is imported. Reading the data (the default) tokenizes it
    as the trainer does, which may import transformers (and through torch, triton's Python module) when the model's
    tokenizer is cached here, but never vLLM, Ray or megatron, and no CUDA."""
    flags = "" if reads_data else ", '--worst-case'"
    allowed = "('transformers', 'triton')" if reads_data else "()"
    code = ("import sys; from rltrain.plan.__main__ import main; rc = main(['--config-name', 'grpo_qwen3', "
            f"'--json'{flags}]); bad = [m for m in ('vllm', 'ray', 'megatron', 'triton', 'transformers') "
            f"if m in sys.modules and m not in {allowed}]; "
            "import torch; assert not torch.cuda.is_initialized(); print('BAD', bad, 'RC', rc)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert "BAD [] RC 0" in r.stdout, r.stdout + r.stderr  # a fresh process: the schema registered by the CLI


def test_impossible_placement_exits_2(capsys):
    rc, _, err = run_main(capsys, "--config-name", "grpo_qwen3", "trainer.n_gpus_per_node=3",
                          "actor.tensor_parallel_size=2")
    assert rc == 2 and err.startswith("rltrain:")


def test_typed_dataclass_config_is_read():
    from rltrain.config.schema import RLConfig

    cfg = RLConfig()
    cfg.model.builtin = "qwen3-0.6b"
    x = read(cfg)
    assert x.shape.hidden_size == 1024 and x.mb_tokens == 16384


def test_missing_checkpoint_names_the_fix(capsys):
    rc, _, err = run_main(capsys, "--config-name", "grpo_qwen3", "model.path=checkpoints/not_there/hf")
    assert rc == 2 and "model.builtin=qwen3-4b" in err


def test_free_cache_engine_false_keeps_the_engine_resident_and_pays_no_sleep_or_wake():
    """rollout.free_cache_engine=false on the 0.6B colocated with vLLM on one H100 (80 GiB card, 0.5 of it to vLLM),
    worked by hand: every training phase holds the engine's 0.5 x 79.18 GiB pool and its CUDA graphs beside what it
    held before; the weight sync is the reload of the 310 tensors alone (the sleep and wake are not
    paid); actor.recompute_old_logprobs=false takes the old-log-prob pass out of the log-probs phase."""
    from rltrain.plan.timing import sync_seconds

    base = ["rollout=vllm", "rollout.gpu_memory_utilization=0.5", "trainer.use_ray=true"]
    asleep = make_plan(qwen06b(*base), device="h100", suggest=False)
    awake = make_plan(qwen06b(*base, "rollout.free_cache_engine=false"), device="h100", suggest=False)
    g0, g1 = asleep.gpus[0], awake.gpus[0]
    pool = 0.5 * 79.18 * GIB
    graphs = cal.value("vllm_non_torch_gib") * GIB
    assert [p.name for p in g0.phases] == [p.name for p in g1.phases]
    for p0, p1 in zip(g0.phases, g1.phases):
        if p0.name in ("generation", "weight sync"):  # awake in both runs
            assert p1.parts == p0.parts and p1.non_torch == p0.non_torch
            continue
        assert "vllm (weights + KV cache)" not in p0.parts  # asleep: nothing of the engine
        assert p1.parts == {**p0.parts, "vllm (weights + KV cache)": pytest.approx(pool)}
        assert p1.non_torch == {**p0.non_torch, "vllm CUDA graphs + workspaces": graphs}
        assert p1.torch_bytes - p0.torch_bytes == pytest.approx(pool)
    assert g0.sleep_frees_bytes == pytest.approx(pool + graphs) and g1.sleep_frees_bytes == 0.0
    assert g1.peak_bytes >= g0.peak_bytes
    assert any("free_cache_engine=false" in n for n in g1.notes)
    # time: the weight sync without the engine's sleep and wake
    reload = 310 * cal.value("reload_s_per_tensor")
    assert sync_seconds(awake.inputs) == pytest.approx(reload)
    assert sync_seconds(asleep.inputs) == pytest.approx(reload + _sleep_wake(asleep.inputs))
    assert asleep.seconds["weight sync"] - awake.seconds["weight sync"] == pytest.approx(_sleep_wake(asleep.inputs))
    assert asleep.seconds["step"] - awake.seconds["step"] == pytest.approx(_sleep_wake(asleep.inputs))
    # and the on-policy update's old log-probs: the log-probs phase loses the old-log-prob pass, nothing else
    onp = make_plan(qwen06b(*base, "actor.recompute_old_logprobs=false", "actor.ppo_mini_batch_size=32",
                            "data.train_batch_size=32"), device="h100", suggest=False)
    ref = make_plan(qwen06b(*base, "actor.ppo_mini_batch_size=32", "data.train_batch_size=32"), device="h100",
                    suggest=False)
    assert onp.seconds["detail/old_log_prob"] == 0.0 < ref.seconds["detail/old_log_prob"]
    assert ref.seconds["log-probs"] - onp.seconds["log-probs"] == pytest.approx(ref.seconds["detail/old_log_prob"])
    assert onp.seconds["update"] == pytest.approx(ref.seconds["update"])


@pytest.mark.parametrize("layout, scaled", [
    (["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2"], True),
    (["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=4"], True),
    (["trainer.n_gpus_per_node=2", "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2"], False),
    (["trainer.n_gpus_per_node=2", "actor.tensor_parallel_size=1"], False),
    (["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=1"], False),
    # split: the training group's TP x DP has no measured run; planned without the factor
    (["trainer.n_gpus_per_node=8", "trainer.colocate=false", "actor.tensor_parallel_size=2",
      "rollout.tensor_parallel_size=2"], False),
])
def test_the_tp_x_dp_layout_factor_scales_the_host_floors_of_that_layout_only(layout, scaled):
    """Colocated actor TP > 1 with DP > 1 (TP groups side by side): the host's floors and fixed costs of every phase
    (forward and update floors, per optimizer step and call, vLLM's per-sequence decode cost) and the weight sync at
    tp_dp_layout_factor, the step their sum; TP alone, DP alone, a split placement: unchanged. Worked against the same
    config with the factor at 1 and each of those constants times it."""
    import contextlib
    import dataclasses as dc

    constant = cal.override
    from rltrain.plan.timing import phase_seconds, tp_dp_factor

    cfg = compose("grpo_qwen3", ["model=qwen3_0.6b_random", "rollout=vllm", "trainer.device=cuda", *layout])
    x = read(cfg)
    x = dc.replace(x, mean_prompt_length=None)
    dev = cal.DEVICES["h200"]
    with constant("tp_dp_layout_factor", 1.0):
        base = phase_seconds(x, dev.hbm_bytes_per_s, dev.total_gib * GIB)
    f = cal.value("tp_dp_layout_factor")
    assert f > 1.5  # the layout's runs took 1.18-1.83x, mostly host time: the fitted value is no placeholder
    got = phase_seconds(x, dev.hbm_bytes_per_s, dev.total_gib * GIB)
    want = f if scaled else 1.0
    assert tp_dp_factor(x) == want
    assert set(got) == set(base)
    host = ("fwd_mb_layer_s", "fwd_row_layer_s", "old_logprob_mb_s", "update_mb_layer_s", "update_step_layer_s",
            "update_call_layer_s", "vllm_step_s", "vllm_seq_step_s", "hf_layer_step_s")
    with contextlib.ExitStack() as stack:
        stack.enter_context(constant("tp_dp_layout_factor", 1.0))
        for name in host:
            stack.enter_context(constant(name, cal.value(name) * want))
        alt = phase_seconds(x, dev.hbm_bytes_per_s, dev.total_gib * GIB)
    for k in base:
        if k not in ("weight sync", "step"):
            assert got[k] == pytest.approx(alt[k], rel=1e-12), k
    assert got["weight sync"] == pytest.approx(base["weight sync"] * want, rel=1e-12)
    assert got["step"] == pytest.approx(sum(got[k] for k in ("generation", "log-probs", "update", "weight sync")))
    # the plan says so where it applies it
    plan = make_plan(cfg, gpu_memory_gib=139.8)
    said = [w for w in plan.warnings if "measured on TP=2 x DP=2" in w]
    assert bool(said) == scaled, plan.warnings


def test_a_gpu_bound_tp_x_dp_step_loses_little_to_the_layout_factor():
    """The factor is the host's (the TP peers wait on each other's launches): a TP=2 x DP=2 step of long sequences,
    bound by its FLOPs, grows by far less than the factor; the short GRPO step of the measured runs by most of it."""
    import dataclasses as dc

    constant = cal.override
    from rltrain.plan.timing import phase_seconds

    dev = cal.DEVICES["h200"]
    f = cal.value("tp_dp_layout_factor")
    growth = {}
    # long: 16k-token responses, whose KV cache reads bound the decode of a TP=2 engine's 32 sequences (at 8k its
    # host work, vLLM's fixed cost per step and the sequences', is the larger)
    for name, extra in (("short", ["rollout.max_response_length=64"]),
                        ("long", ["rollout.max_response_length=16384", "data.train_batch_size=8",
                                  "actor.ppo_mini_batch_size=8"])):
        cfg = compose("grpo_qwen3", ["model=qwen3_0.6b_random", "rollout=vllm", "trainer.device=cuda",
                                     "trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=2",
                                     "rollout.tensor_parallel_size=2", "data.max_prompt_length=64", *extra])
        x = dc.replace(read(cfg), mean_prompt_length=None)
        with constant("tp_dp_layout_factor", 1.0):
            base = phase_seconds(x, dev.hbm_bytes_per_s, dev.total_gib * GIB)["step"]
        growth[name] = phase_seconds(x, dev.hbm_bytes_per_s, dev.total_gib * GIB)["step"] / base
    assert growth["short"] > 1 + 0.6 * (f - 1)
    assert growth["long"] < 1 + 0.3 * (f - 1)


def test_offload_while_rollout_empties_the_engines_phases_and_costs_two_copies():
    """actor.offload_while_rollout: generation holds none of the actor's state, the weight sync its weights alone (the
    export reads them), the training phases all of it; the step pays the state's copy out and back."""
    from rltrain.plan.timing import offload_seconds

    x = read(qwen06b("actor.use_kl_loss=false", "rollout=vllm", "actor.offload_while_rollout=true"))
    P = 596_049_920
    phases = {p.name.split(",")[0]: p for p in plan_gpus(x, 80 * GIB)[0].phases}
    actor = ("actor weights", "actor fp32 master", "actor optimizer (AdamW)")
    assert not set(actor) & set(phases["generation"].parts)
    assert [k for k in actor if k in phases["weight sync"].parts] == ["actor weights"]
    assert all(k in phases["update (actor)"].parts and k in phases["log-probs (forward)"].parts for k in actor)
    assert offload_seconds(x) == pytest.approx(2 * 14 * P / (cal.value("host_copy_gb_s") * 1e9))
    assert offload_seconds(read(qwen06b("actor.use_kl_loss=false", "rollout=vllm"))) == 0.0


def test_the_planners_mirrored_constants_equal_the_runtimes():
    """plan/ imports no runtime code (tests/test_architecture.py), so plan/memory.py restates three of its
    numbers; each must equal the one the run uses."""
    from rltrain.models.megatron.optim import STEP_CHUNK_BYTES
    from rltrain.ops.chunking import CUDA_CHUNK_BUDGET_BYTES
    from rltrain.plan import memory
    from rltrain.rollout.vllm_args import MAX_NUM_SEQS

    assert memory.OPTIM_STEP_CHUNK_BYTES == STEP_CHUNK_BYTES
    assert memory.TORCH_HEAD_CHUNK_BYTES == CUDA_CHUNK_BUDGET_BYTES
    assert memory.VLLM_MAX_NUM_SEQS == MAX_NUM_SEQS
