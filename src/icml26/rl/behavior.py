"""Behavior data for the navigation task, made here because D4RL / Minari cannot be downloaded.

The behavior policy is a scripted waypoint controller (the "expert": around the wall's right end, then to the
goal) with Gaussian action noise; the noise level sets the data's quality, as a SAC checkpoint's training stage
does for D4RL's MuJoCo sets:

==============  ===========================================================================================
level           episodes
==============  ===========================================================================================
expert          noise std 0.1
medium          noise std 1.0, and half of the episodes first visit a random detour waypoint below the wall
medium-replay   a training-like sweep: noise std from 3.0 down to 0.5 across the episodes, in order, detours
                as in medium
random          uniform random actions
==============  ===========================================================================================

Regenerate (written to the user cache dir, ``$ICML26_CACHE`` or ``~/.cache/icml26/rl``)::

    python -m icml26.rl.behavior --level medium --transitions 20000 --seed 0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ..core.assets import cache_dir
from .datasets import KEYS, content_hash, load_dataset, save_dataset, validate
from .envs import NAV_ENV_ID, PointNavWallEnv, make_env

LEVELS = ("expert", "medium", "medium-replay", "random")
NOISE = {"expert": 0.1, "medium": 1.0}
DETOUR_PROB = {"medium": 0.5, "medium-replay": 0.5}
REPLAY_NOISE = (3.0, 0.5)


def waypoint_action(obs: np.ndarray) -> np.ndarray:
    """The scripted expert's action for a (2,) or (B, 2) observation: full-speed unit step toward the current
    waypoint (below the wall: its right end; past it or above it: the goal)."""
    obs = np.atleast_2d(np.asarray(obs, dtype=np.float64))
    below = obs[:, 1] < 0.05
    target = np.where((below & (obs[:, 0] < 0.6))[:, None], [[0.7, -0.2]],
                      np.where(below[:, None], [[0.7, 0.3]], PointNavWallEnv.GOAL[None]))
    d = target - obs
    return d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-6)


def rollout_dataset(env, n_transitions: int, noise_for_episode, rng: np.random.Generator, seed: int,
                    detour_prob: float = 0.0) -> dict:
    """Roll the noisy controller until ``n_transitions`` are recorded (the last episode is cut with a timeout).

    ``noise_for_episode(k)`` gives episode k's noise std; ``None`` means uniform random actions. With probability
    ``detour_prob`` an episode first visits a detour waypoint drawn uniformly below the wall (a second, worse
    mode of behavior that a behavior-cloned average blends with the good one).
    """
    rows = {k: [] for k in KEYS}
    obs, _ = env.reset(seed=seed)
    episode, t = 0, 0
    noise = noise_for_episode(0)
    detour = _detour(rng, detour_prob)
    for i in range(n_transitions):
        if detour is not None and np.linalg.norm(obs - detour) < 0.15:
            detour = None
        if noise is None:
            action = rng.uniform(-1, 1, size=2)
        else:
            base = waypoint_action(obs)[0] if detour is None else (detour - obs) / max(np.linalg.norm(detour - obs), 1e-6)
            action = base + rng.normal(0.0, noise, size=2)
        action = np.clip(action, -1, 1).astype(np.float32)
        nxt, reward, terminated, truncated, _ = env.step(action)
        last = i == n_transitions - 1
        for k, v in (("observations", obs), ("actions", action), ("rewards", reward), ("next_observations", nxt),
                     ("terminals", float(terminated)), ("timeouts", float(truncated or (last and not terminated)))):
            rows[k].append(v)
        obs, t = nxt, t + 1
        if terminated or truncated:
            episode, t = episode + 1, 0
            noise = noise_for_episode(episode)
            detour = _detour(rng, detour_prob)
            obs, _ = env.reset()
    return validate({k: np.asarray(v) for k, v in rows.items()})


def _detour(rng: np.random.Generator, prob: float) -> np.ndarray | None:
    if prob <= 0 or rng.uniform() >= prob:
        return None
    return np.array([rng.uniform(-1.0, 0.4), rng.uniform(-1.0, -0.1)])


def generate(level: str, n_transitions: int, seed: int = 0, env_id: str = NAV_ENV_ID) -> dict:
    """A D4RL-layout dataset of ``n_transitions`` at ``level`` (see module docstring), deterministic in ``seed``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if n_transitions < 1:
        raise ValueError(f"n_transitions must be >= 1, got {n_transitions}")
    env = make_env(env_id)
    rng = np.random.default_rng(seed)
    if level == "random":
        noise = lambda k: None  # noqa: E731
    elif level == "medium-replay":
        expected_eps = max(n_transitions // 60, 1)  # the sweep spans about this many episodes
        hi, lo = REPLAY_NOISE
        noise = lambda k: hi + (lo - hi) * min(k / expected_eps, 1.0)  # noqa: E731
    else:
        noise = lambda k: NOISE[level]  # noqa: E731
    return rollout_dataset(env, n_transitions, noise, rng, seed, DETOUR_PROB.get(level, 0.0))


def cached_dataset(level: str, n_transitions: int, seed: int = 0) -> tuple[dict, Path]:
    """The nav dataset from the user cache dir, generated (and saved atomically) on a miss. The file name carries
    level, size and seed; the stored content hash is checked on every load."""
    path = cache_dir("rl") / f"pointnavwall-{level}-{n_transitions}-s{seed}.npz"
    if path.exists():
        return load_dataset(path)[0], path
    data = generate(level, n_transitions, seed)
    save_dataset(data, path, metadata={"env_id": NAV_ENV_ID, "level": level, "seed": seed,
                                       "command": f"python -m icml26.rl.behavior --level {level} "
                                                  f"--transitions {n_transitions} --seed {seed}"})
    return data, path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate a D4RL-layout dataset for icml26/PointNavWall-v0")
    parser.add_argument("--level", choices=LEVELS, default="medium")
    parser.add_argument("--transitions", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write here (.npz or .hdf5) instead of the cache")
    args = parser.parse_args(argv)
    if args.out is None:
        data, path = cached_dataset(args.level, args.transitions, args.seed)
    else:
        data = generate(args.level, args.transitions, args.seed)
        path = save_dataset(data, args.out, metadata={"env_id": NAV_ENV_ID, "level": args.level, "seed": args.seed})
    from .datasets import episode_returns

    rets = episode_returns(data)
    print(json.dumps({"path": str(path), "transitions": len(data["rewards"]), "episodes": len(rets),
                      "mean_return": float(rets.mean()), "content_hash": content_hash(data)}))


if __name__ == "__main__":
    main()
