"""One worker process hosting any subset of roles (actor, ref, critic, rollout, teacher) on the same devices.

Colocated mode puts all roles in one group (the rollout engine sleeps while training unless
rollout.free_cache_engine=false, weights sync in process); split mode makes one group for training roles and one
for rollout. No Ray here (see group.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from rltrain.config.schema import ActorConfig, ModelConfig, RLConfig, TeacherConfig, TrainerConfig
from rltrain.data.batch import Batch
from rltrain.models.lora import LoraSpec
from rltrain.rollout.sync import build_weight_sync, sync_method
from rltrain.utils.distenv import rendezvous_host
from rltrain.utils.plain import load_plain, save_plain
from rltrain.utils.profiling import WorkerProfiler, phase
from rltrain.utils.seeding import rng_state, seed_all, set_rng_state
from rltrain.utils.stacks import enable_stack_dumps
from rltrain.workers.base import Worker, publish_dist_env

ROLES = ("actor", "ref", "critic", "rollout", "teacher")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
    return device


def init_device(device: str, num_params: int) -> str:
    """Where a built-in preset's random init runs: on the GPU when training there and the fp32 model plus its
    bf16 copy (6 bytes a parameter) take at most half the GPU's memory, else on the CPU. The CPU's generator is
    serial: a Qwen3-4B-shaped init took minutes in each Ray worker (one thread) before vLLM could start; the GPU's
    takes seconds. The two give different (equally distributed) weights for one seed, so the rule reads the
    card's total memory, the same on every rank of a run of one GPU kind, never its free memory, which can differ by
    rank (a run mixing GPU kinds would need the CPU init: the GPU's stream depends on its SM count)."""
    if device != "cuda" or not torch.cuda.is_available():
        return "cpu"
    index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    return f"cuda:{index}" if 6 * num_params <= total / 2 else "cpu"


def initial_hf_model(model_cfg: ModelConfig, tokenizer, seed: int, dtype: torch.dtype, device: str = "cpu"):
    """The transformers model every role starts from: random init of a built-in preset (seeded, so all
    ranks and roles agree) or the pretrained weights at model.path.
    device: the run's training device; a preset's init runs where `init_device` says and the model returned
    is on the CPU either way."""
    from transformers import AutoModelForCausalLM

    from rltrain.models.presets import model_hf_config
    from rltrain.utils.flops import num_params

    hf_config = model_hf_config(model_cfg, tokenizer)
    if model_cfg.builtin is not None:
        where = init_device(device, num_params(hf_config))
        torch.manual_seed(seed)  # seeds the CPU and every GPU generator
        with torch.device(where):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        # small init keeps the random policy close to uniform over the vocab
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        model = model.to(dtype).to("cpu")
        if where != "cpu":
            torch.cuda.empty_cache()  # the init's blocks go back before the roles and the engine allocate
    else:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=dtype,
                                                     trust_remote_code=model_cfg.trust_remote_code)
    return hf_config, model


def build_teacher(teacher: TeacherConfig, *, student: ModelConfig, actor: ActorConfig, trainer: TrainerConfig,
                  device: str, seed: int):
    """This rank's distillation teacher (workers/teacher.py): an ActorRole of role "ref" (forward-only;
    `compute_logprobs`) over the teacher's weights, at teacher_parallel's sizes and
    teacher.log_prob_max_tokens_per_micro_batch (null: the actor's forward budget)."""
    from rltrain.data.tokenizer import load_tokenizer
    from rltrain.models.presets import model_hf_config
    from rltrain.workers.actor import ActorRole
    from rltrain.workers.teacher import load_checkpoint_shard, teacher_parallel, teacher_source

    src = teacher_source(teacher, student)
    dtype = torch.float32 if device == "cpu" else getattr(torch, teacher.dtype)
    tokenizer = load_tokenizer(src.tokenizer)
    if src.checkpoint is not None:  # the shape only: the weights are the checkpoint's shards
        hf_config, sd = model_hf_config(src.model, tokenizer), None
    else:  # seed + 1: a preset teacher's random init is not the student's (same seed, same shape)
        hf_config, hf_model = initial_hf_model(src.model, tokenizer, seed + 1, dtype, device)
        sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
        del hf_model
    tp, pp, ep = teacher_parallel(teacher, actor)
    budget = teacher.log_prob_max_tokens_per_micro_batch or actor.log_prob_max_tokens_per_micro_batch
    role_cfg = dataclasses.replace(actor, tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep,
                                   log_prob_max_tokens_per_micro_batch=budget)
    role = ActorRole(hf_config, sd, role="ref", actor_cfg=role_cfg, trainer_cfg=trainer, device=device, dtype=dtype,
                     seed=seed, total_steps=1)
    if src.checkpoint is not None:
        load_checkpoint_shard(role.engine, src)
    return role


