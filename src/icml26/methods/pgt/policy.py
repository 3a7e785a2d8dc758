"""The goal-conditioned "foundation" policy: a reference-trajectory encoder z = E(tau_ref) (the GROOT analogue of a
video prompt) and a Gaussian policy pi_theta(a | s, z), pretrained by behavior cloning where the reference is
another demonstration of the same behavior; then frozen for PGT."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...core.progress import progress
from . import world


class GoalPolicy(nn.Module):
    """Encoder + policy.

    Args:
        z_dim: latent goal size; hidden: MLP width; ref_points: how many states of the reference trajectory the
            encoder reads (evenly subsampled).
    """

    def __init__(self, z_dim: int = 8, hidden: int = 64, ref_points: int = 11) -> None:
        super().__init__()
        self.ref_points = ref_points
        self.encoder = nn.Sequential(nn.Linear(2 * ref_points, hidden), nn.ReLU(), nn.Linear(hidden, z_dim))
        self.net = nn.Sequential(nn.Linear(2 + z_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 2))
        self.log_std = nn.Parameter(torch.full((2,), math.log(0.3)))

    def encode(self, ref_states: torch.Tensor) -> torch.Tensor:
        """(B, T+1, 2) reference states -> z (B, z_dim)."""
        idx = torch.linspace(0, ref_states.shape[1] - 1, self.ref_points).round().long()
        return self.encoder(ref_states[:, idx].flatten(1))

    def mean(self, states: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """states (..., 2), z broadcastable to (..., z_dim) -> action mean (..., 2)."""
        z = z.expand(*states.shape[:-1], z.shape[-1])
        return self.net(torch.cat((states, z), -1))

    def log_prob(self, states: torch.Tensor, actions: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Trajectory log-likelihood sum_t log pi(a_t | s_t, z): states (B, T, 2), actions (B, T, 2) -> (B,)."""
        mu = self.mean(states, z)
        std = self.log_std.exp()
        lp = -0.5 * ((actions - mu) / std).pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)
        return lp.sum((-1, -2))

    @torch.no_grad()
    def rollout(self, z: torch.Tensor, n: int, horizon: int, gen: torch.Generator, dyn: world.Dynamics = world.ID
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """n stochastic rollouts with latent z (z_dim,) or (n, z_dim): states (n, T+1, 2), actions (n, T, 2)."""
        return rollout_with(self.mean, self.log_std, z, (n,), horizon, gen, dyn)


@torch.no_grad()
def rollout_with(mean_fn, log_std: torch.Tensor, z: torch.Tensor, shape: tuple[int, ...], horizon: int,
                 gen: torch.Generator, dyn: world.Dynamics = world.ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic rollouts of a Gaussian policy a ~ N(mean_fn(s, z), exp(log_std)^2) for a batch of any ``shape``
    (e.g. (n,) for one task, (K, n) for K tasks at once): states (*shape, T+1, 2), actions (*shape, T, 2).

    ``mean_fn(states (*shape, 2), z) -> (*shape, 2)``; z and log_std broadcast against ``shape`` (z of one task
    per leading index: (K, 1, z_dim); log_std (2,) or per task (K, 1, 2)). Start positions and action noise are
    drawn from ``gen`` in the same order for every policy of the same ``shape`` (common random numbers)."""
    n = math.prod(shape)
    pos = world.starts(n, gen, z.device).reshape(*shape, 2)
    states, actions = [pos], []
    for _ in range(horizon):
        a = mean_fn(pos, z) + log_std.exp() * torch.randn(pos.shape, generator=gen).to(pos.device)
        pos = world.step(pos.reshape(n, 2), a.reshape(n, 2), dyn).reshape(*shape, 2)
        states.append(pos)
        actions.append(a)
    return torch.stack(states, -2), torch.stack(actions, -2)


def pretrain(policy: GoalPolicy, steps: int, *, horizon: int, batch: int = 128, lr: float = 1e-3,
             demo_noise: float = 0.3, seed: int = 0) -> list[float]:
    """Behavior cloning: endpoints e uniform in the disc of radius 0.9; the reference and the target are two
    independent noisy demos toward the same e; loss = -mean log pi(target actions | target states, E(reference))."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    losses = []
    for _ in progress(range(steps), desc="pgt foundation BC"):
        r = 0.9 * torch.rand(batch, 1, generator=gen).sqrt()
        ang = 2 * torch.pi * torch.rand(batch, 1, generator=gen)
        e = torch.cat((r * ang.cos(), r * ang.sin()), 1)
        ref_s, _ = world.demos(e, horizon, demo_noise, gen)
        s, a = world.demos(e, horizon, demo_noise, gen)
        loss = -policy.log_prob(s[:, :-1], a, policy.encode(ref_s)[:, None]).mean() / horizon
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
