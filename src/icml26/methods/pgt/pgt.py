"""PGT, exact to the official loop (preference-goal-tuning/PGT, ``train_pgt.py``): rollouts with the current z,
every ordered pair with a higher return preferred, a random held-out split of the pairs, DPO on z only (Adam,
one pair per step), keep the z with the lowest held-out loss; repeated collect -> tune rounds.

    L(z) = -log sigma( beta [ (log pi(tau_w|z) - log pi(tau_w|z_ref)) - (log pi(tau_l|z) - log pi(tau_l|z_ref)) ] )
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .config import PGTConfig
from .policy import GoalPolicy


def preference_pairs(returns: torch.Tensor) -> list[tuple[int, int]]:
    """Every ordered pair (w, l) with R_w > R_l (ties give no pair)."""
    r = returns.tolist()
    return [(i, j) for i in range(len(r)) for j in range(len(r)) if r[i] > r[j]]


def dpo_loss(logp_w: torch.Tensor, logp_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor,
             beta: float) -> torch.Tensor:
    """-log sigma(beta ((logp_w - ref_w) - (logp_l - ref_l))), elementwise."""
    return -F.logsigmoid(beta * ((logp_w - ref_w) - (logp_l - ref_l)))


def split_pairs(pairs: list, cfg: PGTConfig, gen: torch.Generator) -> tuple[list, list]:
    """Random split (eval share ``eval_fraction``), then the caps."""
    perm = torch.randperm(len(pairs), generator=gen).tolist()
    n_eval = max(1, int(round(cfg.eval_fraction * len(pairs)))) if len(pairs) > 1 else 0
    ev = [pairs[i] for i in perm[:n_eval]]
    tr = [pairs[i] for i in perm[n_eval:]]
    if cfg.max_train_pairs is not None:
        tr = tr[: cfg.max_train_pairs]
    if cfg.max_eval_pairs is not None:
        ev = ev[: cfg.max_eval_pairs]
    return tr, ev


def tune_latent(policy: GoalPolicy, z_ref: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
                returns: torch.Tensor, cfg: PGTConfig, gen: torch.Generator, z_init: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict]:
    """One PGT round on collected rollouts: states (N, T+1, 2), actions (N, T, 2), returns (N,).

    The policy is frozen (no parameter gets a gradient); only z (a copy of ``z_init`` or ``z_ref``) is optimised.
    Returns the z with the lowest held-out DPO loss (the start z when no epoch improved on it) and a log.
    """
    for p in policy.parameters():
        p.requires_grad_(False)
    try:
        s = states[:, :-1]
        with torch.no_grad():
            ref_lp = policy.log_prob(s, actions, z_ref)  # log pi(tau | z_ref), precomputed once
        pairs = preference_pairs(returns)
        train, held = split_pairs(pairs, cfg, gen)
        z = (z_ref if z_init is None else z_init).detach().clone().requires_grad_(True)
        opt = torch.optim.Adam([z], lr=cfg.lr)

        def held_loss() -> float:
            if not held:
                return math.nan
            w, l = zip(*held)
            with torch.no_grad():
                lp_w, lp_l = policy.log_prob(s[list(w)], actions[list(w)], z), policy.log_prob(s[list(l)], actions[list(l)], z)
                return float(dpo_loss(lp_w, lp_l, ref_lp[list(w)], ref_lp[list(l)], cfg.beta).mean())

        best_z, best = z.detach().clone(), held_loss()
        history = [best]
        for _ in range(cfg.epochs if train else 0):
            for i in torch.randperm(len(train), generator=gen).tolist():
                w, l = train[i]
                loss = dpo_loss(policy.log_prob(s[w:w + 1], actions[w:w + 1], z),
                                policy.log_prob(s[l:l + 1], actions[l:l + 1], z), ref_lp[w:w + 1], ref_lp[l:l + 1],
                                cfg.beta).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            cur = held_loss()
            history.append(cur)
            if not math.isnan(cur) and (math.isnan(best) or cur < best):
                best, best_z = cur, z.detach().clone()
        return best_z, {"pairs": len(pairs), "train_pairs": len(train), "eval_pairs": len(held),
                        "held_loss": history}
    finally:
        for p in policy.parameters():
            p.requires_grad_(True)


def pgt(policy: GoalPolicy, z_ref: torch.Tensor, collect: Callable[[torch.Tensor], tuple], cfg: PGTConfig,
        gen: torch.Generator) -> tuple[torch.Tensor, list[dict]]:
    """Repeated collect -> tune rounds. ``collect(z) -> (states, actions, returns)`` runs ``cfg.n_rollouts``
    rollouts with latent z. The DPO reference stays z_ref in every round (the script's frozen copy)."""
    z, logs = z_ref.detach().clone(), []
    for _ in range(cfg.rounds):
        states, actions, returns = collect(z)
        z, log = tune_latent(policy, z_ref, states, actions, returns, cfg, gen, z_init=z)
        logs.append({**log, "mean_return": float(returns.mean())})
    return z, logs
