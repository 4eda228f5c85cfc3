"""Benchmark of per-token log-prob + entropy paths side by side: naive materialized logits,
`logprobs_from_logits`, fused `logprobs_from_hidden` (torch; triton on CUDA when available) and peers
(below), against the GEMM floor. It must not be imported by rltrain
(tools only) and does not check correctness (tests/ops does). The fused paths are called as the actor calls them,
`check_bounds=False` (the engine checks labels on the host before copying them; the check inside would be a device
sync per call, which the peers do not pay either).

    python tools/bench_logprob.py --T 4096 --H 256 --V 32000 --dtype fp32 --device cpu --json out.json
    python tools/bench_logprob.py --shapes 8192x4096 32768x4096 65536x2560 --V 151936 --dtype bf16 --device cuda
        (the fused head's three shapes, the providers and the peers, in one call; each shape beside its own floor)

Each provider runs in its own fresh subprocess so that peak memory is per provider:
- CUDA: `torch.cuda.max_memory_allocated() - memory_allocated()` after the inputs exist; times from
  CUDA events (median of --reps runs after a warm-up).
- CPU: growth of the process's peak RSS (Linux VmHWM, reset to the current RSS through
  /proc/self/clear_refs) over the RSS after the inputs exist and an 8-row warm-up ran (so libraries are
  already counted in the baseline); times from `time.perf_counter` (median). Not `ru_maxrss`: on Linux
  it keeps the parent's RSS at fork across exec, which hides a child's smaller peaks.
Peak extra memory is taken on one forward+backward (forward only with --fwd-only), before the timing.
"x floor" divides by the GEMM floor: one `hidden @ weight.T` of the same shape for forward, three times that for
forward+backward (logits, grad of hidden, grad of weight); "x 4 GEMMs" by the two-pass design's four GEMMs timed
back to back (forward, recompute, dHidden, dWeight: gemm_floors_ms), the clocks a GPU holds through sustained work
rather than the burst one short GEMM gets. With --reps > 0 each provider's process times the floor itself, on its
inputs, right before the provider (one GEMM before the forward, the four before forward + backward): the floor and
the provider at the same clocks (a GPU idle before the floor runs a short GEMM ~8% faster than one just done with a
forward + backward); the shape's header line is the floor timed first, in the parent. TFLOP/s counts those same
2*T*H*V (forward) and 6*T*H*V (forward+backward) FLOPs, so recomputation shows up as a lower rate.
A provider that runs out of memory is reported as "OOM" (CUDA OOM error or a child killed by the OS).

--rows-fraction f [f ...] keeps a random f of the T rows (the response rows of a packed batch), one table per
value: "naive" still builds the logits of all T rows, "naive_rows" gathers the kept rows first, the fused paths
take `rows=`. The OOM regime of slime issue #1951, peak memory only (was tools/repro_logprob_memory.py --sweep):
    python tools/bench_logprob.py --T 205280 --H 2560 --V 76032 --reps 0 --device cuda --json repro.json \
        --providers naive,naive_rows,fused_torch,fused_triton --rows-fraction 0.05 0.1 0.25 0.5 0.75 1.0
(on CPU: --T 2052 --H 128 --device cpu, i.e. the old --scale 100 --H 128).

Peers, wrapped to one signature `fn(hidden [T, H], weight [V, H], labels [T] int64) -> (logprob fp32 [T],
entropy fp32 [T] | None)`, differentiable w.r.t. hidden and weight, added to the providers when their wheels are
installed (never committed; no peer code is copied here; --list-peers says which import and why not):
- `liger_flce`: Liger-Kernel `LigerFusedLinearCrossEntropyFunction`, reduction='none' (log-prob only).
- `cce_exact`, `cce_filtered`: Cut Cross-Entropy `linear_cross_entropy`, reduction='none', with
  `filter_eps=None` (exact gradient) and the default `filter_eps='high'` (skips small softmax entries in
  the backward; not exact).
- `verl`: verl's `linear_cross_entropy` (log-prob and entropy), loaded from the installed wheel's
  `verl/utils/kernel/` files with a four-name stand-in for `verl.utils.device`, so verl's package
  `__init__` (ray, tensordict, ...) is never imported.
Kept rows are gathered before calling a peer when a row subset is benchmarked.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import resource
import sys
import tempfile
import types
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import device_name, time_ms
from harness import results as tables
from harness import run_child as harness_run_child  # run_child below is the child's own entry
from harness.head import DTYPES, gemm_floors_ms, make_inputs

from rltrain.ops import logprobs_from_hidden, logprobs_from_logits


def _gather(hidden, labels, rows):
    return (hidden, labels) if rows is None else (hidden.index_select(0, rows), labels.index_select(0, rows))


def naive(hidden, weight, labels, rows=None):
    """Materialize fp32 logits of ALL T rows, then keep `rows` (what most frameworks do)."""
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)  # [T, V]
    if rows is not None:
        logp, labels = logp.index_select(0, rows), labels.index_select(0, rows)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def naive_rows(hidden, weight, labels, rows=None):
    """Gather the kept rows first, then materialize their fp32 logits."""
    hidden, labels = _gather(hidden, labels, rows)
    return naive(hidden, weight, labels)


def from_logits(hidden, weight, labels, rows=None):
    hidden, labels = _gather(hidden, labels, rows)
    return logprobs_from_logits(hidden @ weight.T, labels)


def fused_torch(hidden, weight, labels, rows=None):
    return logprobs_from_hidden(hidden, weight, labels, backend="torch", rows=rows, check_bounds=False)


def fused_triton(hidden, weight, labels, rows=None):
    return logprobs_from_hidden(hidden, weight, labels, backend="triton", rows=rows, check_bounds=False)


def fused_cute(hidden, weight, labels, rows=None):
    return logprobs_from_hidden(hidden, weight, labels, backend="cute", rows=rows, check_bounds=False)


def _available(backend: str) -> bool:
    try:
        module = importlib.import_module(f"rltrain.ops.logprob_{backend}")
    except ImportError:
        return False
    return torch.cuda.is_available() and module.is_available()


def providers(device: str) -> dict:
    """name -> fn(hidden, weight, labels, rows=None) -> (logprobs, entropy)."""
    table = {"naive": naive, "logprobs_from_logits": from_logits, "fused_torch": fused_torch}
    if device == "cuda" and _available("triton"):
        table["fused_triton"] = fused_triton
    if device == "cuda" and _available("cute"):
        table["fused_cute"] = fused_cute
    for name, fn in load_peers()[0].items():
        table[name] = _peer(fn)
    return table


def _peer(fn):
    """A peer `fn(hidden, weight, labels)` as a provider: kept rows are gathered before the call."""

    def call(hidden, weight, labels, rows=None):
        hidden, labels = _gather(hidden, labels, rows)
        return fn(hidden, weight, labels)

    return call


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower() or (
        "can't allocate memory" in str(exc).lower()
    )


# ---------------------------------------------------------------------------- peers
PeerFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


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


def load_peers() -> tuple[dict[str, PeerFn], dict[str, str]]:
    """(the peers importable here, {peer: why not} for the others): a missing or broken peer is reported, never
    fatal to the benchmark."""
    peers, unavailable = {}, {}
    for name, load in (("liger", _liger), ("cce", _cce), ("verl", _verl)):
        try:
            peers.update(load())
        except Exception as exc:  # noqa: BLE001
            unavailable[name] = f"{type(exc).__name__}: {exc}"
    return peers, unavailable


def _proc_status_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process from /proc/self/status (Linux), None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS: `echo 5 > /proc/self/clear_refs`."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class _PeakMemory:
    """Peak bytes allocated beyond the state at `start()`.

    CUDA: allocator stats. CPU: the process's peak RSS (VmHWM), reset to the current RSS at `start()`;
    where that reset is not possible (non-Linux) the growth of `ru_maxrss`, which is only meaningful
    when this process's own peak so far is below what follows (ru_maxrss also carries the parent's RSS
    at fork across exec, which is why we do not rely on it on Linux)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif _reset_peak_rss() and _proc_status_kib("VmRSS") is not None:
            self.hwm = True
            self.base = _proc_status_kib("VmRSS") * 1024
        else:
            self.hwm = False
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak_extra_bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        if self.hwm:
            return _proc_status_kib("VmHWM") * 1024 - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base


