"""The plain, slow, obviously-correct hyper-connections: the ground truth for the tests.

Everything is done token by token with explicit n x n matrices, using the parameters of a fast layer from
``layers.py``: the RMSNorm written out, one matmul per projection, mHC's Sinkhorn-Knopp as the textbook
multiplicative loop (exp domain), mHC-lite as an explicit sum over ``itertools.permutations``, and KromHC as
``torch.kron`` of explicitly built factors U_k = a_0 I + a_1 swap. Stream shapes are (..., n, D).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .layers import HC, MHC, HyperConnection, KromHC, MHCLite


def rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The official RMSNorm of a vector x (k,): ``x / max(||x||, 1e-12) * sqrt(k) * (1 + gamma)``."""
    norm = torch.sqrt((x * x).sum()).clamp_min(1e-12)
    return x / norm * math.sqrt(x.shape[-1]) * (1 + gamma)


def sinkhorn_plain(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Textbook Sinkhorn-Knopp on exp(logits) (n, n): divide by column sums, then by row sums, ``iters`` times.

    The same iterates as the log-domain version in exact arithmetic (column step first, row step last).
    """
    m = logits.exp()
    for _ in range(iters):
        m = m / m.sum(dim=0, keepdim=True)
        m = m / m.sum(dim=1, keepdim=True)
    return m


def permutation_matrix(perm: tuple[int, ...]) -> torch.Tensor:
    """P (n, n) with P[i, perm[i]] = 1."""
    p = torch.zeros(len(perm), len(perm))
    for i, j in enumerate(perm):
        p[i, j] = 1.0
    return p


IDENTITY_2 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
SWAP_2 = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


def token_coefficients(layer: HyperConnection, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H_pre (n,), H_res (n, n), H_post (n,) of one token's streams x (n, D)."""
    n = layer.num_streams
    if isinstance(layer, HC):
        pre, res, post = [], [], []
        for s in range(n):
            xbar = rms_norm(x[s], layer.norm.gamma)
            a = xbar @ layer.dynamic_alpha_fn
            b = xbar @ layer.dynamic_beta_fn
            if layer.tanh:
                a, b = torch.tanh(a), torch.tanh(b)
            row = layer.static_alpha[s] + layer.dynamic_alpha_scale * a
            pre.append(row[0])
            res.append(row[1:])
            post.append(layer.static_beta[s] + layer.dynamic_beta_scale * b)
        return torch.stack(pre), torch.stack(res), torch.stack(post)

    xt = rms_norm(x.reshape(-1), layer.norm.gamma)
    post = 2 * torch.sigmoid(layer.h_post_scale * (xt @ layer.dynamic_beta_fn) + layer.static_beta)
    dyn = xt @ layer.dynamic_alpha_fn
    if isinstance(layer, MHC):
        dyn = dyn.reshape(n, 1 + n)
        pre = torch.sigmoid(layer.pre_branch_scale * dyn[:, 0] + layer.static_alpha[:, 0])
        res_logits = layer.residual_scale * dyn[:, 1:] + layer.static_alpha[:, 1:]
        return pre, sinkhorn_plain(res_logits, layer.sinkhorn_iters), post
    pre = torch.sigmoid(layer.pre_branch_scale * dyn[:n] + layer.static_alpha[:n])
    coeffs = layer.residual_scale * dyn[n:] + layer.static_alpha[n:]
    if isinstance(layer, MHCLite):
        weights = torch.softmax(coeffs, dim=0)
        perms = list(itertools.permutations(range(n)))
        res = sum(w * permutation_matrix(p).to(w.dtype) for w, p in zip(weights, perms))
        return pre, res, post
    if isinstance(layer, KromHC):
        factors = []
        for k in range(layer.num_factors):
            a = torch.softmax(coeffs[2 * k : 2 * k + 2], dim=0)
            factors.append(a[0] * IDENTITY_2.to(a.dtype) + a[1] * SWAP_2.to(a.dtype))
        return pre, functools.reduce(torch.kron, factors), post
    raise TypeError(f"no reference for {type(layer).__name__}")


def reference_coefficients(layer: HyperConnection,
                           stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H_pre (..., n), H_res (..., n, n), H_post (..., n) for a stream (..., n, D), one token at a time."""
    lead = stream.shape[:-2]
    tokens = stream.reshape(-1, *stream.shape[-2:])
    pre, res, post = zip(*(token_coefficients(layer, x) for x in tokens))
    n = layer.num_streams
    return (torch.stack(pre).reshape(*lead, n), torch.stack(res).reshape(*lead, n, n),
            torch.stack(post).reshape(*lead, n))


def reference_forward(layer: HyperConnection, stream: torch.Tensor, **branch_kwargs: Any) -> torch.Tensor:
    """h = sum_s H_pre[s] X[s]; X_new[t] = sum_s H_res[s, t] X[s] + H_post[t] F(h), written as explicit sums.

    Without a branch it returns ``(h, add_residual)`` as the layer's own forward does (the drop-in decoder layers
    call their wrappers that way).
    """
    n = layer.num_streams
    h_pre, h_res, h_post = reference_coefficients(layer, stream)
    branch_input = sum(h_pre[..., s, None] * stream[..., s, :] for s in range(n))

    def add_residual(y: torch.Tensor) -> torch.Tensor:
        outs = [sum(h_res[..., s, t, None] * stream[..., s, :] for s in range(n)) + h_post[..., t, None] * y
                for t in range(n)]
        return torch.stack(outs, dim=-2)

    if layer.branch is None:
        return branch_input, add_residual
    return add_residual(layer.branch(branch_input, **branch_kwargs))


@contextmanager
def use_reference(model: nn.Module) -> Iterator[None]:
    """Within the block, every :class:`HyperConnection` in ``model`` runs :func:`reference_forward`."""
    layers = [m for m in model.modules() if isinstance(m, HyperConnection)]
    for layer in layers:
        layer.forward = functools.partial(reference_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
