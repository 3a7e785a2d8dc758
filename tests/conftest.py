"""Suite-wide settings: no network for transformers, no progress bars in test logs, and a one-thread fixture."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("ICML26_PROGRESS", "0")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module of small-tensor tests.

    On a shared 2-core machine two intra-op threads mostly wait on each other (up to 10x slower under load).
    Use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
