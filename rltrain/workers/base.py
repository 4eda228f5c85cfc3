"""The plain-Python base of every role worker: rank bookkeeping, the torch.distributed environment, and the
check that a directory (the checkpoint dir) is shared by every node.

No Ray here (group.py wraps these classes as Ray actors); a worker also runs in-process for tests.
"""

from __future__ import annotations

import os
import socket

from rltrain.compat.torch import bind_rendezvous_to_host
from rltrain.utils.distenv import free_port  # noqa: F401 (the workers' rendezvous port; tools import it from here)
from rltrain.utils.distenv import loopback_sockets, rendezvous_host


def node_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def publish_dist_env(*, rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int) -> None:
    """Set the variables torch.distributed (env://) and megatron's setup read in this process.

    LOCAL_RANK is the device ordinal this process uses (placement.device_ordinal): torchrun's meaning, which
    under Ray (each actor sees only its own GPUs) is 0, not the position on the node. Rank 0's store listens on
    `master_addr` only (compat/torch.bind_rendezvous_to_host), and a group whose rendezvous is on loopback (all
    ranks on one node) keeps gloo's and NCCL's sockets there too (utils/distenv.loopback_sockets).
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    loopback_sockets(master_addr)
    bind_rendezvous_to_host()


class Worker:
    """One rank of a worker group. `rank`/`world_size` place it in the group's torch.distributed world.

    The distributed environment is published through the usual variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK) so that the model backend's `setup_parallel` initializes the process group.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, master_addr: str | None = None,
                 master_port: int | None = None, local_rank: int = 0):
        self.rank, self.world_size = rank, world_size
        if world_size > 1 or master_addr is not None:
            host = master_addr or rendezvous_host(True, "")  # in process: one node
            publish_dist_env(rank=rank, world_size=world_size, master_addr=host,
                             master_port=master_port or free_port(host), local_rank=local_rank)

    def ping(self) -> int:
        return self.rank

    @staticmethod
    def address() -> tuple[str, int]:
        """(ip, free port) of the node this worker runs on: rank 0's is the rendezvous of its group."""
        return node_ip(), free_port()

    def check_shared_dir(self, path: str, probe_name: str, token: str) -> str | None:
        """None when this worker reads `token` from path/probe_name (written by the driver) and can write
        beside it (path/probe_name.rank<r>, which the driver then reads); else what went wrong."""
        probe = os.path.join(path, probe_name)
        try:
            with open(probe) as f:
                seen = f.read()
        except OSError as err:
            return f"cannot read {probe} ({err.strerror or err})"
        if seen != token:
            return f"{probe} holds another run's probe (a different directory under the same path?)"
        try:
            with open(f"{probe}.rank{self.rank}", "w") as f:
                f.write(token)
        except OSError as err:
            return f"cannot write in {path} ({err.strerror or err})"
        return None
