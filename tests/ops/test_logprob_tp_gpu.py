"""Vocab-parallel parity on two GPUs over NCCL, for each GPU backend of the fused head (triton, cute): bf16 operands,
the vocabulary split in two odd shards, against the fp64 reference of the whole vocabulary (values on every rank,
each rank's weight-shard grads, the hidden grads summed over ranks), with temperature, a row subset and the entropy
with and without its gradient. The CPU twin is test_logprob_tp.py (gloo, the torch backend).

Ranks run as `python <this file> RANK PORT DIR BACKEND` subprocesses, one GPU each; inputs and results travel as
torch.save files.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fp64 reference of the kernel tests
from test_logprob_triton import fp64_reference, rel  # noqa: E402

WORLD = 2
T, H, V_LOCAL, TEMPERATURE = 300, 256, 50_001, 0.9  # V_LOCAL odd: no tile divides it


def _worker(rank: int, port: int, workdir: Path, backend: str) -> None:
    import torch.distributed as dist

    from rltrain.ops import logprobs_from_hidden

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(WORLD)))
    data = {k: v.cuda() for k, v in torch.load(workdir / "inputs.pt").items()}
    shard = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    out = {}
    for case, rows, entropy_grad in (("all", None, True), ("rows", data["rows"], False)):
        hidden = data["hidden"].clone().requires_grad_()
        weight = data["weight"][shard].clone().requires_grad_()
        lp, ent = logprobs_from_hidden(hidden, weight, data["labels"], tp_group=group, rows=rows,
                                       entropy_grad=entropy_grad, backend=backend, temperature=TEMPERATURE)
        loss = lp * data["grad_lp"] + (ent * data["grad_ent"] if entropy_grad else 0)
        loss.sum().backward()
        out[case] = [x.detach().cpu() for x in (lp, ent, hidden.grad, weight.grad)]
    torch.save(out, workdir / f"rank{rank}.pt")
    dist.destroy_process_group()


def _available(backend: str) -> str | None:
    """Why `backend` cannot run here (None when it can)."""
    if torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} CUDA GPUs"
    if backend == "cute":
        from rltrain.ops import logprob_cute

        return None if logprob_cute.is_available() else logprob_cute.unavailable_reason()
    from rltrain.ops import logprob_triton

    return None if logprob_triton.is_available() else "triton is not available"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_vocab_parallel_two_gpus_match_fp64(tmp_path, backend):
    why = _available(backend)
    if why:
        pytest.skip(why)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    v = WORLD * V_LOCAL
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = (torch.randn(v, H, generator=g) * 0.3).bfloat16()
    labels = torch.randint(0, v, (T,), generator=g)
    labels[0], labels[1], labels[2] = 0, V_LOCAL - 1, v - 1  # both ends of each shard's range
    data = dict(hidden=hidden, weight=weight, labels=labels, rows=torch.arange(0, T, 3),
                grad_lp=torch.randn(T, generator=g), grad_ent=torch.randn(T, generator=g))
    torch.save(data, tmp_path / "inputs.pt")

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path), backend], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = []
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r]}"
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    inv = 1.0 / TEMPERATURE
    r_lp, r_ent, r_gh, r_gw = fp64_reference(hidden, weight, labels, inv, data["grad_lp"], data["grad_ent"])
    keep = data["rows"]
    k_lp, k_ent, k_gh, k_gw = fp64_reference(hidden[keep], weight, labels[keep], inv, data["grad_lp"][keep], None)
    for r in range(WORLD):
        shard = slice(r * V_LOCAL, (r + 1) * V_LOCAL)
        lp, ent, _, gw = res[r]["all"]
        assert rel(lp, r_lp) <= 1e-5 and rel(ent, r_ent) <= 1e-5, f"rank {r}: values"
        assert rel(gw, r_gw[shard]) <= 5e-3, f"rank {r}: weight-shard grad"
        lp, ent, gh, gw = res[r]["rows"]
        assert rel(lp[keep], k_lp) <= 1e-5 and rel(ent[keep], k_ent) <= 1e-5, f"rank {r}: row-subset values"
        assert rel(gw, k_gw[shard]) <= 5e-3, f"rank {r}: row-subset weight-shard grad"
        dropped = torch.ones(T, dtype=torch.bool)
        dropped[keep] = False
        assert gh[dropped].abs().max().item() == 0, f"rank {r}: rows outside the subset got a gradient"
    assert rel(res[0]["all"][2].double() + res[1]["all"][2].double(), r_gh) <= 5e-3
    assert rel((res[0]["rows"][2].double() + res[1]["rows"][2].double())[keep], k_gh) <= 5e-3


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
