"""Hand-written backward passes for the three operations that touch the widened stream (N, n, D).

With autograd's generic formulas the stream is read and written about twice as often as needed: slicing the
mixed tensor zero-fills a gradient buffer, the broadcast in the depth connection materialises two (N, n, D)
products before reducing them, and the norm's backward takes three elementwise passes. Each function below
does the same math with fewer passes over the stream. All are parity-tested, forward and
backward, against ``reference.py`` and with ``torch.autograd.gradcheck``. N = tokens, n = streams, D = width.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

NORM_EPS = 1e-12
"""The official RMSNorm is ``F.normalize(x) * sqrt(dim) * (1 + gamma)``; F.normalize clamps the norm at 1e-12."""


class NormedProjection(torch.autograd.Function):
    """``RMSNorm(x) @ weight`` = ``(x @ ((1 + gamma) weight)) * sqrt(k) / max(||x||, eps)``.

    x (N, k), gamma (k,), weight (k, m) -> (N, m). The norm is one scalar per row, so it scales the m-wide output
    instead of the k-wide input (k = nD is the widened stream, m is at most 2n + n!), and the gain folds into the
    weight. Backward: dx = (g r) W_f^T - x (r / ||x||^2) sum(g z), one matmul plus one fused elementwise pass.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        folded = (1 + gamma).unsqueeze(-1) * weight
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        r = math.sqrt(x.shape[-1]) / norm.clamp_min(NORM_EPS)
        z = x @ folded
        ctx.save_for_backward(x, gamma, weight, folded, norm, r, z)
        return z * r

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, gamma, weight, folded, norm, r, z = ctx.saved_tensors
        dz = g * r
        dx = d_gamma = d_weight = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            d_folded = x.transpose(-1, -2) @ dz
            d_weight = (1 + gamma).unsqueeze(-1) * d_folded
            d_gamma = (d_folded * weight).sum(dim=-1)
        if ctx.needs_input_grad[0]:
            # r = sqrt(k) / ||x|| gives dr/dx = -r x / ||x||^2; where the norm is clamped, r is constant.
            coef = (g * z).sum(dim=-1, keepdim=True) * r / norm.square().clamp_min(NORM_EPS**2)
            coef = coef.masked_fill(norm <= NORM_EPS, 0.0)
            dx = (x * -coef).addmm_(dz, folded.transpose(-1, -2))
        return dx, d_gamma, d_weight


class StreamMix(torch.autograd.Function):
    """Width connection: x (N, n, D), a = [H_pre | H_res] (N, n, 1 + n) -> h (N, D), H_res^T x (N, n, D).

    One batched matmul computes both; the backward stacks the two incoming gradients once and uses two batched
    matmuls (dx = a G, da = x G^T) instead of zero-filling a buffer for each slice.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mixed = torch.bmm(a.transpose(1, 2), x)
        ctx.save_for_backward(x, a)
        return mixed[:, 0], mixed[:, 1:]

    @staticmethod
    @once_differentiable
    def backward(ctx, d_branch_input: torch.Tensor | None, d_residual: torch.Tensor | None):
        x, a = ctx.saved_tensors
        n, width = x.shape[1], x.shape[2]
        grad = x.new_zeros(x.shape[0], n + 1, width) if d_branch_input is None or d_residual is None else None
        if grad is None:
            grad = torch.cat((d_branch_input.unsqueeze(1), d_residual), dim=1)
        else:
            if d_branch_input is not None:
                grad[:, 0] = d_branch_input
            if d_residual is not None:
                grad[:, 1:] = d_residual
        dx = torch.bmm(a, grad) if ctx.needs_input_grad[0] else None
        da = torch.bmm(x, grad.transpose(1, 2)) if ctx.needs_input_grad[1] else None
        return dx, da


class DepthConnection(torch.autograd.Function):
    """``residual + H_post ⊗ F(h)``: residual (N, n, D), h_post (N, n), y (N, D) -> (N, n, D).

    The backward gives dH_post = <g_t, y> and dy = H_post^T g (a batched matmul) without autograd's two broadcast
    products and their reductions. (For dH_post a multiply-and-sum is several times faster on CPU than a batched
    matrix-vector product.)
    """

    @staticmethod
    def forward(ctx, residual: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h_post, y)
        return torch.addcmul(residual, h_post.unsqueeze(-1), y.unsqueeze(1))

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        h_post, y = ctx.saved_tensors
        # The gradient of the final stream sum is an expanded (stride-0) view, on which bmm falls back to a loop.
        g = g.contiguous()
        d_post = (g * y.unsqueeze(1)).sum(dim=-1) if ctx.needs_input_grad[1] else None
        d_y = torch.bmm(h_post.unsqueeze(1), g).squeeze(1) if ctx.needs_input_grad[2] else None
        return g, d_post, d_y

