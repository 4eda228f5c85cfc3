"""Where a run's torch.distributed store listens (issue #66): torch's own TCPStore server listens on every interface
whatever host it is given; `bound_store` listens on that host only, and after `bind_rendezvous_to_host` the tcp:// and
env:// rendezvous of init_process_group (and vLLM's) do too. Read from /proc/net/tcp{,6} for this process's sockets."""

import datetime
import os
import sys

import pytest
import torch.distributed as dist

from rltrain.compat.torch import bind_rendezvous_to_host, bound_store
from rltrain.main import CONFIG_DIR
from rltrain.utils.distenv import free_port, rendezvous_host

sys.path.insert(0, os.path.join(os.path.dirname(CONFIG_DIR), "tests", "trainer"))

import exposure  # noqa: E402  (tests/trainer/exposure.py reads /proc)

TIMEOUT = datetime.timedelta(seconds=30)


def _listening_here() -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets of this process in LISTEN state (tests/trainer/exposure.py reads /proc)."""
    mine = exposure.sockets(os.getpid())
    return [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for i, a in exposure.listening().items() if i in mine]


def test_a_bound_store_listens_on_its_host_only_and_serves_clients():
    host = rendezvous_host(True, "10.0.0.7")
    assert host == "127.0.0.1" and rendezvous_host(False, "10.0.0.7") == "10.0.0.7"
    server = bound_store(host, free_port(host), None, is_master=True, timeout=TIMEOUT, multi_tenant=True)
    assert (host, server.port) in _listening_here()
    assert [a for a, p in _listening_here() if p == server.port] == [host]  # not "::" or "0.0.0.0"
    client = bound_store(host, server.port, None, is_master=False, timeout=TIMEOUT)
    server.set("k", "v")
    assert client.get("k") == b"v"


@pytest.mark.parametrize("scheme", ["tcp", "env"])
def test_init_process_groups_rendezvous_listens_on_the_meeting_address_only(scheme, monkeypatch):
    """The store init_process_group (tcp:// as vLLM gives it, env:// as the workers do) makes for rank 0."""
    bind_rendezvous_to_host()
    bind_rendezvous_to_host()  # idempotent
    rdzv = sys.modules["torch.distributed.rendezvous"]
    port = free_port("127.0.0.1")
    if scheme == "tcp":
        url = f"tcp://127.0.0.1:{port}?rank=0&world_size=1"
    else:
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(k, v)
        url = "env://"
    store, rank, world = next(rdzv.rendezvous(url, timeout=TIMEOUT))
    assert (rank, world) == (0, 1)
    assert [a for a, p in _listening_here() if p == port] == ["127.0.0.1"]
    store.set("x", "1")
    assert dist.TCPStore("127.0.0.1", port, 1, False, TIMEOUT).get("x") == b"1"
