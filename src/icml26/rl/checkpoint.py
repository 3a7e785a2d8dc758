"""Atomic checkpoints: ``torch.save`` into memory, then one atomic file replace, so a kill mid-write leaves the
previous checkpoint intact and a resumed run loses at most one interval."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from ..core.io import atomic_write_bytes


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    buf = io.BytesIO()
    torch.save(state, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: str | os.PathLike, map_location: torch.device | str | None = None) -> dict | None:
    """The saved state, or None when there is no checkpoint at ``path``."""
    path = Path(path)
    if not path.exists():
        return None
    return torch.load(path, map_location=map_location, weights_only=False)


def online_run_state(agent, buffer, rng, env, step: int, **extra: Any) -> dict[str, Any]:
    """What an online RL loop needs to continue exactly: the agent and its replay buffer, the loop's numpy ``rng``,
    the environment's own generator and the number of steps done, plus the loop's ``extra`` records (curves, ...).
    Taken right before an episode reset, so the resumed run's reset draws the same start state."""
    return {"agent": agent.state_dict(), "buffer": buffer.state_dict(), "rng": rng.bit_generator.state,
            "step": step, "env_rng": env.unwrapped.np_random.bit_generator.state, **extra}


def restore_online_run(state: dict[str, Any], agent, buffer, rng, env) -> int:
    """Load an :func:`online_run_state` back into ``agent``, ``buffer``, ``rng`` and ``env``; returns the step."""
    agent.load_state_dict(state["agent"])
    buffer.load_state_dict(state["buffer"])
    rng.bit_generator.state = state["rng"]
    env.unwrapped.np_random.bit_generator.state = state["env_rng"]
    return state["step"]
