"""Atomic file writes: a reader never sees a half-written result, checkpoint or report."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def _atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str) -> Path:
    """Write via a temporary file in the same directory, fsync, then ``os.replace`` (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # mkstemp creates the file 0600; give the result the permissions a plain open() would (0666 minus umask).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with os.fdopen(fd, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _jsonable(obj: Any) -> Any:
    """Make floats JSON-safe (NaN/inf become strings) and unwrap numpy/torch scalars."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically. Non-finite floats are stored as strings ("inf", "nan")."""
    text = json.dumps(_jsonable(obj), indent=2, sort_keys=False)
    return _atomic_write(path, lambda h: h.write(text + "\n"), "w")


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return _atomic_write(path, lambda h: h.write(text), "w")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return _atomic_write(path, lambda h: h.write(data), "wb")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as handle:
        return json.load(handle)


def cached_tensors(path: str | os.PathLike, build: Callable[[], dict]) -> dict:
    """Tensors from the safetensors file ``path``; on a miss, ``build()`` them and save them atomically first.

    Used for deterministic derived assets (e.g. a pretrained tiny model) that are costly to rebuild. Tied
    tensors must be passed as separate copies: safetensors refuses shared storage.
    """
    from safetensors.torch import load_file, save

    path = Path(path)
    if path.exists():
        return load_file(str(path))
    tensors = {k: v.detach().contiguous().clone() for k, v in build().items()}
    atomic_write_bytes(path, save(tensors))
    return tensors