def routing_replay(cfg: RLConfig, hf_config, device: str) -> bool:
    """actor.moe_routing_replay for this run's model, decided once (the rollout role records the routing, the actor
    replays it; both read this): as set, or (null) on for an MoE model served by vLLM on GPU in a placement that
    supports it (docs/moe.md: where it was measured), off under rollout.true_on_policy (the actor computes the engine's
    router logits bit for bit, so it routes as the engine did without replay; vLLM 0.26's model runner V2, whose
    sampler the mode matches, captures no routing). True for a dense model is a user error."""
    from rltrain.utils.errors import UserError
    from rltrain.utils.flops import sparse_layers

    a, r = cfg.actor, cfg.rollout
    moe = any(sparse_layers(hf_config))
    if a.moe_routing_replay and not moe:
        raise UserError(f"actor.moe_routing_replay=true needs a Mixture-of-Experts model; model_type="
                        f"{getattr(hf_config, 'model_type', '?')!r} has no sparse layers: set it to false")
    if a.moe_routing_replay is not None:
        return bool(a.moe_routing_replay)
    return (moe and r.engine == "vllm" and device == "cuda" and not r.multi_turn.enable and not r.true_on_policy
            and a.pipeline_parallel_size == 1 and a.tensor_parallel_size == 1)


def read_rank_state(path: str, rank: int, layout: dict[str, int] | None) -> tuple[dict, list[dict]]:
    """(this rank's saved state, the saved states it takes optimizer pieces from) of the checkpoint at `path`. Written
    with this rank's layout (compat.parallel_layout): its own file, no others. Written at another data-parallel size
    (the same TP, PP and EP sizes): the model and RNG state of a rank at this rank's TP/PP/EP coordinates (the same
    data-parallel rank where there is one), and every rank's file at this rank's TP/PP coordinates, memory-mapped
    (each rank reads only its own pieces of them). Another TP, PP or EP size is refused (UserError)."""
    from rltrain.utils.errors import UserError

    own = os.path.join(path, f"worker_rank{rank}.pt")
    if os.path.exists(own):
        sd = load_plain(own, mmap=True)
        if layout is None or sd.get("layout") in (None, layout):
            return sd, []
    files = sorted(f for f in os.listdir(path) if f.startswith("worker_rank") and f.endswith(".pt"))
    saved = [load_plain(os.path.join(path, f), mmap=True) for f in files]
    saved = [s for s in saved if s.get("layout")]
    sizes = ("tp_size", "pp_size", "ep_size")
    other = next((s["layout"] for s in saved if any(s["layout"][k] != layout[k] for k in sizes)), None)
    if other is not None or not saved:
        raise UserError(f"checkpoint {path} was written with tensor/pipeline/expert parallel sizes "
                        f"{tuple(other[k] for k in sizes) if other else '(unknown)'}; this run has "
                        f"{tuple(layout[k] for k in sizes)}: resume with the same actor.tensor_parallel_size, "
                        "pipeline_parallel_size and expert_parallel_size (only the data-parallel size may change)")
    mine = [s for s in saved if (s["layout"]["tp"], s["layout"]["pp"]) == (layout["tp"], layout["pp"])]
    same_ep = [s for s in mine if s["layout"]["ep"] == layout["ep"]]
    base = next((s for s in same_ep if s["layout"]["dp"] == layout["dp"]), same_ep[0])
    return base, mine


