"""Where the engine's state lives between uses: host (CPU) memory instead of the GPU's, for three keys.

- `actor.optimizer_offload_fraction` (HostOptimizer): the first fraction (by elements) of this rank's optimizer
  pieces keep their fp32 master and AdamW moments on the host for good and step there with torch's CPU AdamW: each
  step their grads go to the host (pinned buffers, queued before the device's AdamW so that the copy and the device's
  step overlap), the host steps while the device's kernels run, and the updated masters come back into the params.
  The same idea as megatron-core's HybridDeviceOptimizer (which needs CUDA streams and cannot run on the CPU).
- `actor.offload_while_rollout` (StateOffload): while the colocated rollout engine is awake, the actor's params and
  its device-resident optimizer state (masters, moments) wait in pinned host buffers (kept between offloads) and
  the device memory is freed; they come back for the training phases. What verl's param/optimizer offload and
  slime's memory saver do.
- `ref.offload` (LayerStreamer): the reference model's decoder layers live on the host; each layer's weights are
  copied to the device just before its forward (the next layer's copy queued on a side stream while this one runs)
  and dropped after it. Its embedding, final norm and LM head stay on the device.

On a CPU-only machine the "device" is the CPU: a move is a copy into another tensor, so every path runs (and is
tested for bit-identical round trips) without CUDA. Nothing here changes a number: state comes back as it left.
"""

from __future__ import annotations

import torch


