"""Progress bars for long loops (tqdm on stderr); ``ICML26_PROGRESS=0`` silences them, e.g. in CI logs."""

from __future__ import annotations

import os
from typing import Iterable, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress_enabled() -> bool:
    return os.environ.get("ICML26_PROGRESS", "1") not in ("0", "false", "no")


def progress(iterable: Iterable[T], *, desc: str, total: int | None = None, leave: bool = False) -> Iterable[T]:
    """Wrap ``iterable`` in a progress bar labelled ``desc`` (a no-op wrapper when progress is disabled)."""
    return tqdm(iterable, desc=desc, total=total, leave=leave, disable=not progress_enabled(), dynamic_ncols=True)
