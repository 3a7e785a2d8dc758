"""Hyperparameters of the lock-in probes and the stabilised fine-tuner.

The paper ("Trajectory lock-in and the drift paradox in fine-tuning", ICML 2026) and its code could not be found,
so no value here is the paper's: each default is our reconstruction from the abstract and the room notes
(shared/papers/finetuning-and-optimizers.md section 7), and the help text says where it comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STABILISERS = ("plain", "low_lr", "l2sp", "ewc", "freeze", "project")
CURVATURES = ("fisher", "hessian")


def _positive_int(name: str, value, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _nonneg_float(name: str, value, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} finite number, got {value!r}")


@dataclass
class LockInConfig:
    """Probe and stabiliser settings. Every field is validated; a bad value raises ValueError naming the field."""

    # -- probes (LockInProbe) --
    q: int = field(default=4, metadata={
        "help": "rank q of the effective update subspace U_t (notes 7.1 'top-q subspace'; q=4 is our choice)"})
    window: int = field(default=5, metadata={
        "help": "K, number of consecutive observed updates stacked per window before the SVD (notes 7.1; ours)"})
    curvature: str = field(default="hessian", metadata={
        "help": "operator of the harm signal: 'hessian' (double-backward HVP) or 'fisher' (empirical Fisher from "
                "per-example gradients); notes 7.1 allow either"})
    # -- stabilised fine-tuner (StabilisedFineTuner) --
    stabiliser: str = field(default="plain", metadata={
        "help": f"one of {STABILISERS}: the stabilisers the abstract calls standard plus the curvature-aware "
                "projection ('project', the escape candidate of notes 7.2(ii))"})
    lr: float = field(default=1e-3, metadata={"help": "Adam learning rate of every arm (our laptop-scale choice)"})
    low_lr_factor: float = field(default=0.3, metadata={
        "help": "'low_lr' multiplies lr by this factor (ours); 1.0 reduces low_lr to plain exactly"})
    l2sp: float = field(default=1.0, metadata={
        "help": "lambda of L2-SP, lambda/2 * ||theta - theta_0||^2 added to the task loss (Li et al. 2018 form; "
                "strength ours); 0 reduces l2sp to plain"})
    ewc: float = field(default=1.0, metadata={
        "help": "lambda of the EWC-like penalty lambda/2 * sum_i F_i (theta_i - theta_0,i)^2 with the broad-loss "
                "diagonal Fisher normalised to mean 1 (so it is on L2-SP's scale; ours); 0 reduces ewc to plain"})
    freeze: tuple[str, ...] = field(default=("tok_emb", "blocks.0"), metadata={
        "help": "parameter-name prefixes frozen by the 'freeze' stabiliser (partial fine-tuning; TinyLM names)"})
    project_k: int = field(default=16, metadata={
        "help": "k, number of top broad-loss curvature eigendirections the 'project' arm removes from every "
                "update (notes 7.2(ii) 'top-k Fisher eigenvectors'; k ours); 0 reduces project to plain"})
    project_curvature: str = field(default="fisher", metadata={
        "help": "eigendirections of the broad 'fisher' (SVD of per-example gradients) or 'hessian' (Lanczos on "
                "HVPs) for the 'project' arm"})
    refresh_every: int = field(default=25, metadata={
        "help": "recompute the projection basis every this many steps along the trajectory; 0 = only at theta_0"})
    fisher_examples: int = field(default=64, metadata={
        "help": "number of broad examples whose per-example gradients estimate the Fisher (EWC and project)"})
    lanczos_iters: int = field(default=40, metadata={
        "help": "Lanczos iterations (with full reorthogonalisation) for Hessian eigendirections"})

    def __post_init__(self) -> None:
        _positive_int("q", self.q)
        _positive_int("window", self.window)
        if self.q > self.window:
            raise ValueError(f"q ({self.q}) must not exceed window ({self.window}): K updates span at most K dims")
        if self.curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {CURVATURES}, got {self.curvature!r}")
        if self.stabiliser not in STABILISERS:
            raise ValueError(f"stabiliser must be one of {STABILISERS}, got {self.stabiliser!r}")
        _nonneg_float("lr", self.lr, positive=True)
        _nonneg_float("low_lr_factor", self.low_lr_factor, positive=True)
        _nonneg_float("l2sp", self.l2sp)
        _nonneg_float("ewc", self.ewc)
        if isinstance(self.freeze, str) or not all(isinstance(p, str) and p for p in self.freeze):
            raise ValueError(f"freeze must be a tuple of non-empty parameter-name prefixes, got {self.freeze!r}")
        self.freeze = tuple(self.freeze)
        _positive_int("project_k", self.project_k, allow_zero=True)
        if self.project_curvature not in CURVATURES:
            raise ValueError(f"project_curvature must be one of {CURVATURES}, got {self.project_curvature!r}")
        _positive_int("refresh_every", self.refresh_every, allow_zero=True)
        _positive_int("fisher_examples", self.fisher_examples)
        _positive_int("lanczos_iters", self.lanczos_iters)
        fisher_projection = self.stabiliser == "project" and self.project_curvature == "fisher"
        if fisher_projection and self.project_k > self.fisher_examples:
            raise ValueError(f"project_k ({self.project_k}) must not exceed fisher_examples ({self.fisher_examples}): "
                             "the empirical Fisher has rank at most the number of examples")
