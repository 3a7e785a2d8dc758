"""CSPLoRA planner options. The paper's text beyond its abstract was not available, so every field below is a
documented reconstruction choice (README, "Fidelity"); the defaults are our reading, not the paper's numbers."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

WEIGHTINGS = ("focal", "entropy", "none")
IMPORTANCES = ("fisher", "taylor")
SIZE_NORMS = ("none", "sqrt", "numel")
ALPHA_MODES = ("proportional", "constant")


@dataclass
class CSPLoRAConfig:
    """How CSPLoRA weights probe samples, scores modules and turns scores into ranks.

    ``weighting="none"`` gives the unweighted-importance plan; ``kappa=0`` gives uniform LoRA exactly.
    Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field.
    """

    weighting: str = field(default="focal", metadata={
        "help": "sample weight from the probe's prediction: 'focal' w = (1 - c)^gamma with c = p(y|x) "
                "(abstract: 'reweights probe samples by prediction uncertainty'), 'entropy' w = H(p)/log K, "
                "'none' w = 1 (the unweighted baseline). Weights are normalised to mean 1 over the probe set"})
    gamma: float = field(default=1.0, metadata={
        "help": "exponent of (1 - c) for weighting='focal'; 1 weights by the probability of error, larger values "
                "concentrate on the hardest samples (reconstruction: not in the abstract)"})
    importance: str = field(default="fisher", metadata={
        "help": "per-sample module score: 'fisher' ||dl/dW||_F^2 or 'taylor' sum |W * dl/dW| (both are common "
                "sensitivity scores; which one the paper uses is unknown)"})
    size_norm: str = field(default="numel", metadata={
        "help": "divide a module's score by 1 ('none'), sqrt(numel) ('sqrt') or numel(W) ('numel'); 'numel' scores "
                "the mean per weight, so a large matrix is not favoured twice (its rank already costs more)"})
    kappa: float = field(default=1.0, metadata={
        "help": "sharpness of the plan: proportion pi_m = I_m^kappa / sum_j I_j^kappa; 0 is uniform LoRA"})
    r_min: int = field(default=1, metadata={
        "help": "smallest rank a planned module gets; 0 lets the plan drop a module (it is then not adapted)"})
    r_max: int | None = field(default=None, metadata={
        "help": "largest rank of any module; None caps each module at min(d_in, d_out), where LoRA is full rank"})
    alpha_mode: str = field(default="proportional", metadata={
        "help": "'proportional': alpha_m = alpha_ratio * r_m, so alpha/r (LoRA's scale) is the same in every module "
                "as in uniform LoRA; 'constant': alpha_m = alpha_ratio * mean rank for every module"})
    alpha_ratio: float = field(default=2.0, metadata={
        "help": "alpha / r of the deployed adapters (alpha = 2r is the common LoRA setting)"})

    def __post_init__(self) -> None:
        for name in ("gamma", "kappa", "alpha_ratio"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got the bool {getattr(self, name)!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not (isinstance(self.gamma, (int, float)) and math.isfinite(self.gamma) and self.gamma >= 0):
            raise ValueError(f"gamma must be a finite number >= 0, got {self.gamma!r}")
        if self.importance not in IMPORTANCES:
            raise ValueError(f"importance must be one of {IMPORTANCES}, got {self.importance!r}")
        if self.size_norm not in SIZE_NORMS:
            raise ValueError(f"size_norm must be one of {SIZE_NORMS}, got {self.size_norm!r}")
        if not (isinstance(self.kappa, (int, float)) and math.isfinite(self.kappa) and self.kappa >= 0):
            raise ValueError(f"kappa must be a finite number >= 0 (0 gives uniform LoRA), got {self.kappa!r}")
        if not isinstance(self.r_min, int) or isinstance(self.r_min, bool) or self.r_min < 0:
            raise ValueError(f"r_min must be an int >= 0, got {self.r_min!r}")
        if self.r_max is not None and (not isinstance(self.r_max, int) or isinstance(self.r_max, bool)
                                       or self.r_max < max(self.r_min, 1)):
            raise ValueError(f"r_max must be None or an int >= max(r_min, 1) = {max(self.r_min, 1)}, "
                             f"got {self.r_max!r}")
        if self.alpha_mode not in ALPHA_MODES:
            raise ValueError(f"alpha_mode must be one of {ALPHA_MODES}, got {self.alpha_mode!r}")
        ratio = self.alpha_ratio
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"alpha_ratio must be a positive finite number, got {self.alpha_ratio!r}")

    def to_dict(self) -> dict:
        return asdict(self)
