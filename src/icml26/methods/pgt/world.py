"""The procedural world of the PGT analogue: a 2-D arena with a procedurally generated layout (4 objects and one
hazard disc) and five task families, batched in torch so that K tasks x N rollouts run as one tensor program (the
policy is a torch module; every step stays on its device). The Gymnasium view is ``ProcWorldEnv``
(``icml26/ProcWorld-v0``).

Dynamics. The agent p in [-1, 1]^2 moves by 0.1 * gain * clip(a_xy) + wind (gain 1, wind 0 in distribution; the
out-of-distribution dynamics weaken the actuators and add wind). The third action is a grip: while a_grip > 0 the
agent picks up the nearest object within reach (0.12) and carries it; a_grip <= 0 drops it. Objects touched by the
agent are marked visited (sticky).

Observation (20 numbers): p (2), the 4 object positions (8), visited flags (4), held one-hot (4), hazard centre (2).

Task families (a task = a layout + a plan of up to 3 stage targets; stages advance when their target is reached):
    0 reach(a)           go to object a
    1 via(a -> b)        pass by object a, then go to object b
    2 collect(a, b, c)   touch a, b, c in that order, end at c
    3 avoid(h)           go to the object h behind the hazard without entering it (cost 1 per step inside)
    4 fetch(a -> b)      pick up object a and carry it to object b
Per-step reward = -(remaining path length): the distance from the stage's subject (the agent; for fetch's second
stage the carried object, plus the gap to it when dropped) to the stage target plus the lengths of the remaining
plan segments, minus the hazard cost for ``avoid``. The last stage never completes (staying at the goal is
rewarded), so ``reach`` is the old goal-reaching return. R(tau) = mean_t r_t.

A scene is a dict of tensors with a common leading shape: ``objects`` (..., 4, 2), ``hazard`` (..., 2),
``family`` (...,), ``targets`` (..., 3, 2), ``stage_obj`` (..., 3), ``n_stages`` (...,), ``detour`` (..., 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

STEP = 0.1
TOUCH = 0.12
N_OBJ = 3 + 1
N_STAGES = 3
HAZARD_R = 0.15
HAZARD_COST = 1.0
OBS_DIM = 2 + 2 * N_OBJ + N_OBJ + N_OBJ + 2
ACT_DIM = 3
FAMILIES = ("reach", "via", "collect", "avoid", "fetch")
_STAGES = (1, 2, 3, 1, 2)
_AVOID, _FETCH = FAMILIES.index("avoid"), FAMILIES.index("fetch")


@dataclass(frozen=True)
class Dynamics:
    """wind: added to every move; gain: actuator strength (1 = in distribution)."""

    wind: tuple[float, float] = (0.0, 0.0)
    gain: float = 1.0


ID = Dynamics()


def sample_layouts(n: int, gen: torch.Generator) -> dict:
    """n procedural layouts: object m at angle theta0 + m pi/2 + U(-0.4, 0.4), radius U(0.35, 0.85) (one object
    per quadrant, so they never overlap); the hazard (radius 0.15) sits at 0.55 of the way to a random object h,
    on its straight path from the start region. Returns objects (n, 4, 2), hazard (n, 2), hazard_obj (n,)."""
    theta0 = 2 * math.pi * torch.rand(n, 1, generator=gen)
    ang = theta0 + (math.pi / 2) * torch.arange(N_OBJ) + 0.8 * (torch.rand(n, N_OBJ, generator=gen) - 0.5)
    rad = 0.35 + 0.5 * torch.rand(n, N_OBJ, generator=gen)
    objects = torch.stack((rad * ang.cos(), rad * ang.sin()), -1)
    hazard_obj = torch.randint(N_OBJ, (n,), generator=gen)
    return {"objects": objects, "hazard": 0.55 * objects[torch.arange(n), hazard_obj], "hazard_obj": hazard_obj}


def make_tasks(layouts: dict, family: torch.Tensor, gen: torch.Generator) -> dict:
    """A task of each given family (n,) on each layout: random distinct objects a, b, c (``avoid`` always targets
    the object behind the hazard). The demonstrator of ``avoid`` first heads for a detour point 0.4 beside the
    hazard (side drawn at random)."""
    n = len(family)
    perm = torch.argsort(torch.rand(n, N_OBJ, generator=gen), 1)[:, :N_STAGES]  # distinct a, b, c
    perm[family == _AVOID, 0] = layouts["hazard_obj"][family == _AVOID]
    rows = torch.arange(n)[:, None]
    targets = layouts["objects"][rows, perm]
    n_stages = torch.tensor(_STAGES)[family]
    h = layouts["hazard"]
    perp = torch.stack((-h[:, 1], h[:, 0]), 1) / h.norm(dim=1, keepdim=True).clamp_min(1e-6)
    side = torch.where(torch.rand(n, 1, generator=gen) < 0.5, -1.0, 1.0)
    return {"objects": layouts["objects"], "hazard": h, "family": family, "targets": targets, "stage_obj": perm,
            "n_stages": n_stages, "detour": h + 0.4 * side * perp}


def sample_scenes(n: int, gen: torch.Generator, families: torch.Tensor | None = None) -> dict:
    """n random layouts with one task each; families cycle through all five unless given (n,)."""
    fam = torch.arange(n) % len(FAMILIES) if families is None else families
    return make_tasks(sample_layouts(n, gen), fam, gen)


def perturb(scene: dict, sigma: float, gen: torch.Generator) -> dict:
    """The same scene with the demonstrator's targets and detour shifted by N(0, sigma^2 I): a reference that does
    not quite show the task."""
    t = scene["targets"]
    return {**scene, "targets": t + sigma * torch.randn(t.shape, generator=gen),
            "detour": scene["detour"] + sigma * torch.randn(scene["detour"].shape, generator=gen)}


def index_scene(scene: dict, idx) -> dict:
    return {k: v[idx] for k, v in scene.items()}


def flat_scene(scene: dict, lead: tuple[int, ...], n: int) -> dict:
    """Broadcast a scene with leading shape broadcastable to ``lead`` to (*lead, n) and flatten it to B rows."""
    out = {}
    for k, v in scene.items():
        rest = v.shape[v.dim() - _RANK[k]:]
        out[k] = v.expand((*lead, *rest)).unsqueeze(len(lead)).expand((*lead, n, *rest)).reshape(-1, *rest)
    return out


_RANK = {"objects": 2, "hazard": 1, "hazard_obj": 0, "family": 0, "targets": 2, "stage_obj": 1, "n_stages": 0,
         "detour": 1}


def reset(scene: dict, gen: torch.Generator) -> dict:
    """Initial states of a flat scene (B rows): the agent uniform in [-0.1, 0.1]^2, nothing held or visited."""
    b = scene["family"].shape[0]
    p = (torch.rand(b, 2, generator=gen) * 0.2 - 0.1).to(scene["objects"].device)
    return {"p": p, "q": scene["objects"].clone(), "visited": torch.zeros(b, N_OBJ, device=p.device),
            "held": torch.full((b,), -1, dtype=torch.long, device=p.device),
            "stage": torch.zeros(b, dtype=torch.long, device=p.device),
            "detoured": torch.zeros(b, dtype=torch.bool, device=p.device)}


def observe(state: dict, scene: dict) -> torch.Tensor:
    """(B, OBS_DIM) observation: p, object positions, visited, held one-hot, hazard."""
    held = torch.nn.functional.one_hot(state["held"].clamp_min(0), N_OBJ).to(state["p"].dtype)
    held = held * (state["held"] >= 0)[:, None]
    return torch.cat((state["p"], state["q"].flatten(1), state["visited"], held, scene["hazard"]), 1)


def _remaining(state: dict, scene: dict) -> torch.Tensor:
    """Remaining path length of each row's plan from its current stage (B,)."""
    rows = torch.arange(len(state["p"]), device=state["p"].device)
    t, stage = scene["targets"], state["stage"]
    seg = (t[:, 1:] - t[:, :-1]).norm(dim=-1)  # (B, 2)
    later = torch.arange(1, N_STAGES, device=t.device)[None]
    tail = (seg * ((later > stage[:, None]) & (later < scene["n_stages"][:, None]))).sum(1)
    carry = (scene["family"] == _FETCH) & (stage == 1)
    a = scene["stage_obj"][:, 0]
    qa = state["q"][rows, a]
    subject = torch.where(carry[:, None], qa, state["p"])
    gap = torch.where(carry & (state["held"] != a), (state["p"] - qa).norm(dim=1), torch.zeros_like(tail))
    return (subject - t[rows, stage]).norm(dim=1) + tail + gap


