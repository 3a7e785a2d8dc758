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


def expectile_loss(q: torch.Tensor, v: torch.Tensor, tau: float) -> torch.Tensor:
    """IQL's V loss: (1/B) sum_i |tau - 1(u_i < 0)| u_i^2 with u_i = q_i - v_i."""
    total = 0.0
    for i in range(q.shape[0]):
        u = q[i] - v[i]
        total = total + (tau if float(u.detach()) >= 0 else 1 - tau) * u ** 2
    return total / q.shape[0]


def iql_actor_loss(logp_data: torch.Tensor, adv: torch.Tensor, logp_tilde: torch.Tensor, q_tilde: torch.Tensor,
                   keep: torch.Tensor, beta: float, clip: float, alpha: float) -> torch.Tensor:
    """(1/B) sum_i [keep_i min(exp(beta A_i), clip) (-log pi(a_i|s_i)) + (1 - keep_i)(alpha log pi(a~_i|s_i)
    - Q(s_i, a~_i) / mean|Q(s, a~)|)], the normaliser a constant."""
    scale = sum(abs(float(x.detach())) for x in q_tilde) / len(q_tilde)
    total = 0.0
    for i in range(adv.shape[0]):
        if bool(keep[i]):
            total = total + min(math.exp(beta * float(adv[i])), clip) * -logp_data[i]
        else:
            total = total + alpha * logp_tilde[i] - q_tilde[i] / scale
    return total / adv.shape[0]


def cql_gap(q_rand: torch.Tensor, q_cur: torch.Tensor, q_next: torch.Tensor, logp_cur: torch.Tensor,
            logp_next: torch.Tensor, q_data: torch.Tensor, act_dim: int,
            lower: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample CQL gap for one critic, with CQL's importance weights and Cal-QL's calibration:
    log sum_k exp(Q(s, u_k) - log 0.5^A) + sum_k exp(max(Q(s, a_k), G) - log pi(a_k|s)) [current and next-state
    policy draws] - Q(s, a). Inputs are (B, K) except q_data and lower (B,). Values only (no gradient)."""
    q_rand, q_cur, q_next, q_data = (t.detach() for t in (q_rand, q_cur, q_next, q_data))
    out = []
    for i in range(q_data.shape[0]):
        terms = [float(q_rand[i, k]) - act_dim * math.log(0.5) for k in range(q_rand.shape[1])]
        for qs, lps in ((q_next, logp_next), (q_cur, logp_cur)):
            for k in range(qs.shape[1]):
                q = float(qs[i, k]) if lower is None else max(float(qs[i, k]), float(lower[i]))
                terms.append(q - float(lps[i, k]))
        m = max(terms)
        out.append(m + math.log(sum(math.exp(t - m) for t in terms)) - float(q_data[i]))
    return torch.tensor(out, dtype=torch.float64)