def run_child(spec: dict) -> dict:
    """Measure one provider in this (fresh) process; returns the result dict."""
    fn = {**providers(spec["device"]), "naive_rows": naive_rows}[spec["provider"]]
    hidden, weight, labels, rows = make_inputs(spec)
    fwd_only = spec["fwd_only"]
    if not fwd_only:
        hidden.requires_grad_()
        weight.requires_grad_()
    t = spec["T"]  # outputs are [T] (scattered back) or [N] (kept rows only): use the first entries
    grads = (torch.randn(t, device=hidden.device), torch.randn(t, device=hidden.device))

    def step(h, w, l, r, backward):
        if not backward:
            with torch.no_grad():
                return fn(h, w, l, r)
        lp, ent = fn(h, w, l, r)
        loss = (lp * grads[0][: lp.shape[0]]).sum()
        if ent is not None:
            loss = loss + (ent * grads[1][: ent.shape[0]]).sum()
        loss.backward()
        hidden.grad = weight.grad = None

    result = {"provider": spec["provider"], "status": "ok"}
    try:
        k = min(8, spec["T"])
        step(hidden[:k], weight, labels[:k], None, not fwd_only)  # warm-up on 8 rows
        memory = _PeakMemory(spec["device"])
        memory.start()
        step(hidden, weight, labels, rows, not fwd_only)
        result["peak_extra_mib"] = memory.peak_extra_bytes() / 2**20
        if spec.get("reps", 0) > 0:
            cuda, reps, h, w = spec["device"] == "cuda", spec["reps"], hidden.detach(), weight.detach()
            result["gemm_ms"] = gemm_floors_ms(h, w, reps)[0]  # each right before what it is the floor of
            result["fwd_ms"] = time_ms(lambda: step(hidden, weight, labels, rows, False), reps, cuda=cuda)
            if not fwd_only:
                result["gemm4_ms"] = gemm_floors_ms(h, w, reps, one=False, four=True)[1]
                result["fwdbwd_ms"] = time_ms(lambda: step(hidden, weight, labels, rows, True), reps, cuda=cuda)
    except Exception as exc:  # noqa: BLE001 - OOM is a result, anything else is reported as an error
        result["status"] = "OOM" if _is_oom(exc) else f"error: {type(exc).__name__}: {exc}"
    return result


