"""The goal-reaching world of the PGT analogue: a point in [-1, 1]^2 moved by 0.1 clip(a) (+ optional wind and
actuator gain, the out-of-distribution dynamics), batched in torch so that 50 rollouts run as one tensor program.
A Gymnasium view of the same dynamics is ``GoalReachEnv`` (``icml26/GoalReach-v0``).

A behavior reaches an endpoint e: the scripted demonstrator steps toward e at full speed and stops there, with
Gaussian action noise. A task has a goal g and a per-episode return R(tau) = -mean_t ||p_t - g|| (dense).
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

STEP = 0.1


@dataclass(frozen=True)
class Dynamics:
    """wind: added to every move; gain: actuator strength (1 = in distribution)."""

    wind: tuple[float, float] = (0.0, 0.0)
    gain: float = 1.0


ID = Dynamics()


def step(pos: torch.Tensor, action: torch.Tensor, dyn: Dynamics = ID) -> torch.Tensor:
    """(B, 2), (B, 2) -> next positions (B, 2)."""
    move = STEP * dyn.gain * action.clamp(-1, 1) + torch.tensor(dyn.wind, dtype=pos.dtype, device=pos.device)
    return (pos + move).clamp(-1, 1)


def starts(n: int, gen: torch.Generator, device=None) -> torch.Tensor:
    return (torch.rand(n, 2, generator=gen) * 0.2 - 0.1).to(device)


def demo_action(pos: torch.Tensor, endpoint: torch.Tensor) -> torch.Tensor:
    """Scripted demonstrator: full speed toward the endpoint, proportional inside one step of it."""
    d = (endpoint - pos) / STEP
    return d / d.norm(dim=-1, keepdim=True).clamp_min(1.0)


def demos(endpoints: torch.Tensor, horizon: int, noise: float, gen: torch.Generator, dyn: Dynamics = ID
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy demonstrations toward ``endpoints`` (B, 2): states (B, T+1, 2) and raw actions (B, T, 2)."""
    pos = starts(len(endpoints), gen, endpoints.device)
    states, actions = [pos], []
    for _ in range(horizon):
        a = demo_action(pos, endpoints) + noise * torch.randn(pos.shape, generator=gen).to(pos.device)
        pos = step(pos, a, dyn)
        states.append(pos)
        actions.append(a)
    return torch.stack(states, 1), torch.stack(actions, 1)


def task_return(states: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """R(tau) = -mean_{t >= 1} ||p_t - g||: (B, T+1, 2), (2,) or (B, 2) -> (B,)."""
    goal = goal.reshape(-1, 1, 2)
    return -(states[:, 1:] - goal).norm(dim=-1).mean(1)


def task_goals(n: int, radius: float = 0.7, phase: float = 0.0) -> torch.Tensor:
    """n goals evenly on a circle: the in-distribution tasks."""
    ang = phase + 2 * torch.pi * torch.arange(n) / n
    return radius * torch.stack((ang.cos(), ang.sin()), 1)


class GoalReachEnv(gym.Env):
    """Gymnasium view of one task: obs (x, y), action in [-1, 1]^2, reward -||p - g|| per step."""

    metadata = {"render_modes": []}

    def __init__(self, goal=(0.7, 0.0), horizon: int = 30, wind=(0.0, 0.0), gain: float = 1.0):
        self.goal, self.horizon, self.dyn = np.asarray(goal, dtype=np.float64), int(horizon), Dynamics(tuple(wind), gain)
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self._pos, self._t = np.zeros(2), 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._pos, self._t = self.np_random.uniform(-0.1, 0.1, size=2), 0
        return self._pos.astype(np.float32), {}

    def step(self, action):
        nxt = step(torch.as_tensor(self._pos)[None], torch.as_tensor(np.asarray(action, dtype=np.float64))[None],
                   self.dyn)[0]
        self._pos, self._t = nxt.numpy(), self._t + 1
        reward = -float(np.linalg.norm(self._pos - self.goal))
        return self._pos.astype(np.float32), reward, False, self._t >= self.horizon, {}


if "icml26/GoalReach-v0" not in gym.registry:
    gym.register(id="icml26/GoalReach-v0", entry_point=GoalReachEnv, disable_env_checker=True)
