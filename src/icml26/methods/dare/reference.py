"""Plain, slow versions of DARE's per-sample pieces and of the masked TD3+BC actor loss, written as loops over
samples so that each line reads like the formula; the tests hold dare.py and trainer.py to them."""

from __future__ import annotations

import math

import torch


def kl_mean_score(act: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """d_i = ||a_i - mean_k refs[k, i]||^2 / 2 for act (B, A), refs (K, B, A)."""
    out = []
    for i in range(act.shape[0]):
        abar = sum(refs[k, i] for k in range(refs.shape[0])) / refs.shape[0]
        out.append(sum((act[i, j] - abar[j]) ** 2 for j in range(act.shape[1])) / 2)
    return torch.stack(out)


def min_dist_score(act: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    out = []
    for i in range(act.shape[0]):
        out.append(min(((act[i] - refs[k, i]) ** 2).sum() for k in range(refs.shape[0])))
    return torch.stack(out)


def gaussian_nll(act: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """-log N(a; mean, diag(exp(log_std)^2)), per sample."""
    out = []
    for i in range(act.shape[0]):
        total = 0.0
        for j in range(act.shape[1]):
            s = math.exp(float(log_std[i, j]))
            total += 0.5 * ((float(act[i, j]) - float(mean[i, j])) / s) ** 2 + math.log(s) + 0.5 * math.log(2 * math.pi)
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def posterior_moments(d: list[float], from_offline: list[bool]) -> list[float]:
    """Posterior p_i of "online-like" with one Gaussian per origin fitted by moments, priors = origin shares."""
    off = [x for x, o in zip(d, from_offline) if o]
    on = [x for x, o in zip(d, from_offline) if not o]
    mu_off, mu_on = sum(off) / len(off), sum(on) / len(on)
    spread = sum((x - sum(d) / len(d)) ** 2 for x in d) / len(d)
    floor = 1e-6 + 1e-6 * spread
    var_off = sum((x - mu_off) ** 2 for x in off) / len(off) + floor
    var_on = sum((x - mu_on) ** 2 for x in on) / len(on) + floor
    pi_off, pi_on = len(off) / len(d), len(on) / len(d)

    def pdf(x, mu, var):
        return math.exp(-0.5 * (x - mu) ** 2 / var) / math.sqrt(2 * math.pi * var)

    return [pi_on * pdf(x, mu_on, var_on) / (pi_on * pdf(x, mu_on, var_on) + pi_off * pdf(x, mu_off, var_off))
            for x in d]


def td3bc_actor_loss(q: torch.Tensor, pi: torch.Tensor, act: torch.Tensor, keep: torch.Tensor,
                     alpha: float) -> torch.Tensor:
    """L = (1/B) sum_i [ -lambda Q(s_i, pi(s_i)) + keep_i ||pi(s_i) - a_i||^2 / A ], lambda = alpha / mean|Q|
    (lambda is a constant: no gradient through it). ``keep`` = the constrained subset S_off."""
    lam = alpha / q.abs().mean().detach()
    b, a_dim = act.shape
    total = 0.0
    for i in range(b):
        bc = sum((pi[i, j] - act[i, j]) ** 2 for j in range(a_dim)) / a_dim
        total = total - lam * q[i] + (bc if bool(keep[i]) else 0.0)
    return total / b
