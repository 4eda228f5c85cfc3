"""The "hf" rollout engine: batched sampling with a KV cache on a transformers causal LM (CPU default).
It samples and reports sampler log-probs; it must not compute rewards, re-tokenize text or show progress bars.

Algorithm: prompts x n rows are processed in chunks of `max_batch_size`. Each chunk is left-padded
(attention mask 0 on padding, position ids counted from each row's first real token), prefilled
once, then decoded one token per step with the model's KV cache until every row has finished or
`max_tokens` steps ran. Finished rows keep being fed (their outputs are ignored) so the cache stays
rectangular. A row finishes on an EOS id, a `stop_token_ids` id (both kept in `token_ids`), or when
the decoded text of its generated tokens contains a `stop` string (the completing token is kept;
only generated text is searched, never the prompt).

With return_routed_experts (Mixture-of-Experts models, for rollout routing replay) each response carries the experts
every MoE router picked for each token it processed, prompt then response (`RolloutResponse.routed_experts`),
recorded by forward hooks on transformers' routers.

Sampler log-probs are log softmax(logits / T) of the sampled token before top-k/top-p filtering
(log softmax(logits) when greedy), computed in fp32 from the same logits the sample is drawn from. With
true_on_policy (rollout.true_on_policy) the model computes through ops/invariant.py and the log-prob is that of the
distribution sampled from (after top-k/top-p, renormalized), bit for bit the Megatron actor's.

sleep(level=1) moves the weights to CPU (on a GPU into page-locked host copies kept between sleeps; a no-op on a
CPU engine); sleep(level=2) drops the weights
(parameters go to the meta device, buffers such as rotary tables are kept on CPU) and wake_up()
re-allocates them empty: update_weights must then load every parameter before generate is allowed.
The KV cache only lives inside one generate call, so there is no cache to free between calls.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from rltrain.models.hf_experts import per_expert_views
from rltrain.models.lora import HFAdapters, LoraSpec
from rltrain.ops import invariant as inv
from rltrain.ops.exact import exp
from rltrain.rollout.base import Engine, RolloutResponse, SamplingParams, check_prompts


def sample_next_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None,
                      *, true_on_policy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: [B, V] (any float dtype; computed in fp32).

    Returns (tokens [B] long, logprobs [B] fp32) where logprobs are the tokens' log-probs under
    softmax(logits / T) before top-k/top-p filtering (softmax(logits) when T == 0, greedy argmax).
    true_on_policy: the token is drawn from, and its log-prob is that of, the distribution actually sampled from:
    softmax(logits / T) restricted to the top-k / top-p set and renormalized (ops.invariant.log_softmax, the
    function the actor's head computes it with).
    """
    if true_on_policy:
        greedy = sampling.greedy
        lp_all = inv.log_softmax(logits, 1.0 if greedy else sampling.temperature,
                                 -1 if greedy else sampling.top_k, 1.0 if greedy else sampling.top_p)  # [B, V] fp64
        tokens = lp_all.argmax(-1) if greedy else torch.multinomial(exp(lp_all), 1, generator=generator).squeeze(-1)
        return tokens, lp_all.gather(-1, tokens[:, None]).squeeze(-1).float()
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / sampling.temperature  # [B, V]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    filtered = filter_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
    probs = torch.softmax(filtered, dim=-1)
    tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k set and outside the nucleus (smallest set with mass >= top_p,
    always at least one token) to -inf. logits: [B, V]; top_k <= 0 disables top-k; ties at the
    k-th value are kept."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
        remove_sorted = mass_before >= top_p
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


