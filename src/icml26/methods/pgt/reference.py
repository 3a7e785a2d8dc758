"""Plain versions of PGT's pieces: the trajectory log-likelihood as a loop over time steps, the DPO loss from the
formula, and the pair construction as a double loop; the tests hold pgt.py and policy.py to them."""

from __future__ import annotations

import math

import torch


def trajectory_logprob(policy, states: torch.Tensor, actions: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """sum_t log N(a_t; mu(o_t, z), diag(std^2)) for one trajectory: observations (T, obs_dim), actions
    (T, act_dim)."""
    total = torch.zeros(())
    std = policy.log_std.exp()
    for t in range(states.shape[0]):
        mu = policy.net(torch.cat((states[t], z)))
        for j in range(actions.shape[-1]):
            total = total - 0.5 * ((actions[t, j] - mu[j]) / std[j]) ** 2 - torch.log(std[j]) - 0.5 * math.log(2 * math.pi)
    return total


def dpo_loss(lw: float, ll: float, rw: float, rl: float, beta: float) -> float:
    x = beta * ((lw - rw) - (ll - rl))
    return -math.log(1.0 / (1.0 + math.exp(-x)))


def pairs(returns: list[float]) -> list[tuple[int, int]]:
    out = []
    for i, ri in enumerate(returns):
        for j, rj in enumerate(returns):
            if ri > rj:
                out.append((i, j))
    return out
