"""DARE configuration: host defaults from CORL (algorithms/offline/td3_bc.py, algorithms/finetune/iql.py,
algorithms/finetune/cal_ql.py), DARE's reconstructed options (score, posterior fit, exchange, behavior model,
IQL's relaxed objective) named as such. ``corl_defaults(host, antmaze=...)`` gives each host's CORL values."""

from __future__ import annotations

import math
from dataclasses import dataclass

HOSTS = ("td3bc", "iql", "calql")
BEHAVIORS = ("gaussian", "cvae", "diffusion")
CONSTRAINTS = ("dare", "origin", "all", "none")
SCORES = ("kl_mean", "nll", "min_dist")
FITS = ("moments", "em")
EXCHANGES = ("threshold", "stochastic")


@dataclass
class DAREConfig:
    """Offline-to-online TD3+BC with a per-sample choice of which samples keep the BC constraint.

    Host (TD3+BC, CORL defaults unless noted):
        batch_size: N, samples per update (CORL 256).
        discount: gamma (0.99).
        tau: target-network Polyak rate (5e-3).
        actor_lr, critic_lr: Adam learning rates (3e-4 each).
        policy_noise, noise_clip: TD3 target-policy smoothing (0.2, 0.5), in action units (max_action 1).
        policy_freq: actor and target update every this many critic updates (2).
        alpha: TD3+BC's lambda = alpha / mean|Q| weight on the Q term (2.5).
        hidden, layers: MLP width and depth (CORL 256 x 2; the quick tier uses 64 x 2).
        mixing_ratio: rho, fraction of each online-phase batch drawn from D_off (0.5, CORL Cal-QL).
        expl_noise: std of the Gaussian exploration noise online (0.1).
        reward_scale, reward_bias: r' = scale r + bias (bias -1 is CORL's antmaze convention for IQL).

    Which samples keep the constraint online (``constraint``):
        "dare": sample-level, by behavioral consistency (the method); "origin": B_off keeps it, B_on not (the usual
        split DARE argues against); "all": everyone keeps it (plain TD3+BC continued); "none": dropped at the
        switch (plain TD3 online).

    DARE options (all [REC], reconstructed: the official code was not readable):
        score: alignment d(s, a): "kl_mean" = ||a - abar(s)||^2 / 2 with abar the mean of K behavior-model draws
            (KL between unit Gaussians at a and abar), "nll" = -log mu(a|s), "min_dist" = min_k ||a - a_k||^2.
        n_ref_actions: K draws from the behavior model per state.
        fit: "moments" = one Gaussian per origin (B_off, B_on) from the batch's moments; "em" = a 2-component
            Gaussian mixture fitted by EM on the union, initialised from the origin moments.
        exchange: "threshold" = online-like iff posterior p_i > eta; "stochastic" = online-like ~ Bernoulli(p_i).
        eta: the threshold (0.5).
        behavior: the behavior model mu_psi: "gaussian" (diagonal Gaussian BC), "cvae" (BCQ-style CVAE; its
            "nll" score is the negative ELBO) or "diffusion" (a small DDPM, ``rl.nets.DiffusionBehavior``, the
            paper's choice; its "nll" score is the negative L_simple ELBO proxy).
        diffusion_steps: T of the diffusion behavior model (10; Diffusion-QL uses 5).
        guidance_scale: w of the diffusion model's energy guidance toward the host critic's min_j Q_j / mean|Q|
            when drawing reference actions (0 = off, the default; [REC], the paper's energy model is not known).
        bc_steps, bc_lr: behavior-model fitting on D_off before the online phase.

    Host (``host``): "td3bc" (the fields above), "iql" or "calql" (CORL finetune defaults in
    :func:`corl_defaults`; ``actor_lr`` / ``critic_lr`` are the policy / Q learning rates of every host):
        iql_tau: expectile tau of the V loss (0.7 MuJoCo, 0.9 antmaze).
        iql_beta: AWR inverse temperature beta (3 MuJoCo, 10 antmaze); exp_adv_max: clip of exp(beta A) (100).
        relaxed_alpha: [REC] fixed entropy weight of IQL's relaxed actor objective on S_on,
            alpha log pi(a~|s) - Q(s, a~) / mean|Q| (ICLR reviewer Q5: "SAC-style, fixed coefficient").
        cql_alpha, cql_alpha_online: CQL regulariser weight offline / online (10 / 10 MuJoCo, 5 / 5 antmaze).
        cql_n_actions: sampled actions per state in the CQL log-sum-exp (10).
        calibrate: Cal-QL's max(Q, MC return-to-go) on policy actions during offline pretraining (CORL switches
            it off at the online switch); False gives CQL.
        cql_lagrange, cql_target_action_gap: CORL's Lagrange CQL: the regulariser becomes
            alpha' * cql_alpha * (gap - target_action_gap) with alpha' = exp(log alpha') (init e, clamped to
            [0, 1e6]) learned by Adam at ``critic_lr`` to hold the gap at its target (antmaze: on, 0.8).
        cql_max_target_backup: TD target max_k min_j Q'_j(s', a'_k) over ``cql_n_actions`` policy draws (antmaze).
        cql_clip_diff_min: lower clamp of each sample's CQL gap per critic (CORL antmaze -200; -inf = off).
        orthogonal_init: CORL's orthogonal init (gain sqrt 2, zero bias) of the Cal-QL actor and critics.
        critic_layers, actor_layers: hidden layers of the Q networks (and IQL's V network) / the actor (None:
            ``layers``; CORL Cal-QL's actor has 3, its antmaze Q networks 5).
        actor_log_std_offset: CORL Cal-QL's learnable log-std affine map (scale 1, offset this value, CORL -1);
            None: the plain log-std head.

    Every host builds its actor and critics with ``actor_layers`` / ``critic_layers``; the Cal-QL extras
    (Lagrange, max backup, clip, orthogonal init, log-std map) act in the Cal-QL host only.
    """

    batch_size: int = 256
    discount: float = 0.99
    tau: float = 5e-3
    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    policy_noise: float = 0.2
    noise_clip: float = 0.5
    policy_freq: int = 2
    alpha: float = 2.5
    hidden: int = 256
    layers: int = 2
    mixing_ratio: float = 0.5
    expl_noise: float = 0.1
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    constraint: str = "dare"
    score: str = "kl_mean"
    n_ref_actions: int = 10
    fit: str = "moments"
    exchange: str = "threshold"
    eta: float = 0.5
    behavior: str = "gaussian"
    diffusion_steps: int = 10
    guidance_scale: float = 0.0
    bc_steps: int = 2000
    bc_lr: float = 1e-3
    host: str = "td3bc"
    iql_tau: float = 0.7
    iql_beta: float = 3.0
    exp_adv_max: float = 100.0
    relaxed_alpha: float = 0.1
    cql_alpha: float = 10.0
    cql_alpha_online: float = 10.0
    cql_n_actions: int = 10
    calibrate: bool = True
    cql_lagrange: bool = False
    cql_target_action_gap: float = -1.0
    cql_max_target_backup: bool = False
    cql_clip_diff_min: float = -math.inf
    orthogonal_init: bool = False
    critic_layers: int | None = None
    actor_layers: int | None = None
    actor_log_std_offset: float | None = None

    @property
    def actor_depth(self) -> int:
        """Hidden layers of the actor: ``actor_layers``, else ``layers``."""
        return self.actor_layers or self.layers

    @property
    def critic_depth(self) -> int:
        """Hidden layers of each Q network (and IQL's V network): ``critic_layers``, else ``layers``."""
        return self.critic_layers or self.layers

    def __post_init__(self) -> None:
        for name, allowed in (("constraint", CONSTRAINTS), ("score", SCORES), ("fit", FITS), ("exchange", EXCHANGES),
                              ("host", HOSTS), ("behavior", BEHAVIORS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"DAREConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("batch_size", "policy_freq", "hidden", "layers", "n_ref_actions", "cql_n_actions",
                     "diffusion_steps", "critic_layers", "actor_layers"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise ValueError(f"DAREConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("actor_lr", "critic_lr", "bc_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DAREConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.bc_steps < 0:
            raise ValueError(f"DAREConfig.bc_steps must be >= 0, got {self.bc_steps}")
        if not 0 <= self.discount < 1:
            raise ValueError(f"DAREConfig.discount must be in [0, 1), got {self.discount}")
        if not 0 < self.tau <= 1:
            raise ValueError(f"DAREConfig.tau must be in (0, 1], got {self.tau}")
        if not 0 < self.mixing_ratio < 1:
            raise ValueError(f"DAREConfig.mixing_ratio must be in (0, 1), got {self.mixing_ratio}")
        if not 0 < self.eta < 1:
            raise ValueError(f"DAREConfig.eta must be in (0, 1), got {self.eta}")
        for name in ("alpha", "policy_noise", "noise_clip", "expl_noise", "iql_beta", "relaxed_alpha", "cql_alpha",
                     "cql_alpha_online", "guidance_scale"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DAREConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.guidance_scale > 0 and self.behavior != "diffusion":
            raise ValueError(f"DAREConfig.guidance_scale > 0 needs behavior='diffusion', got {self.behavior!r}")
        if not 0 < self.iql_tau < 1:
            raise ValueError(f"DAREConfig.iql_tau must be in (0, 1), got {self.iql_tau}")
        if math.isnan(self.cql_clip_diff_min) or self.cql_clip_diff_min == math.inf:
            raise ValueError(f"DAREConfig.cql_clip_diff_min must be a number below +inf, got {self.cql_clip_diff_min}")
        if not self.exp_adv_max > 0:
            raise ValueError(f"DAREConfig.exp_adv_max must be > 0, got {self.exp_adv_max}")


def corl_defaults(host: str, *, antmaze: bool = False) -> dict:
    """CORL's finetune defaults for ``host`` as DAREConfig fields (``antmaze``: its sparse-reward values).

    td3bc: algorithms/offline/td3_bc.py (lr 3e-4, alpha 2.5). iql: algorithms/finetune/iql.py (lrs 3e-4, tau 0.7 /
    0.9, beta 3 / 10). calql: algorithms/finetune/cal_ql.py (policy lr 3e-5 / 1e-4, Q lr 3e-4, cql_alpha 10 / 5,
    orthogonal init, a 3-layer actor with the learnable log-std map at offset -1) and, for antmaze,
    configs/finetune/cal_ql/antmaze/*.yaml (5-layer Q networks, Lagrange CQL with target gap 0.8, max target
    backup, gap clipped at -200; its reward map 10 r - 5 is the experiment's ``reward_scale`` / ``reward_bias``).
    Widths stay the caller's ``hidden`` (CORL: 256).
    """
    if host not in HOSTS:
        raise ValueError(f"host must be one of {HOSTS}, got {host!r}")
    if host == "td3bc":
        return {"host": host, "actor_lr": 3e-4, "critic_lr": 3e-4, "alpha": 2.5}
    if host == "iql":
        return {"host": host, "actor_lr": 3e-4, "critic_lr": 3e-4, "iql_tau": 0.9 if antmaze else 0.7,
                "iql_beta": 10.0 if antmaze else 3.0}
    base = {"host": host, "critic_lr": 3e-4, "orthogonal_init": True, "actor_layers": 3, "actor_log_std_offset": -1.0}
    if not antmaze:
        return {**base, "actor_lr": 3e-5, "cql_alpha": 10.0, "cql_alpha_online": 10.0}
    return {**base, "actor_lr": 1e-4, "cql_alpha": 5.0, "cql_alpha_online": 5.0, "critic_layers": 5,
            "cql_lagrange": True, "cql_target_action_gap": 0.8, "cql_max_target_backup": True,
            "cql_clip_diff_min": -200.0}
