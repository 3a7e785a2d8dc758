"""Make icml26's saved models loadable by ``transformers``' Auto classes after a plain ``import icml26``.

A checkpoint written by ``save_pretrained`` names its ``model_type`` (``"icml26_fix"``, ``"icml26_kromhc_llama"``,
...). transformers finds the config class for it in ``CONFIG_MAPPING``, which only knows classes that have been
registered. Registering ours for real means importing ``transformers.modeling_utils`` and every room's model
module: several seconds that ``import icml26`` must not cost a user of the optimizers or probes. So this module
registers *deferred* entries instead, and does it only once transformers' Auto machinery is itself imported:

* :func:`install` (called by ``icml26/__init__``) adds the entries at once if
  ``transformers.models.auto.configuration_auto`` is already imported, and otherwise leaves a one-shot
  post-import hook on ``sys.meta_path`` that adds them right after that module has executed.
* Each entry is a :class:`DeferredConfig`: it carries only the model_type, module and class name. The first time
  transformers uses it (``from_dict``, ``for_model``, any attribute), it imports the room's module, whose own
  ``register_tiny_lm`` call replaces the entry with the real config class and registers the model class with
  ``AutoModelForCausalLM``; the entry then forwards to the real class.

Nothing here imports transformers or torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["DEFERRED_MODEL_TYPES", "DeferredConfig", "install"]

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"

_FIX_DROPIN = "icml26.methods.fix_attention.dropin"
_KROMHC_DROPIN = "icml26.methods.kromhc.dropin"

# model_type -> (module that defines and registers the config, config class name).
DEFERRED_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "icml26_tiny_lm": ("icml26.models.hf", "TinyLMHFConfig"),
    "icml26_fix": ("icml26.methods.fix_attention.hf", "FixLMConfig"),
    "icml26_kromhc": ("icml26.methods.kromhc.hf", "KromHCLMConfig"),
    **{f"icml26_fix_{host}": (_FIX_DROPIN, f"Fix{name}Config") for host, name in
       (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))},
    **{f"icml26_kromhc_{host}": (_KROMHC_DROPIN, f"KromHC{name}Config") for host, name in
       (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))},
}


class DeferredConfig:
    """Stands in ``CONFIG_MAPPING`` for a config class until transformers first uses it.

    ``__module__`` / ``__qualname__`` / ``__name__`` are those of the real class, so transformers' checks on them
    (local vs remote code, ``config_class_to_model_type``) and ``register_tiny_lm``'s same-class test see the real
    class without importing it.
    """

    def __init__(self, model_type: str, module: str, name: str) -> None:
        self.model_type = model_type
        self.__module__ = module
        self.__qualname__ = name
        self.__name__ = name

    def resolve(self) -> type:
        """Import the defining module (which registers the real classes) and return the config class."""
        return getattr(importlib.import_module(self.__module__), self.__qualname__)

    def __getattr__(self, attr: str) -> Any:
        # Only reached for attributes the instance lacks: from_dict, from_pretrained, model_type lookups, ...
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.resolve(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"DeferredConfig({self.model_type!r} -> {self.__module__}.{self.__qualname__})"


def _add_deferred_entries(configuration_auto: Any) -> None:
    mapping = configuration_auto.CONFIG_MAPPING
    for model_type, (module, name) in DEFERRED_MODEL_TYPES.items():
        if model_type not in mapping:  # a real registration (the room already imported) wins
            mapping.register(model_type, DeferredConfig(model_type, module, name))


class _RunAfterExec(importlib.abc.Loader):
    """Wraps a module's loader so that ``callback(module)`` runs once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, callback) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, is_package, ... for tracebacks and tools
        return getattr(self._loader, attr)


class _AutoConfigImportHook(importlib.abc.MetaPathFinder):
    """One-shot finder: wraps the loader of transformers' configuration_auto, then removes itself."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != AUTO_CONFIG_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders; the parent package is already imported
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfterExec(spec.loader, _add_deferred_entries)
        return spec


def install() -> None:
    """Make icml26's model types known to ``AutoConfig`` / ``AutoModelForCausalLM`` (idempotent, cheap)."""
    loaded = sys.modules.get(AUTO_CONFIG_MODULE)
    if loaded is not None:
        _add_deferred_entries(loaded)
    elif not any(isinstance(finder, _AutoConfigImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AutoConfigImportHook())
