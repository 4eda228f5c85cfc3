"""rltrain.plan with LoRA (actor.lora.rank > 0), worked by hand on Qwen3-0.6B's shape: the base frozen in bf16 (no
master, no AdamW state, no gradients, no LM-head weight grad), the adapters with all of those, no reference model,
one vLLM adapter slot."""

from __future__ import annotations

from rltrain.config.entry import compose_config as compose
from rltrain.plan import make_plan
from rltrain.plan.inputs import read
from rltrain.plan.memory import head_bytes, train_static, update_phase, vllm_parts

P = 596_049_920  # Qwen3-0.6B's parameters (tests/plan/test_plan.py)
# one layer's adapters at rank r, every target: q 1024 -> 2048, k/v 1024 -> 1024, o 2048 -> 1024, gate/up 1024 -> 3072,
# down 3072 -> 1024, each r x (in + out)
PER_RANK_LAYER = (1024 + 2048) + 2 * (1024 + 1024) + (2048 + 1024) + 2 * (1024 + 3072) + (3072 + 1024)


def qwen06b(*extra: str):
    return read(compose("grpo_qwen3", ["model=qwen3_0.6b_random", "trainer.n_gpus_per_node=1", "actor.use_kl_loss=true",
                                       *extra]))


def test_lora_static_memory_by_hand():
    x = qwen06b("actor.lora.rank=32")
    A = 28 * 32 * PER_RANK_LAYER
    assert A == 28 * 32 * 22_528
    assert train_static(x, 0) == {"actor weights (frozen base)": 2 * P, "actor LoRA adapters": 2 * A,
                                  "actor LoRA fp32 master": 4 * A, "actor LoRA optimizer (AdamW)": 8 * A}
    # TP=2: the split halves (B of q/k/v/gate/up, A of o/down) halve, the others stay whole
    x2 = qwen06b("actor.lora.rank=32", "actor.tensor_parallel_size=2", "trainer.n_gpus_per_node=2",
                 "rollout.tensor_parallel_size=2")
    split = (2048 + 1024 + 1024) + 2048 + 2 * 3072 + 3072  # q, k, v out; o in; gate, up out; down in
    assert train_static(x2, 0)["actor LoRA adapters"] == 2 * 28 * 32 * (PER_RANK_LAYER - split / 2)
    # attention only
    xa = qwen06b("actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]")
    assert train_static(xa, 0)["actor LoRA adapters"] == 2 * 28 * 8 * ((1024 + 2048) + (1024 + 1024))


def test_lora_update_holds_adapter_grads_and_no_head_weight_grad():
    full, lora = qwen06b("actor.recompute_activations=true"), qwen06b("actor.recompute_activations=true",
                                                                     "actor.lora.rank=32")
    T = 4096
    assert head_bytes(full, T, backward=True) - head_bytes(lora, T, backward=True) == 4 * 151_936 * 1024
    A = 28 * 32 * PER_RANK_LAYER
    step = update_phase(lora, 0, train_static(lora, 0), critic=False)
    grads = {k: v for k, v in step.parts.items() if "gradients" in k}
    assert list(grads.values()) in ([2 * A], [4 * A])  # the backward's bf16 grads or the step's fp32 ones
    assert update_phase(full, 0, train_static(full, 0), critic=False).torch_bytes > step.torch_bytes + 14 * P


def test_lora_plan_is_smaller_and_vllm_holds_one_adapter_slot():
    full = make_plan(compose("grpo_qwen3", ["model=qwen3_0.6b_random", "rollout=vllm", "actor.use_kl_loss=true"]),
                     device="h100")
    lora = make_plan(compose("grpo_qwen3", ["model=qwen3_0.6b_random", "rollout=vllm", "actor.use_kl_loss=true",
                                            "actor.lora.rank=20"]), device="h100")
    # the base's fp32 master + AdamW (this rank's share: sharded over DP) and the reference, less the adapters'
    assert lora.peak_gib < full.peak_gib - (12 / full.inputs.dp + 2) * P / 2**30
    x = qwen06b("rollout=vllm", "actor.lora.rank=20", "rollout.kv_cache_memory_gb=4")
    base = qwen06b("rollout=vllm", "rollout.kv_cache_memory_gb=4")
    slot = 28 * 32 * PER_RANK_LAYER  # vLLM's max_lora_rank for rank 20 is 32
    extra = vllm_parts(x, 80 * 2**30)[0]["vllm (weights + KV cache)"] - vllm_parts(base, 80 * 2**30)[0][
        "vllm (weights + KV cache)"]
    assert extra == 2 * slot
