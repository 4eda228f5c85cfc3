"""Actor and reference roles: a Megatron engine that computes response log-probs and trains the policy.

Composes the model backend (models/megatron), the fused loss path (ops, via the engine) and the RL math
(algorithms); it knows nothing of Ray or the driver loop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from rltrain.algorithms import aggregate_loss, check_off_policy_args, kl_penalty, off_policy_weights, policy_loss
from rltrain.config.schema import (
    ActorConfig,
    LayerComputeConfig,
    LogprobHeadConfig,
    MoEConfig,
    OffPolicyConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainerConfig,
)
from rltrain.data.batch import Batch
from rltrain.models.builder import build_engine
from rltrain.models.engine_config import SampledDistribution
from rltrain.models.loss_protocol import LossFn, MicroBatch, ModelOutputs, as_micro_batch, as_outputs


def label_masks(batch: Batch, *, response_only: bool, loss_mask_only: bool) -> tuple[torch.Tensor, ...]:
    """Full-layout inputs and the rows whose log-probs are computed.

    Returns input_ids [B, S], seq_lens [B], response_start [B], label_mask [B, S] (bool): position t is kept
    when input_ids[t] is a response token (or, with loss_mask_only, a loss_mask token); without
    response_only every real position t >= 1 is computed (debugging / parity).
    """
    input_ids, attn, seq_lens, start = batch.full_sequences()
    if response_only or loss_mask_only:
        keep = batch.loss_mask if loss_mask_only else batch.response_mask  # loss_mask is within response_mask
        label_mask = to_full(batch, keep.bool(), start, input_ids.shape[1])
    else:
        label_mask = attn.bool().clone()
        label_mask[:, 0] = False
    return input_ids, seq_lens, start, label_mask


def to_full(batch: Batch, resp: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
    """Scatter a response-layout tensor [B, R] onto the full layout [B, S] (0 elsewhere)."""
    b, r = resp.shape
    out = torch.zeros((b, width), dtype=resp.dtype)
    cols = start[:, None] + torch.arange(r)[None, :]
    valid = batch.response_mask.bool() & (cols < width)
    out[torch.arange(b)[:, None].expand_as(cols)[valid], cols[valid]] = resp[valid]
    return out


def on_device(mb: dict, device: torch.device) -> dict:
    """The micro-batch's tensors moved to `device` (where the model's outputs are)."""
    from rltrain.models.megatron.compat import host_to_device

    return {k: (host_to_device(v, device) if torch.is_tensor(v) else v) for k, v in mb.items()}


class LossInputs:
    """A loss's per-token inputs of a micro-batch, full layout [b, S]: carried through the engine in
    MicroBatch.extras under `<field>_full` (the flat names the tools' hand-built micro-batches use too)."""

    def tensors(self) -> dict[str, Tensor]:
        """The set fields as the engine's extra tensors, `<field>_full`."""
        return {f"{f.name}_full": getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def of(cls, mb: MicroBatch | Mapping[str, Any], device: torch.device):
        """The inputs of `mb` (a MicroBatch, or a flat dict), on `device` (where the model's outputs are)."""
        flat = mb.extras if isinstance(mb, MicroBatch) else mb
        got = on_device({f.name: flat.get(f"{f.name}_full") for f in fields(cls)}, device)
        return cls(**got)


@dataclass
class PolicyInputs(LossInputs):
    loss_mask: Tensor  # [b, S] float 0/1, the tokens trained
    old_logprobs: Tensor | None  # [b, S] log pi_old(a_t), recomputed before the update; None: the update's own,
    #                             detached (a strictly on-policy update: actor.recompute_old_logprobs=false)
    advantages: Tensor  # [b, S]
    sampler_logprobs: Tensor | None = None  # [b, S] log mu(a_t) of the sampler: with an off-policy correction
    ref_logprobs: Tensor | None = None  # [b, S] log pi_ref(a_t): with the KL loss


class PolicyLoss(LossFn):
    """The actor's loss on one micro-batch (a loss_protocol.LossFn): PPO-family policy loss - entropy bonus + KL.

    All terms are aggregated with `agg` over the micro-batch's loss_mask; the engine multiplies by
    mb.loss_scale (the micro-batch's share of the mini-batch) before backward. With an `off_policy` mode other
    than none, the sampler's log-probs (PolicyInputs.sampler_logprobs) are the behaviour policy: each token's
    policy loss is multiplied by the correction's weight (algorithms/off_policy.py `off_policy_weights`, e.g.
    min(pi_old / pi_sampler, cap) for token_tis); the loss mask is unchanged, so a dropped token (weight 0) keeps
    its place in the aggregation's denominator. Without old log-probs (PolicyInputs.old_logprobs None: a strictly
    on-policy update) the forward's own log-probs, detached, are the old ones (ratio 1) and the weights' pi_old.
    """

    def __init__(self, *, mode: str, clip_low: float, clip_high: float, dual_clip: float | None, agg: str,
                 entropy_coef: float, use_kl_loss: bool, kl_loss_coef: float, kl_loss_type: str,
                 off_policy: OffPolicyConfig | None = None):
        self.mode, self.clip_low, self.clip_high, self.dual_clip, self.agg = mode, clip_low, clip_high, dual_clip, agg
        self.off_policy = off_policy or OffPolicyConfig(mode="none")  # a resolved mode (OffPolicyConfig.effective)
        op = self.off_policy
        check_off_policy_args(op.mode, cap=op.cap, low=op.low, high=op.high)
        self.entropy_coef = entropy_coef
        self.use_kl_loss, self.kl_loss_coef, self.kl_loss_type = use_kl_loss, kl_loss_coef, kl_loss_type
        self.needs_entropy_grad = entropy_coef != 0.0

    @classmethod
    def from_config(cls, a: ActorConfig, *, async_rollout: bool = False) -> PolicyLoss:
        """The actor's loss of a run's actor.* keys; the off-policy correction is actor.off_policy, or what
        actor.tis stands for, or the asynchronous default (OffPolicyConfig.effective)."""
        return cls(mode=a.loss_mode, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
                   agg=a.loss_agg_mode, entropy_coef=a.entropy_coef, use_kl_loss=a.use_kl_loss,
                   kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                   off_policy=OffPolicyConfig.effective(a, async_rollout=async_rollout))

    @property
    def needs_sampler_logprobs(self) -> bool:
        """An off-policy correction is applied: the micro-batches must carry PolicyInputs.sampler_logprobs."""
        return self.off_policy.mode != "none"

    def __call__(self, outputs: ModelOutputs | Mapping[str, Tensor], mb: MicroBatch | Mapping[str, Any]):
        outputs = as_outputs(outputs)
        lp = outputs.logprobs  # [b, S] fp32, 0 outside label_mask
        x = PolicyInputs.of(mb, lp.device)  # the engine's outputs live on its device, the batch on the host
        mask = x.loss_mask  # [b, S]
        old = lp.detach() if x.old_logprobs is None else x.old_logprobs
        weights = None
        if self.needs_sampler_logprobs:
            op = self.off_policy
            weights = off_policy_weights(old, x.sampler_logprobs, mask, mode=op.mode, cap=op.cap,
                                         low=op.low, high=op.high).weights
        pg, m = policy_loss(lp, old, x.advantages, mask, mode=self.mode,
                            clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip, agg=self.agg,
                            weights=weights)
        loss = pg
        metrics: dict[str, Any] = {"actor/pg_loss": pg.detach()}
        metrics.update({f"actor/{k}": v for k, v in m.items()})
        ent = outputs.entropy
        if ent is not None:
            ent_agg = aggregate_loss(ent, mask, self.agg)
            metrics["actor/entropy"] = ent_agg.detach()
            if self.entropy_coef != 0.0:
                loss = loss - self.entropy_coef * ent_agg
        if self.use_kl_loss:
            kl = aggregate_loss(kl_penalty(lp, x.ref_logprobs, self.kl_loss_type), mask, self.agg)
            metrics["actor/kl_loss"] = kl.detach()
            loss = loss + self.kl_loss_coef * kl
        return loss, metrics


class OnPolicyCapture(LossFn):
    """`loss` that also keeps each micro-batch's log-probs and entropy, detached, at the batch rows they belong to
    (the micro-batch's `batch_row` extra [b]): the old log-probs of a strictly on-policy update, which takes them
    from its own forward (actor.recompute_old_logprobs=false). Kept on the device until `full` (no sync per
    micro-batch)."""

    def __init__(self, loss: LossFn):
        self.loss, self.agg = loss, loss.agg
        self.needs_entropy_grad = loss.needs_entropy_grad
        self.parts: list[tuple[Tensor, Tensor, Tensor | None]] = []

    def __call__(self, outputs: ModelOutputs | Mapping[str, Tensor], mb: MicroBatch | Mapping[str, Any]):
        outputs, mb = as_outputs(outputs), as_micro_batch(mb)
        ent = None if outputs.entropy is None else outputs.entropy.detach()
        self.parts.append((mb.extras["batch_row"], outputs.logprobs.detach(), ent))
        return self.loss(outputs, mb)

    def full(self, rows: int, width: int) -> tuple[Tensor, Tensor]:
        """(logprobs [rows, width], entropy [rows, width]) fp32 on the host, 0 where no micro-batch computed them."""
        lp, ent = torch.zeros(rows, width), torch.zeros(rows, width)
        for idx, l, e in self.parts:
            idx = idx.cpu()
            lp[idx, :l.shape[1]] = l.float().cpu()
            if e is not None:
                ent[idx, :e.shape[1]] = e.float().cpu()
        return lp, ent


def share_of(mask: torch.Tensor, total_tokens: float, total_rows: float, agg: str) -> float:
    """Weight of a micro-batch in its mini-batch's loss: token share for token-level aggregation, row
    share for sequence-level aggregation (so the accumulated gradient equals the mini-batch loss's)."""
    if agg == "token-mean":
        return float(mask.sum()) / max(total_tokens, 1.0)
    return mask.shape[0] / max(total_rows, 1.0)


def ppo_updates(engine, loss: LossFn, tensors: dict[str, torch.Tensor], *, mini_batch_rows: int, ppo_epochs: int,
                seed: int, prefix: str, temperature: float = 1.0) -> dict[str, float]:
    """`ppo_epochs` shuffled passes over the rows of `tensors` ([B, ...] each: input_ids, seq_lens, label_mask and
    the loss's `LossInputs.tensors()`) in mini-batches of `mini_batch_rows`, one optimizer step per mini-batch;
    metrics averaged over steps, keyed `<prefix>/...`. temperature: the engine divides the logits by it."""
    rows = tensors["input_ids"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    n_steps = 0
    for _ in range(ppo_epochs):
        perm = torch.randperm(rows, generator=gen)
        for lo in range(0, rows, mini_batch_rows):
            idx = perm[lo:lo + mini_batch_rows]
            mini = {k: v[idx] for k, v in tensors.items()}
            mbs = engine.make_micro_batches(mini, mini["seq_lens"])
            tot_tok = float(mini["loss_mask_full"].sum())
            for mb in mbs:
                mb.loss_scale = share_of(mb.extras["loss_mask_full"], tot_tok, len(idx), loss.agg)
            n_steps += 1
            for k, v in engine.train_step(mbs, loss, temperature=temperature).items():
                v = float(v)
                if math.isfinite(v):
                    sums[k] = sums.get(k, 0.0) + v
                    counts[k] = counts.get(k, 0) + 1
    out = {(k if "/" in k else f"{prefix}/{k}"): sums[k] / counts[k] for k in sums}
    out[f"{prefix}/num_optimizer_steps"] = float(n_steps)
    return out


class ActorRole:
    """The policy (role="actor", trains) or the frozen reference (role="ref", forward only)."""

    def __init__(self, hf_config, hf_state_dict: dict | None, *, role: str, actor_cfg: ActorConfig,
                 trainer_cfg: TrainerConfig, device: str, dtype: torch.dtype, seed: int, total_steps: int,
                 routing_replay: bool = False, true_on_policy: SampledDistribution | None = None,
                 offload_layers: bool = False):
        """true_on_policy: the rollout engine's arithmetic and sampled distribution (rollout.true_on_policy).
        offload_layers: the reference's decoder layers in host memory, streamed in per forward (ref.offload)."""
        assert role in ("actor", "ref"), role
        self.role, self.actor_cfg, self.trainer_cfg = role, actor_cfg, trainer_cfg
        # rollout routing replay (workers/hybrid.routing_replay): the policy's forwards route as the rollout did;
        # the reference keeps its own routing
        self.routing_replay = routing_replay and role == "actor"
        self.engine = build_engine(hf_config, role=role, hf_state_dict=hf_state_dict, device=device, dtype=dtype,
                                   seed=seed, total_steps=total_steps,
                                   max_tokens_per_micro_batch=actor_cfg.max_tokens_per_micro_batch,
                                   forward_max_tokens_per_micro_batch=actor_cfg.log_prob_max_tokens_per_micro_batch,
                                   optim=actor_cfg.group(OptimizerConfig), parallel=actor_cfg.group(ParallelConfig),
                                   compute=actor_cfg.group(LayerComputeConfig), moe=actor_cfg.group(MoEConfig),
                                   head=trainer_cfg.group(LogprobHeadConfig),
                                   lora=actor_cfg.lora if role == "actor" else None, true_on_policy=true_on_policy,
                                   offload_layers=offload_layers and role == "ref")
        self.loss = PolicyLoss.from_config(actor_cfg, async_rollout=trainer_cfg.async_rollout)

    def base_reference(self) -> BaseReference:
        """LoRA: the reference role served by this actor's model with its adapters off (the base, frozen: the
        initial model), no second model."""
        return BaseReference(self)

    # ------------------------------------------------------------------ forward-only
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False,
                         adapters: bool = True, replay: bool = True):
        """(logprobs [B, R], entropy [B, R] or None) of the response tokens under this model. adapters=False: under
        the LoRA actor's base (its adapters off; the reference keeps its own MoE routing). replay=False: the router's
        own routing even where this role replays the rollout's."""
        input_ids, seq_lens, start, label_mask = label_masks(
            batch, response_only=self.trainer_cfg.logprobs_response_only, loss_mask_only=False)
        with contextlib.nullcontext() if adapters else self.engine.lora.disabled():
            lp, ent = self.engine.forward_logprobs(input_ids, seq_lens, label_mask, temperature=temperature,
                                                   with_entropy=with_entropy,
                                                   routed_experts=self._routing(batch) if adapters and replay else None)
        lp = batch.response_from_full(lp.float().cpu(), start)
        ent = None if ent is None else batch.response_from_full(ent.float().cpu(), start)
        return lp, ent

    # ------------------------------------------------------------------ training
    def update(self, batch: Batch, *, mini_batch_rows: int, ppo_epochs: int, temperature: float = 1.0,
               seed: int = 0) -> dict[str, float]:
        """ppo_epochs passes over `batch` in mini-batches of `mini_batch_rows` rows; one optimizer step each.

        Needs batch.old_logprobs and batch.advantages (and ref_logprobs with the KL loss).
        """
        assert batch.old_logprobs is not None, "the update needs old log-probs (or update_on_policy)"
        tensors, _ = self._update_tensors(batch, with_old=True)
        return ppo_updates(self.engine, self.loss, tensors, mini_batch_rows=mini_batch_rows, ppo_epochs=ppo_epochs,
                           seed=seed, prefix="actor", temperature=temperature)

    def update_on_policy(self, batch: Batch, *, mini_batch_rows: int, ppo_epochs: int, temperature: float = 1.0,
                         seed: int = 0) -> tuple[dict[str, float], Tensor, Tensor]:
        """The update of a strictly on-policy step (actor.recompute_old_logprobs=false): one epoch of one mini-batch
        of every row, whose forward runs the old policy's weights (nothing moved them yet): its log-probs, detached,
        are the old ones (no separate pass; batch.old_logprobs is not read). Returns (update's metrics, old
        log-probs [B, R], their entropy [B, R]) in the response layout, as compute_logprobs would give them."""
        rows = len(batch)
        if ppo_epochs != 1 or mini_batch_rows < rows:
            raise ValueError(f"an on-policy update (actor.recompute_old_logprobs=false) is one epoch of one "
                             f"mini-batch; got ppo_epochs={ppo_epochs}, mini-batches of {mini_batch_rows} of {rows} rows")
        tensors, start = self._update_tensors(batch, with_old=False)
        tensors["batch_row"] = torch.arange(rows)
        loss = OnPolicyCapture(self.loss)
        metrics = ppo_updates(self.engine, loss, tensors, mini_batch_rows=mini_batch_rows, ppo_epochs=1, seed=seed,
                              prefix="actor", temperature=temperature)
        lp, ent = loss.full(rows, tensors["input_ids"].shape[1])
        return metrics, batch.response_from_full(lp, start), batch.response_from_full(ent, start)

    def _update_tensors(self, batch: Batch, *, with_old: bool) -> tuple[dict[str, Tensor], Tensor]:
        """(the update's tensors [B, ...]: ids, lengths, label mask, the loss's inputs, routing; response_start [B])."""
        assert self.role == "actor"
        assert batch.advantages is not None
        input_ids, seq_lens, start, label_mask = label_masks(
            batch, response_only=True, loss_mask_only=self.trainer_cfg.logprobs_loss_mask_only)
        s = input_ids.shape[1]
        if self.loss.needs_sampler_logprobs:
            assert batch.sampler_logprobs is not None, \
                f"actor.off_policy.mode={self.loss.off_policy.mode} (or actor.tis) needs the sampler's log-probs"
        if self.loss.use_kl_loss:
            assert batch.ref_logprobs is not None, "actor.use_kl_loss needs reference log-probs"
        inputs = PolicyInputs(
            loss_mask=to_full(batch, batch.loss_mask.float(), start, s),
            old_logprobs=to_full(batch, batch.old_logprobs, start, s) if with_old else None,
            advantages=to_full(batch, batch.advantages, start, s),
            sampler_logprobs=to_full(batch, batch.sampler_logprobs, start, s) if self.loss.needs_sampler_logprobs
            else None,
            ref_logprobs=to_full(batch, batch.ref_logprobs, start, s) if self.loss.use_kl_loss else None)
        tensors = {"input_ids": input_ids, "seq_lens": seq_lens, "label_mask": label_mask, **inputs.tensors()}
        if self.routing_replay:
            tensors["routed_experts"] = self._routing(batch)
        return tensors, start

    def _routing(self, batch: Batch) -> torch.Tensor | None:
        """The batch's rollout routing on the full layout [B, S, L, k] when this role replays it, else None."""
        if not self.routing_replay:
            return None
        if batch.routed_experts is None:
            raise RuntimeError("actor.moe_routing_replay is on but the batch carries no routed experts: the rollout "
                               "engine was not asked for them")
        return batch.full_routed_experts()

    def export_weights(self, bucket_bytes: int):
        """What the rollout engine needs after an update: the HF-named weights, or with LoRA the adapters alone."""
        if self.engine.lora is not None:
            return self.engine.export_lora_weights(bucket_bytes=bucket_bytes)
        return self.engine.export_hf_weights(bucket_bytes=bucket_bytes)

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, sd: dict, optimizer_pieces: list | None = None) -> None:
        """optimizer_pieces: other ranks' saved pieces, for a checkpoint of another data-parallel size."""
        self.engine.load_state_dict(sd, optimizer_pieces)


class BaseReference:
    """The reference role of a LoRA actor: its model with the adapters off (ActorRole.base_reference)."""

    def __init__(self, actor: ActorRole):
        self.actor = actor

    def compute_logprobs(self, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False):
        return self.actor.compute_logprobs(batch, temperature=temperature, with_entropy=with_entropy, adapters=False)
