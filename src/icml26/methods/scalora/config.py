"""Hyperparameters of ScaLoRA's merge-and-rescale step and of the ReLoRA baseline.

The paper (arXiv 2510.23818) fixes the structure (merge every step, column scaling, moments carried over) but
the text we could read leaves the closed form, its safeguards and the step proxy open. Every such choice is a
field here, and its help says whether it comes from the paper ([PAPER]) or is our reconstruction ([RECON]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PROXIES = ("auto", "sgd", "adam")
NONNEG = ("nnls", "clamp")
MOMENT_TRANSFER = ("equivariant", "reset", "keep")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class ScaLoRAConfig:
    """Options of :class:`~icml26.methods.scalora.ScaLoRAOptimizer`; the defaults are our reading of the paper.

    Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field.
    """

    every: int = field(default=1, metadata={
        "help": "K: merge and rescale before every K-th optimizer step. [PAPER, per summaries] 'at each step' -> 1"})
    proxy: str = field(default="auto", metadata={
        "help": "which step the scaling is optimal for. 'sgd': a gradient step on the factors, Delta W = -eta s^2 "
                "(G A~^T A~ + B~ B~^T G), quadratic in the multipliers (the paper's smoothness bound with a "
                "gradient step; the derivation in the notes). 'adam': the inner Adam step, which the equivariant "
                "moment transfer leaves unchanged in factor space, so Delta W = -eta s (P_B A~ + B~ P_A) is linear "
                "in the multipliers; its unknown overall magnitude is fixed by keeping plain LoRA's step norm. "
                "'auto': 'adam' for torch Adam/AdamW inner optimizers, else 'sgd'. [RECON]"})
    nonneg: str = field(default="nnls", metadata={
        "help": "how the squared scalings are kept >= 0: 'nnls' solves the constrained least squares exactly "
                "(active set on 2r unknowns); 'clamp' solves it unconstrained and clamps. [RECON]"})
    target_scale: float = field(default=1.0, metadata={
        "help": "gamma: the target full fine-tuning step is -gamma * eta * G for the inner learning rate eta "
                "(used by the 'sgd' proxy; 1 = full fine-tuning at the same learning rate; the 'adam' proxy is "
                "scale-free). [RECON]"})
    scale_bounds: tuple[float, float] = field(default=(1e-2, 1e2), metadata={
        "help": "(low, high) bounds on each column multiplier per rescale; low > 0 keeps a component from dying "
                "(u_i = v_i = 0 gives both factors zero gradient forever). [RECON safeguard]"})
    moment_transfer: str = field(default="equivariant", metadata={
        "help": "what happens to the inner optimizer's moments of the rescaled factors: 'equivariant' scales first "
                "moments like the gradient and second moments by its square [PAPER: carried over in O((m+n)r)]; "
                "'reset' clears them (a ReLoRA-style ablation); 'keep' leaves them untouched (ablation)"})
    ridge: float = field(default=1e-10, metadata={
        "help": "relative Tikhonov term added to the 2r x 2r Gram matrix (times its mean diagonal) so that nearly "
                "collinear columns stay solvable. [RECON numerical safeguard]"})

    def __post_init__(self) -> None:
        if not _positive_int(self.every):
            raise ValueError(f"every (merge-rescale period K) must be a positive int, got {self.every!r}")
        if self.proxy not in PROXIES:
            raise ValueError(f"proxy must be one of {PROXIES}, got {self.proxy!r}")
        if self.nonneg not in NONNEG:
            raise ValueError(f"nonneg must be one of {NONNEG}, got {self.nonneg!r}")
        if not (_finite(self.target_scale) and self.target_scale > 0):
            raise ValueError(f"target_scale (gamma) must be a positive finite number, got {self.target_scale!r}")
        bounds = self.scale_bounds
        if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(_finite(b) for b in bounds)
                and 0 < bounds[0] <= 1 <= bounds[1]):
            raise ValueError(f"scale_bounds must be a pair (low, high) with 0 < low <= 1 <= high, got {bounds!r}")
        self.scale_bounds = (float(bounds[0]), float(bounds[1]))
        if self.moment_transfer not in MOMENT_TRANSFER:
            raise ValueError(f"moment_transfer must be one of {MOMENT_TRANSFER}, got {self.moment_transfer!r}")
        if not (_finite(self.ridge) and self.ridge >= 0):
            raise ValueError(f"ridge must be a finite number >= 0, got {self.ridge!r}")


@dataclass
class ReLoRAConfig:
    """Options of the ReLoRA baseline (Lialin et al., 2023, arXiv 2307.05695): merge, re-init, reset, re-warm.

    Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field.
    """

    every: int = field(default=100, metadata={
        "help": "N: merge the adapter into the frozen weight and re-initialise it after every N optimizer steps "
                "(ReLoRA uses 5k on 1B-token pretraining; 100 is the notes' laptop-scale choice)"})
    rewarmup_steps: int = field(default=10, metadata={
        "help": "learning rate ramps linearly from 0 back to its value over this many steps after each reset "
                "(ReLoRA's jagged schedule; 0 disables)"})
    prune_ratio: float = field(default=0.99, metadata={
        "help": "fraction of each adapter tensor's optimizer-state entries zeroed by magnitude at a reset "
                "(ReLoRA: 0.99; 1.0 = full reset, 0.0 = keep)"})
    seed: int = field(default=0, metadata={"help": "seed of the generator that re-initialises the A factors"})

    def __post_init__(self) -> None:
        if not _positive_int(self.every):
            raise ValueError(f"every (merge period N) must be a positive int, got {self.every!r}")
        if not (isinstance(self.rewarmup_steps, int) and not isinstance(self.rewarmup_steps, bool)
                and self.rewarmup_steps >= 0):
            raise ValueError(f"rewarmup_steps must be an int >= 0, got {self.rewarmup_steps!r}")
        if not (_finite(self.prune_ratio) and 0.0 <= self.prune_ratio <= 1.0):
            raise ValueError(f"prune_ratio must lie in [0, 1], got {self.prune_ratio!r}")
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0):
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
