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


def orthogonal_init_(module: nn.Module) -> nn.Module:
    """CORL Cal-QL's ``orthogonal_init``: every Linear gets an orthogonal weight with gain sqrt(2) (output layers
    included) and a zero bias. Returns ``module``."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.orthogonal_(m.weight, gain=math.sqrt(2))
            nn.init.zeros_(m.bias)
    return module


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
    ``log_std_offset`` (None: off): CORL's learnable affine map of the log-std head, m * head + o with m
    initialised to 1 and o to this value (CORL uses -1), before the clamp.
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2,
                 log_std_range: tuple[float, float] = (-20.0, 2.0), log_std_offset: float | None = None):
        super().__init__()
        self.net = mlp(obs_dim, 2 * act_dim, hidden, layers)
        self.lo, self.hi = log_std_range
        self.affine_log_std = log_std_offset is not None
        if self.affine_log_std:  # CORL Cal-QL: log_std = m * head + o, m and o learnable (init 1, offset)
            self.log_std_scale = nn.Parameter(torch.tensor(1.0))
            self.log_std_offset = nn.Parameter(torch.tensor(float(log_std_offset)))

    def dist_params(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.net(obs).chunk(2, -1)
        if self.affine_log_std:
            log_std = self.log_std_scale * log_std + self.log_std_offset
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


def vp_beta_schedule(n_steps: int) -> torch.Tensor:
    """The discretised variance-preserving schedule beta_1..beta_T used by Diffusion-QL (Wang et al. 2023) for
    few-step action diffusion: alpha_t = exp(-b_min / T - (b_max - b_min)(2t - 1) / (2 T^2)), b_min 0.1, b_max 10,
    beta_t = 1 - alpha_t; (T,) float32."""
    t = torch.arange(1, n_steps + 1, dtype=torch.float64)
    b_min, b_max = 0.1, 10.0
    alpha = torch.exp(-b_min / n_steps - 0.5 * (b_max - b_min) * (2 * t - 1) / n_steps ** 2)
    return (1 - alpha).float()


class DiffusionBehavior(nn.Module):
    """A small DDPM behavior model mu(a|s) over actions in [-1, 1]^A (Ho et al. 2020, as Diffusion-QL uses it):
    forward process a_t = sqrt(abar_t) a_0 + sqrt(1 - abar_t) eps, a noise-prediction MLP eps_theta(a_t, s, t),
    ancestral sampling with the clipped x_0 prediction. It can represent multimodal behavior, which a Gaussian BC
    model cannot.

    Same interface as :class:`GaussianPolicy` for DARE:

    * ``fit_loss(obs, act, generator)``: Ho et al.'s L_simple, mean over the batch of ||eps - eps_theta||^2 at a
      uniform random step t.
    * ``log_prob(obs, act) -> (B,)``: an ELBO proxy, -1/2 the mean over all T steps and ``n_elbo`` noise draws of
      ||eps - eps_theta(a_t, s, t)||^2 (L_simple, the unweighted ELBO; higher = more behavior-like). The noise draws
      are fixed (seeded) and shared by every row, so the score is a deterministic function of (s, a).
    * ``sample(obs, n, generator, energy=None, guidance_scale=0) -> (n, B, A)``. With ``energy(s, a) -> (M,)``
      and ``guidance_scale`` w > 0, each reverse step's mean is shifted by w beta_t grad_a energy(s, a_t)
      (classifier-style energy guidance toward high energy, e.g. a critic's Q; [REC] stand-in for the paper's
      energy-guided diffusion, whose exact form is not known).

    Args:
        obs_dim, act_dim: sizes. hidden, layers: the noise network's MLP. n_steps: T (Diffusion-QL uses 5).
        time_dim: size of the sinusoidal step embedding. n_elbo: noise draws per step in ``log_prob``.
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, layers: int = 2, n_steps: int = 10,
                 time_dim: int = 16, n_elbo: int = 4):
        super().__init__()
        if n_steps < 1 or time_dim < 2 or time_dim % 2 or n_elbo < 1:
            raise ValueError(f"DiffusionBehavior needs n_steps >= 1, an even time_dim >= 2 and n_elbo >= 1, got "
                             f"{n_steps}, {time_dim}, {n_elbo}")
        self.act_dim, self.n_steps, self.time_dim, self.n_elbo = act_dim, n_steps, time_dim, n_elbo
        self.net = mlp(obs_dim + act_dim + time_dim, act_dim, hidden, layers)
        betas = vp_beta_schedule(n_steps)
        abar = torch.cumprod(1 - betas, 0)
        abar_prev = torch.cat((abar.new_ones(1), abar[:-1]))
        self.register_buffer("betas", betas)
        self.register_buffer("abar", abar)
        # q(a_{t-1} | a_t, a_0) = N(c0 a_0 + ct a_t, var): the DDPM posterior
        self.register_buffer("post_c0", betas * abar_prev.sqrt() / (1 - abar))
        self.register_buffer("post_ct", (1 - abar_prev) * (1 - betas).sqrt() / (1 - abar))
        self.register_buffer("post_var", betas * (1 - abar_prev) / (1 - abar))

    def _embed(self, t: torch.Tensor) -> torch.Tensor:
        """Sinusoidal embedding of the integer step t (M,) -> (M, time_dim)."""
        half = self.time_dim // 2
        freqs = torch.exp(-math.log(100.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        x = t.float().unsqueeze(-1) * freqs
        return torch.cat((x.sin(), x.cos()), -1)

    def eps(self, obs: torch.Tensor, a_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """eps_theta(a_t, s, t): (M, obs), (M, A), (M,) integer steps in [0, T) -> (M, A)."""
        return self.net(torch.cat((obs, a_t, self._embed(t).to(obs.dtype)), -1))

    def _noised(self, act: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ab = self.abar[t].unsqueeze(-1)
        return ab.sqrt() * act + (1 - ab).sqrt() * noise

    def fit_loss(self, obs: torch.Tensor, act: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        t = torch.randint(0, self.n_steps, (obs.shape[0],), generator=generator, device=obs.device)
        noise = torch.randn(act.shape, generator=generator, device=act.device, dtype=act.dtype)
        return (self.eps(obs, self._noised(act, t, noise), t) - noise).pow(2).sum(-1).mean()

    def log_prob(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        B, T, M = obs.shape[0], self.n_steps, self.n_elbo
        gen = torch.Generator(device=obs.device).manual_seed(0)
        # (T, M, 1, A) noise broadcast over the batch: the same draws for every row
        noise = torch.randn((T, M, 1, self.act_dim), generator=gen, device=obs.device, dtype=act.dtype)
        noise = noise.expand(T, M, B, self.act_dim).reshape(-1, self.act_dim)
        t = torch.arange(T, device=obs.device).repeat_interleave(M * B)
        o, a = obs.repeat(T * M, 1), act.repeat(T * M, 1)
        err = (self.eps(o, self._noised(a, t, noise), t) - noise).pow(2).sum(-1)
        return -0.5 * err.view(T * M, B).mean(0)

    def sample(self, obs: torch.Tensor, n: int, generator: torch.Generator | None = None, *, energy=None,
               guidance_scale: float = 0.0) -> torch.Tensor:
        if guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0, got {guidance_scale}")
        B = obs.shape[0]
        o = obs.unsqueeze(0).expand(n, *obs.shape).reshape(n * B, -1)
        a = torch.randn((n * B, self.act_dim), generator=generator, device=obs.device, dtype=obs.dtype)
        for i in reversed(range(self.n_steps)):
            t = torch.full((n * B,), i, device=obs.device, dtype=torch.long)
            with torch.no_grad():
                ab = self.abar[i]
                a0 = ((a - (1 - ab).sqrt() * self.eps(o, a, t)) / ab.sqrt()).clamp(-1.0, 1.0)
                mean = self.post_c0[i] * a0 + self.post_ct[i] * a
            if energy is not None and guidance_scale > 0:
                with torch.enable_grad():
                    x = a.detach().requires_grad_(True)
                    (grad,) = torch.autograd.grad(energy(o, x).sum(), x)
                mean = mean + guidance_scale * self.betas[i] * grad
            if i > 0:
                z = torch.randn(a.shape, generator=generator, device=a.device, dtype=a.dtype)
                a = mean + self.post_var[i].sqrt() * z
            else:
                a = mean
        return a.clamp(-1.0, 1.0).view(n, B, self.act_dim).detach()
