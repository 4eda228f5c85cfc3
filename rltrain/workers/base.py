"""The plain-Python base of every role worker: rank bookkeeping and torch.distributed environment.

No Ray here (group.py wraps these classes as Ray actors); a worker also runs in-process for tests.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Worker:
    """One rank of a worker group. `rank`/`world_size` place it in the group's torch.distributed world.

    The distributed environment is published through the usual variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK) so that the model backend's `setup_parallel` initializes the process group.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, master_addr: str | None = None,
                 master_port: int | None = None, local_rank: int = 0):
        self.rank, self.world_size = rank, world_size
        if world_size > 1 or master_addr is not None:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                              MASTER_ADDR=master_addr or "127.0.0.1", MASTER_PORT=str(master_port or free_port()))

    def ping(self) -> int:
        return self.rank

    @staticmethod
    def address() -> tuple[str, int]:
        """(ip, free port) of the node this worker runs on: rank 0's is the rendezvous of its group."""
        return node_ip(), free_port()
