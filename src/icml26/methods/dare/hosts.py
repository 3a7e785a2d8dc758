"""The IQL and Cal-QL hosts for DARE, each update top to bottom like its paper (CORL's single-file versions,
algorithms/finetune/iql.py and cal_ql.py, read at tinkoff-ai/CORL 1254f0b), with the offline constraint applied
only on the offline-like subset S_off (``keep``):

IQL (Kostrikov et al. 2022):
    V:     L_V = mean_i |tau - 1(u_i < 0)| u_i^2,  u_i = min_j Q'_j(s_i, a_i) - V(s_i)           (all samples)
    Q:     L_Q = 1/2 sum_j mean_i (Q_j(s_i, a_i) - r_i - gamma (1 - d_i) V(s'_i))^2                   (all samples)
    actor: (1/B) sum_i [ keep_i min(exp(beta u_i), M) (-log pi(a_i|s_i))                         (constrained, AWR)
                        + (1 - keep_i) (alpha log pi(a~_i|s_i) - Q(s_i, a~_i) / mean|Q|) ]  a~ ~ pi  (relaxed) [REC]
Cal-QL (Nakamoto et al. 2023) = SAC + CQL regulariser with calibration:
    actor: SAC, mean_i (alpha_SAC log pi(a~_i|s_i) - min_j Q_j(s_i, a~_i)), automatic alpha_SAC     (all samples)
    Q:     TD (no entropy backup; optionally CQL's max target backup) on all samples
           + cql_alpha (1/B) sum_i keep_i [ logsumexp_k (Q(s_i, a_k) - log q(a_k)) - Q(s_i, a_i) ]  (S_off only)
           with Q(s_i, a_k) <- max(Q(s_i, a_k), G_i) on policy actions while calibrating (offline; G the MC return);
           with ``cql_lagrange`` the gap is weighted by a learned alpha' that holds it at a target (CORL antmaze)

``keep`` all True is the unmodified host (CORL IQL / Cal-QL); tests hold both to that and to the reference.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F

from ...rl.nets import IQLGaussianActor, TanhGaussianActor, TwinQ, ValueNet, orthogonal_init_, soft_update
from .config import DAREConfig
from .trainer import DAREHost, DARETD3BC


class DAREIQL(DAREHost):
    """IQL host: expectile V, TD Q through V(s'), AWR actor on S_off and a relaxed entropy-regularised actor on S_on
    (see the module docstring). Exploration online samples the Gaussian policy, as CORL's IQL finetune does."""

    modules = ("actor", "critic", "critic_target", "value", "actor_opt", "critic_opt", "value_opt")

    def _build(self, obs_dim: int, act_dim: int) -> None:
        c = self.config
        self.actor = IQLGaussianActor(obs_dim, act_dim, c.hidden, c.actor_depth).to(self.device)
        self.critic = TwinQ(obs_dim, act_dim, c.hidden, c.critic_depth).to(self.device)
        self.critic_target = copy.deepcopy(self.critic)
        self.value = ValueNet(obs_dim, c.hidden, c.critic_depth).to(self.device)  # V is a critic too
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=c.actor_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=c.critic_lr)
        self.value_opt = torch.optim.Adam(self.value.parameters(), lr=c.critic_lr)

    def value_loss(self, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Expectile regression of V on min_j Q'_j; also returns the advantage u = Q' - V (detached)."""
        with torch.no_grad():
            target_q = torch.min(*self.critic_target(b["observations"], b["actions"]))
        u = target_q - self.value(b["observations"])
        weight = torch.abs(self.config.iql_tau - (u < 0).to(u.dtype))
        return (weight * u.pow(2)).mean(), u.detach()

    def q_loss(self, b: dict) -> torch.Tensor:
        with torch.no_grad():
            y = b["rewards"] + self.config.discount * (1 - b["dones"]) * self.value(b["next_observations"])
        q1, q2 = self.critic(b["observations"], b["actions"])
        return (F.mse_loss(q1, y) + F.mse_loss(q2, y)) / 2

    def actor_loss(self, b: dict, adv: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """AWR on ``keep``, the relaxed objective on the rest; (1/B) over the whole batch."""
        c = self.config
        obs = b["observations"]
        mean = self.actor(obs)
        keep_f = keep.to(mean.dtype)
        exp_adv = torch.exp(c.iql_beta * adv).clamp(max=c.exp_adv_max)
        awr = exp_adv * -self.actor.log_prob(obs, b["actions"], mean)
        if bool(keep.all()):
            return awr.mean()  # skip the relaxed pass (and its random draw) when nothing is relaxed
        a_tilde, logp = self.actor.rsample(obs, self.gen)
        q = torch.min(*self.critic(obs, a_tilde.clamp(-1.0, 1.0)))
        relaxed = c.relaxed_alpha * logp - q / q.abs().mean().detach().clamp_min(1e-6)
        return (keep_f * awr + (1 - keep_f) * relaxed).mean()

    def update(self, b: dict, keep: torch.Tensor) -> dict:
        """CORL IQL's order: V, then Q (through the new V), then the actor, then the Q target."""
        loss_v, adv = self.value_loss(b)
        self.value_opt.zero_grad(set_to_none=True)
        loss_v.backward()
        self.value_opt.step()
        loss_q = self.q_loss(b)
        self.critic_opt.zero_grad(set_to_none=True)
        loss_q.backward()
        self.critic_opt.step()
        loss_pi = self.actor_loss(b, adv, keep)
        self.actor_opt.zero_grad(set_to_none=True)
        loss_pi.backward()
        self.actor_opt.step()
        soft_update(self.critic_target, self.critic, self.config.tau)
        self.n_updates += 1
        return {"value_loss": float(loss_v.detach()), "critic_loss": float(loss_q.detach()),
                "actor_loss": float(loss_pi.detach())}

    def explore(self, obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        with torch.no_grad():
            std = self.actor.log_std.clamp(-20.0, 2.0).exp().cpu().numpy()
        return np.clip(self.act(obs) + std * rng.normal(size=self.act_dim), -1, 1).astype(np.float32)


class DARECalQL(DAREHost):
    """Cal-QL host (CQL with calibration; SAC actor with automatic entropy): the CQL regulariser applies on S_off
    only (see the module docstring). Batches need ``mc_returns`` while calibrating: build the offline buffer with
    ``OfflineBuffer(data, mc_discount=config.discount, ...)``."""

    modules = ("actor", "critic", "critic_target", "actor_opt", "critic_opt", "alpha_opt", "alpha_prime_opt")

    def _build(self, obs_dim: int, act_dim: int) -> None:
        c = self.config
        self.actor = TanhGaussianActor(obs_dim, act_dim, c.hidden, c.actor_depth,
                                       log_std_offset=c.actor_log_std_offset).to(self.device)
        self.critic = TwinQ(obs_dim, act_dim, c.hidden, c.critic_depth).to(self.device)
        if c.orthogonal_init:
            orthogonal_init_(self.actor)
            orthogonal_init_(self.critic)
        self.critic_target = copy.deepcopy(self.critic)
        self.log_alpha = torch.zeros(1, device=self.device, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=c.actor_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=c.critic_lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=c.actor_lr)  # CORL: the policy lr
        # CORL's Lagrange multiplier of the CQL gap: log alpha' starts at 1 and steps at the Q lr
        self.log_alpha_prime = torch.ones(1, device=self.device, requires_grad=True)
        self.alpha_prime_opt = torch.optim.Adam([self.log_alpha_prime], lr=c.critic_lr)
        self.calibrating = c.calibrate

    def start_online(self) -> None:
        super().start_online()
        self.calibrating = False  # CORL's switch_calibration() at the online switch

    def actor_and_alpha_loss(self, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
        obs = b["observations"]
        a_tilde, logp = self.actor.sample(obs, generator=self.gen)
        alpha_loss = -(self.log_alpha * (logp + self.target_entropy).detach()).mean()
        alpha = self.log_alpha.exp().detach()
        q = torch.min(*self.critic(obs, a_tilde))
        return (alpha * logp - q).mean(), alpha_loss

    def _q_many(self, obs: torch.Tensor, acts: torch.Tensor, critic: TwinQ | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q_j(s_i, a_{k,i}) for acts (K, B, A) -> two (B, K) tensors (``critic``: default the online critic)."""
        k = acts.shape[0]
        critic = self.critic if critic is None else critic
        q1, q2 = critic(obs.unsqueeze(0).expand(k, *obs.shape).reshape(-1, obs.shape[-1]),
                        acts.reshape(-1, acts.shape[-1]))
        return q1.view(k, -1).T, q2.view(k, -1).T

    def cql_terms(self, b: dict, q_data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Per-sample CQL gap summed over the two critics, (B,), with K = ``cql_n_actions`` fresh draws of uniform,
        current-policy and next-state-policy actions (see :meth:`cql_gap`)."""
        obs, nobs = b["observations"], b["next_observations"]
        k, bsz = self.config.cql_n_actions, obs.shape[0]
        rand = torch.rand((k, bsz, self.act_dim), generator=self.gen, device=self.device) * 2 - 1
        with torch.no_grad():
            cur, cur_lp = self.actor.sample(obs, k, self.gen)
            nxt, nxt_lp = self.actor.sample(nobs, k, self.gen)
        lower = b["mc_returns"] if self.calibrating else None
        return self.cql_gap(obs, q_data, rand, (cur, cur_lp), (nxt, nxt_lp), lower)

    def cql_gap(self, obs: torch.Tensor, q_data: tuple[torch.Tensor, torch.Tensor], rand: torch.Tensor,
                cur: tuple[torch.Tensor, torch.Tensor], nxt: tuple[torch.Tensor, torch.Tensor],
                lower: torch.Tensor | None) -> torch.Tensor:
        """sum_j [ logsumexp over {Q_j(s, u_k) - log 0.5^A, max(Q_j(s, a'_k), G) - log pi(a'_k|s'),
        max(Q_j(s, a_k), G) - log pi(a_k|s)} - Q_j(s, a) ]: CQL's importance-sampled gap (CORL
        ``cql_importance_sample``) with Cal-QL's calibration by G = ``lower`` (None: no calibration).
        rand, cur[0], nxt[0]: (K, B, A) actions; cur[1], nxt[1]: (K, B) their log-densities; q_data: (B,) each."""
        rand_q, cur_q, nxt_q = self._q_many(obs, rand), self._q_many(obs, cur[0]), self._q_many(obs, nxt[0])
        rand_density = math.log(0.5 ** self.act_dim)
        out = []
        for j in range(2):
            qc, qn = cur_q[j], nxt_q[j]
            if lower is not None:
                qc, qn = torch.maximum(qc, lower.unsqueeze(-1)), torch.maximum(qn, lower.unsqueeze(-1))
            cat = torch.cat((rand_q[j] - rand_density, qn - nxt[1].T, qc - cur[1].T), 1)
            gap = torch.logsumexp(cat, 1) - q_data[j]
            if self.config.cql_clip_diff_min > -math.inf:  # CORL's cql_clip_diff_min (antmaze -200)
                gap = gap.clamp(min=self.config.cql_clip_diff_min)
            out.append(gap)
        return out[0] + out[1]

    def td_target(self, b: dict) -> torch.Tensor:
        """r + gamma (1 - d) min_j Q'_j(s', a'), a' ~ pi(.|s') (no entropy backup, as CORL); with
        ``cql_max_target_backup`` the max over ``cql_n_actions`` draws a'_k of min_j Q'_j(s', a'_k). (B,)"""
        c, nobs = self.config, b["next_observations"]
        with torch.no_grad():
            if c.cql_max_target_backup:
                next_a, _ = self.actor.sample(nobs, c.cql_n_actions, self.gen)
                target = torch.min(*self._q_many(nobs, next_a, self.critic_target)).max(1).values
            else:
                next_a, _ = self.actor.sample(nobs, generator=self.gen)
                target = torch.min(*self.critic_target(nobs, next_a))
            return b["rewards"] + c.discount * (1 - b["dones"]) * target

    def q_loss(self, b: dict, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """TD loss of both critics + the CQL regulariser on S_off (``keep``), and the Lagrange multiplier's loss
        (None without ``cql_lagrange``). The regulariser is weight (1/B) sum_i keep_i gap_i, or with Lagrange
        alpha' weight (1/B) sum_i keep_i (gap_i - 2 target_gap) (gap_i sums the two critics; keep = 1 is CORL's
        per-critic alpha' weight (mean gap_j - target_gap)); alpha' is held fixed in the critic's loss and its own
        loss is -1/2 of the same term with the gap held fixed, as CORL's."""
        c = self.config
        y = self.td_target(b)
        q1, q2 = self.critic(b["observations"], b["actions"])
        td = F.mse_loss(q1, y) + F.mse_loss(q2, y)
        weight = c.cql_alpha_online if self.online else c.cql_alpha
        if weight == 0 or not bool(keep.any()):
            return td, None
        keep_f = keep.to(q1.dtype)
        if not c.cql_lagrange:
            return td + weight * (keep_f * self.cql_terms(b, (q1, q2))).mean(), None
        term = (keep_f * (self.cql_terms(b, (q1, q2)) - 2 * c.cql_target_action_gap)).mean()
        alpha_prime = self.log_alpha_prime.exp().clamp(0.0, 1e6)
        return td + alpha_prime.detach() * weight * term, -0.5 * alpha_prime * weight * term.detach()

    def update(self, b: dict, keep: torch.Tensor) -> dict:
        """CORL Cal-QL's order: actor and alpha losses, Q loss, then the alpha, actor and critic steps, targets."""
        if self.calibrating and "mc_returns" not in b:
            raise ValueError("Cal-QL calibration needs 'mc_returns' in the batch: build the offline buffer with "
                             "OfflineBuffer(data, mc_discount=config.discount)")
        loss_pi, loss_alpha = self.actor_and_alpha_loss(b)
        loss_q, loss_alpha_prime = self.q_loss(b, keep)
        if loss_alpha_prime is not None:
            self.alpha_prime_opt.zero_grad(set_to_none=True)
            loss_alpha_prime.backward()
            self.alpha_prime_opt.step()
        self.alpha_opt.zero_grad(set_to_none=True)
        loss_alpha.backward()
        self.alpha_opt.step()
        self.actor_opt.zero_grad(set_to_none=True)
        loss_pi.backward()
        self.actor_opt.step()
        self.critic_opt.zero_grad(set_to_none=True)
        loss_q.backward()
        self.critic_opt.step()
        soft_update(self.critic_target, self.critic, self.config.tau)
        self.n_updates += 1
        return {"critic_loss": float(loss_q.detach()), "actor_loss": float(loss_pi.detach())}

    def explore(self, obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        with torch.no_grad():
            mean, log_std = self.actor.dist_params(torch.as_tensor(obs, dtype=torch.float32, device=self.device)[None])
        u = mean[0].cpu().numpy() + log_std[0].exp().cpu().numpy() * rng.normal(size=self.act_dim)
        return np.tanh(u).astype(np.float32)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "log_alpha": self.log_alpha.detach().clone(),
                "log_alpha_prime": self.log_alpha_prime.detach().clone(), "calibrating": self.calibrating}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
            self.log_alpha_prime.copy_(state["log_alpha_prime"])
        self.calibrating = bool(state["calibrating"])


HOST_CLASSES = {"td3bc": DARETD3BC, "iql": DAREIQL, "calql": DARECalQL}


def make_agent(obs_dim: int, act_dim: int, config: DAREConfig, device: torch.device | str = "cpu",
               seed: int = 0) -> DAREHost:
    """The host named by ``config.host`` with DARE's constraint mask (``config.constraint``)."""
    return HOST_CLASSES[config.host](obs_dim, act_dim, config, device, seed)
