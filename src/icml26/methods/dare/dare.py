"""DARE's per-sample machinery, vectorised: alignment score, posterior over offline-like vs online-like, and the
exchange that decides which samples keep the offline constraint. [REC] throughout: the mechanism is from the
ICLR-26 reviews (OpenReview lgL9xSFt11), the formulas are our reconstruction (see README, Fidelity).

Shapes: B = batch size, A = action dim, K = reference actions per state.
"""

from __future__ import annotations

import math

import torch

from ...rl.nets import GaussianPolicy

_EPS = 1e-6


@torch.no_grad()
def alignment_score(behavior: GaussianPolicy, obs: torch.Tensor, act: torch.Tensor, kind: str, n_ref: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """d(s, a) >= 0-ish, small = behavior-consistent ("offline-like"); (B, obs), (B, A) -> (B,).

    kind: "kl_mean": ||a - abar||^2 / 2, abar = mean of K draws a_k ~ mu(.|s) (the KL between N(a, I) and
    N(abar, I), the one well-defined reading of the paper's "KL between actions"); "nll": -log mu(a|s);
    "min_dist": min_k ||a - a_k||^2.
    """
    if kind == "nll":
        return -behavior.log_prob(obs, act)
    refs = behavior.sample(obs, n_ref, generator)  # (K, B, A)
    if kind == "kl_mean":
        return 0.5 * (act - refs.mean(0)).pow(2).sum(-1)
    if kind == "min_dist":
        return (act.unsqueeze(0) - refs).pow(2).sum(-1).min(0).values
    raise ValueError(f"unknown score kind {kind!r}")


def _normal_logpdf(x: torch.Tensor, mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    return -0.5 * ((x - mu).pow(2) / var + torch.log(2 * math.pi * var))


def fit_gaussians(d: torch.Tensor, from_offline: torch.Tensor, *, fit: str = "moments", em_iters: int = 10
                  ) -> dict[str, torch.Tensor]:
    """Fit the 1-D score distributions of the offline-like and online-like components.

    "moments": mean / variance of the scores of each origin (B_off, B_on), priors pi_off = |B_off| / B.
    "em": a 2-component Gaussian mixture on all scores by EM, initialised from the origin moments (the component
    started at B_off stays "offline-like"), mixing weights learned.
    Returns tensors ``mu_off, var_off, mu_on, var_on, pi_off, pi_on`` (scalars).
    """
    d = d.double()
    off, on = d[from_offline], d[~from_offline]
    if len(off) == 0 or len(on) == 0:
        raise ValueError("fit_gaussians needs samples of both origins in the batch")
    floor = _EPS + 1e-6 * d.var(unbiased=False)
    p = {"mu_off": off.mean(), "var_off": off.var(unbiased=False) + floor, "mu_on": on.mean(),
         "var_on": on.var(unbiased=False) + floor, "pi_off": d.new_tensor(len(off) / len(d))}
    p["pi_on"] = 1 - p["pi_off"]
    if fit == "em":
        for _ in range(em_iters):
            r_on = posterior_online(d, p)  # E-step: responsibility of the online-like component
            r_off = 1 - r_on
            n_on, n_off = r_on.sum().clamp_min(_EPS), r_off.sum().clamp_min(_EPS)
            p["mu_on"], p["mu_off"] = (r_on * d).sum() / n_on, (r_off * d).sum() / n_off
            p["var_on"] = (r_on * (d - p["mu_on"]).pow(2)).sum() / n_on + floor
            p["var_off"] = (r_off * (d - p["mu_off"]).pow(2)).sum() / n_off + floor
            p["pi_on"], p["pi_off"] = n_on / len(d), n_off / len(d)
    elif fit != "moments":
        raise ValueError(f"unknown fit {fit!r}")
    return p


def posterior_online(d: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """p_i = pi_on N(d_i; mu_on, var_on) / (pi_on N(d_i; mu_on, var_on) + pi_off N(d_i; mu_off, var_off)): (B,)."""
    d = d.double()
    log_on = torch.log(p["pi_on"]) + _normal_logpdf(d, p["mu_on"], p["var_on"])
    log_off = torch.log(p["pi_off"]) + _normal_logpdf(d, p["mu_off"], p["var_off"])
    return torch.sigmoid(log_on - log_off)


def exchange(p_online: torch.Tensor, *, mode: str = "threshold", eta: float = 0.5,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Offline-like mask S_off (True = keeps the constraint) from the posterior: (B,) -> (B,) bool.

    "threshold": S_off = {i : p_i <= eta}; "stochastic": i is online-like with probability p_i. Forcing p to the
    origin labels (0 for B_off, 1 for B_on) gives exactly the origin split.
    """
    if mode == "threshold":
        return p_online <= eta
    if mode == "stochastic":
        u = torch.rand(p_online.shape, generator=generator, dtype=p_online.dtype, device=p_online.device)
        return u >= p_online
    raise ValueError(f"unknown exchange mode {mode!r}")


def separation(d: torch.Tensor, offline_like: torch.Tensor) -> float:
    """d' = |mu_on - mu_off| / sqrt((var_on + var_off) / 2) between the scores labelled offline-like and
    online-like (NaN when one side is empty): the quantity the paper's theory says the exchange increases."""
    a, b = d[offline_like].double(), d[~offline_like].double()
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    pooled = ((a.var(unbiased=False) + b.var(unbiased=False)) / 2).clamp_min(_EPS)
    return float((b.mean() - a.mean()).abs() / pooled.sqrt())


def constrained_mask(constraint: str, from_offline: torch.Tensor, p_online: torch.Tensor | None = None, *,
                     mode: str = "threshold", eta: float = 0.5, generator: torch.Generator | None = None
                     ) -> torch.Tensor:
    """Which samples keep the offline constraint under each arm: (B,) bool."""
    if constraint == "all":
        return torch.ones_like(from_offline)
    if constraint == "none":
        return torch.zeros_like(from_offline)
    if constraint == "origin":
        return from_offline.clone()
    if constraint == "dare":
        if p_online is None:
            raise ValueError("constraint='dare' needs the posterior p_online")
        return exchange(p_online, mode=mode, eta=eta, generator=generator)
    raise ValueError(f"unknown constraint {constraint!r}")