def host_like(t: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for `t`'s contents: pinned when CUDA is there (asynchronous copies), plain otherwise."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")


def to_device(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new device tensor holding `h` (on the CPU "device": a copy into another tensor)."""
    out = torch.empty(h.shape, dtype=h.dtype, device=device)
    out.copy_(h, non_blocking=True)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HostOptimizer:
    """The host's share of the optimizer pieces (actor.optimizer_offload_fraction): which masters live on the host,
    their CPU AdamW, and the grad / master copies around the device's step."""

    def __init__(self, masters: list[torch.Tensor], fraction: float, device: torch.device):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction must be in [0, 1], got {fraction}")
        self.device = device
        total, taken = sum(m.numel() for m in masters), 0
        self.index: list[int] = []
        for i, m in enumerate(masters):
            if fraction > 0 and taken + m.numel() <= fraction * total + 0.5:
                self.index.append(i)
                taken += m.numel()
        self.fraction_taken = taken / total if total else 0.0
        on_host = set(self.index)
        # a host master is a copy of the device one (which is then dropped: the caller keeps the host one)
        self.host_masters = {i: host_like(masters[i]).copy_(masters[i].detach()) for i in self.index}
        for i in self.index:
            masters[i] = self.host_masters[i]
        self.device_masters = [m for i, m in enumerate(masters) if i not in on_host]
        self._host_grads: dict[int, torch.Tensor] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._copied: torch.cuda.Event | None = None
        self._coef = 1.0  # the clip factor of the step under way (bf16 grads: applied with the cast)
        self._pending: list[int] = []  # the pieces whose grads are on their way to the host

    def build(self, hyper: dict) -> None:
        if self.index:
            self.optimizer = torch.optim.AdamW([self.host_masters[i] for i in self.index], **hyper)

    def is_host(self, i: int) -> bool:
        return i in self.host_masters

    def start_step(self, lr: float, grads: list[torch.Tensor | None], coef: float = 1.0) -> None:
        """Queue the host share's grads (in the params' dtype) to the host, before the device's AdamW is queued;
        coef: the clip's factor, applied on the host with the cast to fp32."""
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # the schedule drives the device optimizer; the host one follows it
        self._pending = []
        for i in self.index:
            g = grads[i]
            if g is None:
                continue
            if i not in self._host_grads:
                self._host_grads[i] = host_like(g)
            self._host_grads[i].copy_(g, non_blocking=True)
            self._pending.append(i)
        self._coef = coef
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def finish_step(self) -> None:
        """The host share's AdamW (the device's kernels are queued and run meanwhile)."""
        if self.optimizer is None:
            return
        if self._copied is not None:
            self._copied.synchronize()
        for i in self._pending:  # fp32 grads of the host's pieces (the clip's factor with the cast)
            g = self._host_grads[i].to(self.host_masters[i].dtype)
            self.host_masters[i].grad = g if self._coef == 1.0 else g.mul_(self._coef)
        self.optimizer.step()
        for m in self.host_masters.values():
            m.grad = None

    def state_of(self, i: int, master: torch.Tensor, device_optimizer: torch.optim.Optimizer) -> dict:
        opt = self.optimizer if self.is_host(i) else device_optimizer
        return opt.state.get(master, {})

    def load_states(self, device_optimizer: torch.optim.Optimizer, masters: list[torch.Tensor],
                    states: list[dict], param_groups: list[dict]) -> None:
        """Set each master's AdamW state (empty dicts: not stepped yet) through torch's load_state_dict, which puts
        every tensor where its master lives (the step count too, on the device for the fused kernel)."""
        for opt, idx in ((device_optimizer, [i for i in range(len(masters)) if not self.is_host(i)]),
                         (self.optimizer, self.index)):
            if opt is None:
                continue
            groups = [{**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")},
                       **{k: og[k] for k in ("fused", "foreach") if k in og}, "params": list(range(len(idx)))}
                      for g, og in zip(param_groups, opt.param_groups)]
            opt.load_state_dict({"state": {j: states[i] for j, i in enumerate(idx) if states[i]},
                                 "param_groups": groups})


def by_storage(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by the storage they view (each tensor once): a data-parallel bucket's buffer with its params,
    an MoE layer's stacked experts, a parameter alone."""
    groups: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return list(groups.values())


def repoint(aliases: list[torch.Tensor], storage: torch.Tensor) -> None:
    """Make every tensor of `aliases` view `storage` (a flat byte tensor with the old storage's contents) at its
    old offset, size and stride: views stay views of one another."""
    for t in aliases:
        t.data = torch.empty(0, dtype=t.dtype, device=storage.device).set_(
            storage.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage `t` views, as a flat byte tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class StateOffload:
    """actor.offload_while_rollout: the engine's params and device-resident optimizer state to pinned host buffers
    and back (`offload()`, `onload()`). Storage by storage: every tensor viewing a moved storage (the params of a
    data-parallel bucket and its buffer, stacked experts, fp32 masters that are views of their params) is re-pointed
    at the same offset, so the optimizer, the model and the shards keep their references and views stay views."""

    def __init__(self, model: torch.nn.Module, device: torch.device, optimizer=None):
        self.model, self.device, self.opt = model, device, optimizer
        self.params_on_host = False
        self.state_on_host = False
        self._host: dict[tuple[int, ...], torch.Tensor] = {}  # a storage's aliases (ids) -> its pinned host buffer

    def _move_out(self, tensors: list[torch.Tensor]) -> None:
        moves = []
        for aliases in by_storage(tensors):
            src = storage_bytes(aliases[0])
            key = tuple(id(t) for t in aliases)
            h = self._host.get(key)
            if h is None or h.numel() != src.numel():
                h = self._host[key] = host_like(src)
            h.copy_(src, non_blocking=True)
            moves.append((aliases, h))
        _sync(self.device)
        for aliases, h in moves:
            repoint(aliases, h)

    def _move_in(self, tensors: list[torch.Tensor]) -> None:
        for aliases in by_storage(tensors):
            repoint(aliases, to_device(storage_bytes(aliases[0]), self.device))

    def _state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's device-resident tensors: masters that are not views of the params, AdamW's state."""
        if self.opt is None:
            return []
        out = [m for i, m in enumerate(self.opt.masters) if not self.opt.host.is_host(i) and not self.opt.fp32]
        for st in self.opt.optimizer.state.values():  # the device's AdamW (the host share's stays where it is)
            out += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        return out

    def _param_tensors(self) -> list[torch.Tensor]:
        """The params and everything viewing their storages: the data-parallel buckets' buffers and fp32 masters."""
        out = list(self.model.parameters())
        if self.opt is not None:
            for shards, _, _ in self.opt.groups:
                out += shards.buffers
            if self.opt.fp32:
                out += [m for i, m in enumerate(self.opt.masters) if not self.opt.host.is_host(i)]
        return out

    def offload(self, *, params: bool = True, state: bool = True) -> None:
        """To the host: the optimizer's device state (state) and the params (params). Idempotent."""
        if state and not self.state_on_host:
            self._move_out(self._state_tensors())
            self.state_on_host = True
        if params and not self.params_on_host:
            self._move_out(self._param_tensors())
            self.params_on_host = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self, *, state: bool = True) -> None:
        """The params back on the device, and the optimizer's state unless state=False. Idempotent."""
        if self.params_on_host:
            self._move_in(self._param_tensors())
            self.params_on_host = False
        if state and self.state_on_host:
            self._move_in(self._state_tensors())
            self.state_on_host = False
        _sync(self.device)


class LayerStreamer:
    """ref.offload: `layers` (the reference's decoder layers) live on the host; a forward pre-hook brings a layer's
    weights to the device (waiting for the copy queued by the layer before it, and queuing the next layer's) and a
    forward hook drops them again. The device holds at most two layers' weights at a time. Storage by storage, as
    StateOffload: an MoE layer's stacked experts stay one block."""

    def __init__(self, layers: list[torch.nn.Module], device: torch.device):
        self.layers, self.device = list(layers), device
        self._host: list[list[tuple[list[torch.Tensor], torch.Tensor]]] = []  # per layer: (aliases, host storage)
        for layer in self.layers:
            tensors = list(layer.parameters()) + [b for b in layer.buffers() if b.is_floating_point()]
            pairs = []
            for aliases in by_storage(tensors):
                src = storage_bytes(aliases[0])
                pairs.append((aliases, host_like(src).copy_(src)))
            self._host.append(pairs)
        _sync(device)
        for pairs in self._host:
            for aliases, h in pairs:
                repoint(aliases, h)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, tuple[list[torch.Tensor], object]] = {}
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._pre(i))
            layer.register_forward_hook(self._post(i))
        self.copies = 0  # layers brought to the device (a test reads it)

    def _fetch(self, i: int) -> None:
        """Queue layer i's weights to the device (side stream on CUDA)."""
        if i in self._ready or i >= len(self.layers):
            return
        self.copies += 1
        if self._stream is None:
            self._ready[i] = ([to_device(h, self.device) for _, h in self._host[i]], None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the memory it reuses is free by now
        with torch.cuda.stream(self._stream):
            dev = [to_device(h, self.device) for _, h in self._host[i]]
            event = torch.cuda.Event()
            event.record(self._stream)
        self._ready[i] = (dev, event)

    def _pre(self, i: int):
        def bring(_module, _args) -> None:
            self._fetch(i)
            dev, event = self._ready.pop(i)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
                for t in dev:
                    t.record_stream(torch.cuda.current_stream(self.device))
            for (aliases, _), t in zip(self._host[i], dev):
                repoint(aliases, t)
            self._fetch(i + 1)
        return bring

    def _post(self, i: int):
        def drop(_module, _args, _out) -> None:
            for aliases, h in self._host[i]:
                repoint(aliases, h)
        return drop
