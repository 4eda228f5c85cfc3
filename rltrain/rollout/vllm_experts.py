"""A Mixture-of-Experts model's expert weights into a vLLM engine of this process without vLLM's per-tensor loader:
each MoE layer's experts arrive as one checkpoint tensor per expert and projection (the layout every reader takes,
3 x E a layer: 18,432 for Qwen3-30B-A3B), and vLLM's loader maps each name through its expert table and copies it
into the layer's fused tensors on its own (about 0.3 ms a tensor: seconds a sync). Here the tensors of a layer are
gathered as they stream by and written into the layer's fused tensors in one copy per projection (`w13_weight`
[E, 2 I / tp, H]: each expert's gate rows, then its up rows, of this TP rank; `w2_weight` [E, H, I / tp]: its down
columns), while vLLM's reload takes every other tensor.

vLLM's in-place reload keeps each layer's kernel tensors (the fused tensors' storage, which its CUDA graphs read)
and puts them back after the load, untouched where no weight of the layer came (a FusedMoE module holds only the
experts): the writes land in the storage the engine then reads. Whether this vLLM lays its fused tensors out as
written here is checked once, at the first sync, which loads everything through vLLM and compares its result for
one layer with what the writer would have written (bitwise): only then are the experts written directly, else vLLM
keeps loading them (the reason printed once). It must not import training code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

EXPERT_NAME = re.compile(
    r"^(?P<layer>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class ExpertWriter:
    """Writes checkpoint-layout expert tensors into fused ones: `targets` {layer prefix: (w13 [E, 2 I/tp, H],
    w2 [E, H, I/tp])} of this TP rank (`tp_rank` of `tp_size`). `offer(name, t)` takes an expert tensor of a known
    layer (True) and writes the layer once its 3 x E tensors are there; `finish()` says whether every layer was."""

    def __init__(self, targets: dict[str, tuple[torch.Tensor, torch.Tensor]], tp_rank: int, tp_size: int,
                 keep: str | None = None):
        self.targets, self.tp_rank, self.tp_size = targets, tp_rank, tp_size
        self._pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        self.written: set[str] = set()
        self.keep, self.kept = keep, None  # layer `keep`'s written blocks, kept to check they reached the engine

    def offer(self, name: str, tensor: torch.Tensor) -> bool:
        m = EXPERT_NAME.match(name)
        if m is None or m["layer"] not in self.targets:
            return False
        layer = m["layer"]
        got = self._pending.setdefault(layer, {})
        got[(int(m["expert"]), m["proj"])] = tensor
        if len(got) == 3 * self.targets[layer][0].shape[0]:
            self._write(layer, self._pending.pop(layer))
        return True

    def blocks(self, layer: str, got: dict[tuple[int, str], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of `layer` from its per-expert tensors, this TP rank's part, as vLLM's fused layout holds them."""
        w13, w2 = self.targets[layer]
        n = w13.shape[0]
        inter = w13.shape[1] // 2  # I / tp
        rows = slice(self.tp_rank * inter, (self.tp_rank + 1) * inter)
        gate = torch.stack([got[(j, "gate_proj")][rows] for j in range(n)])  # [E, I/tp, H]
        up = torch.stack([got[(j, "up_proj")][rows] for j in range(n)])
        down = torch.stack([got[(j, "down_proj")][:, rows] for j in range(n)])  # [E, H, I/tp]
        return torch.cat([gate, up], dim=1), down

    def _write(self, layer: str, got: dict[tuple[int, str], torch.Tensor]) -> None:
        w13, w2 = self.targets[layer]
        new13, new2 = self.blocks(layer, got)
        w13.copy_(new13)
        w2.copy_(new2)
        if layer == self.keep:
            self.kept = (new13.to(w13.dtype), new2.to(w2.dtype))
        self.written.add(layer)

    def finish(self) -> list[str]:
        """The layers not written (some of their tensors never came)."""
        return sorted(set(self.targets) - self.written)


