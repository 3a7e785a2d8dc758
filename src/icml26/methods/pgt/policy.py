"""The goal-conditioned "foundation" policy: a reference-trajectory encoder z = E(tau_ref) (the GROOT analogue of a
video prompt) and a Gaussian policy pi_theta(a | o, z), pretrained by behavior cloning on scripted demos of every
task family of the procedural world, where the reference is another demonstration of the same task in the same
layout; then frozen for PGT."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...core.progress import progress
from . import world


class GoalPolicy(nn.Module):
    """Encoder + policy.

    Args:
        z_dim: latent goal size; hidden: MLP width; ref_points: how many observations of the reference trajectory
            the encoder reads (evenly subsampled); obs_dim, act_dim: the world's sizes (20 and 3).
    """

    def __init__(self, z_dim: int = 16, hidden: int = 128, ref_points: int = 11, *, obs_dim: int = world.OBS_DIM,
                 act_dim: int = world.ACT_DIM) -> None:
        super().__init__()
        self.ref_points = ref_points
        self.encoder = nn.Sequential(nn.Linear(obs_dim * ref_points, hidden), nn.ReLU(), nn.Linear(hidden, z_dim))
        self.net = nn.Sequential(nn.Linear(obs_dim + z_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, act_dim))
        self.log_std = nn.Parameter(torch.full((act_dim,), math.log(0.3)))

    def encode(self, ref_obs: torch.Tensor) -> torch.Tensor:
        """(B, T+1, obs_dim) reference observations -> z (B, z_dim)."""
        idx = torch.linspace(0, ref_obs.shape[1] - 1, self.ref_points).round().long()
        return self.encoder(ref_obs[:, idx].flatten(1))

    def mean(self, obs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """obs (..., obs_dim), z broadcastable to (..., z_dim) -> action mean (..., act_dim)."""
        z = z.expand(*obs.shape[:-1], z.shape[-1])
        return self.net(torch.cat((obs, z), -1))

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Trajectory log-likelihood sum_t log pi(a_t | o_t, z): obs (..., T, obs_dim), actions (..., T, act_dim)
        -> (...)."""
        mu = self.mean(obs, z)
        std = self.log_std.exp()
        lp = -0.5 * ((actions - mu) / std).pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)
        return lp.sum((-1, -2))

    @torch.no_grad()
    def rollout(self, z: torch.Tensor, scene: dict, n: int, horizon: int, gen: torch.Generator,
                dyn: world.Dynamics = world.ID) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """n stochastic rollouts of one scene (leading shape ()) with latent z (z_dim,): observations
        (n, T+1, obs_dim), actions (n, T, act_dim), returns (n,)."""
        return world.rollout(self.mean, self.log_std, z, scene, (n,), horizon, gen, dyn)


def pretrain(policy: GoalPolicy, steps: int, *, horizon: int, batch: int = 128, lr: float = 1e-3,
             demo_noise: float = 0.3, seed: int = 0, checkpoint: str | None = None, every: int = 250) -> list[float]:
    """Behavior cloning on the procedural world: each sample is a fresh layout with a task of a random family; the
    reference and the target are two independent noisy demos of that task (different starts and noise); loss =
    -mean log pi(target actions | target observations, E(reference)) / T.

    With ``checkpoint`` (a file path) the policy, Adam state, generator state and losses are saved atomically every
    ``every`` steps and a rerun resumes from there (at most ``every`` steps lost); the result is the same as an
    uninterrupted run."""
    import io as _io
    import os

    from ...core.io import atomic_write_bytes

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    losses: list[float] = []
    if checkpoint and os.path.exists(checkpoint):
        state = torch.load(checkpoint, weights_only=False)
        policy.load_state_dict(state["policy"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        losses = state["losses"]
    for i in progress(range(len(losses), steps), desc="pgt foundation BC"):
        fam = torch.randint(len(world.FAMILIES), (batch,), generator=gen)
        scene = world.sample_scenes(batch, gen, fam)
        ref_o, _, _ = world.demos(scene, horizon, demo_noise, gen)
        o, a, _ = world.demos(scene, horizon, demo_noise, gen)
        loss = -policy.log_prob(o[:, :-1], a, policy.encode(ref_o)[:, None]).mean() / horizon
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if checkpoint and ((i + 1) % every == 0 or i + 1 == steps):
            buf = _io.BytesIO()
            torch.save({"policy": policy.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "losses": losses}, buf)
            atomic_write_bytes(checkpoint, buf.getvalue())
    return losses
