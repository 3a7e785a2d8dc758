"""Plain, slow, obviously-correct SALAAD pieces: the ground truth the tests hold the fast paths to.

* elementwise soft threshold with Python loops, SVT from a *full* SVD summed one rank-one term at a time,
  energy ranks by a running sum;
* :class:`ReferenceController` and :class:`ReferenceBlock`: one block's ADMM with scalar Python control flow, one
  block at a time (the hook batches equal shapes);
* :func:`ialm_numpy`: the IALM-RPCA iteration in float64 NumPy;
* :func:`hpa_reference`: the HPA allocation and truncation with plain loops and a full sort.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .config import BlockConfig


def _sign(v: float) -> float:
    return float((v > 0) - (v < 0))


def soft_threshold_loop(x: torch.Tensor, tau: float) -> torch.Tensor:
    """sign(x) max(|x| - tau, 0) entry by entry (any shape)."""
    flat = x.detach().double().flatten().tolist()
    out = [_sign(v) * max(abs(v) - tau, 0.0) for v in flat]
    return torch.tensor(out, dtype=torch.float64).view(x.shape).to(x.dtype)


def svt_reference(matrix: torch.Tensor, tau: float) -> tuple[torch.Tensor, list[float]]:
    """sum_i soft_tau(sigma_i) u_i v_i^T from a full SVD (full_matrices=True); also the thresholded sigmas."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=True)
    out = torch.zeros_like(matrix)
    sigmas = []
    for i in range(s.numel()):
        sigma = _sign(float(s[i])) * max(abs(float(s[i])) - tau, 0.0)
        sigmas.append(sigma)
        if sigma != 0.0:
            out = out + sigma * torch.outer(u[:, i], vh[i])
    return out, sigmas


def energy_rank_reference(s: list[float], quantile: float, *, squared: bool) -> int:
    """Smallest k with (sum_{i<k} w_i) / (sum w) >= quantile, w = s^2 or s; 0 for a zero spectrum."""
    w = [v * v if squared else v for v in s]
    total = sum(w)
    if total <= 0:
        return 0
    running = 0.0
    for k, v in enumerate(w, start=1):
        running += v
        if running / total >= quantile:
            return k
    return len(w)


class ReferenceController:
    """alpha/beta controller, transcribed as plainly as possible."""

    def __init__(self, mode: str, init: float, k_p: float, k_d: float, switch_after: int, target: float):
        self.mode, self.k_p, self.k_d, self.switch_after, self.target = mode, k_p, k_d, switch_after, target
        self.value = 0.0 if mode == "hard_cut" else init
        self.updates = 0
        self.previous = 0.0

    def update(self, rate: float, rho: float) -> None:
        self.updates += 1
        if self.mode != "adaptive":
            return
        if self.updates < self.switch_after:
            self.value += rho * (rate - self.target) * self.k_p
        else:
            self.value += rho * (rate - self.target) * self.k_p + rho * max(0.0, rate - self.previous) * self.k_d
        self.previous = rate


class ReferenceBlock:
    """One block's ADMM state (L, S, Y, alpha, beta, fixed or ramped rho), updated one block at a time.

    ``admm(x)`` runs the official order: L (SVT), alpha, S (soft threshold), beta, rho, Y. Only the "fixed" and
    "adaptive" controller modes and the "fixed" / "adaptive" rho modes are covered.
    """

    def __init__(self, x: torch.Tensor, config: BlockConfig):
        self.config = config
        self.rho0 = self.rho = config.rho.rho
        self.epoch = 0
        a, b = config.alpha, config.beta
        self.alpha = ReferenceController(a.mode, a.init, a.k_p, a.k_d, a.switch_after, config.rate_rank)
        self.beta = ReferenceController(b.mode, b.init, b.k_p, b.k_d, b.switch_after, config.rate_sparsity)
        u, s, vh = torch.linalg.svd(x, full_matrices=True)
        self.total_rank = min(x.shape)
        k = int(self.total_rank * config.rate_rank) if config.init_energy > 0 else 0
        self.L = torch.zeros_like(x)
        for i in range(k):
            self.L = self.L + float(s[i]) * torch.outer(u[:, i], vh[i])
        self.S = torch.zeros_like(x)
        self.Y = torch.zeros_like(x)

    def penalty(self, x: torch.Tensor) -> torch.Tensor:
        return self.rho / 2 * torch.sum((x - self.L - self.S + self.Y / self.rho) ** 2)

    def admm(self, x: torch.Tensor) -> None:
        x = x.detach()
        self.L, sigmas = svt_reference(x - self.S + self.Y / self.rho, self.alpha.value / self.rho)
        self.alpha.update(energy_rank_reference(sigmas, self.config.energy, squared=True) / self.total_rank, self.rho)
        self.S = soft_threshold_loop(x - self.L + self.Y / self.rho, self.beta.value / self.rho)
        self.beta.update(sum(1 for v in self.S.flatten().tolist() if v != 0.0) / self.S.numel(), self.rho)
        self.epoch += 1
        cfg = self.config.rho
        if cfg.mode == "adaptive" and self.epoch >= cfg.start_epoch:
            s = 0.5 * (1.0 + math.tanh(2.944439 / cfg.ramp_width * (self.epoch - 1 - cfg.ramp_mid)))
            self.rho = self.rho0 + (cfg.ramp_factor * self.rho0 - self.rho0) * s
        self.Y = self.Y + self.rho * (x - self.L - self.S)


