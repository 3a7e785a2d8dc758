"""Behavior policies for MuJoCo datasets, made here because D4RL / Minari cannot be downloaded: our own SAC
(Haarnoja et al. 2018, automatic entropy; tanh-Gaussian actor, twin Q, no target actor), trained on a Gymnasium
MuJoCo task with atomic checkpoints (resume after a kill loses at most one interval), actor snapshots and their
evaluation returns along the way; then D4RL-layout datasets recorded from the snapshots.

Levels, following D4RL's definitions (Fu et al. 2020) at our budget:

==============  ===========================================================================================
level           data
==============  ===========================================================================================
expert          rollouts of the best snapshot (its stochastic policy)
medium          rollouts of the first snapshot whose evaluation return reaches 1/3 of the way from random to
                expert ("a policy trained to about a third of expert performance")
medium-replay   SAC's own replay buffer up to the medium snapshot (every transition it collected until then)
random          uniform random actions
==============  ===========================================================================================

Normalised score: 100 (R - R_random) / (R_expert - R_random) with R_random the mean return of uniform actions and
R_expert the best snapshot's evaluation return, both measured here and stored in each dataset's metadata
(``ref_random``, ``ref_expert``); ``register_dataset_refs`` makes ``evaluate_policy`` use them.

Train, then record (written to ``$ICML26_CACHE/rl`` or ``~/.cache/icml26/rl``)::

    python -m icml26.rl.sac train --env Hopper-v5 --steps 150000 --seed 0
    python -m icml26.rl.sac record --env Hopper-v5 --level medium --transitions 100000 --seed 0
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..core.assets import cache_dir
from ..core.progress import progress
from .buffers import OnlineBuffer
from .checkpoint import load_checkpoint, online_run_state, restore_online_run, save_checkpoint
from .datasets import KEYS, content_hash, load_dataset, save_dataset, validate
from .envs import make_env
from .evaluation import REF_RETURNS, evaluate_policy
from .nets import TanhGaussianActor, TwinQ, soft_update

LEVELS = ("expert", "medium", "medium-replay", "random")


class SAC:
    """Soft actor-critic with automatic temperature (target entropy -|A|), CORL/SB3-style defaults: lr 3e-4,
    batch 256, gamma 0.99, tau 5e-3, 2x256 MLPs.

    Args:
        obs_dim, act_dim: sizes (actions in [-1, 1]^act_dim; Gymnasium's MuJoCo tasks use that range).
        device: any torch device; seed: network init and the sampling generator.
    """

    def __init__(self, obs_dim: int, act_dim: int, *, hidden: int = 256, layers: int = 2, lr: float = 3e-4,
                 batch_size: int = 256, discount: float = 0.99, tau: float = 5e-3,
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        if not lr > 0 or batch_size < 1 or not 0 <= discount < 1 or not 0 < tau <= 1:
            raise ValueError("SAC needs lr > 0, batch_size >= 1, discount in [0, 1) and tau in (0, 1]")
        self.device, self.act_dim, self.hidden, self.layers = torch.device(device), int(act_dim), hidden, layers
        self.batch_size, self.discount, self.tau = int(batch_size), float(discount), float(tau)
        torch.manual_seed(seed)
        self.actor = TanhGaussianActor(obs_dim, act_dim, hidden, layers).to(self.device)
        self.critic = TwinQ(obs_dim, act_dim, hidden, layers).to(self.device)
        self.critic_target = copy.deepcopy(self.critic)
        self.log_alpha = torch.zeros(1, device=self.device, requires_grad=True)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)

    def update(self, b: dict) -> dict:
        """One SAC step: critic (soft TD target), actor, temperature, Polyak target."""
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            na, nlp = self.actor.sample(b["next_observations"], generator=self.gen)
            target = torch.min(*self.critic_target(b["next_observations"], na)) - alpha * nlp
            y = b["rewards"] + self.discount * (1 - b["dones"]) * target
        q1, q2 = self.critic(b["observations"], b["actions"])
        loss_q = F.mse_loss(q1, y) + F.mse_loss(q2, y)
        self.critic_opt.zero_grad(set_to_none=True)
        loss_q.backward()
        self.critic_opt.step()
        a, lp = self.actor.sample(b["observations"], generator=self.gen)
        loss_pi = (alpha * lp - torch.min(*self.critic(b["observations"], a))).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        loss_pi.backward()
        self.actor_opt.step()
        loss_alpha = -(self.log_alpha * (lp.detach() - self.act_dim)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        loss_alpha.backward()
        self.alpha_opt.step()
        soft_update(self.critic_target, self.critic, self.tau)
        return {"critic_loss": float(loss_q.detach()), "actor_loss": float(loss_pi.detach())}

    def act(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.actor(torch.as_tensor(obs, dtype=torch.float32, device=self.device)[None])[0].cpu().numpy()

    def state_dict(self) -> dict:
        mods = ("actor", "critic", "critic_target", "actor_opt", "critic_opt", "alpha_opt")
        return {**{m: getattr(self, m).state_dict() for m in mods}, "log_alpha": self.log_alpha.detach().clone(),
                "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        for m in ("actor", "critic", "critic_target", "actor_opt", "critic_opt", "alpha_opt"):
            getattr(self, m).load_state_dict(state[m])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.gen.set_state(state["gen"])


def _sample_action(actor: TanhGaussianActor, obs: np.ndarray, rng: np.random.Generator, device) -> np.ndarray:
    """A stochastic action from the tanh-Gaussian policy with numpy's generator (so a resumed run replays it)."""
    with torch.no_grad():
        mean, log_std = actor.dist_params(torch.as_tensor(obs, dtype=torch.float32, device=device)[None])
    u = mean[0].cpu().numpy() + np.exp(log_std[0].cpu().numpy()) * rng.normal(size=mean.shape[-1])
    return np.tanh(u).astype(np.float32)


def run_dir(env_id: str, seed: int) -> Path:
    return cache_dir("rl", f"sac-{env_id.lower()}-s{seed}")


def train_sac(env_id: str, steps: int, *, seed: int = 0, start_steps: int = 5000, snapshot_every: int = 10000,
              eval_episodes: int = 5, checkpoint_every: int = 5000, out: str | Path | None = None,
              stop_after: int | None = None, **sac_kw) -> dict:
    """Train SAC on ``env_id`` for ``steps`` environment steps (UTD 1, uniform actions for the first
    ``start_steps``), snapshotting the actor every ``snapshot_every`` steps with its deterministic evaluation
    return. Resumes from ``out/checkpoint.pt`` when present (taken at episode ends, atomically). Returns the
    snapshot table ``{"snapshots": [[step, return], ...], "steps_done"}``, also written to ``out/snapshots.json``.
    """
    if steps < 1 or snapshot_every < 1 or checkpoint_every < 1:
        raise ValueError("steps, snapshot_every and checkpoint_every must be >= 1")
    out = Path(out) if out is not None else run_dir(env_id, seed)
    env, eval_env = make_env(env_id), make_env(env_id)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    agent = SAC(obs_dim, act_dim, seed=seed, **sac_kw)
    buf = OnlineBuffer(obs_dim, act_dim, steps, agent.device)
    rng = np.random.default_rng(seed + 2)
    step, last_ckpt, snaps, timeouts = 0, 0, [], []
    state = load_checkpoint(out / "checkpoint.pt")
    if state is not None:
        step = last_ckpt = restore_online_run(state, agent, buf, rng, env)
        snaps, timeouts = state["snaps"], state["timeouts"]
        obs, _ = env.reset()
    else:
        obs, _ = env.reset(seed=seed)
    for step in progress(range(step, steps), desc=f"SAC {env_id}", total=steps - step):
        if step < start_steps:
            action = rng.uniform(-1, 1, size=act_dim).astype(np.float32)
        else:
            action = _sample_action(agent.actor, obs, rng, agent.device)
        nxt, r, terminated, truncated, _ = env.step(action)
        buf.add(obs, action, r, nxt, terminated)
        timeouts.append(bool(truncated and not terminated))
        obs = nxt
        if step + 1 >= start_steps:
            agent.update(buf.sample(agent.batch_size, agent.gen))
        done = step + 1
        if done % snapshot_every == 0:
            ret = evaluate_policy(eval_env, agent.act, eval_episodes, seed=10_000)["return"]
            save_checkpoint(out / f"actor-{done}.pt", {"actor": agent.actor.state_dict(), "return": ret,
                                                            "hidden": agent.hidden, "layers": agent.layers})
            snaps.append([done, ret])
        if terminated or truncated:
            if done - last_ckpt >= checkpoint_every:
                save_checkpoint(out / "checkpoint.pt", online_run_state(agent, buf, rng, env, done, snaps=snaps,
                                                                        timeouts=timeouts))
                _write_json(out / "snapshots.json", {"env_id": env_id, "seed": seed, "snapshots": snaps,
                                                     "steps_done": done})
                last_ckpt = done
            obs, _ = env.reset()
        if stop_after is not None and done >= stop_after:
            return {"snapshots": snaps, "steps_done": done}
    save_checkpoint(out / "checkpoint.pt",
                    online_run_state(agent, buf, rng, env, steps, snaps=snaps, timeouts=timeouts))
    _write_json(out / "snapshots.json", {"env_id": env_id, "seed": seed, "snapshots": snaps, "steps_done": steps})
    return {"snapshots": snaps, "steps_done": steps}


def _write_json(path: Path, obj: dict) -> None:
    from ..core.io import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(obj, indent=1).encode())


