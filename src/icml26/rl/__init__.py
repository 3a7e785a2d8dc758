"""Shared offline / offline-to-online RL core: Gymnasium environments, D4RL-layout datasets, replay buffers,
evaluation with normalised scores, behavior-data generation and atomic checkpoints.

Importing ``icml26.rl`` registers the numpy navigation task with Gymnasium (``icml26/PointNavWall-v0``);
nothing here imports MuJoCo unless a MuJoCo environment is asked for.
"""

from .envs import NAV_ENV_ID, PointNavWallEnv, make_env, register_envs

register_envs()

__all__ = ["NAV_ENV_ID", "PointNavWallEnv", "make_env", "register_envs"]
