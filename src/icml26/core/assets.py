"""Optional dependencies and offline assets: import them lazily, fail with the install command.

Rooms and loaders call :func:`require` instead of a bare ``import`` so that a user who lacks an
extra gets one sentence telling them what to install, not a ``ModuleNotFoundError`` deep in a stack.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType


class MissingAssetError(ImportError):
    """An optional package or offline asset is not installed; the message names the install command."""


def require(module: str, install: str, *, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise :class:`MissingAssetError` whose message shows ``install``.

    Args:
        module: dotted module name, e.g. ``"transformers"``.
        install: the exact shell command that provides it, e.g. ``"pip install 'icml26[llm]'"``.
        purpose: what the module is needed for, to make the message self-explanatory.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        why = f" (needed for {purpose})" if purpose else ""
        raise MissingAssetError(f"Python package '{module}' is not installed{why}. Install it with: {install}") from err


def cache_dir(*parts: str) -> Path:
    """User cache directory for derived assets (converted weights, extracted corpora).

    ``$ICML26_CACHE`` wins, then ``$XDG_CACHE_HOME/icml26``, then ``~/.cache/icml26``.
    """
    root = os.environ.get("ICML26_CACHE")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "icml26")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
