"""SALAAD hyperparameters. Defaults are the official ones (github.com/HaoMAFRLu/salaad @ 8520042,
``configs/llama_9m.yaml``, ``salaad/adaptive_param.py``, ``salaad/adaptive_rho.py``, ``scripts/resave_model.py``).

Three levels:

* :class:`ControllerConfig`: the adaptive rule of one threshold (alpha on the nuclear norm, beta on the l1 norm).
* :class:`RhoConfig`: the ADMM penalty rho of one block (fixed in the official config).
* :class:`BlockConfig`: everything per weight block X (targets, energy quantile, the two controllers, rho).
* :class:`SALAADConfig`: the trainer-level switches (ADMM every ``num_freq`` steps) and the HPA deployment knobs.

``official_block_config(kind)`` returns the official per-block setting for "linear" (attention and MLP
projections), "embedding" and "lm_head"; the official YAML differs between them only in rho, ``init_energy`` and
the embedding's alpha k_d.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

CONTROLLER_MODES = ("fixed", "adaptive", "hard_cut")
RHO_MODES = ("fixed", "shape_dependent", "adaptive")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _non_negative(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _fraction(value: object, *, closed: bool = True) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (0.0 < value <= 1.0 if closed else 0.0 < value < 1.0)


@dataclass
class ControllerConfig:
    """The adaptive threshold of one block (official class ``PARAM``).

    mode "adaptive": ``value += rho * k_p * (rate - target)`` for updates 1 .. ``switch_after`` - 1, then
    ``value += rho * k_p * (rate - target) + rho * k_d * max(0, rate - previous rate)``. "fixed": the value never
    moves. "hard_cut" (beta only): the value is reset before each S update to rho times the |.|-quantile of
    ``X - L + Y/rho`` that keeps the target density.
    """

    mode: str = field(default="adaptive", metadata={"help": "'fixed', 'adaptive' or 'hard_cut' (PARAM.mode)"})
    init: float = field(default=0.0, metadata={"help": "initial value of the threshold (alpha_dict/beta_dict init: 0)"})
    k_p: float = field(default=0.2, metadata={
        "help": "proportional gain on the rate error ('rate_decay'; 0.2 for alpha, 0.002 for beta in llama_9m.yaml)"})
    k_d: float = field(default=0.01, metadata={
        "help": "gain on the rate increase after the switch ('drate'; 0.01, and 1 for the embedding's alpha)"})
    switch_after: int = field(default=1500, metadata={
        "help": "updates before the k_d term starts (PARAM.start_epoch = 1500, hard-coded in adaptive_param.py)"})

    def __post_init__(self) -> None:
        if self.mode not in CONTROLLER_MODES:
            raise ValueError(f"mode must be one of {CONTROLLER_MODES}, got {self.mode!r}")
        if not (isinstance(self.init, (int, float)) and math.isfinite(self.init)):
            raise ValueError(f"init (the starting threshold) must be a finite number, got {self.init!r}")
        if not _non_negative(self.k_p):
            raise ValueError(f"k_p (rate_decay) must be a finite number >= 0, got {self.k_p!r}")
        if not _non_negative(self.k_d):
            raise ValueError(f"k_d (drate) must be a finite number >= 0, got {self.k_d!r}")
        if not isinstance(self.switch_after, int) or isinstance(self.switch_after, bool) or self.switch_after < 1:
            raise ValueError(f"switch_after must be a positive int, got {self.switch_after!r}")


@dataclass
class RhoConfig:
    """The ADMM penalty of one block (official class ``RHO``).

    "fixed": rho. "shape_dependent": 1 / (n_blocks * sqrt(m * n)). "adaptive": from ADMM update ``start_epoch`` on,
    the tanh ramp rho + (ramp_factor - 1) rho * (1 + tanh(2.944439 (t - ramp_mid) / ramp_width)) / 2 at t = update - 1.
    """

    rho: float = field(default=1e-6, metadata={
        "help": "rho (llama_9m.yaml: 1e-6 attention/MLP, 3e-7 embed_tokens, 6e-8 lm_head)"})
    mode: str = field(default="fixed", metadata={"help": "'fixed', 'shape_dependent' or 'adaptive' (rho_dict.mode)"})
    start_epoch: int = field(default=2, metadata={"help": "ADMM update from which the schedule applies (rho_dict)"})
    ramp_factor: float = field(default=10.0, metadata={
        "help": "adaptive mode: final rho / initial rho (adaptive_rho.py)"})
    ramp_mid: float = field(default=2000.0, metadata={"help": "adaptive mode: update index of the ramp midpoint"})
    ramp_width: float = field(default=100.0, metadata={"help": "adaptive mode: 5%-95% width W of the ramp"})

    def __post_init__(self) -> None:
        if not _positive(self.rho):
            raise ValueError(f"rho must be a positive finite number, got {self.rho!r}")
        if self.mode not in RHO_MODES:
            raise ValueError(f"mode (of rho) must be one of {RHO_MODES}, got {self.mode!r}")
        if not isinstance(self.start_epoch, int) or isinstance(self.start_epoch, bool) or self.start_epoch < 0:
            raise ValueError(f"start_epoch must be an int >= 0, got {self.start_epoch!r}")
        if not _positive(self.ramp_factor):
            raise ValueError(f"ramp_factor must be > 0, got {self.ramp_factor!r}")
        if not (isinstance(self.ramp_mid, (int, float)) and math.isfinite(self.ramp_mid)):
            raise ValueError(f"ramp_mid must be a finite number, got {self.ramp_mid!r}")
        if not _positive(self.ramp_width):
            raise ValueError(f"ramp_width must be > 0, got {self.ramp_width!r}")


@dataclass
class BlockConfig:
    """Per-block setting of X = L + S (one ``layers:`` entry of the official YAML)."""

    rate_rank: float = field(default=0.15, metadata={"help": "target rank ratio r* of L (rate_rank)"})
    rate_sparsity: float = field(default=0.05, metadata={"help": "target density d* of S (rate_sparsity)"})
    energy: float = field(default=0.999, metadata={
        "help": "quantile of the squared spectrum of L that defines its rank ratio for the alpha controller"})
    init_energy: float = field(default=0.15, metadata={
        "help": "> 0: L starts as the rank-int(rate_rank * min(m, n)) SVD of X; 0: L starts at 0 (official YAML: "
                "0.15 attention and lm_head, 0.35 MLP, 0.45 embedding; only its sign is read)"})
    is_init: bool = field(default=False, metadata={
        "help": "start alpha at rho * sigma_k(X), k = ceil(rate_rank * min(m, n)) - 1 (is_init: false)"})
    alpha: ControllerConfig = field(default_factory=lambda: ControllerConfig(k_p=0.2, k_d=0.01))
    beta: ControllerConfig = field(default_factory=lambda: ControllerConfig(k_p=0.002, k_d=0.01))
    rho: RhoConfig = field(default_factory=RhoConfig)

    def __post_init__(self) -> None:
        if not _fraction(self.rate_rank):
            raise ValueError(f"rate_rank must lie in (0, 1], got {self.rate_rank!r}")
        if not _fraction(self.rate_sparsity):
            raise ValueError(f"rate_sparsity must lie in (0, 1], got {self.rate_sparsity!r}")
        if not _fraction(self.energy):
            raise ValueError(f"energy (the spectrum quantile) must lie in (0, 1], got {self.energy!r}")
        if not _non_negative(self.init_energy):
            raise ValueError(f"init_energy must be a finite number >= 0, got {self.init_energy!r}")
        if not isinstance(self.is_init, bool):
            raise ValueError(f"is_init must be a bool, got {self.is_init!r}")
        for name, cls in (("alpha", ControllerConfig), ("beta", ControllerConfig), ("rho", RhoConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if self.alpha.mode == "hard_cut":
            raise ValueError("alpha.mode 'hard_cut' is not defined for the nuclear-norm threshold (official alpha "
                             "stays 0 there); use 'fixed' or 'adaptive'")


@dataclass
class SALAADConfig:
    """Trainer-level switches and the deployment (HPA) knobs."""

    num_freq: int = field(default=2, metadata={"help": "run the ADMM block every num_freq optimizer steps (num_freq)"})
    truncate_init: bool = field(default=False, metadata={
        "help": "replace each selected X by its rank-int(rate_rank * min(m, n)) SVD before training (trainer is_init)"})
    hpa_gamma: float = field(default=0.5, metadata={
        "help": "gamma: share of the parameter reduction taken from L; the rest from S (resave_model.py --gamma 0.5)"})
    hpa_energy: float = field(default=0.999, metadata={
        "help": "quantile of the (unsquared) spectrum of L that sets its deployable rank (uia.py energy_quantile)"})
    hpa_density_rate: float = field(default=1e8, metadata={
        "help": "entries of S with |S| <= max|S| / rate count as zero (UIA rate; resave_model.py passes 1e8)"})

    def __post_init__(self) -> None:
        if not isinstance(self.num_freq, int) or isinstance(self.num_freq, bool) or self.num_freq < 1:
            raise ValueError(f"num_freq must be a positive int, got {self.num_freq!r}")
        if not isinstance(self.truncate_init, bool):
            raise ValueError(f"truncate_init must be a bool, got {self.truncate_init!r}")
        if not (isinstance(self.hpa_gamma, (int, float)) and not isinstance(self.hpa_gamma, bool)
                and 0.0 <= self.hpa_gamma <= 1.0):
            raise ValueError(f"hpa_gamma must lie in [0, 1], got {self.hpa_gamma!r}")
        if not _fraction(self.hpa_energy):
            raise ValueError(f"hpa_energy must lie in (0, 1], got {self.hpa_energy!r}")
        if not _positive(self.hpa_density_rate):
            raise ValueError(f"hpa_density_rate must be > 0, got {self.hpa_density_rate!r}")


_OFFICIAL = {
    # kind: (rho, init_energy, alpha k_d), from configs/llama_9m.yaml
    "linear": (1e-6, 0.15, 0.01),
    "embedding": (3e-7, 0.45, 1.0),
    "lm_head": (6e-8, 0.15, 0.01),
}
BLOCK_KINDS = tuple(_OFFICIAL)


def official_block_config(kind: str = "linear", *, rho_scale: float = 1.0) -> BlockConfig:
    """The official per-block setting of ``kind`` ("linear", "embedding", "lm_head"), rho multiplied by ``rho_scale``.

    The official MLP blocks use init_energy 0.35 instead of 0.15; the code only tests ``init_energy > 0``, so both
    give the same run.
    """
    if kind not in _OFFICIAL:
        raise ValueError(f"kind must be one of {BLOCK_KINDS}, got {kind!r}")
    if not _positive(rho_scale):
        raise ValueError(f"rho_scale must be > 0, got {rho_scale!r}")
    rho, init_energy, alpha_kd = _OFFICIAL[kind]
    return BlockConfig(init_energy=init_energy, alpha=ControllerConfig(k_p=0.2, k_d=alpha_kd),
                       beta=ControllerConfig(k_p=0.002, k_d=0.01), rho=RhoConfig(rho=rho * rho_scale))


def with_rho_scale(config: BlockConfig, rho_scale: float) -> BlockConfig:
    """A copy of ``config`` whose rho is multiplied by ``rho_scale``."""
    if not _positive(rho_scale):
        raise ValueError(f"rho_scale must be > 0, got {rho_scale!r}")
    return dataclasses.replace(config, rho=dataclasses.replace(config.rho, rho=config.rho.rho * rho_scale))
