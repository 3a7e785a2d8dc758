"""Offline-to-online RL with DARE's sample-level constraint release, top to bottom like the paper's loop (the
TD3+BC host here; IQL and Cal-QL in ``hosts.py``, all on :class:`DAREHost`):

    pretrain the host offline on D_off
    fit the behavior model mu_psi on D_off
    for each online step:
        act with pi + noise, store in D_on
        B = B_off (rho N from D_off) + B_on ((1 - rho) N from D_on)
        d = alignment score of every sample;  p = posterior online-like;  S_off = exchange(p)
        critic: TD3 loss on all of B;  actor: -lambda Q on all of B, BC term on S_off only   (TD3+BC host)

The four arms differ only in S_off (see ``DAREConfig.constraint``). Checkpoints (atomic) are taken at the first
episode end after every ``checkpoint_every`` online steps and hold everything (networks, optimisers, both
buffers' online part, every random generator, the env's random state), so a killed run resumes bit-identically.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ...core.progress import progress
from ...rl.buffers import OfflineBuffer, OnlineBuffer, mixed_batch
from ...rl.checkpoint import load_checkpoint, online_run_state, restore_online_run, save_checkpoint
from ...rl.evaluation import evaluate_policy
from ...rl.nets import CVAE, Actor, DiffusionBehavior, GaussianPolicy, TwinQ, soft_update
from .config import DAREConfig
from .dare import alignment_score, constrained_mask, fit_gaussians, posterior_online, separation


class DAREHost:
    """What every host shares: the behavior model mu_psi and its fitting, DARE's per-batch split into S_off / S_on,
    offline pretraining (constraint on every sample), acting, and the checkpoint state. A host adds its networks
    in ``_build`` (listing them in ``modules``) and its masked update ``update(batch, keep)``.

    Args:
        obs_dim, act_dim: sizes (actions in [-1, 1]^act_dim).
        config: :class:`DAREConfig`.
        device: any torch device.
        seed: seeds the networks' init and the sampling generator.
    """

    modules: tuple[str, ...] = ()

    def __init__(self, obs_dim: int, act_dim: int, config: DAREConfig, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        if not isinstance(config, DAREConfig):
            raise TypeError(f"config must be a DAREConfig, got {type(config).__name__}")
        if int(obs_dim) < 1 or int(act_dim) < 1:
            raise ValueError(f"obs_dim and act_dim must be >= 1, got {obs_dim}, {act_dim}")
        self.config, self.device = config, torch.device(device)
        self.obs_dim, self.act_dim = int(obs_dim), int(act_dim)
        torch.manual_seed(seed)
        self._build(obs_dim, act_dim)
        c = config
        if c.behavior == "diffusion":
            self.behavior = DiffusionBehavior(obs_dim, act_dim, c.hidden, c.layers, n_steps=c.diffusion_steps)
        else:
            self.behavior = (GaussianPolicy if c.behavior == "gaussian" else CVAE)(obs_dim, act_dim, c.hidden,
                                                                                    c.layers)
        self.behavior = self.behavior.to(self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.n_updates = 0
        self.online = False

    def _build(self, obs_dim: int, act_dim: int) -> None:
        raise NotImplementedError

    def update(self, b: dict, keep: torch.Tensor) -> dict:
        raise NotImplementedError

    def start_online(self) -> None:
        """Called at the offline-to-online switch (Cal-QL switches calibration off there, as CORL does)."""
        self.online = True

    def explore(self, obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The online behavior action: the deterministic action plus Gaussian noise ``expl_noise`` (TD3), clipped."""
        return np.clip(self.act(obs) + rng.normal(0.0, self.config.expl_noise, size=self.act_dim), -1, 1
                       ).astype(np.float32)

    def act(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.actor(torch.as_tensor(obs, dtype=torch.float32, device=self.device)[None])[0].cpu().numpy()

    # -- phases ------------------------------------------------------------------------------------------------
    def pretrain(self, offline: OfflineBuffer, steps: int) -> None:
        """Offline training of the host (its constraint on every sample)."""
        keep = torch.ones(self.config.batch_size, dtype=torch.bool, device=self.device)
        for _ in progress(range(steps), desc=f"offline {self.config.host}"):
            self.update(offline.sample(self.config.batch_size, self.gen), keep)

    def fit_behavior(self, offline: OfflineBuffer, steps: int | None = None) -> float:
        """Fit the behavior model mu_psi(a|s) on D_off (Gaussian: max likelihood; CVAE: BCQ's ELBO loss); returns
        the final loss."""
        opt = torch.optim.Adam(self.behavior.parameters(), lr=self.config.bc_lr)
        loss_v = math.nan
        for _ in range(self.config.bc_steps if steps is None else steps):
            b = offline.sample(self.config.batch_size, self.gen)
            loss = self.behavior.fit_loss(b["observations"], b["actions"], self.gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_v = float(loss.detach())
        return loss_v

    def split(self, b: dict, from_offline: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """S_off mask for this arm, plus DARE's diagnostics (fraction of B_off released, fraction of B_on kept,
        score separation d' under the origin labels and under the exchanged labels)."""
        c = self.config
        diag: dict = {}
        p = None
        # scores are only needed by DARE (the other arms skip them: they cost a behavior-model pass per update)
        if c.constraint == "dare" and from_offline.any() and (~from_offline).any():
            beh = _EnergyGuided(self.behavior, self._energy, c.guidance_scale) if c.guidance_scale > 0 \
                else self.behavior
            d = alignment_score(beh, b["observations"], b["actions"], c.score, c.n_ref_actions, self.gen)
            p = posterior_online(d, fit_gaussians(d, from_offline, fit=c.fit))
        keep = constrained_mask(c.constraint if p is not None or c.constraint != "dare" else "origin",
                                from_offline, p, mode=c.exchange, eta=c.eta, generator=self.gen)
        if p is not None:
            dare_keep = keep
            diag = {"released": float((from_offline & ~dare_keep).sum() / from_offline.sum()),
                    "kept_online": float((~from_offline & dare_keep).sum() / (~from_offline).sum()),
                    "sep_origin": separation(d, from_offline), "sep_exchange": separation(d, dare_keep)}
        return keep, diag


    def _energy(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """The diffusion model's guidance energy: min_j Q_j(s, a) / mean|Q| (scale-free, so ``guidance_scale``
        means the same for every reward scale); every host has a twin ``critic``."""
        q = torch.min(*self.critic(obs, act))
        return q / q.detach().abs().mean().clamp_min(1e-6)

    # -- checkpoint --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        mods = (*self.modules, "behavior")
        return {**{m: getattr(self, m).state_dict() for m in mods}, "gen": self.gen.get_state(),
                "n_updates": self.n_updates, "online": self.online, "config": asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        # torch's Optimizer.load_state_dict keeps the given Adam moment and step tensors (no copy) when their dtype
        # and device already match, so training would update ``state`` in place, and the next agent loaded from
        # the same in-memory state (the next arm from one offline start) would begin from the moments this one
        # ended with. Copy first: loading never ties the agent to the caller's tensors.
        state = copy.deepcopy(state)
        for m in (*self.modules, "behavior"):
            getattr(self, m).load_state_dict(state[m])
        self.gen.set_state(state["gen"])
        self.n_updates = int(state["n_updates"])
        self.online = bool(state.get("online", False))


class DARETD3BC(DAREHost):
    """TD3+BC host with a per-sample constraint mask (see :class:`DAREHost` for the arguments)."""

    modules = ("actor", "critic", "actor_target", "critic_target", "actor_opt", "critic_opt")

    def _build(self, obs_dim: int, act_dim: int) -> None:
        c = self.config
        self.actor = Actor(obs_dim, act_dim, c.hidden, c.actor_depth).to(self.device)
        self.critic = TwinQ(obs_dim, act_dim, c.hidden, c.critic_depth).to(self.device)
        self.actor_target, self.critic_target = copy.deepcopy(self.actor), copy.deepcopy(self.critic)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=c.actor_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=c.critic_lr)

    # -- losses ------------------------------------------------------------------------------------------------
    def critic_loss(self, b: dict) -> torch.Tensor:
        """TD3: y = r + gamma (1 - done) min_j Q'_j(s', pi'(s') + clip(noise)); MSE for both critics."""
        c = self.config
        with torch.no_grad():
            noise = (torch.randn(b["actions"].shape, generator=self.gen, device=self.device) * c.policy_noise
                     ).clamp(-c.noise_clip, c.noise_clip)
            next_a = (self.actor_target(b["next_observations"]) + noise).clamp(-1.0, 1.0)
            tq1, tq2 = self.critic_target(b["next_observations"], next_a)
            y = b["rewards"] + c.discount * (1 - b["dones"]) * torch.min(tq1, tq2)
        q1, q2 = self.critic(b["observations"], b["actions"])
        return F.mse_loss(q1, y) + F.mse_loss(q2, y)

    def actor_loss(self, b: dict, keep: torch.Tensor) -> torch.Tensor:
        """(1/B) sum_i [-lambda Q1(s_i, pi(s_i)) + keep_i ||pi(s_i) - a_i||^2 / A], lambda = alpha / mean|Q|.
        ``keep`` all True is TD3+BC, all False is TD3 (reference: reference.td3bc_actor_loss)."""
        pi = self.actor(b["observations"])
        q = self.critic.q1(torch.cat((b["observations"], pi), -1)).squeeze(-1)
        lam = self.config.alpha / q.abs().mean().detach()
        bc = (pi - b["actions"]).pow(2).mean(-1)
        return (-lam * q + keep.to(bc.dtype) * bc).mean()

    def update(self, b: dict, keep: torch.Tensor) -> dict:
        """One TD3 step: critic on all samples; every ``policy_freq`` steps the actor (masked BC) and targets."""
        loss_q = self.critic_loss(b)
        self.critic_opt.zero_grad(set_to_none=True)
        loss_q.backward()
        self.critic_opt.step()
        self.n_updates += 1
        out = {"critic_loss": float(loss_q.detach())}
        if self.n_updates % self.config.policy_freq == 0:
            loss_pi = self.actor_loss(b, keep)
            self.actor_opt.zero_grad(set_to_none=True)
            loss_pi.backward()
            self.actor_opt.step()
            soft_update(self.critic_target, self.critic, self.config.tau)
            soft_update(self.actor_target, self.actor, self.config.tau)
            out["actor_loss"] = float(loss_pi.detach())
        return out


def finetune(agent: DAREHost, env, eval_env, offline: OfflineBuffer, online_steps: int, *, eval_every: int,
             eval_episodes: int, seed: int, checkpoint: str | Path | None = None, checkpoint_every: int = 1000,
             stop_after: int | None = None) -> dict:
    """The online phase (UTD 1). Returns ``{"curve": [[step, normalized], ...], "diag": {...means...},
    "steps_done"}``. With ``checkpoint`` set, resumes from it when present. ``stop_after`` ends the call early
    (as a kill would), for the resume test."""
    if not isinstance(agent, DAREHost):
        raise TypeError(f"agent must be a DAREHost (make_agent), got {type(agent).__name__}")
    for name, v in (("online_steps", online_steps), ("eval_every", eval_every), ("eval_episodes", eval_episodes),
                    ("checkpoint_every", checkpoint_every)):
        if int(v) < 1:
            raise ValueError(f"finetune: {name} must be >= 1, got {v}")
    c = agent.config
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    if (obs_dim, act_dim) != (agent.obs_dim, agent.act_dim):
        raise ValueError(f"finetune: the env has obs/action dims {(obs_dim, act_dim)} but the agent was built for "
                         f"{(agent.obs_dim, agent.act_dim)}")
    if (offline._t["observations"].shape[1], offline._t["actions"].shape[1]) != (obs_dim, act_dim):
        raise ValueError("finetune: the offline dataset's observation/action dims do not match the env's")
    buf = OnlineBuffer(obs_dim, act_dim, max(online_steps, 1), agent.device, reward_scale=c.reward_scale,
                       reward_bias=c.reward_bias)
    rng = np.random.default_rng(seed + 2)
    agent.start_online()
    step, last_ckpt, curve, diags = 0, 0, [], []
    state = load_checkpoint(checkpoint) if checkpoint is not None else None
    if state is not None:
        step = last_ckpt = restore_online_run(state, agent, buf, rng, env)
        curve, diags = state["curve"], state["diags"]
        obs, _ = env.reset()
    else:
        curve.append([0, evaluate_policy(eval_env, agent.act, eval_episodes, seed=10_000 + seed)["normalized"]])
        obs, _ = env.reset(seed=seed)
    bar = progress(range(step, online_steps), desc=f"online [{c.constraint}]", total=online_steps - step)
    for step in bar:
        action = agent.explore(obs, rng)
        nxt, r, terminated, truncated, _ = env.step(action)
        buf.add(obs, action, r, nxt, terminated)
        obs = nxt
        batch, from_offline = mixed_batch(offline, buf, c.batch_size, c.mixing_ratio, agent.gen)
        keep, diag = agent.split(batch, from_offline)
        agent.update(batch, keep)
        if diag:
            diags.append(diag)
        done_steps = step + 1
        if done_steps % eval_every == 0 or done_steps == online_steps:
            curve.append([done_steps, evaluate_policy(eval_env, agent.act, eval_episodes,
                                                      seed=10_000 + seed)["normalized"]])
        if terminated or truncated:
            if checkpoint is not None and done_steps - last_ckpt >= checkpoint_every:
                # taken right before the reset, so the resumed run's reset draws the same start
                save_checkpoint(checkpoint, online_run_state(agent, buf, rng, env, done_steps, curve=curve,
                                                             diags=diags))
                last_ckpt = done_steps
            obs, _ = env.reset()
        if stop_after is not None and done_steps >= stop_after:
            return {"curve": curve, "diag": _mean_diag(diags), "steps_done": done_steps}
    return {"curve": curve, "diag": _mean_diag(diags), "steps_done": online_steps}


def _mean_diag(diags: list[dict]) -> dict:
    keys = {k for d in diags for k in d}
    return {k: float(np.nanmean([d[k] for d in diags if k in d])) if diags else math.nan for k in sorted(keys)}


class _EnergyGuided:
    """A diffusion behavior model whose ``sample`` is energy-guided (``log_prob`` unchanged), for
    :func:`alignment_score`."""

    def __init__(self, model: DiffusionBehavior, energy, scale: float) -> None:
        self.model, self.energy, self.scale = model, energy, scale

    def sample(self, obs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.model.sample(obs, n, generator, energy=self.energy, guidance_scale=self.scale)

    def log_prob(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        return self.model.log_prob(obs, act)
