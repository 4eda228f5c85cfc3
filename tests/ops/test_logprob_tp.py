"""Vocab-parallel parity: a real gloo group of 2 CPU processes, the vocabulary split in 2, against the
fp64 single-process reference (values, weight-shard grads, hidden grads summed over ranks).

The ranks are started as `python <this file> RANK WORLD PORT DIR` subprocesses (not multiprocessing
pickling), so the test works under any pytest import mode; inputs and results travel as torch.save files.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from rltrain.utils.distenv import free_port

WORLD = 2
T, H, V_LOCAL, CHUNK, TEMPERATURE = 29, 12, 61, 6, 0.9  # global vocab 122; T not a multiple of CHUNK


def _worker(rank: int, world: int, port: int, workdir: Path) -> None:
    import torch.distributed as dist

    from rltrain.ops import logprobs_from_hidden, logprobs_from_logits

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    data = torch.load(workdir / "inputs.pt")
    shard = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    out = {}

    # fused path, all rows, grads on both outputs
    hidden = data["hidden"].clone().requires_grad_()
    weight = data["weight"][shard].clone().requires_grad_()
    lp, ent = logprobs_from_hidden(
        hidden, weight, data["labels"], tp_group=group, backend="torch", chunk_size=CHUNK, temperature=TEMPERATURE
    )
    (lp * data["grad_lp"] + ent * data["grad_ent"]).sum().backward()
    out["fused"] = (lp.detach(), ent.detach(), hidden.grad, weight.grad)

    # fused path with rows and entropy_grad=False
    hidden = data["hidden"].clone().requires_grad_()
    weight = data["weight"][shard].clone().requires_grad_()
    lp, ent = logprobs_from_hidden(
        hidden, weight, data["labels"], tp_group=group, rows=data["keep"], entropy_grad=False,
        chunk_size=CHUNK, temperature=TEMPERATURE,
    )
    assert ent.grad_fn is None
    (lp * data["grad_lp"]).sum().backward()
    out["rows"] = (lp.detach(), ent.detach(), hidden.grad, weight.grad)

    # logits path on this rank's logits shard
    logits = (data["hidden"] @ data["weight"][shard].T).requires_grad_()
    lp, ent = logprobs_from_logits(logits, data["labels"], tp_group=group, chunk_size=CHUNK, temperature=TEMPERATURE)
    (lp * data["grad_lp"] + ent * data["grad_ent"]).sum().backward()
    out["logits"] = (lp.detach(), ent.detach(), logits.grad)

    torch.save(out, workdir / f"rank{rank}.pt")
    dist.destroy_process_group()


def _close(actual, expected, what, rel=2e-5):
    atol = rel * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _reference(hidden, weight, labels, grad_lp, grad_ent, keep=None):
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    logits = h64 @ w64.T
    logits.retain_grad()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    mask = torch.ones(len(labels), dtype=torch.float64) if keep is None else keep.double()
    (lp * grad_lp.double() * mask + ent * grad_ent.double() * mask).sum().backward()
    return lp.detach(), ent.detach(), h64.grad, w64.grad, logits.grad


def test_vocab_parallel_two_gloo_ranks_match_fp64(tmp_path):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    hidden = torch.randn(T, H)
    weight = torch.randn(WORLD * V_LOCAL, H) * (2 / H**0.5)
    labels = torch.randint(0, WORLD * V_LOCAL, (T,))
    labels[0], labels[1] = 0, WORLD * V_LOCAL - 1  # one label at each end of the vocabulary
    keep = torch.rand(T) < 0.5
    keep[0] = True
    data = dict(hidden=hidden, weight=weight, labels=labels, keep=keep, grad_lp=torch.randn(T), grad_ent=torch.randn(T))
    torch.save(data, tmp_path / "inputs.pt")

    port = free_port("127.0.0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(WORLD), str(port), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed (seed {seed}):\n{logs[rank]}"
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    ref_lp, ref_ent, ref_gh, ref_gw, ref_glogits = _reference(hidden, weight, labels, data["grad_lp"], data["grad_ent"])
    # fused: every rank returns the global values; weight grads per shard; hidden grads are partial sums
    for rank, res in enumerate(results):
        lp, ent, _, gw = res["fused"]
        _close(lp, ref_lp, f"fused logprobs rank {rank} (seed {seed})")
        _close(ent, ref_ent, f"fused entropy rank {rank} (seed {seed})")
        _close(gw, ref_gw[rank * V_LOCAL:(rank + 1) * V_LOCAL], f"fused grad weight shard {rank} (seed {seed})")
    _close(sum(r["fused"][2] for r in results), ref_gh, f"fused grad hidden summed over ranks (seed {seed})")

    # logits path: global values, exact grads of each rank's logits shard
    for rank, res in enumerate(results):
        lp, ent, glogits = res["logits"]
        _close(lp, ref_lp, f"logits logprobs rank {rank} (seed {seed})")
        _close(ent, ref_ent, f"logits entropy rank {rank} (seed {seed})")
        _close(glogits, ref_glogits[:, rank * V_LOCAL:(rank + 1) * V_LOCAL], f"grad logits shard {rank} (seed {seed})")

    # rows + entropy_grad=False: kept rows as the reference, others 0; grads of log-probs only
    r_lp, r_ent, r_gh, r_gw, _ = _reference(hidden, weight, labels, data["grad_lp"], torch.zeros(T), keep=keep)
    for rank, res in enumerate(results):
        lp, ent, _, gw = res["rows"]
        _close(lp[keep], r_lp[keep], f"rows logprobs rank {rank} (seed {seed})")
        _close(ent[keep], r_ent[keep], f"rows entropy rank {rank} (seed {seed})")
        assert torch.count_nonzero(lp[~keep]) == 0 and torch.count_nonzero(ent[~keep]) == 0
        _close(gw, r_gw[rank * V_LOCAL:(rank + 1) * V_LOCAL], f"rows grad weight shard {rank} (seed {seed})")
    gh = sum(r["rows"][2] for r in results)
    _close(gh, r_gh, f"rows grad hidden summed (seed {seed})")
    assert torch.count_nonzero(gh[~keep]) == 0


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
