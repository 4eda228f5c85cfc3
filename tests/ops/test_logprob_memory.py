"""Peak-memory check of the fused torch path against the naive materialized-logits path on CPU, each
measured in a fresh subprocess as the growth of peak RSS over the RSS after the inputs exist. The child
is this file run as a script: `python <file> naive|fused`.

Peak RSS is Linux's VmHWM, reset to the current RSS through /proc/self/clear_refs just before the
measured step. `ru_maxrss` alone is not enough: Linux carries the parent's (pytest's) RSS at fork over
exec into the child's ru_maxrss, which would hide the child's smaller peaks. Without /proc the child
falls back to ru_maxrss growth.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# naive fp32 logits alone: 512 MiB (H does not change it; it is GEMM time only). The fused path's growth is its
# chunk's scratch (CPU_CHUNK_BUDGET_BYTES, 256 MiB), whatever T: measured 2.6 GB naive, 0.25 GB fused (T = 8192
# doubled the naive growth and the test's time, 36 s in CI, for no other claim)
T, H, V = 4096, 64, 32768


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS
        return True
    except OSError:
        return False


def _child(path: str) -> None:
    import resource

    import torch

    from rltrain.ops import logprobs_from_hidden

    def naive(hidden, weight, labels):
        logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)  # [T, V]
        return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def fused(hidden, weight, labels):
        return logprobs_from_hidden(hidden, weight, labels, backend="torch")

    fn = {"naive": naive, "fused": fused}[path]
    torch.manual_seed(0)
    hidden = torch.randn(T, H, requires_grad=True)
    weight = (torch.randn(V, H) / H**0.5).requires_grad_()
    labels = torch.randint(0, V, (T,))
    grad_lp, grad_ent = torch.randn(T), torch.randn(T)
    lp, ent = fn(hidden[:4], weight, labels[:4])  # warm-up: libraries and kernels loaded, grads allocated
    (lp.sum() + ent.sum()).backward()
    hwm = _reset_peak_rss()
    baseline_kib = _status_kib("VmRSS") if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lp, ent = fn(hidden, weight, labels)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(hidden.grad).all()
    peak_kib = _status_kib("VmHWM") if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"GROWTH_KIB {peak_kib - baseline_kib}")


def _growth_kib(path: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, __file__, path], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{path} child failed:\n{proc.stdout}\n{proc.stderr}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("GROWTH_KIB ")]
    assert line, proc.stdout
    return int(line[-1].split()[1])


@pytest.mark.slow
def test_fused_torch_peak_rss_growth_is_under_a_quarter_of_naive():
    naive = _growth_kib("naive")
    fused = _growth_kib("fused")
    logits_kib = T * V * 4 // 1024
    assert naive >= logits_kib, f"naive path grew only {naive} KiB, less than its own logits ({logits_kib} KiB)"
    assert fused < naive / 4, f"fused grew {fused} KiB, naive {naive} KiB"


if __name__ == "__main__":
    _child(sys.argv[1])
