"""The Megatron train/forward engine behind the actor, reference and critic workers: forward-only
log-probs/values, the micro-batched train step, HF weight load/export, checkpoint state. It must not
know about Ray, rollouts or advantages (the caller's loss_fn holds the algorithm).

Sequence layout: right-padded rows with causal attention, micro-batches grouped by length under a
token budget (docs/megatron_backend.md says why: no varlen kernels needed on CPU or without TE, and
causal masking already keeps padding after the real tokens from affecting them).

Alignment: output entry t of a row is about token t given tokens < t (log p(x_t | x_<t), or the
critic's V(x_<t)), computed from the hidden state at t-1; entry 0 and entries outside the mask are 0.

Pipeline parallelism (pp_size > 1): forward and train step run megatron-core's own schedule
(`get_forward_backward_func`, 1F1B) with the head and the caller's loss on the last stage; results
and metrics are broadcast from it so every rank returns the same; pipeline.py holds the plumbing.

Precision: params in `params_dtype`; when that is not fp32 (bf16 on GPU) AdamW runs on fp32 master
copies and the params are refreshed from them after each step. On CPU use fp32.

Speed (docs/benchmarks/update.md): the train step syncs with the device once, after the
backward (metrics, losses and the grad norm come back in one copy). The optimizer side (masters, grad
reductions, norm, clip, AdamW) is optim.py's; `elementwise_fusion` (fusion.py) picks how the layers'
elementwise work runs, `recompute_granularity` what activation recomputation keeps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import torch
from megatron.core import parallel_state

from rltrain.models.engine_config import EngineConfig
from rltrain.models.lora import LoraSpec
from rltrain.models.loss_protocol import LossFn, MicroBatch, ModelOutputs, as_micro_batch
from rltrain.models.megatron import head as head_mod
from rltrain.models.megatron import invariant as invariant_mod
from rltrain.models.megatron import pipeline as pipeline_mod
from rltrain.models.megatron import weights as weights_mod
from rltrain.models.megatron.build import HAVE_TE, UnsupportedModelError, build_gpt_model, moe_layer_pattern
from rltrain.models.megatron.compat import host_to_device, setup_parallel, torch_device
from rltrain.models.megatron.fusion import FUSIONS
from rltrain.models.megatron.micro_batch import make_micro_batches
from rltrain.models.megatron.lora import LoraAdapters
from rltrain.models.megatron.moe import (ExpertPasses, RouterStats, RoutingReplay, expert_collectives_on_cpu,
                                        set_aux_loss_scale, use_grouped_expert_gemm)
from rltrain.models.megatron.offload import LayerStreamer, StateOffload
from rltrain.models.megatron.optim import EngineOptimizer, OptimizerSide


class MegatronEngine(pipeline_mod.PipelineStages, ExpertPasses, OptimizerSide):
    """One role's Megatron model on this rank (TP-sharded, one pipeline stage), with its optimizer
    when it trains."""

    def __init__(self, hf_config: Any, config: EngineConfig | None = None, *, role: str = "actor",
                 params_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0):
        """config: the typed engine config (models/builder.py makes it from a run's config; None: the schema's
        defaults)."""
        c = config or EngineConfig()
        o, par, comp, head = c.optim, c.parallel, c.compute, c.head
        self.config = c
        c.check(role)
        self.dims = setup_parallel(par, seed=seed)  # the degrees over this world, validated (config/parallel.py)
        tp_size, pp_size = self.dims.tp, self.dims.pp
        self.role = role
        self.device = torch_device(device)
        self.params_dtype = params_dtype
        self.fused = head.fused_linear_logprob
        self.backend = head.fused_linear_logprob_backend
        self.chunk_size = head.logprobs_chunk_size
        self.max_tokens_per_micro_batch = c.max_tokens_per_micro_batch
        self.forward_max_tokens_per_micro_batch = c.forward_max_tokens_per_micro_batch or c.max_tokens_per_micro_batch
        self.pp_size = pp_size
        self.ep_size = self.dims.ep
        self.vocab_size = int(hf_config.vocab_size)
        moe = any(moe_layer_pattern(hf_config))
        # megatron's MoE layers train under tensor parallelism only with sequence parallelism, and its norms take
        # sequence parallelism only from Transformer Engine; dense models keep full sequences on every TP rank
        self.sequence_parallel = tp_size > 1 and moe and HAVE_TE
        if tp_size > 1 and moe and not HAVE_TE and role != "ref":
            raise UnsupportedModelError(
                f"actor.tensor_parallel_size={tp_size} with a Mixture-of-Experts model: megatron-core trains MoE "
                "layers under tensor parallelism only with sequence parallelism, which it builds only with "
                "Transformer Engine (not installed); split the experts with actor.expert_parallel_size instead "
                "and keep actor.tensor_parallel_size=1")
        self.tp_size = tp_size
        # megatron's MoE token dispatch over several ranks allocates on the CUDA device (compat's CPU shim)
        self._dispatch_collectives = moe and (self.dims.ep > 1 or tp_size > 1)
        with pipeline_mod.cpu_schedule_shim() if pp_size > 1 else contextlib.nullcontext():
            self.model = build_gpt_model(
                hf_config, dims=self.dims, params_dtype=params_dtype, device=self.device,
                make_vocab_size_divisible_by=c.make_vocab_size_divisible_by, sequence_parallel=self.sequence_parallel,
                recompute_activations=comp.recompute_activations and role != "ref",
                recompute_granularity=comp.recompute_granularity, recompute_modules=tuple(comp.recompute_modules),
                moe_aux_loss_coeff=c.moe.moe_aux_loss_coeff, moe_z_loss_coeff=c.moe.moe_z_loss_coeff,
            )
        FUSIONS[comp.elementwise_fusion](self.model)
        self.sampled = invariant_mod.setup(self.model, hf_config, c)  # rollout.true_on_policy: (top_k, top_p)
        if c.moe.moe_grouped_gemm:
            use_grouped_expert_gemm(self.model)
        self.router_stats = RouterStats(self.model)  # empty for a dense model
        self.routing_replay = RoutingReplay(self.model)
        self._aux_losses = bool(self.router_stats) and (c.moe.moe_aux_loss_coeff > 0 or c.moe.moe_z_loss_coeff > 0)
        # Only the last pipeline stage has the head (output layer / value head).
        self.last_stage = pp_size == 1 or parallel_state.is_pipeline_last_stage()
        if pp_size > 1:
            cfg = self.model.config
            cfg.variable_seq_lengths = False  # one [s, b, H] shape per schedule call (pipeline.py)
            if self.device.type == "cpu":
                cfg.batch_p2p_comm = False  # plain isend/irecv; batch_p2p_sync needs CUDA
        if self.last_stage and role == "critic":
            head_mod.attach_value_head(self.model, hf_config.hidden_size, dtype=params_dtype, device=self.device,
                                       seed=seed)
        elif self.last_stage:
            head_mod.set_head_mode(self.model, "hidden" if head.fused_linear_logprob else "logits")

        spec = LoraSpec.from_config(c.lora) if role == "actor" else None  # LoRA: the optimizer takes the adapters
        self.lora = None if spec is None else LoraAdapters(self.model, spec, seed=seed)  # only (the base frozen)
        self.optim: EngineOptimizer | None = None
        self.layer_streamer: LayerStreamer | None = None
        if role == "ref":
            self.model.requires_grad_(False)
            if c.offload_layers:  # ref.offload: the decoder layers on the host, streamed in for each forward
                self.layer_streamer = LayerStreamer(list(self.model.decoder.layers), self.device)
        else:
            self.optim = EngineOptimizer.from_config(self.model, c, params_dtype=params_dtype, device=self.device)
        self.state_offload = StateOffload(self.model, self.device, self.optim)  # actor.offload_while_rollout

    # ---------------------------------------------------------------- weights and checkpoints

    def load_hf_weights(self, state_dict_or_path) -> None:
        """Load HF-named full tensors (state_dict or safetensors dir) into this rank's shards."""
        if self._tied_stage_copy():
            state_dict_or_path = pipeline_mod.TiedHeadAlias(weights_mod._as_source(state_dict_or_path))
        weights_mod.load_hf_weights(self.model, state_dict_or_path)
        if self.optim is not None:
            self.optim.masters_from_params()

    def export_hf_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs of the WHOLE model, gathered over TP in buckets and, with
        pp_size > 1, merged over the pipeline stages (pipeline.merge_stages): every rank gets every
        tensor, so any rank can feed a rollout engine. Collective: all TP and PP ranks must iterate."""
        self.onload(state=False)  # offloaded params come back for the export (the optimizer's state stays away)
        it = weights_mod.export_hf_weights(self.model, bucket_bytes)
        if self.pp_size == 1:
            return it
        if self._tied_stage_copy():  # the last stage's tied head copy is the first stage's embedding
            it = ((n, t) for n, t in it if n != "lm_head.weight")
        return pipeline_mod.merge_stages(it, bucket_bytes, self.device)

    def _tied_stage_copy(self) -> bool:
        """True on a later pipeline stage holding a copy of the tied embedding as its LM head."""
        return self.pp_size > 1 and self.model.share_embeddings_and_output_weights and not self.model.pre_process

    def export_lora_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters' (PEFT name, full tensor) pairs, every stage's on every rank (as export_hf_weights)."""
        it = self.lora.export()
        return it if self.pp_size == 1 else pipeline_mod.merge_stages(it, bucket_bytes, self.device)

    def state_dict(self) -> dict[str, Any]:
        """This rank's model shards (with LoRA: the adapters only; the base is the initial model; no `_extra_state`:
        weights.checkpoint_state) + its pieces of the optimizer state (optim.py: keyed by parameter name and element
        range) + scheduler, for checkpoints: tensors and plain values only."""
        self.onload()
        model = self.lora.state_dict() if self.lora else weights_mod.checkpoint_state(self.model)
        sd: dict[str, Any] = {"model": model}
        if self.optim is not None:
            sd.update(self.optim.state_dict())
        return sd

    def load_state_dict(self, sd: dict[str, Any], optimizer_pieces: list[tuple[dict[str, Any], bool]] | None = None
                        ) -> None:
        """Load state_dict's output. optimizer_pieces: when the checkpoint was written at another data-parallel
        size, the ranks' `sd["optimizer"]["params"]` of this rank's TP/PP coordinates, each with whether it is of
        this rank's expert-parallel rank (EngineOptimizer.load_state_dict takes this rank's pieces from them)."""
        self.onload()
        model = sd["model"] if self.lora else weights_mod.with_own_extra_state(self.model, sd["model"])
        (self.lora or self.model).load_state_dict(model)
        if self.optim is not None:
            self.optim.load_state_dict(sd, optimizer_pieces)

    # ---------------------------------------------------------------- micro-batching

    def make_micro_batches(self, tensors: dict[str, torch.Tensor], seq_lens: torch.Tensor, *,
                           forward_only: bool = False) -> list[MicroBatch]:
        """micro_batch.make_micro_batches under this engine's max_tokens_per_micro_batch (its docstring says how);
        forward_only: the forward-only passes' budget (forward_max_tokens_per_micro_batch)."""
        return make_micro_batches(tensors, seq_lens, self._budget(forward_only))

    def _budget(self, forward_only: bool) -> int:
        return self.forward_max_tokens_per_micro_batch if forward_only else self.max_tokens_per_micro_batch

    # ---------------------------------------------------------------- forward

    def _trunk(self, input_ids: torch.Tensor, seq_lens: torch.Tensor | None = None,
               routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s] ids -> [b, s, H] hidden (hidden modes) or [b, s, V_local_padded] logits. seq_lens: the rows'
        lengths, for the MoE router statistics (which count real tokens only). routed_experts [b, s, L, k]: the
        experts the MoE layers route the tokens to (routing replay; None: the router's own top-k)."""
        if routed_experts is not None:
            if self.pp_size > 1 or self.sequence_parallel:
                raise ValueError("routing replay needs the whole layer stack and sequence on each rank "
                                 "(pipeline_parallel_size = 1, no sequence parallelism)")
            self.routing_replay.set(self._to_device(routed_experts[:, :input_ids.shape[1]]))
        elif self.routing_replay.active:
            self.routing_replay.clear()
        input_ids = self._to_device(input_ids)
        b, s = input_ids.shape
        width = s
        if self.sequence_parallel and s % self.tp_size:  # the sequence is split over the TP ranks: pad it (on the
            width = s + self.tp_size - s % self.tp_size  # right, where causal attention keeps it from real tokens)
            input_ids = torch.cat([input_ids, input_ids.new_zeros(b, width - s)], dim=1)
        position_ids = torch.arange(width, device=self.device).unsqueeze(0).expand(b, width)
        if self.router_stats.recording and seq_lens is not None:  # megatron's token order is [s, b]
            lens = self._to_device(torch.as_tensor(seq_lens))
            valid = (position_ids < lens.unsqueeze(1)).t()
            if self.sequence_parallel:  # this TP rank's routers see its block of the sequence
                valid = valid.chunk(self.tp_size)[parallel_state.get_tensor_model_parallel_rank()]
            self.router_stats.valid = valid.reshape(-1)
        out = self.model(input_ids, position_ids, None)
        return out if width == s else out[:, :s]

    @staticmethod
    def _valid(mask: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """[b, s] bool: mask & inside the row & t >= 1 (no prediction for the first token)."""
        s = mask.shape[1]
        pos = torch.arange(s, device=mask.device)
        return mask.bool() & (pos.unsqueeze(0) < seq_lens.to(mask.device).unsqueeze(1)) & (pos >= 1)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return host_to_device(t, self.device)

    def _head_rows_and_labels(self, input_ids, seq_lens, label_mask):
        """(rows, labels, check_bounds) for the head: row t-1 predicts token t where the label mask holds.
        Inputs on the host (how batches arrive): the row indices and the token-id range check are computed
        there, for free, and the head runs without a host sync (check_bounds=False). Inputs already on the
        device: a bool mask, and the head checks (its nonzero and range checks each sync once)."""
        valid = self._valid(label_mask.to(input_ids.device), seq_lens)
        rows = valid[:, 1:].reshape(-1)  # [N] bool
        labels = torch.where(rows, input_ids[:, 1:].reshape(-1), 0)
        if input_ids.device.type != "cpu":
            return rows.to(self.device), labels.to(self.device), True
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.vocab_size):
            bad = labels[(labels < 0) | (labels >= self.vocab_size)]
            raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5].tolist()}; the tokenizer and model.* disagree")
        index = rows.nonzero().squeeze(1)
        return self._to_device(index), self._to_device(labels), False

    def _token_logprobs(self, input_ids, seq_lens, label_mask, *, temperature, with_entropy, entropy_grad,
                        trunk_out=None, routed_experts=None):
        """-> logprobs [b, s] fp32, entropy [b, s] fp32 | None (0 outside the valid mask).
        trunk_out: the model output [b, s, X] when already computed (pipeline last stage)."""
        rows, labels, check = self._head_rows_and_labels(input_ids, seq_lens, label_mask)
        input_ids = self._to_device(input_ids)
        out = self._trunk(input_ids, seq_lens, routed_experts) if trunk_out is None else trunk_out  # [b, s, X]
        b, s = input_ids.shape
        prev = out[:, :-1].reshape(b * (s - 1), out.shape[-1])  # [N, X], row t-1 predicts token t
        kwargs = dict(rows=rows, with_entropy=with_entropy, entropy_grad=entropy_grad,
                      temperature=temperature, chunk_size=self.chunk_size, check_bounds=check)
        if self.fused:
            lp, ent = head_mod.fused_logprobs(self.model, prev, labels, backend=self.backend, sampled=self.sampled,
                                              **kwargs)
        else:
            lp, ent = head_mod.unfused_logprobs(self.model, prev, labels, **kwargs)
        zero_col = torch.zeros(b, 1, dtype=torch.float32, device=self.device)
        return tuple(None if x is None else torch.cat([zero_col, x.view(b, s - 1)], dim=1) for x in (lp, ent))

    def _token_values(self, input_ids, seq_lens, mask, trunk_out=None):
        """-> values [b, s] fp32: entry t = V(x_<t) from the hidden state at t-1; 0 outside mask."""
        valid = self._valid(mask.to(self.device), seq_lens)
        hidden = self._trunk(input_ids, seq_lens) if trunk_out is None else trunk_out  # [b, s, H]
        v = self.model.value_head(hidden[:, :-1]).squeeze(-1).float()  # [b, s-1]
        v = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
        return torch.where(valid, v, torch.zeros_like(v))

    def _check_replay(self, routed: bool) -> None:
        """Routing replay (routed experts given) is wired for whole layer stacks: refused under pipeline parallelism."""
        if routed and self.pp_size > 1:
            raise ValueError("routing replay needs pipeline_parallel_size = 1 (each stage would need its layers' part)")

    def _check_rows(self, input_ids, seq_lens):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] < 2:
            raise ValueError("input_ids must have S >= 2 (no token has a prediction otherwise)")
        return torch.as_tensor(seq_lens).long()

    @torch.no_grad()
    @expert_collectives_on_cpu
    def forward_logprobs(self, input_ids, seq_lens, label_mask, *, temperature: float = 1.0,
                         with_entropy: bool = True, routed_experts: torch.Tensor | None = None):
        """input_ids [B, S] right-padded, seq_lens [B], label_mask [B, S] bool ->
        (logprobs [B, S] fp32, entropy [B, S] fp32 | None); entry t = log p(x_t | x_<t) where
        label_mask (t >= 1, t < seq_len), 0 elsewhere. No grad. Micro-batched by token budget.
        routed_experts [B, S, L, k]: route the MoE layers' tokens to these experts (rollout routing replay)."""
        if self.role == "critic":
            raise ValueError("forward_logprobs is for role 'actor' or 'ref'; the critic has forward_values")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        seq_lens = self._check_rows(input_ids, seq_lens)
        self._check_replay(routed_experts is not None)
        self.onload()
        self.model.eval()
        B, S = input_ids.shape
        lp_out = torch.zeros(B, S, dtype=torch.float32)
        ent_out = torch.zeros(B, S, dtype=torch.float32) if with_entropy else None
        if self.pp_size > 1:
            mbs = self.make_micro_batches({"input_ids": input_ids, "label_mask": label_mask}, seq_lens,
                                          forward_only=True)

            def head(mb: MicroBatch, out):
                lp, ent = self._token_logprobs(mb.input_ids, mb.seq_lens, mb.label_mask,
                                               temperature=temperature, with_entropy=with_entropy,
                                               entropy_grad=False, trunk_out=out)
                lp_out[mb.sample_idx, : lp.shape[1]] = lp.cpu()
                if with_entropy:
                    ent_out[mb.sample_idx, : ent.shape[1]] = ent.cpu()

            self._pp_forward_only(mbs, head)
            pipeline_mod.broadcast_from_last_stage(lp_out, self.device)
            if with_entropy:
                pipeline_mod.broadcast_from_last_stage(ent_out, self.device)
            return lp_out.to(input_ids.device), None if ent_out is None else ent_out.to(input_ids.device)
        tensors = {"input_ids": input_ids, "label_mask": label_mask}
        if routed_experts is not None:
            tensors["routed_experts"] = routed_experts
        mbs = self.make_micro_batches(tensors, seq_lens, forward_only=True)
        idle = self._expert_padding_passes(len(mbs))  # agreed before any rank enters an expert collective
        for mb in mbs:
            lp, ent = self._token_logprobs(mb.input_ids, mb.seq_lens, mb.label_mask,
                                           temperature=temperature, with_entropy=with_entropy,
                                           entropy_grad=False, routed_experts=mb.routed_experts)
            w = lp.shape[1]
            lp_out[mb.sample_idx, :w] = lp.cpu()
            if with_entropy:
                ent_out[mb.sample_idx, :w] = ent.cpu()
        for _ in range(idle):
            self._idle_pass()
        return lp_out.to(input_ids.device), None if ent_out is None else ent_out.to(input_ids.device)

    @torch.no_grad()
    @expert_collectives_on_cpu
    def forward_values(self, input_ids, seq_lens, mask):
        """Critic values [B, S] fp32 (entry t = V(x_<t)), 0 outside mask. No grad."""
        if self.role != "critic":
            raise ValueError(f"forward_values needs role='critic', this engine is {self.role!r}")
        seq_lens = self._check_rows(input_ids, seq_lens)
        self.onload()
        self.model.eval()
        B, S = input_ids.shape
        out = torch.zeros(B, S, dtype=torch.float32)
        if self.pp_size > 1:
            def head(mb: MicroBatch, trunk_out):
                v = self._token_values(mb.input_ids, mb.seq_lens, mb.label_mask, trunk_out=trunk_out)
                out[mb.sample_idx, : v.shape[1]] = v.cpu()

            self._pp_forward_only(self.make_micro_batches({"input_ids": input_ids, "label_mask": mask}, seq_lens,
                                                          forward_only=True), head)
            return pipeline_mod.broadcast_from_last_stage(out, self.device).to(input_ids.device)
        mbs = self.make_micro_batches({"input_ids": input_ids, "label_mask": mask}, seq_lens, forward_only=True)
        for _ in range(self._expert_padding_passes(len(mbs))):
            self._idle_pass()
        for mb in mbs:
            v = self._token_values(mb.input_ids, mb.seq_lens, mb.label_mask)
            out[mb.sample_idx, : v.shape[1]] = v.cpu()
        return out.to(input_ids.device)

    # ---------------------------------------------------------------- training

    def _grad_norm(self, grads: list[torch.Tensor | None]) -> torch.Tensor:  # engine methods: profilers wrap them
        return self.optim.grad_norm(grads)

    def _clip(self, grads: list[torch.Tensor | None], norm: float) -> None:
        self.optim.clip(grads, norm)

    def _outputs(self, mb: MicroBatch, *, temperature: float, entropy_grad: bool, trunk_out=None) -> ModelOutputs:
        """The model's outputs for the loss: values (critic, over mb.label_mask) or log-probs and entropy."""
        seq_lens = self._check_rows(mb.input_ids, mb.seq_lens)
        if mb.label_mask is None:
            raise ValueError("a train-step micro-batch needs label_mask [b, s] (the positions the loss reads)")
        if self.role == "critic":
            return ModelOutputs(values=self._token_values(mb.input_ids, seq_lens, mb.label_mask, trunk_out=trunk_out))
        lp, ent = self._token_logprobs(mb.input_ids, seq_lens, mb.label_mask, temperature=temperature,
                                       with_entropy=True, entropy_grad=entropy_grad, trunk_out=trunk_out,
                                       routed_experts=mb.routed_experts)
        return ModelOutputs(logprobs=lp, entropy=ent)

    @expert_collectives_on_cpu
    def train_step(self, micro_batches: Sequence[MicroBatch | Mapping[str, Any]],
                   loss_fn: LossFn | Callable[[ModelOutputs, MicroBatch], Any], *,
                   temperature: float = 1.0) -> dict[str, float]:
        """Gradient accumulation over `micro_batches`, then clip + AdamW + scheduler step.

        micro_batches: `MicroBatch`es (make_micro_batches), or flat dicts of the same names (MicroBatch.from_mapping:
        the tools' hand-built ones). loss_fn (loss_protocol.LossFn): loss_fn(outputs, mb) -> (loss 0-dim, metrics
        of floats/0-dim tensors), where outputs (ModelOutputs) holds logprobs and entropy [b, s] for the actor
        (entropy carries grad only if `loss_fn.needs_entropy_grad`, False when the loss does not declare it) or
        values [b, s] for the critic, over mb.label_mask. temperature: the logits are divided by it (the
        sampler's; 1 = the model's own distribution; the critic ignores it). Each micro-batch's loss is
        multiplied by mb.loss_scale (its share of the mini-batch; None: 1/len) before backward. Gradients are
        averaged over data-parallel ranks. Returns the micro-batch mean of the metrics plus `grad_norm` (before
        clipping) and `lr` (of this step). A NaN/inf loss or grad norm raises FloatingPointError and no step is
        taken.
        """
        if self.optimizer is None:
            raise ValueError(f"train_step needs role 'actor' or 'critic', this engine is {self.role!r}")
        if not micro_batches:
            raise ValueError("train_step got no micro-batches")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        micro_batches = [as_micro_batch(mb) for mb in micro_batches]
        self._check_replay(any(mb.routed_experts is not None for mb in micro_batches))
        needs_entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", False))  # a plain function declares none
        temperature = float(temperature)
        self.onload()
        self.model.train()
        self.optim.zero_grad()
        if self.router_stats:
            self.router_stats.start()
        sums: dict[str, Any] = {}  # metric sums: python floats or 0-dim device tensors (summed without a sync)
        losses: list[torch.Tensor] = []  # per micro-batch, checked for NaN/inf after the backward passes
        if self.pp_size > 1:
            sums = self._pp_accumulate(micro_batches, loss_fn, temperature, needs_entropy_grad)
        for _ in range(self._expert_padding_passes(len(micro_batches)) if self.pp_size == 1 else 0):
            self._idle_pass(backward=True)  # before the real ones: the last real backward stays the last
        for i, mb in enumerate(micro_batches if self.pp_size == 1 else ()):
            outputs = self._outputs(mb, temperature=temperature, entropy_grad=needs_entropy_grad)
            loss, metrics = loss_fn(outputs, mb)
            losses.append(loss.detach().float().reshape(()))
            scale = 1.0 / len(micro_batches) if mb.loss_scale is None else mb.loss_scale
            if i == len(micro_batches) - 1:
                self.optim.arm()  # the last backward: data-parallel buckets start as their grads complete
            if self._aux_losses:
                set_aux_loss_scale(scale, self.device)
            (loss * float(scale)).backward()
            for k, v in {"loss": loss, **metrics}.items():
                v = v.detach().float().reshape(()) if torch.is_tensor(v) else float(v)
                sums[k] = sums.get(k, 0.0) + v
        grads = self.optim.reduce_grads()  # this rank's pieces' (optim.py)
        moe_stats = self.router_stats.finish() if self.router_stats else {}
        # the step's one host sync: grad norm, every micro-batch loss and the device metric sums in one copy
        tensor_keys = [k for k, v in sums.items() if torch.is_tensor(v)]
        fetched = torch.stack([self._grad_norm(grads), *losses,
                               *(sums[k].to(self.device) for k in tensor_keys), *moe_stats.values()]).tolist()
        grad_norm, fetched = fetched[0], fetched[1:]
        moe_stats = dict(zip(moe_stats, fetched[len(fetched) - len(moe_stats):]))
        fetched = fetched[:len(fetched) - len(moe_stats)]
        sums.update(zip(tensor_keys, fetched[len(losses):]))
        bad = [x for x in fetched[:len(losses)] if not math.isfinite(x)]
        if bad or not math.isfinite(grad_norm):
            self.optim.zero_grad()
            what = f"loss is {bad[0]} in a micro-batch" if bad else f"grad norm is {grad_norm}"
            raise FloatingPointError(f"{what}; no optimizer step taken")
        self._clip(grads, grad_norm)
        lr = self.optim.step()
        out = {k: v / len(micro_batches) for k, v in sums.items()}
        out.update(grad_norm=grad_norm, lr=lr, **moe_stats)
        return out