class HFEngine(Engine):
    """Sampling engine on a transformers causal LM.

    model: a PreTrainedModel, or a path / hub name for AutoModelForCausalLM.from_pretrained.
    tokenizer: anything with decode(list[int]) -> str; needed only for `stop` strings (loaded from
        the model path when one is given and it holds a tokenizer).
    eos_token_id: int or list; default tokenizer.eos_token_id, else the model's generation config.
    pad_token_id: filler id for left padding (masked out); default tokenizer pad, else EOS, else 0.
    max_batch_size: rows (prompts x n) per forward batch.
    return_routed_experts: record the MoE routing of every token (RolloutResponse.routed_experts).
    lora: the actor trains LoRA adapters (actor.lora): the model gets them (models/lora.HFAdapters, B = 0 until the
        first update) and update_weights takes their PEFT-named tensors, the base staying as it is.
    true_on_policy: the model computes through ops/invariant.py (models/invariant_hf.py) and samples with
        sample_next_token(true_on_policy=True): its log-probs are the Megatron actor's to the bit
        (rollout.true_on_policy).
    """

    def __init__(self, model, *, tokenizer=None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 64,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 return_routed_experts: bool = False, lora: LoraSpec | None = None,
                 true_on_policy: bool = False) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"HFEngine max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if isinstance(model, (str, os.PathLike)):
            model, tokenizer = _load_pretrained(str(model), tokenizer, dtype)
        self.device = torch.device(device)
        self.dtype = dtype
        if next(model.parameters()).dtype != dtype:
            model = model.to(dtype=dtype)
        self.model = model.to(self.device).eval()
        self.true_on_policy = true_on_policy
        if true_on_policy:
            from rltrain.models.invariant_hf import make_invariant

            make_invariant(self.model)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            gen_cfg = getattr(model, "generation_config", None)
            eos_token_id = getattr(gen_cfg, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(model.config, "eos_token_id", None)
        self._eos = _as_id_tuple(eos_token_id)
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (self._eos[0] if self._eos else 0)
        self._asleep_level = 0
        self._host: list[torch.Tensor] | None = None  # level 1 on a GPU: the weights' pinned host copies
        self._buffers_backup: dict[str, torch.Tensor] = {}
        self._missing_params: set[int] = set()  # ids of parameters still empty after a level-2 wake_up
        self._routing = _RoutingRecorder(self.model) if return_routed_experts else None
        self.adapters = None if lora is None else HFAdapters(self.model, lora)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResponse]:
        check_prompts(prompts_token_ids)
        if self._asleep_level:
            raise RuntimeError("HFEngine.generate called while asleep; call wake_up() first")
        if self._missing_params:
            raise RuntimeError(f"HFEngine woke from sleep(level=2) but {len(self._missing_params)} parameters were "
                               "never loaded; call update_weights with the full model before generate")
        if sampling.stop and not callable(getattr(self.tokenizer, "decode", None)):
            raise ValueError("SamplingParams.stop strings need a tokenizer with decode(); pass HFEngine(tokenizer=...)")
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed)
        rows = [(i, list(p)) for i, p in enumerate(prompts_token_ids) for _ in range(sampling.n)]
        responses: list[RolloutResponse] = []
        for start in range(0, len(rows), self.max_batch_size):
            responses.extend(self._generate_chunk(rows[start:start + self.max_batch_size], sampling, generator))
        return responses

    def _generate_chunk(self, rows: list[tuple[int, list[int]]], sampling: SamplingParams,
                        generator: torch.Generator | None) -> list[RolloutResponse]:
        batch = len(rows)
        width = max(len(p) for _, p in rows)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for b, (_, prompt) in enumerate(rows):
            input_ids[b, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[b, width - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1)
        next_position = position_ids[:, -1:] + 1  # [B, 1]
        routing = [self._routing.take(batch)] if self._routing else []  # [B, width, L, k], then [B, 1, L, k] a step

        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None] * batch
        stop_reason: list[str | int | None] = [None] * batch
        stop_ids, eos = set(sampling.stop_token_ids), set(self._eos)
        for step in range(sampling.max_tokens):
            next_tokens, next_logprobs = sample_next_token(out.logits[:, -1, :], sampling, generator,
                                                           true_on_policy=self.true_on_policy)
            token_list, logprob_list = next_tokens.tolist(), next_logprobs.tolist()
            for b in range(batch):
                if finish[b] is not None:
                    continue
                tok = token_list[b]
                tokens[b].append(tok)
                logprobs[b].append(logprob_list[b])
                if tok in stop_ids:
                    finish[b], stop_reason[b] = "stop", tok
                elif tok in eos:
                    finish[b] = "stop"
                elif sampling.stop and (hit := _first_stop_string(self.tokenizer.decode(tokens[b]), sampling.stop)):
                    finish[b], stop_reason[b] = "stop", hit
                elif step + 1 == sampling.max_tokens:
                    finish[b] = "length"
            if all(f is not None for f in finish):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=-1)
            out = self.model(input_ids=next_tokens[:, None].to(self.device), attention_mask=attention_mask,
                             position_ids=next_position, past_key_values=out.past_key_values, use_cache=True)
            next_position = next_position + 1
            if self._routing:
                routing.append(self._routing.take(batch))
        del out  # the KV cache dies with this call
        if routing:  # row b: its real prompt tokens, then the response tokens it was fed (all but possibly the last)
            routing = torch.cat(routing, dim=1)
            routing = [routing[b, width - len(rows[b][1]):width + len(tokens[b])] for b in range(batch)]
        return [RolloutResponse(prompt_index=rows[b][0], token_ids=tokens[b], logprobs=logprobs[b],
                                finish_reason=finish[b], stop_reason=stop_reason[b],
                                routed_experts=routing[b] if routing else None) for b in range(batch)]

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each (HF name, tensor) into the model as it arrives; tied aliases such as
        `lm_head.weight` are accepted. Returns how many tensors were loaded."""
        if self._asleep_level == 2:
            raise RuntimeError("HFEngine.update_weights after sleep(level=2): call wake_up() first "
                               "(it allocates empty weights for the update to fill)")
        targets = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            targets.update(per_expert_views(name, param))  # MoE: checkpoint names of the fused expert tensors
        targets.update(self.model.named_buffers(remove_duplicate=False))
        if self.adapters is not None:
            targets.update(self.adapters.tensors)  # LoRA: the adapters by their PEFT names
        loaded = 0
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                example = next(iter(targets), "")
                raise ValueError(f"update_weights: {name!r} is not a parameter of the rollout model "
                                 f"{type(self.model).__name__}; expected HF names such as {example!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the rollout model expects {tuple(target.shape)}")
            target.copy_(tensor)  # converts dtype/device without keeping a second copy
            self._missing_params.discard(id(target._base if target._base is not None else target))
            loaded += 1
        return loaded

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(
                f"HFEngine.sleep level must be 1 (offload weights to CPU) or 2 (drop weights), got {level!r}")
        if self._asleep_level:
            return
        if level == 1:
            if self.device.type == "cuda":
                self._offload_pinned()
            else:
                self.model.to("cpu")
        else:
            self._buffers_backup = {n: b.detach().to("cpu", copy=True) for n, b in self.model.named_buffers()}
            self.model.to("meta")
        self._asleep_level = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer of the model once (a tied weight is one Parameter)."""
        return [*self.model.parameters(), *self.model.buffers()]

    @torch.no_grad()
    def _offload_pinned(self) -> None:
        """Level 1 on a GPU: each weight into its own page-locked host copy, kept between sleeps (allocated at the
        first sleep), then the GPU storage released. `model.to("cpu")` allocated pageable memory at every sleep and
        copied through it: 0.54 s for the Qwen3-0.6B's 1.19 GB on one host, 0.13 s on another."""
        tensors = self._tensors()
        if self._host is None:
            self._host = [torch.empty_like(t, device="cpu").pin_memory() for t in tensors]
        for t, h in zip(tensors, self._host):
            h.copy_(t, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the host copies are whole before the GPU's go
        for t, h in zip(tensors, self._host):
            t.data = h

    @torch.no_grad()
    def _reload_pinned(self) -> None:
        for t, h in zip(self._tensors(), self._host):
            t.data = torch.empty_like(h, device=self.device).copy_(h, non_blocking=True)
        # stream-ordered: generate's kernels and the next sleep's copies into the same host buffers run after these

    def wake_up(self) -> None:
        if self._asleep_level == 1:
            if self.device.type == "cuda":
                self._reload_pinned()
            else:
                self.model.to(self.device)
        elif self._asleep_level == 2:
            self.model.to_empty(device=self.device)
            # to("meta") / to_empty give each module a new Parameter: tied weights (lm_head = embeddings) come
            # back as two; tie them again, so one update of the shared name fills both
            if callable(getattr(self.model, "tie_weights", None)):
                self.model.tie_weights()
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(self._buffers_backup[name])
            self._buffers_backup = {}
            self._missing_params = {id(p) for p in self.model.parameters()}
        self._asleep_level = 0


class _RoutingRecorder:
    """The experts each MoE router of a transformers model (Qwen3-MoE's `mlp.gate`: a TopKRouter whose forward
    returns (logits, top-k weights, top-k indices)) picked for each token of a forward, in layer order."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        if not self.routers:
            raise ValueError(f"return_routed_experts needs a Mixture-of-Experts model; {type(model).__name__} has "
                             "no MoE router")
        self.dtype = torch.uint8 if self.routers[0].num_experts <= 256 else torch.int16
        self._picked: list[torch.Tensor] = []
        for router in self.routers:
            router.register_forward_hook(self._on_forward)

    def _on_forward(self, router, inputs, output) -> None:
        self._picked.append(output[2].to(self.dtype))  # [tokens, k], tokens batch-major

    def take(self, batch: int) -> torch.Tensor:
        """[batch, s, L, k] (on the host) of the forward since the last take."""
        if len(self._picked) != len(self.routers):
            raise RuntimeError(f"expected one routing per MoE layer ({len(self.routers)}), got {len(self._picked)}")
        picked, self._picked = torch.stack(self._picked, dim=1), []
        return picked.view(batch, -1, *picked.shape[1:]).cpu()


def _first_stop_string(text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string occurring earliest in text (None if none occurs)."""
    best, best_pos = None, len(text) + 1
    for s in stops:
        pos = text.find(s)
        if pos != -1 and pos < best_pos:
            best, best_pos = s, pos
    return best


def _load_pretrained(path: str, tokenizer, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    except OSError as err:
        raise ValueError(f"HFEngine could not load a causal LM from {path!r} (rollout model path): {err}") from err
    if tokenizer is None and os.path.exists(os.path.join(path, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return model, tokenizer
