"""Benchmark cases more than one tool runs, defined once: the actor update step of a random model (bench_update,
profile_step's update, gpu_smoke), the GRPO run of a Qwen3-0.6B-shaped model (gpu_smoke, gpu_placements) and the
split grpo_tiny learning runs (bench_offpolicy).
Must not time or report anything: the tools do.
"""

from __future__ import annotations

import dataclasses

# The GRPO run on a Qwen3-0.6B-shaped random model (one GPU per worker group)
GRPO_06B_OVERRIDES = [
    "model=qwen3_0.6b_random", "trainer.device=cuda", "trainer.n_gpus_per_node=1",
    "trainer.logger=[console,jsonl]", "trainer.progress_bar=false", "trainer.plots=false",
    "trainer.fused_linear_logprob_backend=triton", "trainer.test_freq=-1",
    "data.train_batch_size=32", "rollout.n=8", "rollout.max_response_length=64", "data.max_prompt_length=64",
    "actor.ppo_mini_batch_size=16", "actor.lr=1e-6", "actor.use_kl_loss=true",
    "actor.max_tokens_per_micro_batch=16384", "rollout.max_batch_size=256",
]

# split placement for the tools' trainer runs (bench_offpolicy): train group and rollout group on devices
# of their own; no checkpoints (a save waits for the batch in flight outside the step timer: none while timing)
SPLIT = ["trainer.use_ray=true", "trainer.colocate=false", "trainer.progress_bar=false", "trainer.plots=false",
         "trainer.save_freq=-1"]
# grpo_tiny set up to learn in tens of steps (the CPU test tests/trainer/test_async_e2e.py uses the same shape)
TINY_LEARN = ["data.train_batch_size=32", "rollout.n=16", "actor.ppo_mini_batch_size=16", "actor.lr=3e-3",
              "data.synthetic.val_size=64", "rollout.val_temperature=1.0", "rollout.val_n=4",
              "trainer.logger=[jsonl]"]

PRESETS = {"qwen3-0.6b": "qwen3-0.6b", "qwen3-4b": "qwen3-4b", "tiny": "tiny"}

# named lever combinations of the actor update
LEVER_SETS = {
    "legacy": dict(norms="fp32", optim="foreach", fusion="none"),  # the engine as measured in issue 17
    "norms": dict(norms="bf16", optim="foreach", fusion="none"),
    "norms+optim": dict(norms="bf16", optim="fused", fusion="none"),
    "mcore": dict(norms="bf16", optim="fused", fusion="mcore"),
    "all": dict(norms="bf16", optim="fused", fusion="compile"),
}


@dataclasses.dataclass
class Row:
    """One actor update step: model preset, tokens in one micro-batch, and the speed levers."""

    name: str
    preset: str = "qwen3-0.6b"
    tokens: int = 8192
    head: str = "fused"
    norms: str = "bf16"
    optim: str = "fused"
    fusion: str = "none"
    recompute: str = "none"
    tp: int = 1
    profile: bool = False
    # rows of this many tokens, tokens // seq_len of them in one right-padded micro-batch (the GRPO update's
    # shape: 128 rows of ~69 tokens); None: one sequence of `tokens`
    seq_len: int | None = None

    @property
    def rows_and_len(self) -> tuple[int, int]:
        length = self.seq_len or self.tokens
        if not 1 <= length <= self.tokens:
            raise ValueError(f"row {self.name}: seq_len={self.seq_len} must be in [1, tokens={self.tokens}]")
        return self.tokens // length, length

    def overrides(self) -> list[str]:
        """This update step (one sequence of `tokens` in one micro-batch, one AdamW step) as the trainer config
        rltrain.plan reads: a results row's config (tools/planlab)."""
        T = self.tokens
        ov = ["model=qwen3_0.6b_random", f"model.builtin={self.preset}", "trainer.device=cuda",
              f"trainer.n_gpus_per_node={self.tp}", f"actor.tensor_parallel_size={self.tp}", "data.train_batch_size=1",
              "rollout.n=1", "actor.ppo_mini_batch_size=1", f"data.max_prompt_length={T // 2}",
              f"rollout.max_response_length={T - T // 2}", f"actor.max_tokens_per_micro_batch={T}",
              "actor.use_kl_loss=false", f"actor.elementwise_fusion={self.fusion}",
              f"trainer.fused_linear_logprob={'true' if self.head == 'fused' else 'false'}",
              "trainer.fused_linear_logprob_backend=triton"]
        if self.recompute != "none":
            ov += ["actor.recompute_activations=true", f"actor.recompute_granularity={self.recompute}"]
        return ov


