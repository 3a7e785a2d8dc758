"""Janus-LoRA options. The official code (github.com/zackschen/Janus-LoRA @ 5d7f706) holds only a project page, so
every non-LoRA field is a reconstruction from the abstract and the page; its help says what it is anchored on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PROJECTIONS = ("none", "gpm", "inflora", "gr")
GR_SOLVERS = ("min_norm", "project_both")
SUBSPACES = ("online", "gpm")


@dataclass
class JanusLoRAConfig:
    """How the continual LoRA trainer protects old tasks; sizes (r, alpha) come from the AdapterConfig.

    ``projection="none", dml_weight=0`` is plain sequential LoRA; ``"gpm"`` is LoRA-GPM (A's gradient projected off
    V); ``"inflora"`` trains only B with A drawn in the complement of V; ``"gr"`` is Gradient Rectification.
    Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field.
    """

    projection: str = field(default="gr", metadata={
        "help": "'gr' (Janus-LoRA, abstract: closed-form factor updates whose composite is orthogonal to V), 'gpm' "
                "(LoRA-GPM baseline: project grad A off V), 'inflora' (InfLoRA-style: A in the complement of V, only B "
                "trained), 'none' (sequential LoRA)"})
    gr_solver: str = field(default="min_norm", metadata={
        "help": "RECON. 'min_norm': the smallest change of the plain (dA, dB) step such that B dA V + dB A V = 0 "
                "(a Sylvester solve; exactly plain LoRA when V is empty); 'project_both': A <- A P at task start and "
                "grad A <- grad A P (the notes' simpler variant)"})
    dml_weight: float = field(default=1.0, metadata={
        "help": "lambda_DML, weight of the Decoupled Margin Loss (RECON: value not public); 0 switches DML off"})
    margin: float = field(default=0.1, metadata={
        "help": "m, cosine margin: new features are pushed until cos(f, mu_old) <= m (RECON: value not public)"})
    energy_threshold: float = field(default=0.97, metadata={
        "help": "tau, fraction of each layer's input energy the protected basis V must capture (GPM convention, "
                "Saha et al. 2021 use 0.97-0.99; RECON for Janus-LoRA)"})
    subspace: str = field(default="online", metadata={
        "help": "'online' (OE: streaming input covariance accumulated during training, no stored samples, no extra "
                "pass; RECON of the page's 'online estimation') or 'gpm' (an extra pass over the task's data at the "
                "task end with the final weights, as GPM)"})
    lr: float = field(default=0.1, metadata={"help": "SGD learning rate for the factors (tuned per arm on one grid)"})
    momentum: float = field(default=0.9, metadata={
        "help": "heavy-ball momentum; the rectification acts on the final step, so GR stays exact (ours)"})
    rcond: float = field(default=1e-9, metadata={
        "help": "relative eigenvalue cut-off of the Sylvester pseudo-inverse in the min_norm GR solve (ours)"})

    def __post_init__(self) -> None:
        for name in ("dml_weight", "margin", "energy_threshold", "lr", "momentum", "rcond"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got the bool {getattr(self, name)!r}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.gr_solver not in GR_SOLVERS:
            raise ValueError(f"gr_solver must be one of {GR_SOLVERS}, got {self.gr_solver!r}")
        if self.subspace not in SUBSPACES:
            raise ValueError(f"subspace must be one of {SUBSPACES}, got {self.subspace!r}")
        if not (isinstance(self.dml_weight, (int, float)) and math.isfinite(self.dml_weight) and self.dml_weight >= 0):
            raise ValueError(f"dml_weight must be a finite number >= 0 (0 switches DML off), got {self.dml_weight!r}")
        if not (isinstance(self.margin, (int, float)) and -1.0 <= self.margin < 1.0):  # NaN fails too
            raise ValueError(f"margin must be a cosine in [-1, 1), got {self.margin!r}")
        if not (isinstance(self.energy_threshold, (int, float)) and 0.0 < self.energy_threshold <= 1.0):
            raise ValueError(f"energy_threshold must lie in (0, 1], got {self.energy_threshold!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum!r}")
        if not (isinstance(self.rcond, (int, float)) and 0.0 < self.rcond < 1.0):
            raise ValueError(f"rcond must lie in (0, 1), got {self.rcond!r}")


# The arms of the claim, as config overrides (baselines are switches of the same trainer).
ARMS: dict[str, dict] = {
    "janus": {"projection": "gr", "dml_weight": 1.0},
    "lora": {"projection": "none", "dml_weight": 0.0},
    "lora_gpm": {"projection": "gpm", "dml_weight": 0.0},
    "inflora": {"projection": "inflora", "dml_weight": 0.0},
    "gr_only": {"projection": "gr", "dml_weight": 0.0},
    "dml_only": {"projection": "none", "dml_weight": 1.0},
}
