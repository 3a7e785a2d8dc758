"""AdaMeZO hyperparameters. Defaults are the official code's (github.com/shawnnn3di/AdaMeZO @ 4412153)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class AdaMeZOConfig:
    """Hyperparameters of MeZO / AdaMeZO; ``window=0`` is plain MeZO.

    Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field.
    """

    lr: float = field(default=1e-7, metadata={"help": "learning rate eta; README example for OPT-1.3B SST-2 is 1e-7"})
    eps: float = field(default=1e-3, metadata={"help": "SPSA perturbation scale epsilon (MeZO default, run.py zo_eps)"})
    betas: tuple[float, float] = field(default=(0.7, 0.9), metadata={
        "help": "(beta1, beta2) window decay of the first and second moment (run.py defaults); beta2=0 -> v := 1"})
    window: int = field(default=10, metadata={
        "help": "h, number of (seed, projected gradient) pairs replayed (HESS_WINDOW=10); 0 or 1 -> MeZO"})
    weight_decay: float = field(default=0.0, metadata={
        "help": "lambda, decoupled weight decay added to the update (HF default 0); see zo_param_groups for exclusions"})
    direction_scale: float = field(default=100.0, metadata={
        "help": "constant multiplying m / (sqrt(v) + adam_eps) in the official update (trainer.py), absorbed into lr"})
    adam_eps: float = field(default=1e-5, metadata={"help": "added outside the square root of v (trainer.py)"})
    seed: int = field(default=0, metadata={"help": "base seed; the perturbation seed of step t derives from (seed, t)"})

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps (the perturbation scale) must be a positive finite number, got {self.eps!r}")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        for name, beta in zip(("betas[0] (beta1)", "betas[1] (beta2)"), self.betas):
            if not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
                raise ValueError(f"{name} must lie in [0, 1), got {beta!r}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ValueError(f"window must be a non-negative int (0 or 1 means plain MeZO), got {self.window!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not (isinstance(self.direction_scale, (int, float)) and self.direction_scale > 0):
            raise ValueError(f"direction_scale must be > 0, got {self.direction_scale!r}")
        if not (isinstance(self.adam_eps, (int, float)) and self.adam_eps > 0):
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

    @property
    def adaptive(self) -> bool:
        """False when the window is too short for moments (h < 2): the official code then runs MeZO."""
        return self.window >= 2
