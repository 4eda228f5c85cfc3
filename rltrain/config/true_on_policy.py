"""The rule of rollout.true_on_policy (issue 60): the combinations under which the rollout engine's and the actor's
log-probs cannot be the same bits, each with its reason and fix. Config only: validate.py calls it with the rest.
"""

from __future__ import annotations


def true_on_policy_errors(cfg) -> list[str]:
    """Where rollout.true_on_policy cannot make the engine's and the actor's log-probs the same bits (a composed
    RLConfig, typed): one message naming every reason and its fix, or none."""
    r, a, t = cfg.rollout, cfg.actor, cfg.trainer
    if not r.true_on_policy:
        return []
    why = []
    if r.engine == "vllm" and t.device == "cpu":
        why.append("rollout.engine=vllm on CPU (vLLM's batch-invariant kernels are CUDA ones): use rollout.engine=hf")
    if a.tensor_parallel_size > 1 or a.expert_parallel_size > 1 or r.tensor_parallel_size > 1:
        why.append("tensor or expert parallel size > 1 (a reduction split over ranks adds their partial sums in "
                   "another order than one device): set actor.tensor_parallel_size, actor.expert_parallel_size and "
                   "rollout.tensor_parallel_size to 1")
    if a.elementwise_fusion != "none":
        why.append(f"actor.elementwise_fusion={a.elementwise_fusion} (fused kernels compute the SiLU and the adds "
                   "their own way): set actor.elementwise_fusion=none")
    if r.engine == "vllm" and (r.top_k > 0 or r.top_p < 1.0):
        why.append("rollout.top_k / rollout.top_p with rollout.engine=vllm (vLLM masks them on a path its batch size "
                   "picks: a Triton kernel from 8 rows, a sort below): set them to -1 / 1.0, or use rollout.engine=hf")
    if r.engine == "vllm" and t.device != "cpu" and a.moe_routing_replay:
        why.append("actor.moe_routing_replay=true with rollout.engine=vllm (vLLM 0.26's model runner V2, whose sampler "
                   "the mode matches, does not capture routed experts; with the key on the actor computes the "
                   "router's logits as the engine does, so it routes as the engine did without replay): set "
                   "actor.moe_routing_replay=false or null")
    if not t.fused_linear_logprob:
        why.append("trainer.fused_linear_logprob=False (the exact log-prob is the fused head's mode): set "
                   "trainer.fused_linear_logprob=true")
    elif r.engine != "vllm" and t.fused_linear_logprob_backend not in ("auto", "torch"):
        why.append(f"trainer.fused_linear_logprob_backend={t.fused_linear_logprob_backend} with rollout.engine="
                   f"{r.engine} (its exact head is the fused head's batch-invariant mode on the torch backend; the "
                   "Triton and CuTe heads tile the vocab their own way; with vLLM any backend: vLLM's kernels give "
                   "the value): set trainer.fused_linear_logprob_backend=torch")
    if int(a.lora.rank) > 0:
        why.append(f"actor.lora.rank={a.lora.rank} (the adapters' products are plain GEMMs on both sides, whose rows "
                   "depend on the batch): set actor.lora.rank=0")
    if not why:
        return []
    return ["rollout.true_on_policy=true cannot make the engine's and the actor's log-probs equal with "
            + "; ".join(why)]
