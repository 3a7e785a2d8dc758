"""Plain CSPLoRA importance: one sample at a time, parameter gradients from autograd, Python loops for the weights.

This is the ground truth for ``planner.py``, which gets the same numbers from one batched pass with per-sample
gradients reconstructed by hooks. Nothing here is shared with the batched code except the probe function and
the config.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from .config import CSPLoRAConfig


def _one_sample(batch: Any, i: int) -> Any:
    """Sample ``i`` of a batch (a tensor, or a tuple/list/dict of tensors sharing the first dimension), kept 1-long."""
    if isinstance(batch, torch.Tensor):
        return batch[i:i + 1]
    if isinstance(batch, dict):
        return {k: _one_sample(v, i) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_one_sample(v, i) for v in batch)
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}")


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return _batch_size(first)


def reference_weights(confidence: list[float], entropy: list[float] | None, config: CSPLoRAConfig) -> list[float]:
    """w(x) = u(x) / mean u, with u = (1 - c)^gamma, H / log K or 1, element by element."""
    u = []
    for i, c in enumerate(confidence):
        if config.weighting == "none":
            u.append(1.0)
        elif config.weighting == "entropy":
            u.append(min(max(entropy[i], 0.0), 1.0))
        else:
            u.append((1.0 - min(max(c, 0.0), 1.0)) ** config.gamma)
    mean = sum(u) / len(u)
    return [x / mean for x in u] if mean > 0 else [1.0] * len(u)


def reference_importance(model: nn.Module, batches: list[Any], probe_fn, names: Sequence[str],
                         config: CSPLoRAConfig) -> tuple[dict[str, float], list[float]]:
    """Raw importance I_m = mean_x w(x) s_m(x) (before size normalisation) and the weights w, sample by sample.

    Each sample runs alone through ``probe_fn``; s_m(x) is read from the parameter gradient dl(x)/dW_m.
    """
    modules = [model.get_submodule(n) for n in names]
    flags = [m.weight.requires_grad for m in modules]
    was_training = model.training
    model.eval()
    scores: list[list[float]] = []
    confidence: list[float] = []
    entropy: list[float] = []
    try:
        for m in modules:
            m.weight.requires_grad_(True)
        for batch in batches:
            for i in range(_batch_size(batch)):
                with torch.enable_grad():
                    out = probe_fn(model, _one_sample(batch, i))
                    grads = torch.autograd.grad(out.loss.sum(), [m.weight for m in modules], allow_unused=True)
                row = []
                for m, g in zip(modules, grads):
                    if g is None:
                        row.append(0.0)
                    elif config.importance == "fisher":
                        row.append(float(g.double().pow(2).sum()))
                    else:
                        row.append(float((g.double() * m.weight.detach().double()).abs().sum()))
                scores.append(row)
                confidence.append(float(out.confidence.reshape(-1)[0]))
                entropy.append(float(out.entropy.reshape(-1)[0]) if out.entropy is not None else math.nan)
    finally:
        for m, flag in zip(modules, flags):
            m.weight.requires_grad_(flag)
        model.train(was_training)
    weights = reference_weights(confidence, entropy, config)
    importance = {}
    for j, name in enumerate(names):
        importance[name] = sum(w * row[j] for w, row in zip(weights, scores)) / len(scores)
    return importance, weights


def reference_proportions(importance: dict[str, float], shapes: dict[str, tuple[int, int]],
                          config: CSPLoRAConfig) -> dict[str, float]:
    """pi_m = (I_m / numel_m^p)^kappa / sum_j (I_j / numel_j^p)^kappa, written out directly."""
    power = {"none": 0.0, "sqrt": 0.5, "numel": 1.0}[config.size_norm]
    score = {n: v / (shapes[n][0] * shapes[n][1]) ** power for n, v in importance.items()}
    if config.kappa == 0 or all(v <= 0 for v in score.values()):
        return {n: 1.0 / len(score) for n in score}
    powered = {n: (v ** config.kappa if v > 0 else 0.0) for n, v in score.items()}
    total = sum(powered.values())
    return {n: v / total for n, v in powered.items()}
