"""Policy evaluation and D4RL-style normalised score: 100 (R - R_random) / (R_expert - R_random).

Reference returns for the nav task are measured here (``measure_reference_returns``) and pinned in
``REF_RETURNS``; a test re-measures them. Reward is 1 on reaching the goal (episode ends) and 0 otherwise, so a
return is a success indicator: the scripted expert succeeds on every start, uniform random actions never do.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .envs import NAV_ENV_ID

REF_RETURNS = {NAV_ENV_ID: {"random": 0.0, "expert": 1.0}}
"""Per env id: mean return of uniform random actions and of the noiseless scripted expert over 100 episodes
(seed 0), measured by ``measure_reference_returns``. MuJoCo ids are measured with our own SAC at the full tier."""


def normalized_score(ret: float, env_id: str = NAV_ENV_ID, refs: dict | None = None) -> float:
    """100 (ret - random) / (expert - random) with the env's reference returns."""
    refs = refs or REF_RETURNS.get(env_id)
    if refs is None:
        raise KeyError(f"no reference returns for {env_id!r}; pass refs={{'random': ..., 'expert': ...}}")
    return 100.0 * (ret - refs["random"]) / (refs["expert"] - refs["random"])


def evaluate_policy(env, act: Callable[[np.ndarray], np.ndarray], episodes: int, seed: int) -> dict:
    """Run ``episodes`` episodes of ``act(obs) -> action`` (deterministic evaluation policy).

    Returns ``{"return", "normalized", "success", "length"}`` means; episode k is reset with ``seed + k``.
    """
    returns, successes, lengths = [], [], []
    env_id = env.spec.id if env.spec is not None else NAV_ENV_ID
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        total, done, steps, success = 0.0, False, 0, False
        while not done:
            obs, r, terminated, truncated, info = env.step(act(obs))
            total += float(r)
            steps += 1
            success = success or bool(info.get("success", False))
            done = terminated or truncated
        returns.append(total)
        successes.append(success)
        lengths.append(steps)
    ret = float(np.mean(returns))
    out = {"return": ret, "success": float(np.mean(successes)), "length": float(np.mean(lengths))}
    out["normalized"] = normalized_score(ret, env_id) if env_id in REF_RETURNS else float("nan")
    return out


def measure_reference_returns(episodes: int = 100, seed: int = 0) -> dict:
    """Mean returns of uniform random actions and of the noiseless scripted expert on the nav task."""
    from .behavior import waypoint_action
    from .envs import make_env

    env = make_env(NAV_ENV_ID)
    rng = np.random.default_rng(seed)
    rand = evaluate_policy(env, lambda o: rng.uniform(-1, 1, size=2).astype(np.float32), episodes, seed)
    expert = evaluate_policy(env, lambda o: waypoint_action(o)[0].astype(np.float32), episodes, seed)
    return {"random": rand["return"], "expert": expert["return"]}
