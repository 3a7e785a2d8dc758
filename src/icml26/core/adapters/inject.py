"""Inject adapters into a model's nn.Linear modules by name; merge, unmerge, save, load, count."""

from __future__ import annotations

import os
import re
from typing import Callable, Iterator

import torch
from torch import nn

from .base import AdapterConfig, AdapterLinear


def find_target_modules(model: nn.Module, target_modules) -> list[str]:
    """Names of the ``nn.Linear`` modules selected by ``target_modules``.

    A list/tuple of strings selects modules whose name equals an entry or ends with ``"." + entry``; every entry
    must select at least one module. A single string is a regex that must match the whole name. An entry that
    selects nothing raises ValueError listing the Linear modules the model has.
    """
    adapted = {name: type(mod).__name__ for name, mod in model.named_modules() if isinstance(mod, AdapterLinear)}
    linears = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)
               and name.rpartition(".")[0] not in adapted]  # an adapter's own base layer is not a target

    def selects(target: str, name: str) -> bool:
        if isinstance(target_modules, str):
            return re.fullmatch(target, name) is not None
        return name == target or name.endswith("." + target)

    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    again = sorted({f"{n} ({kind})" for t in targets for n, kind in adapted.items()
                    if selects(t, n) or selects(t, n + ".base")})
    if again:
        raise ValueError(f"target_modules select layers that already have an adapter: {', '.join(again)}; call "
                         f"merge_and_unload(model) first, or choose other modules")
    chosen, unmatched = [], []
    for target in targets:
        hits = [n for n in linears if selects(target, n)]
        if not hits:
            unmatched.append(target)
        chosen += [h for h in hits if h not in chosen]
    if unmatched:
        shown = ", ".join(linears[:40]) + (" ..." if len(linears) > 40 else "")
        raise ValueError(f"target_modules {unmatched} matched no nn.Linear module; the model's Linear modules are: "
                         f"{shown or '(none)'}")
    return [n for n in linears if n in chosen]


def inject_adapters(model: nn.Module, config: AdapterConfig,
                    make: Callable[[nn.Linear, int, float, str], AdapterLinear]) -> list[str]:
    """Replace each targeted Linear with ``make(linear, rank, alpha, name)`` and freeze everything else.

    Returns the names of the adapted modules. Per-module ranks and alphas come from ``config.rank_for`` and
    ``config.alpha_for`` (so a CSPLoRA plan's ``rank_pattern`` applies to every adapter method alike). Every
    ``rank_pattern``/``alpha_pattern`` key must match at least one adapted module.
    """
    names = find_target_modules(model, config.target_modules)
    for pattern_name, patterns in (("rank_pattern", config.rank_pattern), ("alpha_pattern", config.alpha_pattern)):
        for key in patterns:
            if not any(AdapterConfig._pattern_matches(key, n) for n in names):
                raise ValueError(f"{pattern_name} key {key!r} matches none of the adapted modules {names}")
    # Build every adapter before touching the model, so a bad rank for one module leaves the model as it was.
    flags = {param: param.requires_grad for param in model.parameters()}
    try:
        layers = {name: make(model.get_submodule(name), config.rank_for(name), config.alpha_for(name), name)
                  for name in names}
    except BaseException:
        for param, flag in flags.items():
            param.requires_grad_(flag)
        raise
    for param in model.parameters():
        param.requires_grad_(False)
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
    return names


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, AdapterLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, AdapterLinear):
            yield name, module


def merge_adapters(model: nn.Module) -> None:
    for _, layer in adapter_layers(model):
        layer.merge()


def unmerge_adapters(model: nn.Module) -> None:
    for _, layer in adapter_layers(model):
        layer.unmerge()


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain ``nn.Linear`` back (peft's merge_and_unload).

    Afterwards the model has its original module layout and state-dict keys, so ``save_pretrained`` writes a
    checkpoint that a plain ``AutoModel.from_pretrained`` loads with no icml26 import. Returns ``model``.
    """
    for name, layer in list(adapter_layers(model)):
        if not layer.merged:
            layer.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.base)
    return model


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors: keys whose last component starts with the owning layer's ``prefix``."""
    prefixes = {type(layer).prefix for _, layer in adapter_layers(model)}
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1].startswith(tuple(prefixes))}


def save_adapters(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the adapter tensors to a safetensors file (atomically)."""
    from safetensors.torch import save

    from ..io import atomic_write_bytes

    state = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(model).items()}
    atomic_write_bytes(path, save(state))


def load_adapters(model: nn.Module, path: str | os.PathLike) -> None:
    """Load adapter tensors saved by :func:`save_adapters` into a model with the same adapters injected."""
    from safetensors.torch import load_file

    saved = load_file(str(path))
    expected = adapter_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter file {path} does not fit this model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for _, layer in adapter_layers(model):
        if layer.merged:
            raise RuntimeError("unmerge the adapters before loading new adapter weights")
    model.load_state_dict(saved, strict=False)


def count_trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