def step(state: dict, action: torch.Tensor, scene: dict, dyn: Dynamics = ID) -> tuple[dict, torch.Tensor]:
    """One step of B rows: action (B, 3) -> (next state, reward (B,))."""
    a = action.clamp(-1, 1)
    wind = torch.tensor(dyn.wind, dtype=a.dtype, device=a.device)
    p = (state["p"] + STEP * dyn.gain * a[:, :2] + wind).clamp(-1, 1)
    grip = a[:, 2] > 0
    held = torch.where(grip, state["held"], torch.full_like(state["held"], -1))
    dist = (state["q"] - p[:, None]).norm(dim=-1)  # (B, M)
    near = dist.min(1)
    held = torch.where(grip & (held < 0) & (near.values < TOUCH), near.indices, held)
    carried = torch.nn.functional.one_hot(held.clamp_min(0), N_OBJ).bool() & (held >= 0)[:, None]
    q = torch.where(carried[..., None], p[:, None], state["q"])
    visited = torch.maximum(state["visited"], (dist < TOUCH).to(p.dtype))
    rows = torch.arange(len(p), device=p.device)
    stage = state["stage"]
    reached = (p - scene["targets"][rows, stage]).norm(dim=1) < TOUCH
    fetch = scene["family"] == _FETCH
    reached = torch.where(fetch, held == scene["stage_obj"][:, 0], reached)
    stage = torch.where(reached & (stage < scene["n_stages"] - 1), stage + 1, stage)
    detoured = state["detoured"] | ((p - scene["detour"]).norm(dim=1) < TOUCH)
    new = {"p": p, "q": q, "visited": visited, "held": held, "stage": stage, "detoured": detoured}
    inside = ((p - scene["hazard"]).norm(dim=1) < HAZARD_R) & (scene["family"] == _AVOID)
    return new, -_remaining(new, scene) - HAZARD_COST * inside.to(p.dtype)


