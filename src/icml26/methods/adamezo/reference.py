"""Plain AdaMeZO with dense stored directions: the slow, obviously-correct ground truth for the tests.

It keeps every z_k as full tensors (h x P floats, exactly what AdaMeZO avoids) and forms m and v as the
explicit weighted sums of the paper. ``optimizer.AdaMeZO`` must produce the same parameters step for step.
"""

from __future__ import annotations

from typing import Callable

import torch

from .optimizer import perturbation_seed


def draw_direction(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """z(seed): one N(0, I) tensor per parameter, drawn in order from a single generator (the MeZO stream)."""
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    return [torch.normal(0.0, 1.0, size=p.shape, generator=gen, dtype=p.dtype, device=p.device) for p in params]


def dense_moments(directions: list[list[torch.Tensor]], projections: list[float],
                  betas: tuple[float, float]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m = sum_i beta1^(h-1-i) p_i z_i and v = sum_i beta2^(h-1-i) p_i^2 z_i^2 over slots i = 0 (oldest) .. h-1."""
    h = len(directions)
    beta1, beta2 = betas
    m = [torch.zeros_like(z) for z in directions[0]]
    v = [torch.zeros_like(z) for z in directions[0]]
    for i, (z_list, p) in enumerate(zip(directions, projections)):
        for j, z in enumerate(z_list):
            m[j] = m[j] + beta1 ** (h - 1 - i) * p * z
            v[j] = v[j] + beta2 ** (h - 1 - i) * p ** 2 * z * z
    return m, v


class ReferenceAdaMeZO:
    """Dense AdaMeZO on a list of tensors (single group, no weight-decay exclusions).

    Same schedule as the official trainer: MeZO while ``window < 2`` or ``t <= window``, then
    theta <- theta - lr (scale * m / (sqrt(v) + adam_eps) + lambda theta), with v := 1 when beta2 == 0.
    """

    def __init__(self, params: list[torch.Tensor], lr: float, *, eps: float = 1e-3,
                 betas: tuple[float, float] = (0.7, 0.9), window: int = 10, weight_decay: float = 0.0,
                 direction_scale: float = 100.0, adam_eps: float = 1e-5, seed: int = 0):
        self.params, self.lr, self.eps, self.betas, self.window = params, lr, eps, betas, window
        self.weight_decay, self.scale, self.adam_eps, self.seed = weight_decay, direction_scale, adam_eps, seed
        self.t = 0
        self.directions: list[list[torch.Tensor]] = []
        self.projections: list[float] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> None:
        z = draw_direction(self.params, perturbation_seed(self.seed, self.t))
        for p, zi in zip(self.params, z):
            p.add_(self.eps * zi)
        loss_plus = float(closure())
        for p, zi in zip(self.params, z):
            p.sub_(2 * self.eps * zi)
        loss_minus = float(closure())
        for p, zi in zip(self.params, z):
            p.add_(self.eps * zi)
        proj = (loss_plus - loss_minus) / (2 * self.eps)
        self.directions = (self.directions + [z])[-max(self.window, 1):]
        self.projections = (self.projections + [proj])[-max(self.window, 1):]

        if self.window < 2 or self.t <= self.window:
            steps = [proj * zi for zi in z]
        else:
            m, v = dense_moments(self.directions, self.projections, self.betas)
            if self.betas[1] == 0:
                v = [torch.ones_like(x) for x in v]
            steps = [self.scale * mi / (vi.sqrt() + self.adam_eps) for mi, vi in zip(m, v)]
        for p, s in zip(self.params, steps):
            p.sub_(self.lr * (s + self.weight_decay * p))
        self.t += 1
