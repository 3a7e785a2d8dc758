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
        # A projection that is not an nn.Linear (GPT-2's transformers Conv1D stores its weight transposed) is named
        # with its type, since "no match" would be a confusing answer for a module that exists.
        others = sorted({f"{n} ({type(m).__name__})" for t in unmatched for n, m in model.named_modules()
                         if n and not isinstance(m, nn.Linear) and selects(t, n) and hasattr(m, "weight")})
        if others:
            raise ValueError(f"target_modules {unmatched} select modules that are not nn.Linear: "
                             f"{', '.join(others[:10])}; these adapters wrap nn.Linear only. For transformers' "
                             "Conv1D (GPT-2 style) use the peft route, which supports it")
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
    """The adapter tensors (keys whose last component starts with the owning layer's ``prefix``), plus
    ``<layer>.base.weight`` of every layer whose base weight was changed in training (``base_modified``)."""
    layers = dict(adapter_layers(model))
    prefixes = tuple({type(layer).prefix for layer in layers.values()})
    state = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1].startswith(prefixes)}
    state.update({f"{name}.base.weight": layer.base.weight for name, layer in layers.items() if layer.base_modified})
    return state


def save_adapters(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the adapter tensors to a safetensors file (atomically).

    Layers whose frozen weight absorbed updates in training (ScaLoRA, ReLoRA) also write that weight, so that
    :func:`load_adapters` restores the function exactly; such a file is as large as those layers' weights.
    """
    from safetensors.torch import save

    from ..io import atomic_write_bytes

    if not any(True for _ in adapter_layers(model)):
        raise ValueError("the model has no icml26 adapter layer to save (a peft model saves its adapters with "
                         "its own save_pretrained)")
    for name, layer in adapter_layers(model):
        if layer.merged and layer.base_modified:
            raise RuntimeError(f"unmerge the adapters before saving: {name}'s base weight is saved and, merged, it "
                               "would hold the update twice")
    state = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(model).items()}
    atomic_write_bytes(path, save(state))


def load_adapters(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a file written by :func:`save_adapters` into a model with the same adapters injected.

    Base weights in the file replace those of their layers (which are then ``base_modified``). A file without a
    base weight for a layer whose base weight was changed in training is refused: its factors were trained against
    another base, and loading them would silently change the function.
    """
    from safetensors.torch import load_file

    saved = load_file(str(path))
    layers = dict(adapter_layers(model))
    expected = adapter_state_dict(model)
    bases = {f"{name}.base.weight": name for name in layers}
    missing = sorted(k for k in set(expected) - set(saved) if k not in bases)
    unexpected = sorted(k for k in set(saved) - set(expected) if k not in bases)
    if missing or unexpected:
        raise ValueError(f"adapter file {path} does not fit this model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    stale = sorted(bases[k] for k in bases if layers[bases[k]].base_modified and k not in saved)
    if stale:
        raise ValueError(f"the base weights of {stale[:5]} were changed in training (merged updates), and {path} "
                         "has no base weights for them: its factors belong to another base; load it into a fresh "
                         "copy of the model")
    if any(layer.merged for layer in layers.values()):
        raise RuntimeError("unmerge the adapters before loading new adapter weights")
    model.load_state_dict(saved, strict=False)
    for key, name in bases.items():
        if key in saved:
            layers[name].base_modified = True


def count_trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
