"""Critic role (PPO): the same Megatron trunk with a scalar value head, trained with the clipped value loss.

Values are aligned like log-probs: values[b, j] = V(s) at the state that produces response token j.
No Ray, no driver logic here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rltrain.algorithms import value_loss
from rltrain.config.schema import (ActorConfig, CriticConfig, MoEConfig, OptimizerConfig, ParallelConfig,
                                   TrainerConfig)
from rltrain.data.batch import Batch
from rltrain.models.builder import build_engine
from rltrain.models.loss_protocol import LossFn, MicroBatch, ModelOutputs, as_outputs
from rltrain.workers.actor import LossInputs, label_masks, ppo_updates, to_full


@dataclass
class ValueInputs(LossInputs):
    loss_mask: Tensor  # [b, S] float 0/1, the tokens trained
    old_values: Tensor  # [b, S] V(s_t) at rollout time
    returns: Tensor  # [b, S] the regression targets


class ValueLoss(LossFn):
    """The critic's clipped value loss on one micro-batch (a loss_protocol.LossFn)."""

    needs_entropy_grad = False

    def __init__(self, *, clip: float, agg: str):
        self.clip, self.agg = clip, agg

    def __call__(self, outputs: ModelOutputs | Mapping[str, Tensor], mb: MicroBatch | Mapping[str, Any]):
        v = as_outputs(outputs).values  # [b, S]
        x = ValueInputs.of(mb, v.device)
        loss, m = value_loss(v, x.old_values, x.returns, x.loss_mask, clip=self.clip, agg=self.agg)
        metrics = {"critic/vf_loss": loss.detach()}
        metrics.update({f"critic/{k}": val for k, val in m.items()})
        return loss, metrics


class CriticRole:
    def __init__(self, hf_config, hf_state_dict: dict | None, *, critic_cfg: CriticConfig, actor_cfg: ActorConfig,
                 trainer_cfg: TrainerConfig, device: str, dtype: torch.dtype, seed: int, total_steps: int):
        self.cfg, self.trainer_cfg = critic_cfg, trainer_cfg
        self.engine = build_engine(hf_config, role="critic", hf_state_dict=hf_state_dict, device=device, dtype=dtype,
                                   seed=seed, total_steps=total_steps,
                                   max_tokens_per_micro_batch=critic_cfg.max_tokens_per_micro_batch,
                                   optim=critic_cfg.group(OptimizerConfig), parallel=actor_cfg.group(ParallelConfig),
                                   moe=actor_cfg.group(MoEConfig))
        self.loss = ValueLoss(clip=critic_cfg.value_clip, agg=critic_cfg.loss_agg_mode)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """V [B, R] at the states producing each response token; 0 outside response_mask."""
        input_ids, seq_lens, start, label_mask = label_masks(batch, response_only=True, loss_mask_only=False)
        values = self.engine.forward_values(input_ids, seq_lens, label_mask)
        return batch.response_from_full(values.float().cpu(), start)

    def update(self, batch: Batch, *, mini_batch_rows: int, ppo_epochs: int, seed: int = 0) -> dict[str, float]:
        assert batch.values is not None and batch.returns is not None
        input_ids, seq_lens, start, label_mask = label_masks(batch, response_only=True, loss_mask_only=False)
        s = input_ids.shape[1]
        inputs = ValueInputs(loss_mask=to_full(batch, batch.loss_mask.float(), start, s),
                             old_values=to_full(batch, batch.values, start, s),
                             returns=to_full(batch, batch.returns, start, s))
        tensors = {"input_ids": input_ids, "seq_lens": seq_lens, "label_mask": label_mask, **inputs.tensors()}
        return ppo_updates(self.engine, self.loss, tensors, mini_batch_rows=mini_batch_rows, ppo_epochs=ppo_epochs,
                           seed=seed + 7, prefix="critic")

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, sd: dict, optimizer_pieces: list | None = None) -> None:
        """optimizer_pieces: other ranks' saved pieces, for a checkpoint of another data-parallel size."""
        self.engine.load_state_dict(sd, optimizer_pieces)
