"""Seeding: one call makes a run repeatable (same seed, same metrics) on CPU."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch's global generators and return a fresh ``torch.Generator`` seeded with ``seed``.

    Deterministic algorithms are requested (warn-only, so CPU ops without a deterministic variant still run).
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.Generator().manual_seed(seed)
