"""Fixtures shared by the rollout tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core box run 10-100x faster single-threaded (no spin-waiting). A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
