"""The rules of issue 59's keys: where the actor's state may leave the GPU (actor.offload_while_rollout), where a
model's weights may be made by the actor's own ranks (model.init=engine), and the MoE run levers
(actor.moe_routing_replay_compare, rollout.direct_expert_sync_after). Config only: validate.py calls it with the rest.
"""

from __future__ import annotations

MODEL_INITS = ("hf", "engine")  # model.init


def scale_errors(cfg) -> list[str]:
    """Every problem of these keys in `cfg` (a composed RLConfig, typed or DictConfig), each naming the fix."""
    m, a, r, t, alg = cfg.model, cfg.actor, cfg.rollout, cfg.trainer, cfg.algorithm
    e: list[str] = []
    if m.init not in MODEL_INITS:
        e.append(f"model.init={m.init!r} is not allowed; choose one of {', '.join(MODEL_INITS)}")
    elif m.init == "engine":  # the actor's ranks make a preset's weights: nothing else starts from them
        if m.builtin is None:
            e.append("model.init=engine makes a built-in preset's random weights on the actor's GPUs; a checkpoint "
                     "(model.path) is loaded as it is: set model.builtin or model.init=hf")
        if a.use_kl_loss or alg.use_kl_in_reward:
            e.append("model.init=engine builds no reference model (it would need the actor's random weights): set "
                     "actor.use_kl_loss=false and algorithm.use_kl_in_reward=false, or model.init=hf")
        if alg.adv_estimator == "gae":
            e.append("model.init=engine builds no critic (algorithm.adv_estimator=gae): use model.init=hf")
        if a.lora.rank:
            e.append("model.init=engine with actor.lora.rank > 0: the rollout engine's base would be dummy weights "
                     "and a LoRA sync brings the adapters only; use model.init=hf")
    if a.offload_while_rollout and not (t.colocate or not t.use_ray):
        e.append("actor.offload_while_rollout=true moves the actor's state off the GPUs while a colocated rollout "
                 "engine uses them; with trainer.colocate=false the engines have GPUs of their own: set it to false")
    if a.offload_while_rollout and not r.free_cache_engine:
        e.append("actor.offload_while_rollout=true with rollout.free_cache_engine=false: the engine stays awake "
                 "through the update, which needs the actor's state on the GPU; set one of them to its default")
    if a.moe_routing_replay_compare and a.moe_routing_replay is False:
        e.append("actor.moe_routing_replay_compare=true compares the replayed log-probs with computed routing's: it "
                 "needs actor.moe_routing_replay=true (or null on an MoE model with vLLM on GPU)")
    if r.direct_expert_sync_after < -1:
        e.append(f"rollout.direct_expert_sync_after={r.direct_expert_sync_after} is impossible; it must be >= 0 (syncs "
                 "through vLLM's loader first) or -1 (never write the experts directly)")
    return e
