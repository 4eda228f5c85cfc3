"""Peer fused LM-head kernels wrapped to one signature so tools/bench_logprob.py can time them beside ours.
Benchmark glue only: nothing in rltrain imports this, and no peer code is copied here (their wheels are
installed on the benchmark machine, never committed).

`PEERS: dict[str, callable]` holds the peers importable in this environment; each callable is
`fn(hidden [T, H], weight [V, H], labels [T] int64) -> (logprob fp32 [T], entropy fp32 [T] | None)`,
differentiable w.r.t. hidden and weight (per-token upstream grads allowed):

- `liger_flce`: Liger-Kernel `LigerFusedLinearCrossEntropyFunction`, reduction='none' (log-prob only).
- `cce_exact`, `cce_filtered`: Cut Cross-Entropy `linear_cross_entropy`, reduction='none', with
  `filter_eps=None` (exact gradient) and the default `filter_eps='high'` (skips small softmax entries in
  the backward; not exact).
- `verl`: verl's `linear_cross_entropy` (log-prob and entropy), loaded from the installed wheel's
  `verl/utils/kernel/` files with a four-name stand-in for `verl.utils.device`, so verl's package
  `__init__` (ray, tensordict, ...) is never imported.

Run `python tools/bench_peers.py` to list what is importable (and why the others are not).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Callable

import torch

PeerFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]
PEERS: dict[str, PeerFn] = {}
UNAVAILABLE: dict[str, str] = {}  # peer name -> why it is not in PEERS


def _liger() -> dict[str, PeerFn]:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as F

    def liger_flce(hidden, weight, labels):
        # positional args: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
        # label_smoothing, reduction
        out = F.apply(hidden, weight, labels, None, None, -100, 0.0, 0.0, "none")
        loss = out[0] if isinstance(out, tuple) else out
        return -loss.float(), None

    return {"liger_flce": liger_flce}


def _cce() -> dict[str, PeerFn]:
    from cut_cross_entropy import linear_cross_entropy

    def cce_exact(hidden, weight, labels):
        return -linear_cross_entropy(hidden, weight, labels, reduction="none", filter_eps=None).float(), None

    def cce_filtered(hidden, weight, labels):
        return -linear_cross_entropy(hidden, weight, labels, reduction="none").float(), None

    return {"cce_exact": cce_exact, "cce_filtered": cce_filtered}


def _verl() -> dict[str, PeerFn]:
    spec = importlib.util.find_spec("verl")  # locates the wheel without executing verl/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    if not (root / "utils" / "kernel" / "linear_cross_entropy.py").exists():
        raise ImportError(f"{root} has no utils/kernel/linear_cross_entropy.py")
    if "verl" not in sys.modules or not getattr(sys.modules["verl"], "_rltrain_shim", False):
        pkg = types.ModuleType("verl")
        pkg.__path__ = [str(root)]
        pkg._rltrain_shim = True
        utils = types.ModuleType("verl.utils")
        utils.__path__ = [str(root / "utils")]
        device = types.ModuleType("verl.utils.device")  # the four names kernels.py uses, CUDA only
        device.is_cuda_available = torch.cuda.is_available()
        device.get_device_name = lambda: "cuda"
        device.get_torch_device = lambda: torch.cuda
        device.get_device_capability = lambda device_id=0: torch.cuda.get_device_capability(device_id)
        sys.modules.update({"verl": pkg, "verl.utils": utils, "verl.utils.device": device})
    mod = importlib.import_module("verl.utils.kernel.linear_cross_entropy")

    def verl(hidden, weight, labels):
        lp, ent = mod.linear_cross_entropy(hidden, weight, labels, 1.0, "none", None)
        return lp.float(), ent.float()

    return {"verl": verl}


for _name, _load in (("liger", _liger), ("cce", _cce), ("verl", _verl)):
    try:
        PEERS.update(_load())
    except Exception as exc:  # a missing or broken peer is reported, never fatal to the benchmark
        UNAVAILABLE[_name] = f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    print("available:", ", ".join(PEERS) or "none")
    for name, why in UNAVAILABLE.items():
        print(f"unavailable {name}: {why}")
