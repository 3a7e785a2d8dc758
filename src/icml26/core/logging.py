"""Metric logging to JSON Lines: one object per line, flushed as written, readable while a run is going."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .io import _jsonable


class JsonlLogger:
    """Append metric records to ``path`` (``{"step": ..., "time": ..., **metrics}`` per line).

    Use as a context manager or call :meth:`close`. Each line is flushed, so a killed run keeps what it logged.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a")
        self._start = time.perf_counter()

    def log(self, step: int, **metrics: Any) -> None:
        record = {"step": step, "time": round(time.perf_counter() - self._start, 4), **metrics}
        self._handle.write(json.dumps(_jsonable(record)) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()

    def __enter__(self) -> "JsonlLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read every complete line of a JSONL file (a torn last line from a kill is skipped)."""
    records = []
    with open(path) as handle:
        for line in handle:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
