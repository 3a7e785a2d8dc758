"""DARE configuration: TD3+BC host defaults from CORL (algorithms/offline/td3_bc.py, finetune defaults), DARE's
reconstructed options (score, posterior fit, exchange) named as such."""

from __future__ import annotations

from dataclasses import dataclass

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
        bc_steps, bc_lr: behavior-model (Gaussian BC) fitting on D_off before the online phase.
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
    bc_steps: int = 2000
    bc_lr: float = 1e-3

    def __post_init__(self) -> None:
        for name, allowed in (("constraint", CONSTRAINTS), ("score", SCORES), ("fit", FITS), ("exchange", EXCHANGES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"DAREConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("batch_size", "policy_freq", "hidden", "layers", "n_ref_actions"):
            if int(getattr(self, name)) < 1:
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
        for name in ("alpha", "policy_noise", "noise_clip", "expl_noise"):
            if getattr(self, name) < 0:
                raise ValueError(f"DAREConfig.{name} must be >= 0, got {getattr(self, name)}")