def fused_moe_targets(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (w13_weight, w2_weight)} of every fused MoE layer of a vLLM model (3-D tensors)."""
    out = {}
    for name, module in model.named_modules():
        w13, w2 = getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)
        if torch.is_tensor(w13) and torch.is_tensor(w2) and w13.dim() == 3 and w2.dim() == 3:
            out[name] = (w13.data, w2.data)
    return out


def layout_problem(writer: ExpertWriter, layer: str, got: dict[tuple[int, str], torch.Tensor],
                   num_experts: int) -> str | None:
    """Why the direct write would not reproduce what vLLM's loader put in `layer` (None: bitwise the same)."""
    w13, w2 = writer.targets[layer]
    if w13.shape[0] != num_experts:
        return f"{layer} holds {w13.shape[0]} of {num_experts} experts (vLLM's expert parallelism)"
    if len(got) != 3 * num_experts:
        return f"{layer}'s experts did not all come in one sync"
    new13, new2 = writer.blocks(layer, got)
    if new13.shape != w13.shape or new2.shape != w2.shape:
        return f"{layer}: fused shapes {tuple(w13.shape)}, {tuple(w2.shape)}, not the checkpoint's stacked"
    if not (torch.equal(new13.to(w13.dtype), w13) and torch.equal(new2.to(w2.dtype), w2)):
        return f"{layer}: vLLM's loader laid the experts out otherwise (reordered or processed)"
    return None


class ExpertFastPath:
    """The per-engine switch: `split(stream, targets, tp)` -> the stream without the experts it writes itself (once
    the layout is checked and `after` syncs went through vLLM's loader), or the whole stream, with one layer's
    experts kept aside for the check at the first sync. after: syncs through vLLM's loader before the direct writes
    (rollout.direct_expert_sync_after; -1: never)."""

    def __init__(self, num_experts: int, after: int = 1):
        self.num_experts, self.after = num_experts, after
        self.state = "unverified" if after >= 0 else "off"  # -> "checked" -> "on" | "off"
        self.reason = "" if after >= 0 else "rollout.direct_expert_sync_after=-1"
        self.syncs = 0
        self._writer: ExpertWriter | None = None
        self._probe: tuple[str, dict] | None = None

    def begin(self, targets: dict[str, tuple[torch.Tensor, torch.Tensor]], tp_rank: int, tp_size: int) -> bool:
        """A sync starts: this TP rank's fused tensors; returns whether it writes the experts directly."""
        first_direct = self.state == "checked" and self.syncs >= self.after
        self._writer = ExpertWriter(targets, tp_rank, tp_size, keep=min(targets, default=None) if first_direct else None)
        if first_direct:
            self.state = "on"
        self.syncs += 1
        probe_layer = min(targets, default=None)
        self._probe = (probe_layer, {}) if self.state == "unverified" and probe_layer else None
        return self.state == "on"

    def split(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync's stream for vLLM's loader: without the experts written here (direct), else whole."""
        probe_layer = None if self._probe is None else self._probe[0]
        for name, t in named_tensors:
            if self.state == "on" and self._writer.offer(name, t):
                continue
            if self._probe is not None:
                m = EXPERT_NAME.match(name)
                if m and m["layer"] == probe_layer:
                    self._probe[1][(int(m["expert"]), m["proj"])] = t.detach().clone()
            yield name, t

    @property
    def check_after_reload(self) -> bool:
        """Whether after_reload wants the engine's fused tensors as they are after the reload (the first direct
        sync: did the writes reach what the engine reads?)."""
        return self.state == "on" and self._writer is not None and self._writer.keep is not None

    def after_reload(self, targets_now: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> str | None:
        """After vLLM's reload: the first sync checks the layout (and switches on or off); a direct sync checks that
        every layer was written, the first one also that one layer's writes are what the engine holds after the
        reload (`targets_now`; else the loader takes the experts again from the next sync). Returns a line to
        print when the state changed."""
        if self.state == "on":
            missing = self._writer.finish()
            if missing:
                raise RuntimeError(f"expert weights of {missing[:3]} (and {max(0, len(missing) - 3)} more layers) did "
                                   "not all come in the weight sync")
            layer, kept = self._writer.keep, self._writer.kept
            if layer is None or targets_now is None:
                return None
            self._writer.keep = self._writer.kept = None
            now = targets_now.get(layer)
            if now is None or kept is None or not all(torch.equal(a, b) for a, b in zip(kept, now)):
                self.state, self.reason = "off", f"the writes into {layer} were not what the engine held after its reload"
                return (f"rltrain: expert weights written directly did not reach vLLM's tensors ({self.reason}); "
                        "its loader takes them from the next sync")
            return None
        if self.state != "unverified" or self._probe is None:
            return None
        layer, got = self._probe
        why = layout_problem(self._writer, layer, got, self.num_experts)
        self.state, self.reason, self._probe = ("off", why, None) if why else ("checked", "", None)
        if why:
            return f"rltrain: expert weights keep vLLM's loader ({why})"
        return (f"rltrain: vLLM's fused expert layout checked; expert weights go straight into it from sync "
                f"{max(self.after, 1) + 1}")
