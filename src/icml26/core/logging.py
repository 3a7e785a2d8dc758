"""Metric logging to JSON Lines: one object per line, flushed as written, readable while a run is going."""

from __future__ import annotations

import contextvars
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

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
        self.tags: dict[str, Any] = {}  # merged into every record, e.g. {"seed": 2} set by the runner

    def log(self, step: int, **metrics: Any) -> None:
        self.write_record({"step": step, "time": round(time.perf_counter() - self._start, 4), **self.tags,
                           **metrics})

    def write_record(self, record: dict[str, Any]) -> None:
        """Append one whole record as it is (e.g. one that a worker process's logger wrote)."""
        self._handle.write(json.dumps(_jsonable(record)) + "\n")
        self._handle.flush()

    def absorb(self, part: str | os.PathLike, keep: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Append every whole record of ``part`` (a worker process's own log, if it wrote one), or only those for
        which ``keep(record)`` is true, then delete it, so one finished task's lines arrive together and never
        interleave with another's."""
        part = Path(part)
        if part.exists():
            for record in read_jsonl(part):
                if keep is None or keep(record):
                    self.write_record(record)
            part.unlink()

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


_ACTIVE: contextvars.ContextVar[JsonlLogger | None] = contextvars.ContextVar("icml26_metric_log", default=None)


@contextmanager
def metric_log(path: str | os.PathLike) -> Iterator[JsonlLogger]:
    """Make ``path`` the destination of :func:`log_metrics` calls inside the block (the runner sets one per spec)."""
    with JsonlLogger(path) as logger:
        token = _ACTIVE.set(logger)
        try:
            yield logger
        finally:
            _ACTIVE.reset(token)


@contextmanager
def tagged(**tags: Any) -> Iterator[None]:
    """Add ``tags`` to every record the active metric log receives inside the block (an inner block's win), e.g. the
    stored training or the tuning point a line belongs to, by which a resumed run knows to keep it."""
    logger = _ACTIVE.get()
    if logger is None:
        yield
        return
    outer = logger.tags
    logger.tags = {**outer, **tags}
    try:
        yield
    finally:
        logger.tags = outer


def current_metric_log() -> JsonlLogger | None:
    """The active :func:`metric_log`'s logger (None outside one), e.g. to collect what a worker process logged."""
    return _ACTIVE.get()


def log_metrics(step: int, **metrics: Any) -> None:
    """Log to the active :func:`metric_log`, if any; training loops call this unconditionally."""
    logger = _ACTIVE.get()
    if logger is not None:
        logger.log(step, **metrics)