def random_return(env_id: str, episodes: int = 10, seed: int = 0) -> float:
    """Mean return of uniform random actions (the normaliser's R_random)."""
    rng = np.random.default_rng(seed)
    env = make_env(env_id)
    return evaluate_policy(env, lambda o: rng.uniform(-1, 1, size=env.action_space.shape).astype(np.float32),
                           episodes, seed)["return"]


def choose_snapshots(snaps: list, r_random: float) -> dict:
    """``{"expert": (step, return), "medium": (step, return)}``: the best snapshot, and the first one reaching
    R_random + (R_expert - R_random) / 3."""
    if not snaps:
        raise ValueError("no SAC snapshots yet: train first (python -m icml26.rl.sac train ...)")
    best = max(snaps, key=lambda s: s[1])
    if best[1] <= r_random:
        raise ValueError(f"no SAC snapshot beats random actions yet (best {best[1]:.1f} <= {r_random:.1f}); "
                         "train longer")
    bar = r_random + (best[1] - r_random) / 3
    medium = next(s for s in snaps if s[1] >= bar)
    return {"expert": tuple(best), "medium": tuple(medium)}


def record(env_id: str, level: str, n_transitions: int, *, seed: int = 0, src: str | Path | None = None) -> dict:
    """A D4RL-layout dataset at ``level`` from a finished (or partial) SAC run in ``src`` (default: the cache)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if n_transitions < 1:
        raise ValueError(f"n_transitions must be >= 1, got {n_transitions}")
    src = Path(src) if src is not None else run_dir(env_id, seed)
    table = json.loads((src / "snapshots.json").read_text()) if (src / "snapshots.json").exists() else None
    if table is None:
        raise FileNotFoundError(f"no SAC run at {src}; train first: python -m icml26.rl.sac train --env {env_id}")
    r_random = random_return(env_id)
    picks = choose_snapshots(table["snapshots"], r_random)  # also for "random": its metadata names R_expert
    env = make_env(env_id)
    rng = np.random.default_rng(seed + 7)
    meta = {"env_id": env_id, "level": level, "seed": seed, "ref_random": r_random, "ref_expert": picks["expert"][1],
            "sac_expert_step": picks["expert"][0], "sac_medium_step": picks["medium"][0]}
    if level == "medium-replay":
        state = load_checkpoint(src / "checkpoint.pt")
        n = min(picks["medium"][0], state["buffer"]["size"])
        t = {k: v[:n].numpy() for k, v in state["buffer"]["tensors"].items()}
        data = {"observations": t["observations"], "actions": t["actions"], "rewards": t["rewards"],
                "next_observations": t["next_observations"], "terminals": t["dones"],
                "timeouts": np.asarray(state["timeouts"][:n], dtype=np.float32)}
        data["timeouts"][-1] = 1.0 - data["terminals"][-1]
        return {"data": validate(data), "meta": meta}
    if level == "random":
        act = lambda o: rng.uniform(-1, 1, size=env.action_space.shape).astype(np.float32)  # noqa: E731
    else:
        snap = load_checkpoint(src / f"actor-{picks[level][0]}.pt")
        actor = TanhGaussianActor(env.observation_space.shape[0], env.action_space.shape[0], snap["hidden"],
                                  snap["layers"])
        actor.load_state_dict(snap["actor"])
        act = lambda o: _sample_action(actor, o, rng, "cpu")  # noqa: E731
    return {"data": rollouts(env, act, n_transitions, seed, desc=f"record {env_id} {level}"), "meta": meta}


def rollouts(env, act, n_transitions: int, seed: int, desc: str = "rollouts") -> dict:
    """``n_transitions`` of ``act(obs) -> action`` in ``env`` as a D4RL-layout dict (terminated -> terminals,
    truncated or the final cut -> timeouts)."""
    rows = {k: [] for k in KEYS}
    obs, _ = env.reset(seed=seed)
    for i in progress(range(n_transitions), desc=desc):
        action = act(obs)
        nxt, r, term, trunc, _ = env.step(action)
        last = i == n_transitions - 1
        for k, v in (("observations", obs), ("actions", action), ("rewards", r), ("next_observations", nxt),
                     ("terminals", float(term)), ("timeouts", float((trunc or last) and not term))):
            rows[k].append(v)
        obs = nxt
        if term or trunc:
            obs, _ = env.reset()
    return validate({k: np.asarray(v) for k, v in rows.items()})


D4RL_REFS = {"Hopper-v5": (-20.272305, 3234.3), "HalfCheetah-v5": (-280.178953, 12135.0),
             "Walker2d-v5": (1.629008, 4592.3)}
"""D4RL's published random / expert reference returns (d4rl/infos.py REF_MIN_SCORE / REF_MAX_SCORE, v2 tasks),
used only by the smoke tier, which has no SAC run to measure its own."""


def random_dataset(env_id: str, n_transitions: int, seed: int = 0) -> dict:
    """Uniform-random rollouts (no SAC needed), with D4RL's published reference returns registered for the
    normalised score: the smoke tier's stand-in for a recorded dataset."""
    env = make_env(env_id)
    rng = np.random.default_rng(seed + 7)
    data = rollouts(env, lambda o: rng.uniform(-1, 1, size=env.action_space.shape).astype(np.float32),
                    n_transitions, seed)
    lo, hi = D4RL_REFS[env_id]
    register_dataset_refs({"env_id": env_id, "ref_random": lo, "ref_expert": hi})
    return data