def hf_config(preset: str):
    from rltrain.models.presets import hf_config_for

    return hf_config_for(path=None, builtin=preset, vocab_size=4096 if preset == "tiny" else None)


def policy_micro_batch(input_ids, seed: int = 0) -> dict:
    """A PPO micro-batch of the engine's layout over input_ids [B, S]: every token but the first trained."""
    import torch

    b, s = input_ids.shape
    g = torch.Generator().manual_seed(seed)
    label_mask = torch.ones(b, s, dtype=torch.bool)
    label_mask[:, 0] = False
    return {"input_ids": input_ids, "seq_lens": torch.full((b,), s), "label_mask": label_mask,
            "loss_mask_full": label_mask.float(), "old_logprobs_full": torch.zeros(b, s),
            "advantages_full": torch.randn(b, s, generator=g), "loss_scale": 1.0}


def policy_loss_fn():
    from rltrain.workers.actor import PolicyLoss

    return PolicyLoss(mode="ppo", clip_low=0.2, clip_high=0.28, dual_clip=None, agg="token-mean",
                      entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl")


def _legacy_norms(build):
    """build_gpt_model as it was before the norm fix: RMSNorm weights left in fp32 (megatron's local spec
    builds them without a dtype), so torch.rms_norm takes its unfused composite path on bf16 inputs."""
    import torch

    def wrapped(*a, **kw):
        model = build(*a, **kw)
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.float()
        return model

    return wrapped


def actor_engine(cfg, *, tokens: int, device: str, dtype, tp: int = 1, fused: bool = True, backend: str = "auto",
                 compute=None, weight_decay: float | None = None):
    """The actor engine of a case through the one engine builder (models/builder.py): lr 1e-5, `tokens` per
    micro-batch, TP `tp`, the fused head or materialized logits; compute: a LayerComputeConfig (default: none)."""
    from rltrain.config.schema import LayerComputeConfig, LogprobHeadConfig, OptimizerConfig, ParallelConfig
    from rltrain.models.builder import build_engine

    optim = OptimizerConfig(lr=1e-5, **({} if weight_decay is None else {"weight_decay": weight_decay}))
    return build_engine(cfg, role="actor", dtype=dtype, device=device, seed=0, total_steps=1000, optim=optim,
                        max_tokens_per_micro_batch=tokens,  # vocab padding: EngineConfig's VOCAB_PADDING (1)
                        parallel=ParallelConfig(tensor_parallel_size=tp), compute=compute or LayerComputeConfig(),
                        head=LogprobHeadConfig(fused_linear_logprob=fused, fused_linear_logprob_backend=backend))


def build_for_row(row: Row, device: str | None = None, tp_rank_seed: int = 1):
    """-> (engine, [micro_batch], loss_fn) for one row on this process's device."""
    import torch

    from rltrain.config.schema import LayerComputeConfig
    from rltrain.models.megatron import engine as engine_mod  # its build_gpt_model, patched for norms=fp32

    cfg = hf_config(row.preset)
    cuda = torch.cuda.is_available()
    device = device or ("cuda" if cuda else "cpu")
    orig_build = engine_mod.build_gpt_model
    if row.norms == "fp32":
        engine_mod.build_gpt_model = _legacy_norms(orig_build)
    try:
        eng = actor_engine(cfg, tokens=row.tokens, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                           tp=row.tp, fused=row.head == "fused", compute=LayerComputeConfig(
                               recompute_activations=row.recompute != "none", recompute_modules=["mlp"],
                               recompute_granularity="selective" if row.recompute == "selective" else "full",
                               elementwise_fusion=row.fusion))
    finally:
        engine_mod.build_gpt_model = orig_build
    if row.optim == "foreach":  # torch's default AdamW on CUDA, as the engine used before
        params = eng.optimizer.param_groups[0]["params"]
        eng.optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                          foreach=True)
        owner = getattr(eng, "optim", None) or eng  # the engine's optimizer part, where it has one
        owner.scheduler = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda step: 1.0)
    ids = torch.randint(0, cfg.vocab_size, row.rows_and_len, generator=torch.Generator().manual_seed(tp_rank_seed))
    return eng, [policy_micro_batch(ids)], policy_loss_fn()
