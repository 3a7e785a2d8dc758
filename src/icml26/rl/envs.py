"""Environments through Gymnasium: a fast numpy sparse-reward navigation task with a wall (antmaze-like) for the
quick tier, and MuJoCo locomotion (Hopper-v5, ...) at the full tier when ``gymnasium[mujoco]`` imports.

``PointNavWall-v0`` (registered as ``icml26/PointNavWall-v0``): a point in the square [-1, 1]^2 starts near
(-0.6, -0.6) and must reach the goal disc (radius 0.15) around (-0.6, 0.6). A horizontal wall at y = 0 spans
x in [-1, 0.4], so the agent has to go right around the wall's end and come back: a U-shaped path of about
32 steps, which makes stitching matter as in antmaze. Action a in [-1, 1]^2 moves the point by 0.1 a (plus
optional Gaussian action noise, the "changed dynamics" knob); a move that would cross the wall or leave the
square is cancelled. Reward 1 on reaching the goal, which ends the episode (``terminated``); otherwise 0;
``truncated`` after ``max_episode_steps`` (default 50). Observation (x, y) as float32.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

NAV_ENV_ID = "icml26/PointNavWall-v0"
MUJOCO_IDS = ("Hopper-v5", "HalfCheetah-v5", "Walker2d-v5")


class PointNavWallEnv(gym.Env):
    """Sparse-reward 2-D point navigation around a wall (see module docstring).

    Args:
        max_episode_steps: horizon; the episode is truncated after this many steps.
        step_size: distance moved per unit action.
        start_noise: half-width of the uniform noise on the start position.
        action_noise: std of Gaussian noise added to the action before the move (0 = deterministic dynamics).
        goal_radius: the goal disc's radius.
    """

    metadata = {"render_modes": []}
    START = np.array([-0.6, -0.6])
    GOAL = np.array([-0.6, 0.6])
    WALL_Y, WALL_X_END = 0.0, 0.4

    def __init__(self, max_episode_steps: int = 50, step_size: float = 0.1, start_noise: float = 0.1,
                 action_noise: float = 0.0, goal_radius: float = 0.15) -> None:
        if max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
        if not step_size > 0 or not goal_radius > 0 or start_noise < 0 or action_noise < 0:
            raise ValueError("step_size and goal_radius must be > 0, start_noise and action_noise >= 0")
        self.max_episode_steps, self.step_size = int(max_episode_steps), float(step_size)
        self.start_noise, self.action_noise, self.goal_radius = float(start_noise), float(action_noise), float(goal_radius)
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self._pos = self.START.copy()
        self._t = 0

    def _obs(self) -> np.ndarray:
        return self._pos.astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._pos = self.START + self.np_random.uniform(-self.start_noise, self.start_noise, size=2)
        self._t = 0
        return self._obs(), {}

    @classmethod
    def crosses_wall(cls, old: np.ndarray, new: np.ndarray) -> bool:
        """True when the segment old -> new passes through the wall (y = 0, x <= 0.4)."""
        if (old[1] - cls.WALL_Y) * (new[1] - cls.WALL_Y) > 0:
            return False
        dy = new[1] - old[1]
        x_at = old[0] if dy == 0 else old[0] + (cls.WALL_Y - old[1]) * (new[0] - old[0]) / dy
        return bool(x_at <= cls.WALL_X_END)

    def step(self, action):
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(2), -1.0, 1.0)
        if self.action_noise > 0:
            a = a + self.np_random.normal(0.0, self.action_noise, size=2)
        new = self._pos + self.step_size * a
        if np.all(np.abs(new) <= 1.0) and not self.crosses_wall(self._pos, new):
            self._pos = new
        self._t += 1
        reached = bool(np.linalg.norm(self._pos - self.GOAL) <= self.goal_radius)
        truncated = (not reached) and self._t >= self.max_episode_steps
        return self._obs(), float(reached), reached, truncated, {"success": reached}


def register_envs() -> None:
    """Register ``icml26/PointNavWall-v0`` with Gymnasium (idempotent)."""
    if NAV_ENV_ID not in gym.registry:
        gym.register(id=NAV_ENV_ID, entry_point=PointNavWallEnv, max_episode_steps=None,
                     disable_env_checker=True)


def make_env(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make(env_id)`` with clear errors: an unknown id names the supported ones, a MuJoCo id without
    ``gymnasium[mujoco]`` names the install command."""
    register_envs()
    if env_id in MUJOCO_IDS:
        from ..core.assets import require

        require("mujoco", "pip install 'gymnasium[mujoco]'", purpose=f"the MuJoCo environment {env_id}")
    if env_id not in gym.registry:
        raise ValueError(f"unknown environment id {env_id!r}; supported here: {NAV_ENV_ID!r} (numpy) and "
                         f"{list(MUJOCO_IDS)} (needs gymnasium[mujoco]), or any id registered with Gymnasium")
    return gym.make(env_id, **kwargs)
