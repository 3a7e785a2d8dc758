"""Suite-wide settings: no network for transformers, no progress bars in test logs, and a one-thread fixture."""

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("ICML26_PROGRESS", "0")

# `make test` runs the suite in pytest-xdist workers (one per core). Each worker, and every subprocess a test
# starts, gets an equal share of the cores as torch threads: two workers with two intra-op threads each on a
# 2-core machine mostly wait on each other (small tensors; see `one_thread`).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", _share)
    os.environ.setdefault("MKL_NUM_THREADS", _share)
    if "torch" in sys.modules:  # a plugin imported torch before this file: its pool size is already fixed
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


@pytest.fixture
def one_step_bandit():
    """A D4RL-layout dataset of 2,000 one-step episodes (2-D observations and actions, actions uniform in [-1, 1],
    reward -||a - a*||^2 with a* = (0.5, -0.3)): an offline RL learner that uses its rewards moves its actor to a*.

    Returns ``(data, obs, target)``: the validated dataset, 50 observations to query the actor at, and a*."""
    import numpy as np

    from icml26.rl.datasets import validate

    rng = np.random.default_rng(0)
    n = 2000
    obs = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    act = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    target = np.array([0.5, -0.3], dtype=np.float32)
    data = validate({"observations": obs, "actions": act, "rewards": -((act - target) ** 2).sum(1),
                     "next_observations": obs, "terminals": np.ones(n), "timeouts": np.zeros(n)})
    return data, obs[:50], target


@pytest.fixture
def run_card_snippet():
    """``run(readme, after, namespace=None) -> namespace``: execute the first ```python block that follows the text
    ``after`` in a card (README; the card's first block when ``after`` is empty), so a test runs the snippet users
    copy exactly as written; ``namespace`` supplies the names the snippet takes as given (a model, a dataset)."""
    import re
    from pathlib import Path

    def run(readme, after: str = "", namespace: dict | None = None) -> dict:
        text = Path(readme).read_text()
        block = re.search(r"```python\n(.*?)```", text[text.index(after):], re.S).group(1)
        scope = {} if namespace is None else namespace
        exec(compile(block, str(readme), "exec"), scope)
        return scope

    return run
