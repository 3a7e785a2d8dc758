"""Small MLP networks shared by the RL rooms: deterministic tanh actor, twin Q critics, Gaussian BC policy,
SAC-style tanh-Gaussian actor, IQL's Gaussian actor, a state-value net and a BCQ-style CVAE behavior model."""

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

    def fit_loss(self, obs: torch.Tensor, act: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        """Behavior-cloning loss: the mean negative log-likelihood."""
        return -self.log_prob(obs, act).mean()

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


class TanhGaussianActor(nn.Module):
    """SAC-style stochastic policy a = tanh(u), u ~ N(m(s), diag(exp(2 log_std(s)))) (CORL Cal-QL's
    ``TanhGaussianPolicy``; max_action 1); (B, obs) -> actions in (-1, 1)^act.

    ``sample`` returns reparameterised actions (n, B, act) and their log-densities (n, B) with the tanh
    change-of-variables correction; ``forward`` is the deterministic action tanh(m(s)) used for evaluation.
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2,
                 log_std_range: tuple[float, float] = (-20.0, 2.0)):
        super().__init__()
        self.net = mlp(obs_dim, 2 * act_dim, hidden, layers)
        self.lo, self.hi = log_std_range

    def dist_params(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.net(obs).chunk(2, -1)
        return mean, log_std.clamp(self.lo, self.hi)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dist_params(obs)[0])

    def sample(self, obs: torch.Tensor, n: int | None = None, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised draws: (B, act), (B,) when ``n`` is None, else (n, B, act), (n, B)."""
        mean, log_std = self.dist_params(obs)
        shape = mean.shape if n is None else (n, *mean.shape)
        eps = torch.randn(shape, generator=generator, device=mean.device, dtype=mean.dtype)
        u = mean + eps * log_std.exp()
        # log N(u) - sum log(1 - tanh(u)^2), the latter written stably as 2 (log 2 - u - softplus(-2u))
        logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - (2 * (math.log(2) - u - torch.nn.functional.softplus(-2 * u))).sum(-1)
        return torch.tanh(u), logp


class IQLGaussianActor(nn.Module):
    """CORL IQL's Gaussian policy: mean tanh(MLP(s)), a state-independent learned log-std (init 0, clamped to
    [-20, 2]); ``log_prob`` of an action under N(mean, std^2) summed over dims, ``forward`` the mean."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.net = mlp(obs_dim, act_dim, hidden, layers)
        self.log_std = nn.Parameter(torch.zeros(act_dim))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(obs))

    def log_prob(self, obs: torch.Tensor, act: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
        mean = self(obs) if mean is None else mean
        log_std = self.log_std.clamp(-20.0, 2.0)
        z = (act - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def rsample(self, obs: torch.Tensor, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised draw (B, act) and its log-density (B,)."""
        mean = self(obs)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        act = mean + eps * self.log_std.clamp(-20.0, 2.0).exp()
        return act, self.log_prob(obs, act, mean)


class ValueNet(nn.Module):
    """State value V(s): (B, obs) -> (B,)."""

    def __init__(self, obs_dim: int, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.net = mlp(obs_dim, 1, hidden, layers)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).squeeze(-1)


class CVAE(nn.Module):
    """BCQ-style conditional VAE behavior model mu(a|s): encoder q(z|s, a) = N(m, diag(s^2)), decoder
    a = tanh(D(s, z)), prior N(0, I) with draws clipped to [-0.5, 0.5] as in BCQ.

    Same interface as :class:`GaussianPolicy` for DARE: ``sample(obs, n, generator) -> (n, B, act)``,
    ``log_prob(obs, act) -> (B,)`` (here the ELBO with a unit-variance Gaussian decoder, a lower bound on
    log mu(a|s) up to a constant; with the encoder mean as z, so it is deterministic), and ``fit_loss`` for
    training (reconstruction + 0.5 KL, BCQ's weighting).
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2, latent_dim: int | None = None):
        super().__init__()
        self.latent_dim = latent_dim or 2 * act_dim
        self.enc = mlp(obs_dim + act_dim, 2 * self.latent_dim, hidden, layers)
        self.dec = mlp(obs_dim + self.latent_dim, act_dim, hidden, layers)

    def encode(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.enc(torch.cat((obs, act), -1)).chunk(2, -1)
        return mean, log_std.clamp(-4.0, 15.0)

    def decode(self, obs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dec(torch.cat((obs, z), -1)))

    def fit_loss(self, obs: torch.Tensor, act: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        mean, log_std = self.encode(obs, act)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        recon = self.decode(obs, mean + eps * log_std.exp())
        kl = -0.5 * (1 + 2 * log_std - mean.pow(2) - (2 * log_std).exp()).sum(-1)
        return ((recon - act).pow(2).sum(-1) + 0.5 * kl).mean()

    def log_prob(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        mean, log_std = self.encode(obs, act)
        recon = self.decode(obs, mean)
        kl = -0.5 * (1 + 2 * log_std - mean.pow(2) - (2 * log_std).exp()).sum(-1)
        return -0.5 * (recon - act).pow(2).sum(-1) - kl

    def sample(self, obs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        z = torch.randn((n, obs.shape[0], self.latent_dim), generator=generator, device=obs.device,
                        dtype=obs.dtype).clamp(-0.5, 0.5)
        return self.decode(obs.unsqueeze(0).expand(n, *obs.shape), z)