def dataset_path(env_id: str, level: str, n_transitions: int, seed: int = 0) -> Path:
    return cache_dir("rl") / f"{env_id.lower()}-{level}-{n_transitions}-s{seed}.npz"


def cached_mujoco_dataset(env_id: str, level: str, n_transitions: int, seed: int = 0) -> tuple[dict, dict]:
    """The recorded dataset and its metadata from the cache; a clear error with the commands when it is missing.
    Registers the dataset's reference returns for ``evaluate_policy``'s normalised score."""
    path = dataset_path(env_id, level, n_transitions, seed)
    if not path.exists():
        raise FileNotFoundError(
            f"no {env_id} {level} dataset at {path}; make it with: python -m icml26.rl.sac train --env {env_id} "
            f"--seed {seed} && python -m icml26.rl.sac record --env {env_id} --level {level} "
            f"--transitions {n_transitions} --seed {seed}")
    data, meta = load_dataset(path)
    register_dataset_refs(meta)
    return data, meta


def register_dataset_refs(meta: dict) -> None:
    """Use a recorded dataset's measured R_random / R_expert for its env's normalised score."""
    REF_RETURNS[str(meta["env_id"])] = {"random": float(meta["ref_random"]), "expert": float(meta["ref_expert"])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="SAC behavior policies and D4RL-layout MuJoCo datasets")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--env", default="Hopper-v5")
    t.add_argument("--steps", type=int, default=150_000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--snapshot-every", type=int, default=10_000)
    r = sub.add_parser("record")
    r.add_argument("--env", default="Hopper-v5")
    r.add_argument("--level", choices=LEVELS, default="medium")
    r.add_argument("--transitions", type=int, default=100_000)
    r.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd == "train":
        res = train_sac(args.env, args.steps, seed=args.seed, snapshot_every=args.snapshot_every)
        print(json.dumps(res))
        return
    rec = record(args.env, args.level, args.transitions, seed=args.seed)
    command = (f"python -m icml26.rl.sac train --env {args.env} --seed {args.seed} && python -m icml26.rl.sac "
               f"record --env {args.env} --level {args.level} --transitions {args.transitions} --seed {args.seed}")
    path = save_dataset(rec["data"], dataset_path(args.env, args.level, args.transitions, args.seed),
                        metadata={**rec["meta"], "command": command})
    print(json.dumps({"path": str(path), "content_hash": content_hash(rec["data"]), **rec["meta"],
                      "transitions": len(rec["data"]["rewards"])}))


if __name__ == "__main__":
    main()
