"""The Batch that crosses stages (rollout -> rewards -> log-probs -> advantages -> update).

Holds padded tensors grouped by role plus per-row Python values; it must not know about models,
workers or Ray: it only slices, pads, concatenates and re-lays out rows.

Layout: prompts are LEFT-padded to width P (so all prompts end at column P-1 and generation starts
at column P), responses are RIGHT-padded to width R. Per-token scores live in the response layout
`[B, R]` and are 0 outside `response_mask`. `full_sequences()` builds the right-padded
`[B, P+R]` layout models consume (prompt without its left pad, then the response) and
`response_from_full()` cuts per-token results on that layout back to `[B, R]`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

# Optional per-token fields in the response layout, and the optional per-row ones.
_TOKEN_FIELDS = ("sampler_logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "token_rewards",
                 "advantages", "returns", "weight_versions")
_ROW_FIELDS = ("scores", "group_ids", "dummy_mask")
# MoE routing of each token ([B, width, L, k] expert ids): the prompt's in the prompt layout, the response's in the
# response layout.
_ROUTING_FIELDS = {"prompt_routed_experts": "prompt_ids", "routed_experts": "response_ids"}


@dataclass
class Batch:
    # ---- input: the prompt ----
    prompt_ids: Tensor  # [B, P] int64 prompt token ids, LEFT-padded (pad value irrelevant: see prompt_mask)
    prompt_mask: Tensor  # [B, P] int64 1 on real prompt tokens, 0 on left padding
    # ---- response: what the policy produced ----
    response_ids: Tensor  # [B, R] int64 response token ids (model + tool-output tokens), RIGHT-padded
    response_mask: Tensor  # [B, R] int64 1 on every real response token (tool output included), 0 on padding
    loss_mask: Tensor  # [B, R] int64 1 on tokens the model generated (trained on); 0 on tool output and padding
    # ---- scores: per token in the response layout, fp32, 0 outside response_mask ----
    sampler_logprobs: Tensor | None = None  # [B, R] log pi_sampler(a_t | s_t) reported by the rollout engine
    old_logprobs: Tensor | None = None  # [B, R] log pi_old(a_t | s_t) recomputed by the actor before the update
    ref_logprobs: Tensor | None = None  # [B, R] log pi_ref(a_t | s_t) from the frozen reference model
    teacher_logprobs: Tensor | None = None  # [B, R] log pi_teacher(a_t | s_t) from the distillation teacher (teacher.*)
    values: Tensor | None = None  # [B, R] critic V(s_t) (PPO)
    token_rewards: Tensor | None = None  # [B, R] per-token reward (score on the last token, minus KL-in-reward)
    advantages: Tensor | None = None  # [B, R] A_t from the advantage estimator
    returns: Tensor | None = None  # [B, R] value targets (PPO)
    weight_versions: Tensor | None = None  # [B, R] int64 policy version of the rollout weights that sampled each token
    #   (the number of updates they reflect; set by trainer/rollout_source.py), 0 outside response_mask
    # ---- MoE routing the rollout engine used (rollout routing replay, docs/moe.md): expert ids per token ----
    prompt_routed_experts: Tensor | None = None  # [B, P, L, k] uint8/int16 (L: the MoE layers), LEFT-padded
    routed_experts: Tensor | None = None  # [B, R, L, k] the response tokens' experts, RIGHT-padded
    scores: Tensor | None = None  # [B] fp32 scalar reward of each response from the reward function
    # ---- ids ----
    group_ids: Tensor | None = None  # [B] int64 rows sharing a prompt (the n samples of GRPO) share an id
    dummy_mask: Tensor | None = None  # [B] bool True on rows added by pad_to_multiple (all their masks are 0)
    # ---- per-row Python values (ground_truth, data_source, prompt text, finish_reason, ...) ----
    non_tensor: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        b = self.prompt_ids.shape[0]
        for name in ("prompt_mask",):
            assert getattr(self, name).shape == self.prompt_ids.shape, f"{name} must match prompt_ids {tuple(self.prompt_ids.shape)}"
        for name in ("response_mask", "loss_mask", *_TOKEN_FIELDS):
            t = getattr(self, name)
            assert t is None or t.shape == self.response_ids.shape, (
                f"{name} has shape {tuple(t.shape)}, expected {tuple(self.response_ids.shape)}"
            )
        for name in _ROW_FIELDS:
            t = getattr(self, name)
            assert t is None or t.shape == (b,), f"{name} has shape {tuple(t.shape)}, expected ({b},)"
        for name, like in _ROUTING_FIELDS.items():
            t = getattr(self, name)
            assert t is None or (t.dim() == 4 and t.shape[:2] == getattr(self, like).shape), (
                f"{name} has shape {tuple(t.shape)}, expected {tuple(getattr(self, like).shape)} + (layers, top-k)")
        assert (self.prompt_routed_experts is None) == (self.routed_experts is None), \
            "prompt_routed_experts and routed_experts are set together"
        assert self.response_ids.shape[0] == b
        for k, v in self.non_tensor.items():
            assert len(v) == b, f"non_tensor[{k!r}] has {len(v)} entries for {b} rows"

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_lengths(self) -> Tensor:  # [B]
        return self.prompt_mask.sum(-1)

    @property
    def response_lengths(self) -> Tensor:  # [B]
        return self.response_mask.sum(-1)

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if f.name != "non_tensor"]

    # ------------------------------------------------------------------ row selection
    def select(self, index: Tensor | Sequence[int] | Sequence[bool]) -> "Batch":
        """Rows by integer index ([K] int) or boolean mask ([B] bool); order follows `index`."""
        idx = torch.as_tensor(index)
        if idx.dtype == torch.bool:
            if idx.shape != (len(self),):
                raise ValueError(f"boolean mask must have shape ({len(self)},), got {tuple(idx.shape)}")
            idx = idx.nonzero().flatten()
        idx = idx.to(torch.long).flatten()
        kw = {}
        for name in self._tensor_fields():
            t = getattr(self, name)
            kw[name] = None if t is None else t[idx.to(t.device)]
        pos = idx.tolist()
        kw["non_tensor"] = {k: [v[i] for i in pos] for k, v in self.non_tensor.items()}
        return Batch(**kw)

    def chunk(self, size: int) -> list["Batch"]:
        """Consecutive chunks of `size` rows (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        return [self.select(torch.arange(s, min(s + size, len(self)))) for s in range(0, len(self), size)]

    def split(self, n_chunks: int) -> list["Batch"]:
        """`n_chunks` consecutive chunks whose sizes differ by at most one (the first ones larger).

        For data-parallel dispatch call `pad_to_multiple(n_chunks)` first so all chunks are equal.
        """
        if not 1 <= n_chunks <= max(len(self), 1):
            raise ValueError(f"n_chunks must be in [1, {len(self)}] for a batch of {len(self)} rows, got {n_chunks}")
        base, extra = divmod(len(self), n_chunks)
        out, start = [], 0
        for i in range(n_chunks):
            n = base + (1 if i < extra else 0)
            out.append(self.select(torch.arange(start, start + n)))
            start += n
        return out

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order. Prompt widths are left-padded and response widths
        right-padded to the largest; an optional field must be set in all batches or in none."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        p = max(b.prompt_ids.shape[1] for b in batches)
        r = max(b.response_ids.shape[1] for b in batches)
        keys = set(batches[0].non_tensor)
        for i, b in enumerate(batches):
            if set(b.non_tensor) != keys:
                raise ValueError(f"batch {i} has non_tensor keys {sorted(b.non_tensor)}, batch 0 has {sorted(keys)}")
        kw = {}
        for name in batches[0]._tensor_fields():
            ts = [getattr(b, name) for b in batches]
            if all(t is None for t in ts):
                kw[name] = None
                continue
            if any(t is None for t in ts):
                missing = [i for i, t in enumerate(ts) if t is None]
                raise ValueError(f"field {name!r} is set in some batches but None in batches {missing}")
            if name in ("prompt_ids", "prompt_mask", "prompt_routed_experts"):
                ts = [_pad_cols(t, p, left=True) for t in ts]
            elif name in ("response_ids", "response_mask", "loss_mask", "routed_experts", *_TOKEN_FIELDS):
                ts = [_pad_cols(t, r, left=False) for t in ts]
            kw[name] = torch.cat(ts, dim=0)
        kw["non_tensor"] = {k: [x for b in batches for x in b.non_tensor[k]] for k in batches[0].non_tensor}
        return Batch(**kw)

    def to(self, device: torch.device | str) -> "Batch":
        kw = {n: (None if getattr(self, n) is None else getattr(self, n).to(device)) for n in self._tensor_fields()}
        return Batch(**kw, non_tensor=self.non_tensor)

    def to_state(self) -> dict:
        """The batch as a plain dict of its fields (tensors, and the per-row values as they are): what a checkpoint
        holds of it (utils/plain.py), read back by `from_state`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> "Batch":
        """The batch `to_state` wrote (also an older checkpoint's pickled Batch, which utils/plain.py reads as the
        dict of its fields); an unknown field is refused by the constructor."""
        return cls(**state)

    def replace(self, **changes) -> "Batch":
        """A shallow copy with some fields replaced (e.g. `batch.replace(advantages=adv)`)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ data-parallel padding
    def pad_to_multiple(self, n: int) -> "Batch":
        """Append dummy rows so len(batch) % n == 0. A dummy row copies row 0's tokens (so models see a
        valid sequence) but has response_mask = loss_mask = 0, per-token scores 0, score 0, group id
        -1-k, and dummy_mask True; `drop_dummies()` removes them again."""
        if n <= 0:
            raise ValueError(f"pad_to_multiple needs a positive n, got {n}")
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch: there is no row to copy")
        k = (-len(self)) % n
        own = self if self.dummy_mask is not None else self.replace(
            dummy_mask=torch.zeros(len(self), dtype=torch.bool, device=self.prompt_ids.device)
        )
        if k == 0:
            return own
        pad = own.select(torch.zeros(k, dtype=torch.long))
        zero_like = lambda t: None if t is None else torch.zeros_like(t)  # noqa: E731
        changes = {name: zero_like(getattr(pad, name)) for name in ("response_mask", "loss_mask", "scores", *_TOKEN_FIELDS)}
        if pad.group_ids is not None:
            changes["group_ids"] = -1 - torch.arange(k, dtype=pad.group_ids.dtype, device=pad.group_ids.device)
        changes["dummy_mask"] = torch.ones(k, dtype=torch.bool, device=pad.prompt_ids.device)
        changes["non_tensor"] = {key: [None] * k for key in pad.non_tensor}
        return Batch.concat([own, pad.replace(**changes)])

    def drop_dummies(self) -> "Batch":
        """Remove the rows that pad_to_multiple added (a no-op without dummy_mask)."""
        if self.dummy_mask is None:
            return self
        return self.select(~self.dummy_mask.cpu()).replace(dummy_mask=None)

    # ------------------------------------------------------------------ sequence layout
    def full_sequences(self, pad_token_id: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Right-padded model input: for each row its real prompt tokens then its response tokens.

        Returns input_ids [B, P+R], attention_mask [B, P+R] (1 on prompt + real response tokens),
        seq_lens [B] and response_start [B] (column where the response begins = prompt length).
        Position t of a per-token result on this layout belongs to input_ids[:, t].
        """
        b, p = self.prompt_ids.shape
        r = self.response_ids.shape[1]
        prompt_lens = self.prompt_lengths  # [B]
        response_lens = self.response_lengths  # [B]
        seq_lens = prompt_lens + response_lens
        cols = torch.arange(p + r, device=self.prompt_ids.device).expand(b, -1)  # [B, P+R]
        # Source column in the concatenation [prompt (left-padded) | response] for each target column.
        src = cols + (p - prompt_lens)[:, None]  # [B, P+R]
        both = torch.cat([self.prompt_ids, self.response_ids], dim=1)  # [B, P+R]
        valid = cols < seq_lens[:, None]
        input_ids = torch.where(valid, both.gather(1, src.clamp(max=p + r - 1)), torch.full_like(both, pad_token_id))
        return input_ids, valid.to(self.prompt_mask.dtype), seq_lens, prompt_lens

    def full_routed_experts(self) -> Tensor:
        """The routing of full_sequences()' tokens: [B, P+R, L, k] int64 expert ids, position t the experts
        input_ids[:, t] went to. Padding holds experts 0..k-1 (any valid ids: causal attention keeps padding
        from the real tokens, and the model's outputs there are not read)."""
        if self.routed_experts is None:
            raise ValueError("this batch carries no MoE routing (the rollout engine returned none)")
        b, p = self.prompt_ids.shape
        r = self.response_ids.shape[1]
        layers, k = self.routed_experts.shape[2:]
        seq_lens = self.prompt_lengths + self.response_lengths
        src = torch.arange(p + r).expand(b, -1) + (p - self.prompt_lengths)[:, None]  # as full_sequences
        both = torch.cat([self.prompt_routed_experts, self.routed_experts], dim=1).long()  # [B, P+R, L, k]
        got = both.gather(1, src.clamp(max=p + r - 1)[:, :, None, None].expand(b, p + r, layers, k))
        valid = (torch.arange(p + r)[None, :] < seq_lens[:, None])[:, :, None, None]
        return torch.where(valid, got, torch.arange(k).expand(b, p + r, layers, k))

    def response_from_full(self, full: Tensor, response_start: Tensor | None = None) -> Tensor:
        """Cut a per-token result on the full_sequences layout ([B, P+R] or [B, P+R, ...]) back to the
        response layout [B, R] (or [B, R, ...]); zero outside response_mask."""
        return response_from_full(full, self.prompt_lengths if response_start is None else response_start,
                                  self.response_mask)


def response_from_full(full: Tensor, response_start: Tensor, response_mask: Tensor) -> Tensor:
    """out[b, j] = full[b, response_start[b] + j] where response_mask[b, j] = 1, else 0.

    full: [B, L, *] per-token results on a right-padded layout; response_start: [B]; response_mask: [B, R].
    """
    b, r = response_mask.shape
    idx = response_start[:, None].to(torch.long) + torch.arange(r, device=full.device)[None, :]  # [B, R]
    idx = idx.clamp(max=full.shape[1] - 1)
    idx = idx.view(b, r, *([1] * (full.dim() - 2))).expand(b, r, *full.shape[2:])
    out = full.gather(1, idx)
    mask = response_mask.view(b, r, *([1] * (full.dim() - 2))).to(torch.bool)
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def pad_left(seqs: Sequence[Sequence[int]], pad_value: int = 0, width: int | None = None) -> tuple[Tensor, Tensor]:
    """Lists of ids -> (ids [B, W] left-padded, mask [B, W]); W = longest unless `width` is given."""
    return _pad(seqs, pad_value, width, left=True)


def pad_right(seqs: Sequence[Sequence[int]], pad_value: int = 0, width: int | None = None) -> tuple[Tensor, Tensor]:
    """Lists of ids -> (ids [B, W] right-padded, mask [B, W]); W = longest unless `width` is given."""
    return _pad(seqs, pad_value, width, left=False)


def _pad(seqs, pad_value, width, left):
    w = max((len(s) for s in seqs), default=0) if width is None else width
    ids = torch.full((len(seqs), w), pad_value, dtype=torch.long)
    mask = torch.zeros((len(seqs), w), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s) > w:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than width={w}")
        if len(s) == 0:
            continue
        sl = slice(w - len(s), w) if left else slice(0, len(s))
        ids[i, sl] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def _pad_cols(t: Tensor, width: int, left: bool) -> Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    pad = torch.zeros((t.shape[0], extra, *t.shape[2:]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t] if left else [t, pad], dim=1)
