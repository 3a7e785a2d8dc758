"""Small MLP networks shared by the RL rooms: deterministic tanh actor, twin Q critics, Gaussian BC policy."""

from __future__ import annotations

import math

import torch
from torch import nn


def mlp(in_dim: int, out_dim: int, hidden: int, layers: int) -> nn.Sequential:
    """``layers`` hidden ReLU layers of width ``hidden``, then a linear output."""
    mods: list[nn.Module] = []
    d = in_dim
    for _ in range(layers):
        mods += [nn.Linear(d, hidden), nn.ReLU()]
        d = hidden
    mods.append(nn.Linear(d, out_dim))
    return nn.Sequential(*mods)


class Actor(nn.Module):
    """Deterministic policy pi(s) = max_action * tanh(MLP(s)); (B, obs) -> (B, act)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2, max_action: float = 1.0):
        super().__init__()
        self.net, self.max_action = mlp(obs_dim, act_dim, hidden, layers), max_action

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.max_action * torch.tanh(self.net(obs))


class TwinQ(nn.Module):
    """Two independent critics Q1, Q2(s, a); ``forward`` returns both as (B,) tensors."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.q1 = mlp(obs_dim + act_dim, 1, hidden, layers)
        self.q2 = mlp(obs_dim + act_dim, 1, hidden, layers)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat((obs, act), -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class GaussianPolicy(nn.Module):
    """Diagonal Gaussian mu(a|s) = N(m(s), diag(exp(2 log_std(s)))) with clamped log-std; a behavior model fitted
    by maximum likelihood (behavior cloning)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2,
                 log_std_range: tuple[float, float] = (-5.0, 2.0)):
        super().__init__()
        self.net = mlp(obs_dim, 2 * act_dim, hidden, layers)
        self.lo, self.hi = log_std_range

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, obs) -> mean (B, act), log_std (B, act)."""
        mean, log_std = self.net(obs).chunk(2, -1)
        return mean, log_std.clamp(self.lo, self.hi)

    def log_prob(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """log mu(a|s), summed over action dims: (B,)."""
        mean, log_std = self(obs)
        z = (act - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def sample(self, obs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n draws per state: (n, B, act)."""
        mean, log_std = self(obs)
        eps = torch.randn((n, *mean.shape), generator=generator, device=mean.device, dtype=mean.dtype)
        return mean + eps * log_std.exp()


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging: theta' <- (1 - tau) theta' + tau theta."""
    for t, s in zip(target.parameters(), source.parameters()):
        t.lerp_(s, tau)
