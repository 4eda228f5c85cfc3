"""Shared helpers of the megatron backend tests: random tiny Qwen3 HF models, HF reference
log-probs/entropy computed from materialized logits, and the gloo ranks of the TP/PP/DP tests (forked from a
fork server that imported the stack once).
Not a test module."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket

import torch
import torch.multiprocessing as mp
from transformers import Qwen3ForCausalLM

from rltrain.models.engine_config import EngineConfig
from rltrain.models.megatron.tiny import tiny_qwen3_config

ENGINE_ARGS = ("role", "params_dtype", "device", "seed")  # MegatronEngine's own arguments; the rest is its config


def engine_config(**keys) -> EngineConfig:
    """An EngineConfig with single typed fields set by their schema names (lr, tensor_parallel_size,
    fused_linear_logprob, max_tokens_per_micro_batch, ...): each on the key group that declares it."""
    c = EngineConfig()
    owners = [getattr(c, f.name) for f in dataclasses.fields(c) if dataclasses.is_dataclass(getattr(c, f.name))]
    for key, value in keys.items():
        owner = next((g for g in owners if key in {f.name for f in dataclasses.fields(g)}), c)
        if key not in {f.name for f in dataclasses.fields(owner)}:
            raise TypeError(f"no engine config field {key!r}")
        setattr(owner, key, value)
    return c


def make_engine(hf_config, **kw):
    """MegatronEngine(hf_config, engine_config(...), role=..., seed=...) from one set of keyword arguments."""
    from rltrain.models.megatron import MegatronEngine

    args = {k: kw.pop(k) for k in ENGINE_ARGS if k in kw}
    return MegatronEngine(hf_config, engine_config(**kw), **args)


def random_hf_model(vocab_size: int = 101, seed: int = 0, **cfg) -> Qwen3ForCausalLM:
    """A tiny random Qwen3ForCausalLM in fp32 whose norm weights are not all ones."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size, **cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.mul_(3.0)  # sharper distributions than the 0.02-std init
    return model


def tiny_moe_config(vocab_size: int = 101, **cfg):
    """A tiny Qwen3-MoE config: 4 experts, top-2, renormalized, every layer sparse unless `cfg` says otherwise;
    head_dim 24 (not hidden / heads) as the dense tiny model's."""
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4,
              num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
              tie_word_embeddings=False, max_position_embeddings=256, attention_dropout=0.0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kw.update(cfg)
    return Qwen3MoeConfig(**kw)


def random_moe_model(vocab_size: int = 101, seed: int = 0, **cfg):
    """A tiny random Qwen3MoeForCausalLM in fp32 (fused in-memory experts, as transformers 5 holds them), weights
    scaled as random_hf_model's, the router's too (sharper routing: fewer near-ties between experts)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(vocab_size, **cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # transformers initializes the router to zeros: every expert tied
            else:
                p.mul_(3.0)
    return model


def random_batch(vocab_size: int, seq_lens: list[int], seed: int = 1):
    """Right-padded input_ids [B, S] (pad id vocab_size-1), seq_lens [B], label_mask [B, S] (a
    'response' suffix of each row: t >= prompt_len, t < seq_len)."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(seq_lens), max(seq_lens)
    ids = torch.randint(0, vocab_size, (B, S), generator=g)
    pos = torch.arange(S)
    lens = torch.tensor(seq_lens)
    ids = torch.where(pos < lens[:, None], ids, vocab_size - 1)
    prompt = torch.tensor([max(1, n // 3) for n in seq_lens])
    mask = (pos >= prompt[:, None]) & (pos < lens[:, None])
    return ids, lens, mask


def hf_logprobs(model, ids, mask, temperature: float = 1.0):
    """fp64 reference from materialized HF logits: (lp [B, S], ent [B, S]), 0 outside mask/t=0."""
    logits = model(ids).logits.double() / temperature  # [B, S, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    m = mask[:, 1:]
    zero = torch.zeros(ids.shape[0], 1, dtype=lp.dtype, device=lp.device)
    lp = torch.cat([zero, torch.where(m, lp, 0.0)], 1)
    ent = torch.cat([zero, torch.where(m, ent, 0.0)], 1)
    return lp, ent


def ppo_batch(hf, vocab_size: int, seq_lens: list[int], seed: int):
    """A PPO mini-batch for `hf`: random rows, old log-probs near the model's own (+ noise), random advantages."""
    ids, lens, mask = random_batch(vocab_size, seq_lens, seed=seed)
    with torch.no_grad():
        ref_lp, _ = hf_logprobs(hf, ids, mask)
    g = torch.Generator().manual_seed(seed + 1)
    old = (ref_lp.float() + 0.3 * torch.randn(ids.shape, generator=g)) * mask
    adv = torch.randn(ids.shape, generator=g) * mask
    return {"input_ids": ids, "label_mask": mask, "old_logprobs": old, "advantages": adv}, lens


def hf_loss_inputs(hf, batch, lens):
    """(ModelOutputs, MicroBatch) of the whole mini-batch on transformers, with grad: log-probs and entropy from
    materialized fp32 logits, 0 at t = 0 and outside the label mask, for a loss_fn to compare with the engine's."""
    from rltrain.models.loss_protocol import MicroBatch, ModelOutputs

    logits = hf(batch["input_ids"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    zero = torch.zeros(len(lens), 1)
    lp = torch.cat([zero, logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)], 1)
    ent = torch.cat([zero, -(logp.exp() * logp).sum(-1)], 1)
    m = batch["label_mask"].clone()
    m[:, 0] = False
    mb = MicroBatch.from_mapping({**batch, "seq_lens": torch.as_tensor(lens), "label_mask": m})
    return ModelOutputs(logprobs=lp * m, entropy=ent * m), mb


def ppo_loss_with_entropy(outputs, mb):
    """The engine's loss_fn in the multi-process engine tests: PPO clip loss minus 0.01 x mean entropy (so the
    entropy's gradient path is exercised too)."""
    from rltrain.algorithms import policy_loss

    loss, metrics = policy_loss(outputs.logprobs, mb.extras["old_logprobs"], mb.extras["advantages"], mb.label_mask,
                                mode="ppo", clip_low=0.2, clip_high=0.2)
    m = mb.label_mask
    return loss - 0.01 * (outputs.entropy * m).sum() / m.sum(), metrics


ppo_loss_with_entropy.needs_entropy_grad = True


# What every rank imports, imported once per test process by multiprocessing's fork server: the ranks fork from it
# instead of each starting a fresh interpreter that imports torch, transformers and megatron again (several CPU-s a
# rank, 18 ranks in tests/models). The server never runs a tensor op (no thread pool to fork).
RANK_PRELOAD = ["torch", "transformers", "rltrain.compat.megatron", "rltrain.models.megatron"]


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in `nprocs` processes forked from the fork server (RANK_PRELOAD imported there); joins them
    and raises a rank's error as torch.multiprocessing.spawn does. A rank sees this process's sys.path and working
    directory; its environment is the one this process had when the server started (set a rank's variables in
    the rank, as join_gloo_world does)."""
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def spawn_gloo_ranks(worker, world: int, out_dir) -> None:
    """Run worker(rank, world, port, out_dir) in `world` processes (start_ranks; each calls join_gloo_world
    first); the rendezvous port is a free one on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(worker, (world, port, str(out_dir)), world)


def join_gloo_world(rank: int, world: int, port: int) -> None:
    """In a spawned rank: the torchrun variables for a world on 127.0.0.1, one CPU thread, warnings off."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
