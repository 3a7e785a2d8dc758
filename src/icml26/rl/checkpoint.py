"""Atomic checkpoints: ``torch.save`` into memory, then one atomic file replace, so a kill mid-write leaves the
previous checkpoint intact and a resumed run loses at most one interval."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from ..core.io import atomic_write_bytes


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    buf = io.BytesIO()
    torch.save(state, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: str | os.PathLike, map_location: torch.device | str | None = None) -> dict | None:
    """The saved state, or None when there is no checkpoint at ``path``."""
    path = Path(path)
    if not path.exists():
        return None
    return torch.load(path, map_location=map_location, weights_only=False)