def demo_action(state: dict, scene: dict) -> torch.Tensor:
    """Scripted demonstrator (B, 3): full speed toward the stage target (``avoid``: the detour point first),
    proportional inside one step of it; grip on for ``fetch`` only."""
    rows = torch.arange(len(state["p"]), device=state["p"].device)
    target = scene["targets"][rows, state["stage"]]
    target = torch.where(((scene["family"] == _AVOID) & ~state["detoured"])[:, None], scene["detour"], target)
    d = (target - state["p"]) / STEP
    move = d / d.norm(dim=-1, keepdim=True).clamp_min(1.0)
    grip = torch.where(scene["family"] == _FETCH, 1.0, -1.0).to(move.dtype)[:, None]
    return torch.cat((move, grip), 1)


@torch.no_grad()
def demos(scene: dict, horizon: int, noise: float, gen: torch.Generator, dyn: Dynamics = ID
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noisy demonstrations of a flat scene (B rows): observations (B, T+1, OBS_DIM), raw actions (B, T, 3) and
    returns (B,) under the scene's own plan."""
    state = reset(scene, gen)
    obs, acts, rew = [observe(state, scene)], [], []
    for _ in range(horizon):
        eps = torch.randn(len(state["p"]), ACT_DIM, generator=gen).to(state["p"].device)
        a = demo_action(state, scene) + noise * eps
        state, r = step(state, a, scene, dyn)
        obs.append(observe(state, scene))
        acts.append(a)
        rew.append(r)
    return torch.stack(obs, 1), torch.stack(acts, 1), torch.stack(rew, 1).mean(1)


@torch.no_grad()
def rollout(mean_fn, log_std: torch.Tensor, z: torch.Tensor, scene: dict, shape: tuple[int, ...], horizon: int,
            gen: torch.Generator, dyn: Dynamics = ID) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stochastic rollouts of a Gaussian policy a ~ N(mean_fn(o, z), exp(log_std)^2) for a batch of any ``shape``
    = (*lead, n): n rollouts of each scene of leading shape broadcastable to ``lead`` (e.g. (K, n) for K tasks).
    Returns observations (*shape, T+1, OBS_DIM), actions (*shape, T, 3), returns (*shape).

    ``mean_fn(obs (*shape, OBS_DIM), z) -> (*shape, 3)``; z and log_std broadcast against ``shape``. Starts and
    action noise are drawn from ``gen`` in the same order for every policy of the same ``shape`` (common random
    numbers)."""
    n_rows = math.prod(shape)
    flat = flat_scene(scene, tuple(shape[:-1]), shape[-1])
    state = reset(flat, gen)
    o = observe(state, flat)
    obs, acts, rew = [o.reshape(*shape, OBS_DIM)], [], []
    for _ in range(horizon):
        a = mean_fn(obs[-1], z) + log_std.exp() * torch.randn(*shape, ACT_DIM, generator=gen).to(o.device)
        state, r = step(state, a.reshape(n_rows, ACT_DIM), flat, dyn)
        obs.append(observe(state, flat).reshape(*shape, OBS_DIM))
        acts.append(a)
        rew.append(r)
    return torch.stack(obs, -2), torch.stack(acts, -2), torch.stack(rew, -1).mean(-1).reshape(shape)


class ProcWorldEnv(gym.Env):
    """Gymnasium view of the procedural world: each reset draws a layout and a task (of ``family``, or a random
    family) from the env's RNG; obs (20,), action in [-1, 1]^3, reward the per-step reward above; truncated at
    ``horizon``. ``info["family"]`` names the task family."""

    metadata = {"render_modes": []}

    def __init__(self, family: str | None = None, horizon: int = 40, wind=(0.0, 0.0), gain: float = 1.0):
        if family is not None and family not in FAMILIES:
            raise ValueError(f"unknown task family {family!r}; choose one of {FAMILIES} or None")
        if int(horizon) < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.family, self.horizon, self.dyn = family, int(horizon), Dynamics(tuple(wind), float(gain))
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(OBS_DIM,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(ACT_DIM,), dtype=np.float32)
        self._scene = self._state = None
        self._t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        gen = torch.Generator().manual_seed(int(self.np_random.integers(2**62)))
        fam = FAMILIES.index(self.family) if self.family else int(torch.randint(len(FAMILIES), (1,), generator=gen))
        self._scene = sample_scenes(1, gen, torch.tensor([fam]))
        self._state, self._t = reset(self._scene, gen), 0
        return self._obs(), {"family": FAMILIES[fam]}

    def _obs(self) -> np.ndarray:
        return observe(self._state, self._scene)[0].numpy().astype(np.float32)

    def step(self, action):
        a = torch.as_tensor(np.asarray(action, dtype=np.float32)).reshape(1, ACT_DIM)
        self._state, r = step(self._state, a, self._scene, self.dyn)
        self._t += 1
        info = {"family": FAMILIES[int(self._scene["family"][0])]}
        return self._obs(), float(r[0]), False, self._t >= self.horizon, info


if "icml26/ProcWorld-v0" not in gym.registry:
    gym.register(id="icml26/ProcWorld-v0", entry_point=ProcWorldEnv, disable_env_checker=True)