def measure_in_subprocess(spec: dict, timeout_s: int = 1800) -> dict:
    """Run `run_child(spec)` in a fresh interpreter; a child killed by the OS counts as OOM."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "child.log")
        res = harness_run_child([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)], log,
                                timeout_s=timeout_s, poll_s=0.05)
        with open(log) as f:
            text = f.read()
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    if res["timed_out"]:
        return {"provider": spec["provider"], "status": f"timeout after {timeout_s} s"}
    if res["rc"] < 0 or res["rc"] == 137:
        return {"provider": spec["provider"], "status": "OOM"}  # SIGKILL from the OOM killer
    return {"provider": spec["provider"], "status": f"error: rc={res['rc']}: {res['tail'][-500:]}"}


def machine_description(device: str) -> str:
    threads = "" if device == "cuda" else f", {torch.get_num_threads()} threads"
    return f"{device_name()} (torch {torch.__version__}{threads})"


def _fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def floors_of(result: dict, floor_fwd: float | None, floor_4: float | None) -> tuple[float | None, float | None]:
    """(one GEMM, four GEMMs) a provider's times are divided by: its own, timed in its process, else the shape's."""
    return result.get("gemm_ms") or floor_fwd, result.get("gemm4_ms") or floor_4


def table_rows(spec: dict, sweep: list[dict], floor_fwd: float | None, floor_4: float | None = None) -> list[dict]:
    """One kernel-table row per provider that ran and rows fraction: ms forward and forward + backward, the peak
    extra MiB and the floors it is divided by: one GEMM and four GEMMs back to back (gemm_floors_ms), the
    provider's own (timed in its process) where it has them, else the shape's (floor_fwd, floor_4)."""
    import datetime

    out = []
    gpu = device_name() if spec["device"] == "cuda" else "CPU"
    for s in sweep:
        for name, r in s["results"].items():
            if r["status"] != "ok":
                continue
            m = {k: round(r[k], 4) for k in ("fwd_ms", "fwdbwd_ms", "peak_extra_mib") if r.get(k) is not None}
            one, four = floors_of(r, floor_fwd, floor_4)
            if one:
                m["gemm_ms"] = round(one, 4)
            if four:
                m["gemm4_ms"] = round(four, 4)
            variant = name + ("" if spec["dtype"] == "bf16" else f", {spec['dtype']}") + (
                f", response fraction {s['rows_fraction']}" if s["rows_fraction"] is not None else "")
            out.append(tables.row("bench_logprob", f"{spec['T']}x{spec['H']}x{spec['V']}", tables.device_kind(gpu),
                                  variant, m, date=datetime.date.today().isoformat()))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=4096, help="tokens")
    parser.add_argument("--H", type=int, default=256, help="hidden size")
    parser.add_argument("--V", type=int, default=32000, help="vocab size (of the shard)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fwd-only", action="store_true", help="skip backward")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--providers", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")
    tables.add_arguments(parser, "a row per provider and rows fraction (kernel)")
    parser.add_argument("--rows-fraction", type=float, nargs="+", default=None,
                        help="keep this fraction of the T rows (response rows), one run per value given; adds the "
                             "naive_rows provider (with --reps 0: the memory sweep of slime #1951)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="TxH[xV]",
                        help="several shapes in one call, one after another (V default: --V), instead of --T/--H; "
                             "e.g. the head's three: 8192x4096 32768x4096 65536x2560 with --V 151936")
    parser.add_argument("--list-peers", action="store_true", help="say which peers import here, and why not")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list_peers:
        peers, unavailable = load_peers()
        print("available:", ", ".join(peers) or "none")
        for name, why in unavailable.items():
            print(f"unavailable {name}: {why}")
        return
    if args.child is not None:
        print("RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return

    names = list(providers(args.device)) + (["naive_rows"] if args.rows_fraction else [])
    if args.providers:
        wanted = args.providers.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"--providers: unknown {unknown}; available: {names}")
        names = wanted
    try:
        shapes = [_parse_shape(text, args.V) for text in args.shapes] if args.shapes else [(args.T, args.H, args.V)]
    except ValueError as err:
        parser.error(str(err))  # exit 2
    payloads = [run_shape(args, t, h, v, names) for t, h, v in shapes]
    if args.json_path:
        payload = payloads[0] if len(payloads) == 1 else {"shapes": payloads}
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json_path}")


def _parse_shape(text: str, default_v: int) -> tuple[int, int, int]:
    """'TxH' or 'TxHxV' (V default: --V) -> (T, H, V)."""
    parts = text.lower().split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shapes {text!r}: expected TxH or TxHxV with positive integers, e.g. 8192x4096")
    t, h, v = (int(p) for p in parts) if len(parts) == 3 else (int(parts[0]), int(parts[1]), default_v)
    return t, h, v


def run_shape(args, T: int, H: int, V: int, names: list[str]) -> dict:
    """Every provider on one shape, each in its own process, beside the same run's GEMM floor: printed, upserted into
    the kernel table and returned as the --json payload of the shape."""
    fractions = args.rows_fraction or [None]
    spec = dict(T=T, H=H, V=V, dtype=args.dtype, device=args.device, fwd_only=args.fwd_only, reps=args.reps)
    # --reps 0: peak memory only (no floor, no times)
    if args.reps > 0:
        hidden, weight, _, _ = make_inputs({**spec, "rows_fraction": None})
        floor_fwd, floor_4 = gemm_floors_ms(hidden, weight, args.reps, four=not args.fwd_only)
        del hidden, weight
    else:
        floor_fwd = floor_4 = None
    floor_fwdbwd = floor_fwd and 3 * floor_fwd
    fwd_flops, fwdbwd_flops = 2 * T * H * V, 6 * T * H * V
    print(f"T={T} H={H} V={V} dtype={args.dtype} device={args.device}  [{machine_description(args.device)}]")
    if floor_fwd:
        print(f"GEMM floor, timed first: fwd {floor_fwd:.2f} ms, fwd+bwd (3 GEMMs) {floor_fwdbwd:.2f} ms"
              + (f"; the two-pass design's 4 GEMMs back to back {floor_4:.2f} ms" if floor_4 else "")
              + " (each provider below is divided by its own, timed in its process right before it)")
    sweep = []
    for frac in fractions:
        results = {name: measure_in_subprocess({**spec, "rows_fraction": frac, "provider": name}) for name in names}
        sweep.append({"rows_fraction": frac, "results": results})
        if frac is not None:
            rows = max(1, int(round(T * frac)))
            print(f"rows fraction {frac}: {rows} rows (one fp32 [rows, V] logits tensor: {rows * V * 4 / 2**20:.1f} MiB)")
        print(f"{'provider':<24}{'ms fwd':>10}{'ms fwd+bwd':>12}{'peak extra MiB':>16}{'x floor fwd':>13}"
              f"{'x floor f+b':>13}{'x 4 GEMMs':>11}{'TFLOP/s f+b':>13}{'GEMM ms':>10}{'4 GEMMs ms':>12}")
        for name, res in results.items():
            if res["status"] != "ok":
                print(f"{name:<24}{res['status']:>10}")
                continue
            fwd, fb = res.get("fwd_ms"), res.get("fwdbwd_ms")
            one, four = floors_of(res, floor_fwd, floor_4)
            print(f"{name:<24}{_fmt(fwd, '.2f'):>10}{_fmt(fb, '.2f'):>12}{_fmt(res['peak_extra_mib']):>16}"
                  f"{_fmt(fwd and one and fwd / one, '.2f'):>13}"
                  f"{_fmt(fb and one and fb / (3 * one), '.2f'):>13}"
                  f"{_fmt(fb and four and fb / four, '.2f'):>11}"
                  f"{_fmt(fb and fwdbwd_flops / fb / 1e9, '.3f'):>13}{_fmt(one, '.2f'):>10}{_fmt(four, '.2f'):>12}",
                  flush=True)
    tables.upsert("kernel", table_rows(spec, sweep, floor_fwd, floor_4), args.results)
    return {"config": {**spec, "rows_fraction": args.rows_fraction}, "machine": machine_description(args.device),
            "floor_ms": {"fwd": floor_fwd, "fwdbwd": floor_fwdbwd, "fwdbwd_4gemm": floor_4},
            "flops": {"fwd": fwd_flops, "fwdbwd": fwdbwd_flops},
            # one fraction (or none): its results, as before; a sweep: every fraction's
            **({"results": sweep[0]["results"]} if len(sweep) == 1 else {"sweep": sweep})}

if __name__ == "__main__":
    main()