def ialm_numpy(d: np.ndarray, lam: float, *, eps1: float = 1e-7, eps2: float = 1e-5, rho: float = 1.6,
               max_iter: int = 1000) -> tuple[np.ndarray, np.ndarray, int]:
    """Inexact ALM robust PCA in float64 NumPy (the official ``ialm.fit`` iteration, without its printing)."""
    d = np.asarray(d, dtype=np.float64)
    norm_two = np.linalg.norm(d, 2)
    y = d / max(norm_two, np.linalg.norm(d, np.inf) / lam)
    a, e = np.zeros_like(d), np.zeros_like(d)
    d_norm = np.linalg.norm(d, "fro")
    mu = 1.25 / norm_two
    for it in range(1, max_iter + 1):
        t = d - a + y / mu
        e_new = np.maximum(t - lam / mu, 0) + np.minimum(t + lam / mu, 0)
        u, s, vt = np.linalg.svd(d - e_new + y / mu, full_matrices=False)
        svp = int(np.count_nonzero(s > 1 / mu))
        a = u[:, :svp] @ np.diag(s[:svp] - 1 / mu) @ vt[:svp]
        z = d - a - e_new
        y = y + mu * z
        grow = mu * np.linalg.norm(e - e_new, "fro") < eps2 * d_norm
        if grow:
            mu *= rho
        e = e_new
        if grow and np.linalg.norm(z, "fro") / d_norm < eps1:
            return a, e, it
    return a, e, max_iter


def count_now(ranks: dict[str, int], keep: dict[str, int], dims: dict[str, tuple[int, int]], rest: int) -> int:
    """rest + sum over blocks of rank (m + n) + kept entries."""
    return rest + sum(ranks[k] * (dims[k][0] + dims[k][1]) + keep[k] for k in ranks)


def hpa_reference(components: dict[str, tuple[torch.Tensor, torch.Tensor]], dense_params: int, target: int, *,
                  gamma: float, energy: float = 0.999, density_rate: float = 1e8
                  ) -> tuple[dict[str, int], dict[str, int], dict[str, torch.Tensor]]:
    """(ranks, kept entries, deployed weights) of HPA, with loops and a full sort instead of top-k."""
    dims, q, d = {}, {}, {}
    p_layers = p_l = p_s = 0
    for name, (low, sparse) in components.items():
        m, n = low.shape
        dims[name] = (m, n)
        values = [abs(v) for v in sparse.flatten().tolist()]
        eps = max(values) / density_rate
        nnz = sum(1 for v in values if v > eps)
        sigmas = torch.linalg.svd(low.float(), full_matrices=True)[1].tolist()
        rank = energy_rank_reference(sigmas, energy, squared=False)
        q[name], d[name] = rank / min(m, n), nnz / (m * n)
        p_layers += m * n
        p_l += rank * (m + n)
        p_s += nnz
    p_total = dense_params - p_layers + p_l + p_s
    if target < p_total:
        want_l = int((p_total - target) * gamma)
        want_s = (p_total - target) - want_l
        # Spill-over: a side that cannot give its share gives all it has, the other side covers the rest.
        if want_l > p_l and want_s > p_s:
            want_l, want_s = p_l, p_s
        elif want_l > p_l:
            want_s, want_l = min(p_s, want_s + want_l - p_l), p_l
        elif want_s > p_s:
            want_l, want_s = min(p_l, want_l + want_s - p_s), p_s
        ratio_l = 1.0 if p_l == 0 else min(max(1 - want_l / p_l, 0.0), 1.0)
        ratio_s = 1.0 if p_s == 0 else min(max(1 - want_s / p_s, 0.0), 1.0)
        q = {k: v * ratio_l for k, v in q.items()}
        d = {k: v * ratio_s for k, v in d.items()}

    def count() -> int:
        total = dense_params
        for k in q:
            m, n = dims[k]
            total += (m + n) * int(min(m, n) * q[k]) - m * n + int(m * n * d[k])
        return total

    short = target - count() - 1
    if short > 0:
        d = {k: v + short / p_layers for k, v in d.items()}
    ranks = {k: int(min(dims[k]) * q[k]) for k in q}
    keep = {k: int(dims[k][0] * dims[k][1] * d[k]) for k in d}
    rest = dense_params - p_layers
    while count_now(ranks, keep, dims, rest) > target >= rest:
        fullest = sorted(keep, key=lambda k: -keep[k])[0]
        if keep[fullest] > 0:
            keep[fullest] -= 1
        else:
            widest = sorted(ranks, key=lambda k: -ranks[k] * sum(dims[k]))[0]
            ranks[widest] -= 1
    weights = {}
    for name, (low, sparse) in components.items():
        u, s, vh = torch.linalg.svd(low.float(), full_matrices=True)
        w = torch.zeros_like(low, dtype=torch.float32)
        for i in range(ranks[name]):
            w = w + float(s[i]) * torch.outer(u[:, i], vh[i])
        flat = sparse.float().flatten()
        if keep[name] >= flat.numel():
            kept = flat
        elif keep[name] == 0:
            kept = torch.zeros_like(flat)
        else:
            cut = sorted((abs(v) for v in flat.tolist()), reverse=True)[keep[name] - 1]
            kept = torch.tensor([v if abs(v) >= cut else 0.0 for v in flat.tolist()])
        weights[name] = w + kept.view_as(w)
    return ranks, keep, weights
