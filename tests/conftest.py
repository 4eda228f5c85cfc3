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
