"""Shared pytest setup: GPU tests skip cleanly without CUDA, sandbox tests without kernel isolation;
wandb never reaches the network."""

import functools
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Tiny models run faster on one thread; the Ray workers of end-to-end tests get the same setting.
os.environ.setdefault("RLTRAIN_TORCH_THREADS", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


@functools.lru_cache(maxsize=1)
def _sandbox_not_isolated() -> str:
    """Why the sandbox refuses to run code on this machine ('' when it isolates it); probed once."""
    from rltrain.sandbox import probe_isolation

    probe = probe_isolation()
    return "" if probe.isolated else probe.isolation


def pytest_runtest_setup(item):
    if item.get_closest_marker("sandbox") and _sandbox_not_isolated():
        pytest.skip(f"the sandbox refuses to run code on this machine ({_sandbox_not_isolated()}): it needs user "
                    "namespaces, Landlock and seccomp; tests/sandbox/test_isolation_required.py covers the refusal")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_dist_env():
    """An in-process worker publishes torch.distributed's variables in this process and must take them back
    (LocalWorkerGroup.shutdown). One left behind is inherited by every later subprocess, whose rendezvous then
    meets this process's store on the same port (EADDRINUSE in CI once): the test that leaks fails, named."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    after = {k: os.environ.get(k) for k in _DIST_ENV}
    if after != before:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pytest.fail(f"the test left torch.distributed variables in the environment: "
                    f"{ {k: v for k, v in after.items() if before[k] != v} }")
