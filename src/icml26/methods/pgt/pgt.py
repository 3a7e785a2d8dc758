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


def adam(params, lr: float) -> torch.optim.Adam:
    """torch.optim.Adam, fused where the device supports it (the same update; on CPU the fused kernel saves most
    of the per-step Python cost of these thousands of tiny steps)."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.Adam(params, lr=lr)


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


def tune_latents(policy: GoalPolicy, z_ref: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
                 returns: torch.Tensor, cfg: PGTConfig, gens: list[torch.Generator], z_init: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list[dict]]:
    """:func:`tune_latent` for K tasks at once (the same computation, equal to float rounding): z_ref (K, z_dim),
    states (K, N, T+1, 2), actions (K, N, T, 2), returns (K, N), one generator per task (drawn in the same order
    as K separate calls).

    Why the same: every step takes one pair per task and minimises the sum of the K DPO losses; z_k only enters
    loss k, and Adam is elementwise, so the stacked Adam on z (K, z_dim) is K independent Adams. Needs the same
    number of training pairs in every task (always so with distinct returns and the caps); otherwise it falls
    back to K calls of :func:`tune_latent`. Returns z (K, z_dim) and one log per task."""
    k = z_ref.shape[0]
    if not (states.shape[0] == actions.shape[0] == returns.shape[0] == len(gens) == k):
        raise ValueError(f"tune_latents needs K={k} tasks in states, actions, returns and gens, got "
                         f"{states.shape[0]}, {actions.shape[0]}, {returns.shape[0]}, {len(gens)}")
    z0 = z_ref if z_init is None else z_init
    saved = [g.get_state() for g in gens]
    splits = [split_pairs(preference_pairs(returns[j]), cfg, gens[j]) for j in range(k)]
    if len({len(tr) for tr, _ in splits}) > 1 or len({len(ev) for _, ev in splits}) > 1 or not splits[0][1]:
        for g, state in zip(gens, saved):  # rewind: the per-task calls draw their own splits again
            g.set_state(state)
        outs = [tune_latent(policy, z_ref[j], states[j], actions[j], returns[j], cfg, gens[j], z0[j])
                for j in range(k)]
        return torch.stack([o[0] for o in outs]), [o[1] for o in outs]
    for p in policy.parameters():
        p.requires_grad_(False)
    try:
        s = states[:, :, :-1]
        rows = torch.arange(k)
        with torch.no_grad():
            ref_lp = policy.log_prob(s, actions, z_ref[:, None, None])  # (K, N)
        train = torch.tensor([tr for tr, _ in splits])  # (K, P, 2)
        held = torch.tensor([ev for _, ev in splits])  # (K, H, 2)
        z = z0.detach().clone().requires_grad_(True)
        opt = adam([z], cfg.lr)

        def pair_loss(pairs: torch.Tensor) -> torch.Tensor:
            """pairs (K, M, 2) -> DPO losses (K, M) at the current z."""
            m = pairs.shape[1]
            idx, r = torch.cat((pairs[..., 0], pairs[..., 1]), 1), rows[:, None]  # winners then losers, one pass
            lp = policy.log_prob(s[r, idx], actions[r, idx], z[:, None, None])
            ref = ref_lp[r, idx]
            return dpo_loss(lp[:, :m], lp[:, m:], ref[:, :m], ref[:, m:], cfg.beta)

        def held_loss() -> torch.Tensor:
            with torch.no_grad():
                return pair_loss(held).mean(1)

        best = held_loss()
        best_z, history = z.detach().clone(), [best]
        for _ in range(cfg.epochs):
            order = torch.stack([torch.randperm(train.shape[1], generator=g) for g in gens])  # (K, P)
            for i in range(train.shape[1]):
                loss = pair_loss(train[rows, order[:, i]][:, None]).sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            cur = held_loss()
            history.append(cur)
            better = cur < best
            best = torch.where(better, cur, best)
            best_z = torch.where(better[:, None], z.detach(), best_z)
        hist = torch.stack(history, 1).tolist()
        npairs = [len(preference_pairs(returns[j])) for j in range(k)]
        return best_z, [{"pairs": npairs[j], "train_pairs": train.shape[1], "eval_pairs": held.shape[1],
                         "held_loss": hist[j]} for j in range(k)]
    finally:
        for p in policy.parameters():
            p.requires_grad_(True)


def pgt_tasks(policy: GoalPolicy, z_ref: torch.Tensor, collect: Callable[[torch.Tensor], tuple], cfg: PGTConfig,
              gens: list[torch.Generator]) -> tuple[torch.Tensor, list[list[dict]]]:
    """:func:`pgt` for K tasks at once: z_ref (K, z_dim); ``collect(z (K, z_dim)) -> (states (K, N, T+1, 2),
    actions (K, N, T, 2), returns (K, N))``. Returns z (K, z_dim) and the per-round logs of every task."""
    z, logs = z_ref.detach().clone(), []
    for _ in range(cfg.rounds):
        states, actions, returns = collect(z)
        z, log = tune_latents(policy, z_ref, states, actions, returns, cfg, gens, z_init=z)
        logs.append([{**entry, "mean_return": float(r)} for entry, r in zip(log, returns.mean(1))])
    return z, [list(task) for task in zip(*logs)]
