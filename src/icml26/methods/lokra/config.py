"""LoKRA / LoKRA+ options. The official code (github.com/AMD-AGI/LoKRA) could not be read: every field below that is
not standard LoRA is a reconstruction, and its help says what it is anchored on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

COHERENCE_KINDS = ("mean_square", "soft_max")
PENALTY_TARGETS = ("channels", "components")
KR_AXES = ("auto", "columns", "rows")
PLUS_INITS = ("zero_u", "zero_v")
PLUS_BUDGETS = ("strict", "grow")


@dataclass
class LoKRAConfig:
    """The Kruskal-rank penalty and the LoKRA+ factor layout; sizes (r, alpha) come from the AdapterConfig.

    ``lam=0`` makes :class:`~icml26.methods.lokra.LoKRALinear` plain LoRA (a test checks bit-identical training).
    Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field.
    """

    lam: float = field(default=0.1, metadata={
        "help": "lambda, weight of the penalty added to the task loss per adapted layer (RECON: the paper's value is "
                "unknown; the notes give 1e-3..1e-1, we take the upper end)"})
    coherence: str = field(default="mean_square", metadata={
        "help": "surrogate for a low Kruskal rank: 'mean_square' (mean squared off-diagonal cosine, cheap through the "
                "r x r Gram) or 'soft_max' (log-mean-exp of |cosines|, a smooth max coherence) (RECON)"})
    tau: float = field(default=0.1, metadata={"help": "temperature of the 'soft_max' coherence (RECON)"})
    penalty_on: str = field(default="channels", metadata={
        "help": "LoKRA: 'channels' penalises the d_in columns of A and the d_out columns of B^T (one per channel, the "
                "blog's 'k-rank of A and B^T'); 'components' penalises the r rows of A and r columns of B (RECON). "
                "LoKRA+ always penalises the per-channel columns of U and V"})
    norm_eps: float = field(default=1e-4, metadata={
        "help": "columns are divided by sqrt(||x||^2 + eps^2), which keeps the penalty's gradient finite at a "
                "zero-initialised factor (ours)"})
    kr_axis: str = field(default="auto", metadata={
        "help": "LoKRA+: which side of dW holds the Khatri-Rao vectors: 'columns' (one per input channel, length "
                "d_out), 'rows' (one per output channel, length d_in) or 'auto' = the longer side, as in KRAdapter "
                "(arXiv 2508.00230)"})
    plus_init: str = field(default="zero_u", metadata={
        "help": "LoKRA+: which factor starts at zero so that dW = 0: 'zero_u' (the smaller factor U, as KRAdapter's "
                "code) or 'zero_v'; the other is uniform in +-1/sqrt(rows) (RECON: the paper's init is unknown)"})
    plus_budget: str = field(default="strict", metadata={
        "help": "LoKRA+: 'strict' fits U, V into LoRA-r's budget r (d_in + d_out) and raises ValueError if the "
                "Khatri-Rao vectors cannot reach the layer size; 'grow' then uses the smallest factors that can"})

    def __post_init__(self) -> None:
        if not (isinstance(self.lam, (int, float)) and math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"lam (the penalty weight lambda) must be a finite number >= 0, got {self.lam!r}")
        if self.coherence not in COHERENCE_KINDS:
            raise ValueError(f"coherence must be one of {COHERENCE_KINDS}, got {self.coherence!r}")
        if not (isinstance(self.tau, (int, float)) and math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"tau (the soft-max temperature) must be a positive finite number, got {self.tau!r}")
        if self.penalty_on not in PENALTY_TARGETS:
            raise ValueError(f"penalty_on must be one of {PENALTY_TARGETS}, got {self.penalty_on!r}")
        if not (isinstance(self.norm_eps, (int, float)) and math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise ValueError(f"norm_eps must be a positive finite number, got {self.norm_eps!r}")
        if self.kr_axis not in KR_AXES:
            raise ValueError(f"kr_axis must be one of {KR_AXES}, got {self.kr_axis!r}")
        if self.plus_init not in PLUS_INITS:
            raise ValueError(f"plus_init must be one of {PLUS_INITS}, got {self.plus_init!r}")
        if self.plus_budget not in PLUS_BUDGETS:
            raise ValueError(f"plus_budget must be one of {PLUS_BUDGETS}, got {self.plus_budget!r}")
