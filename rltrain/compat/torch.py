"""torch and Triton features probed at run time: fp32-output low-precision GEMMs (torch >= 2.8 on CUDA),
Triton's TMA tensor descriptors (newer Triton) and the multiprocessor count Triton grids are sized by; and
torch.distributed's rendezvous store bound to the address its ranks meet at (`bound_store`, `bind_rendezvous_to_host`:
torch's own listens on every interface). No numerics here (ops/ decides what to do with the probes); where a group
meets is decided in utils/distenv.rendezvous_host.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def cuda_mm_out_dtype() -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=torch.float32)` / `torch.addmm(...)` for bf16 CUDA
    GEMMs (fp32 result straight from the fp32 accumulator, torch >= 2.8)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
        acc = torch.zeros(2, 2, dtype=torch.float32, device="cuda")
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0] == 2)
    except (TypeError, RuntimeError):
        return False


def optional_triton() -> tuple:
    """(triton, triton.language), or (None, None) on an install without Triton (the torch paths run then)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - exercised on installs without triton
        return None, None
    return triton, tl


def triton_interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where Triton kernels run on CPU tensors (the CPU tests of the kernels)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def multiprocessor_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (what Triton launchers size their grids by); 4 for a CPU tensor (the
    Triton interpreter: any small number exercises the grid logic)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def triton_tensor_descriptor():
    """Triton's TensorDescriptor class (TMA loads on Hopper), or None on a Triton without it / without Triton."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # older triton: pointer loads only (or no triton at all)
        return None
    return TensorDescriptor


def bound_store(host: str, port: int, world_size: int | None, *, is_master: bool, timeout,
                multi_tenant: bool = False, use_libuv: bool = True):
    """A torch.distributed TCPStore whose server (is_master) listens on `host` only. torch's own TCPStore server
    listens on every interface whatever `host` says, with no authentication; here the socket is bound to `host`
    first and handed over (`master_listen_fd`, which the store then owns and closes). Clients are plain TCPStores."""
    import socket

    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout, multi_tenant=multi_tenant, use_libuv=use_libuv)
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout, multi_tenant=multi_tenant,
                         master_listen_fd=sock.detach(), use_libuv=use_libuv)


def bind_rendezvous_to_host() -> None:
    """Make torch.distributed's tcp:// and env:// rendezvous (init_process_group's, vLLM's) create rank 0's store with
    `bound_store`: it listens on the address the ranks are told to meet at (MASTER_ADDR, the URL's host) only, so a
    run on one node, which meets at 127.0.0.1, listens on loopback only. Idempotent; a torch without the hook
    (torch.distributed.rendezvous._create_c10d_store) is left alone."""
    import sys

    import torch.distributed  # noqa: F401 (loads torch.distributed.rendezvous)

    rdzv = sys.modules.get("torch.distributed.rendezvous")
    create = getattr(rdzv, "_create_c10d_store", None)
    if create is None or getattr(create, "_rltrain_bound", False):
        return

    def create_bound(hostname, port, rank, world_size, timeout, use_libuv=True):
        if rdzv._torchelastic_use_agent_store() or rank != 0:  # clients (torchrun's agent owns its server)
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        return bound_store(hostname, port, world_size, is_master=True, timeout=timeout, multi_tenant=True,
                           use_libuv=use_libuv)

    create_bound._rltrain_bound = True
    rdzv._create_c10d_store = create_bound