class HybridWorker(Worker):
    def __init__(self, cfg: RLConfig, roles: list[str], rank: int = 0, world_size: int = 1):
        unknown = set(roles) - set(ROLES)
        assert not unknown, unknown
        super().__init__(rank=rank, world_size=world_size)
        enable_stack_dumps()  # a Ray worker that hangs prints where on `kill -USR1 <pid>` (utils/stacks.py)
        self.cfg, self.roles = cfg, list(roles)
        self.actor = self.ref = self.critic = self.rollout = self.teacher = None
        self.offload_actor = False  # actor.offload_while_rollout in a colocated worker (setup)
        self.layout: dict[str, int] | None = None  # the training roles' mesh (compat.parallel_layout), set in setup
        self.profiler = WorkerProfiler()  # trainer.profile_steps: started and stopped by the driver around a step

    def setup(self, master_addr: str, master_port: int, local_rank: int = 0) -> dict:
        """Build this rank's roles. local_rank: the CUDA ordinal to use (workers/placement.py decides it).
        Returns {"rank", "device", "roles", "mesh"}; mesh is megatron's {"tp", "pp", "dp"} of this rank
        (None without a training role), from which the group builds its data-parallel dispatch."""
        cfg = self.cfg
        publish_dist_env(rank=self.rank, world_size=self.world_size, master_addr=master_addr,
                         master_port=master_port, local_rank=local_rank)
        t = cfg.trainer
        seed = t.seed
        seed_all(seed)
        torch.set_num_threads(max(1, int(os.environ.get("RLTRAIN_TORCH_THREADS", torch.get_num_threads()))))
        self.device = resolve_device(t.device)
        if self.device == "cuda":
            torch.cuda.set_device(local_rank)
        train_dtype = torch.float32 if self.device == "cpu" else getattr(torch, cfg.model.dtype)
        if cfg.rollout.true_on_policy and cfg.rollout.engine == "vllm" and self.device == "cuda":
            from rltrain.compat import vllm_kernels

            vllm_kernels.enable()  # vLLM's batch-invariant mode, before any engine or GEMM of this process
        from rltrain.data.tokenizer import load_tokenizer

        m = cfg.model
        self.tokenizer = load_tokenizer(m.tokenizer or m.path, trust_remote_code=m.trust_remote_code)
        if self.roles != ["teacher"]:  # a teacher of its own group builds no student
            self._build_student(seed, train_dtype)
        if "teacher" in self.roles:  # after the student's roles: they are built as in a run without it
            self.teacher = build_teacher(cfg.teacher, student=cfg.model, actor=cfg.actor, trainer=t,
                                         device=self.device, seed=seed)
        mesh = None
        if any(role is not None for role in (self.actor, self.ref, self.critic, self.teacher)):
            from rltrain.models.megatron.compat import parallel_coordinates, parallel_layout

            mesh = parallel_coordinates()
            self.layout = parallel_layout()
        return {"rank": self.rank, "device": self.device, "roles": self.roles, "mesh": mesh}

    def _build_student(self, seed: int, train_dtype: torch.dtype) -> None:
        """The student's roles of this rank (actor, ref, critic, rollout) from model.*, and the weight path."""
        cfg, t = self.cfg, self.cfg.trainer
        m = cfg.model
        if m.init == "engine":  # the actor makes its own random weights; the engine takes them (first push)
            from rltrain.models.presets import model_hf_config

            self.hf_config, hf_model, sd = model_hf_config(m, self.tokenizer), None, None
        else:
            self.hf_config, hf_model = initial_hf_model(m, self.tokenizer, seed, train_dtype, self.device)
            sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
        hf_config = self.hf_config
        total = t.total_steps * max(1, cfg.actor.ppo_epochs)
        replay = routing_replay(cfg, hf_config, self.device)
        if "actor" in self.roles:
            from rltrain.workers.actor import ActorRole

            from rltrain.models.engine_config import SampledDistribution

            r = cfg.rollout
            self.actor = ActorRole(hf_config, sd, role="actor", actor_cfg=cfg.actor, trainer_cfg=t,
                                   device=self.device, dtype=train_dtype, seed=seed, total_steps=total,
                                   routing_replay=replay, true_on_policy=SampledDistribution(r.top_k, r.top_p, r.engine)
                                   if r.true_on_policy else None)
        if "ref" in self.roles and self.actor is not None and self.actor.engine.lora is not None:
            self.ref = self.actor.base_reference()  # LoRA: the initial model is the actor with its adapters off
        elif "ref" in self.roles:
            from rltrain.workers.actor import ActorRole

            self.ref = ActorRole(hf_config, sd, role="ref", actor_cfg=cfg.actor, trainer_cfg=t,
                                 device=self.device, dtype=train_dtype, seed=seed, total_steps=total,
                                 offload_layers=cfg.ref.offload)
        if "critic" in self.roles:
            from rltrain.workers.critic import CriticRole

            self.critic = CriticRole(hf_config, sd, critic_cfg=cfg.critic, actor_cfg=cfg.actor, trainer_cfg=t,
                                     device=self.device, dtype=train_dtype, seed=seed, total_steps=total)
        # the weight path, chosen once for this worker's placement (rollout/sync/): colocated when it holds both
        # the actor and the rollout engine
        lora = LoraSpec.from_config(cfg.actor.lora)  # None: full fine-tuning
        method = sync_method(colocated="actor" in self.roles and "rollout" in self.roles, device=self.device,
                             engine=cfg.rollout.engine, adapters_only=lora is not None)
        # actor.offload_while_rollout (colocated): the actor's state waits in host memory whenever the engine is awake,
        # from before it starts (it sizes its memory from what is free then)
        self.offload_actor = bool(cfg.actor.offload_while_rollout and self.actor is not None and "rollout" in self.roles)
        if self.offload_actor:
            self.actor.engine.offload()
        if "rollout" in self.roles:
            from rltrain.workers.rollout import RolloutRole

            self.rollout = RolloutRole(engine=cfg.rollout.engine, model=hf_model or hf_config,
                                       tokenizer=self.tokenizer,
                                       rollout_cfg=cfg.rollout, device=self.device, dtype=train_dtype,
                                       sync=method, seed=seed, sandbox_cfg=cfg.sandbox, routed_experts=replay,
                                       lora=lora)
        else:
            del hf_model
        self.weight_sync = build_weight_sync(method, engine=None if self.rollout is None else self.rollout.engine,
                                             engine_tp=cfg.rollout.tensor_parallel_size)

    def close(self) -> None:
        """Drop the roles and tear down torch.distributed / Megatron groups (in-process use)."""
        if self.rollout is not None:
            self.rollout.close()
        self.actor = self.ref = self.critic = self.rollout = self.teacher = None
        from rltrain.models.megatron.compat import teardown_parallel

        teardown_parallel()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ rollout
    @phase("generate")
    def generate(self, prompts: list[dict], group_offset: int, validate: bool = False, seed: int | None = None):
        return self.rollout.generate(prompts, group_offset=group_offset, validate=validate, seed=seed)

    @phase("rollout_sleep")
    def rollout_sleep(self) -> None:
        """The engine sleeps; with actor.offload_while_rollout the actor's state comes back to the GPU."""
        if self.rollout is not None:
            self.rollout.sleep()
        if self.offload_actor:
            self.actor.engine.onload()

    @phase("rollout_wake_up")
    def rollout_wake_up(self) -> dict[str, float]:
        """Wakes the engine; {the seconds of releasing the update's cached blocks, of the engine's wake-up}."""
        import time

        if self.rollout is None:
            return {}
        t0 = time.perf_counter()
        if self.offload_actor:  # the optimizer's state leaves now; the params after the weight sync has read them
            self.actor.engine.offload(params=False)
        if self.device == "cuda":  # the update's cached blocks go back to the driver before vLLM maps its memory
            torch.cuda.empty_cache()
        t1 = time.perf_counter()
        self.rollout.wake_up()
        return {"empty_cache": t1 - t0, "engine": time.perf_counter() - t1}

    # ------------------------------------------------------------------ forward-only
    @phase("old_log_prob")
    def compute_old_logprobs(self, batch: Batch, temperature: float, replay: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """replay=False: with the router's own routing even where the actor replays the rollout's."""
        return self.actor.compute_logprobs(batch, temperature=temperature, with_entropy=True, replay=replay)

    @phase("ref")
    def compute_ref_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        return self.ref.compute_logprobs(batch, temperature=temperature, with_entropy=False)[0]

    @phase("teacher")
    def compute_teacher_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """The distillation teacher's log-probs [B, R] of the response tokens (workers/teacher.py)."""
        return self.teacher.compute_logprobs(batch, temperature=temperature, with_entropy=False)[0]

    @phase("values")
    def compute_values(self, batch: Batch) -> torch.Tensor:
        return self.critic.compute_values(batch)

    # ------------------------------------------------------------------ training
    @phase("update_actor")
    def update_actor(self, batch: Batch, mini_batch_rows: int, ppo_epochs: int, temperature: float, seed: int):
        return self.actor.update(batch, mini_batch_rows=mini_batch_rows, ppo_epochs=ppo_epochs,
                                 temperature=temperature, seed=seed)

    @phase("update_actor")
    def update_actor_on_policy(self, batch: Batch, mini_batch_rows: int, ppo_epochs: int, temperature: float,
                               seed: int):
        """actor.recompute_old_logprobs=false: (metrics, old log-probs [B, R], entropy [B, R]) of the on-policy
        update, whose own forward gave the old log-probs (ActorRole.update_on_policy)."""
        return self.actor.update_on_policy(batch, mini_batch_rows=mini_batch_rows, ppo_epochs=ppo_epochs,
                                           temperature=temperature, seed=seed)

    @phase("update_critic")
    def update_critic(self, batch: Batch, mini_batch_rows: int, ppo_epochs: int, seed: int):
        return self.critic.update(batch, mini_batch_rows=mini_batch_rows, ppo_epochs=ppo_epochs, seed=seed)

    # ------------------------------------------------------------------ weight sync (trainer/weight_sync.py drives)
    @phase("weight_sync_send")
    def weight_sync_send(self, bucket_bytes: int):
        """Export the actor's HF-named weights bucket by bucket into this worker's weight sync: colocated, into the
        engine of this process; split, train rank 0 streams them to the rollout group (its TP peers only iterate)."""
        sent = self.weight_sync.send(self.actor.export_weights(bucket_bytes), bucket_bytes)
        if self.offload_actor:  # the engine generates next: the actor's params and state wait in host memory
            self.actor.engine.offload()
        return sent

    def weight_sync_address(self) -> tuple[str, int, int]:
        """Split mode, train rank 0: where the weight-sync group meets (host, gloo port, NCCL port)."""
        (ip, port), (_, nccl_port) = self.address(), self.address()
        return rendezvous_host(self.cfg.trainer.nnodes == 1, ip), port, nccl_port

    def weight_sync_connect(self, host: str, port: int, nccl_port: int, num_rollout_ranks: int) -> None:
        """Split mode: join the weight-sync group (called on both groups at once, group.run_together)."""
        self.weight_sync.connect(host=host, port=port, nccl_port=nccl_port, rank=self.rank,
                                 num_rollout_ranks=num_rollout_ranks, sender=self.rollout is None)

    @phase("weight_sync_receive")
    def weight_sync_receive(self, version: int | None = None) -> int:
        """Split mode, rollout ranks: load the stream train rank 0 sends into this rank's engine. version: the policy
        version of those weights (rollout.partial stamps the tokens generated after it with it); a partial
        generation in flight is paused between two chunks while they load."""
        with self.rollout.paused(version):
            return self.weight_sync.receive()

    # ------------------------------------------------------------------ partial rollouts (rollout.partial)
    def generate_start(self, job_id: int, prompts: list[dict], group_offset: int, validate: bool = False,
                       seed: int | None = None) -> None:
        """Queue a generation (rollout.partial) and return at once; generate_result(job_id) waits for it."""
        self.rollout.generate_start(job_id, prompts, group_offset=group_offset, validate=validate, seed=seed)

    def generate_result(self, job_id: int):
        return self.rollout.generate_result(job_id)

    # ------------------------------------------------------------------ profiling (trainer.profile_steps)
    def profile_start(self) -> None:
        self.profiler.start()

    def profile_stop(self, out_dir: str, step: int, group: str) -> str:
        """Write this worker's trace of the step: <out_dir>/step<step>/trace_<group>_rank<rank>.json.gz."""
        return self.profiler.stop(os.path.join(out_dir, f"step{step}", f"trace_{group}_rank{self.rank}.json.gz"))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"rng": rng_state(), "layout": self.layout}
        if self.actor is not None:
            sd["actor"] = self.actor.state_dict()
        if self.critic is not None:
            sd["critic"] = self.critic.state_dict()
        return sd

    def save(self, path: str) -> str:
        fname = os.path.join(path, f"worker_rank{self.rank}.pt")
        save_plain(self.state_dict(), fname)  # tensors and plain values only (utils/plain.py)
        return fname

    def load(self, path: str, bucket_bytes: int) -> None:
        sd, others = read_rank_state(path, self.rank, self.layout)  # data only: nothing in the files runs
        for name in ("actor", "critic"):
            role = getattr(self, name)
            if role is not None and name in sd:
                pieces = [(o[name]["optimizer"]["params"], o["layout"]["ep"] == self.layout["ep"])
                          for o in others if name in o] if others else None
                role.load_state_dict(sd[name], optimizer_pieces=pieces)
        rng = sd.get("rng")
        if rng:
            set_rng_state(rng)
        if self.rollout is not None and self.actor is not None:
            self.weight_sync_send(bucket_bytes)

    def export_hf(self, out_dir: str, merged: bool = False) -> str | None:
        """Write the actor as a transformers checkpoint (config + safetensors + tokenizer), rank 0 only. LoRA: a PEFT
        adapter directory (adapter_config.json, adapter_model.safetensors; peft loads it onto model.path), and with
        `merged` the merged model (W + alpha / r B A) as a transformers checkpoint in <out_dir>/merged."""
        from rltrain.models.hf_export import save_hf_checkpoint, save_peft_adapter  # the one HF writer
        from rltrain.models.lora import merged_weights

        lora = self.actor.engine.lora
        named = dict(self.actor.export_weights(1 << 30))  # collective: every rank gathers
        base = dict(self.actor.engine.export_hf_weights(1 << 30)) if lora is not None and merged else None
        if self.rank != 0:
            return None
        if lora is None:
            save_hf_checkpoint(out_dir, self.hf_config, named, tokenizer=self.tokenizer, dtype=torch.float32)
            return out_dir
        save_peft_adapter(out_dir, lora.spec, named, base_model=self.cfg.model.path, tokenizer=self.tokenizer)
        if base is not None:
            save_hf_checkpoint(os.path.join(out_dir, "merged"), self.hf_config, merged_weights(base, named, lora.spec),
                               tokenizer=self.tokenizer, dtype=torch.float32)
        return out_dir
