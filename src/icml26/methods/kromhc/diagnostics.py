"""Measurements on the residual mixing matrices: doubly stochastic error, composite over depth, Amax gain."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .layers import HyperConnection


def doubly_stochastic_error(h: torch.Tensor) -> float:
    """Largest violation of double stochasticity over a batch of matrices (..., n, n).

    ``max(|row sum - 1|, |column sum - 1|, -min entry)``, computed in the matrices' own dtype (the float32
    question is whether the float32 matrices themselves are doubly stochastic).
    """
    rows = (h.sum(dim=-1) - 1).abs().max()
    cols = (h.sum(dim=-2) - 1).abs().max()
    negative = (-h.min()).clamp_min(0)
    return float(torch.stack((rows, cols, negative.to(rows.dtype))).max())


def amax_gain(h: torch.Tensor) -> float:
    """DeepSeek's Amax gain of (..., n, n): the largest absolute row or column sum (1 for a doubly stochastic map)."""
    return float(torch.maximum(h.abs().sum(dim=-1).amax(), h.abs().sum(dim=-2).amax()))


def composite(h_res: list[torch.Tensor]) -> torch.Tensor:
    """The map from the first sub-layer's input streams to the last one's output, without the branches.

    Each sub-layer applies X <- H_res^T X, so over sub-layers 1..L the streams see H_L^T ... H_1^T
    = (H_1 H_2 ... H_L)^T; the product is taken in the matrices' dtype. Shapes (..., n, n) -> (..., n, n).
    """
    out = h_res[0]
    for h in h_res[1:]:
        out = out @ h
    return out.transpose(-1, -2)


@contextmanager
def record_mixing(model: nn.Module) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Within the block, every :class:`HyperConnection` in ``model`` appends its detached H_pre, H_res and H_post
    (in call order) to the yielded list."""
    store: list[dict[str, torch.Tensor]] = []
    layers = [m for m in model.modules() if isinstance(m, HyperConnection)]
    for layer in layers:
        layer.recorder = store
    try:
        yield store
    finally:
        for layer in layers:
            layer.recorder = None


def mixing_report(records: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Summary of one forward pass's matrices (as recorded by :func:`record_mixing`, one forward only).

    ds_error_res: worst doubly stochastic error of any H_res; ds_error_composite: of the composite over depth;
    amax_gain_composite: its Amax gain; mixing_activity: mean ||H_res - I||_F over sub-layers and tokens.
    """
    if not records:
        return {"ds_error_res": 0.0, "ds_error_composite": 0.0, "amax_gain_composite": 1.0, "mixing_activity": 0.0}
    mats = [r["h_res"] for r in records]
    eye = torch.eye(mats[0].shape[-1], dtype=mats[0].dtype)
    comp = composite(mats)
    return {
        "ds_error_res": max(doubly_stochastic_error(h) for h in mats),
        "ds_error_composite": doubly_stochastic_error(comp),
        "amax_gain_composite": amax_gain(comp),
        "mixing_activity": float(torch.stack([torch.linalg.matrix_norm(h - eye).mean() for h in mats]).mean()),
    }
