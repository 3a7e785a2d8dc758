"""Options of the three attention layers of this room: softmax + RoPE (baseline), FoX and FiX.

FoX defaults are those of the official code (github.com/zhixuan-lin/forgetting-transformer @ 883f260,
``ForgettingAttentionLayer``). FiX has no readable official code (github.com/AlayaDB-AI/FiX could not be read),
so its defaults are our reconstruction (README, "Fidelity"); every uncertain choice is a field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ATTENTIONS = ("softmax", "fox", "fix")
GATE_FORMS = ("mamba", "sigmoid", "none")
GATE_GRANULARITIES = ("channel", "head")
GATE_SOURCES = ("token", "hidden")
FGATE_TYPES = ("full", "bias_only", "fixed", "none")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _range(name: str, value: object, *, low_may_be_zero: bool = False) -> tuple[float, float]:
    ok = (isinstance(value, (tuple, list)) and len(value) == 2 and _positive(value[1])
          and (_positive(value[0]) or (low_may_be_zero and value[0] == 0)) and value[0] <= value[1])
    if not ok:
        what = "a non-negative low and a positive high" if low_may_be_zero else "positive numbers"
        raise ValueError(f"{name} must be a pair (low, high) of {what} with low <= high, got {value!r}")
    return float(value[0]), float(value[1])


@dataclass
class FixConfig:
    """Which attention (``attention``) and its options; every field is validated in ``__post_init__``.

    Shapes and sizes (d_model, n_heads, max_seq_len) come from the host model (``TinyLMConfig``).
    """

    attention: str = field(default="fix", metadata={
        "help": "'softmax' (causal softmax + RoPE, the baseline), 'fox' (scalar forget gate per head, FoX) or "
                "'fix' (per-channel forget gate on the values + output RMSNorm, FiX)"})
    rope: bool | None = field(default=None, metadata={
        "help": "rotary embeddings on q, k. None = each layer's published default: FiX keeps RoPE (abstract: VO "
                "encoding complements QK encodings), FoX is NoPE (official use_rope=False), softmax uses RoPE"})
    rope_base: float | None = field(default=None, metadata={
        "help": "RoPE base; None = the host model's rope_base (FoX's official 500000 targets 16K contexts)"})
    norm_eps: float = field(default=1e-6, metadata={
        "help": "eps of the per-head output RMSNorm (FiX, and FoX with fox_output_norm). FoX official "
                "norm_eps=1e-6; FiX's 'low-epsilon' value is unknown (README)"})
    qk_norm_eps: float = field(default=1e-5, metadata={
        "help": "eps of FoX's QK-norm (qk_norm=True): the official code builds it with the layer-norm default "
                "1e-5, not norm_eps"})
    output_gate: bool = field(default=False, metadata={
        "help": "sigmoid output gate after the output norm (FoX-Pro use_output_gate); unknown for FiX; off"})
    # ---- FiX gates (reconstruction) ----
    gate_form: str = field(default="mamba", metadata={
        "help": "FiX log forget gate. 'mamba': log f = -exp(A_log) * softplus(g + dt_bias) (third-party report of "
                "'Mamba-style gate initialization'); 'sigmoid': log f = logsigmoid(g + b) / gate_temperature "
                "(GLA/FoX style); 'none': f = 1, FiX reduces to RMSNorm(softmax attention)"})
    gate_granularity: str = field(default="channel", metadata={
        "help": "'channel': one gate per value channel (FiX); 'head': one gate per head tied across channels, "
                "which makes FiX exactly RMSNorm(FoX) up to eps"})
    gate_rank: int | None = field(default=None, metadata={
        "help": "rank r of the gate projection g = W_up W_down x (third-party: 'low-rank projection of hidden "
                "states'); None = ceil(d_model / 16) (official-kernel benchmark); 0 = one full-rank Linear"})
    gate_bottleneck_norm: bool = field(default=True, metadata={
        "help": "RMSNorm (no gain) on the rank-r bottleneck: g = W_up RMSNorm(W_down x) (official-kernel "
                "benchmark); False = g = W_up W_down x (this room's first reconstruction)"})
    gate_layer0_source: str = field(default="token", metadata={
        "help": "where layer 0 takes its gates from: 'token' = a learned token embedding (vocab x r) in place of "
                "W_down x (official-kernel benchmark; needs the layer built by this room's TinyLM factory or HF "
                "model, which pass the token ids), 'hidden' = W_down x like every other layer"})
    output_norm_shared: bool = field(default=True, metadata={
        "help": "FiX output RMSNorm with one gain of size head_dim shared by all heads (official-kernel benchmark); "
                "False = H * head_dim gains (FoX's GroupNorm layout)"})
    gate_temperature: float = field(default=16.0, metadata={
        "help": "tau of the 'sigmoid' form; 16 keeps f near 1 at init (GLA; x-transformers #281 advice)"})
    a_init_range: tuple[float, float] = field(default=(0.0, 16.0), metadata={
        "help": "'mamba' form: gate strength A = exp(A_log) drawn uniformly from (low, high] (official-kernel "
                "benchmark: U(0, 16]; Mamba-2's A_init_range is [1, 16])"})
    dt_init_range: tuple[float, float] = field(default=(1e-3, 1e-1), metadata={
        "help": "'mamba' form: softplus(dt_bias) log-uniform in this range (Mamba dt_min, dt_max)"})
    # ---- FoX (official code) ----
    fgate_type: str = field(default="full", metadata={
        "help": "FoX forget gate: 'full' f = sigmoid(w_h x + b_h); 'bias_only' learned data-independent; "
                "'fixed' data-independent buffer; 'none' f = 1 (softmax attention)"})
    decay_time_min: float | None = field(default=None, metadata={
        "help": "FoX fgate_bias_init for 'bias_only'/'fixed': per-head decay times log-spaced in "
                "[decay_time_min, decay_time_max], bias = -log(expm1(1 / tau))"})
    decay_time_max: float | None = field(default=None, metadata={"help": "see decay_time_min"})
    fox_output_norm: bool = field(default=False, metadata={
        "help": "per-head RMSNorm of the FoX attention output (official use_output_norm; Pro blocks)"})
    qk_norm: bool = field(default=False, metadata={"help": "per-head RMSNorm of FoX's q and k (official qk_norm)"})
    # ---- numerics ----
    chunk_size: int = field(default=4, metadata={
        "help": "FiX kernel leaf size C: pairs inside a leaf use an explicit C x C x Dh decay, the rest a dyadic tree "
                "of matmuls; 4 was fastest on CPU (benchmarks/fix_attention_speed.py)"})

    def __post_init__(self) -> None:
        choices = {"attention": ATTENTIONS, "gate_form": GATE_FORMS, "gate_granularity": GATE_GRANULARITIES,
                   "fgate_type": FGATE_TYPES, "gate_layer0_source": GATE_SOURCES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.rope is not None and not isinstance(self.rope, bool):
            raise ValueError(f"rope must be True, False or None (the layer's default), got {self.rope!r}")
        for name in ("output_gate", "fox_output_norm", "qk_norm", "gate_bottleneck_norm", "output_norm_shared"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.rope_base is not None and not _positive(self.rope_base):
            raise ValueError(f"rope_base must be a positive number or None, got {self.rope_base!r}")
        if not _positive(self.norm_eps) or self.norm_eps >= 1.0:
            raise ValueError(f"norm_eps must lie in (0, 1), got {self.norm_eps!r}")
        if self.gate_rank is not None and (not isinstance(self.gate_rank, int) or isinstance(self.gate_rank, bool)
                                           or self.gate_rank < 0):
            raise ValueError(f"gate_rank must be None (ceil(d_model / 16)) or a non-negative int (0 = full rank), "
                             f"got {self.gate_rank!r}")
        if not _positive(self.qk_norm_eps) or self.qk_norm_eps >= 1.0:
            raise ValueError(f"qk_norm_eps must lie in (0, 1), got {self.qk_norm_eps!r}")
        if not _positive(self.gate_temperature):
            raise ValueError(f"gate_temperature must be a positive number, got {self.gate_temperature!r}")
        self.a_init_range = _range("a_init_range", self.a_init_range, low_may_be_zero=True)
        self.dt_init_range = _range("dt_init_range", self.dt_init_range)
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        times = (self.decay_time_min, self.decay_time_max)
        needs_times = self.fgate_type == "fixed"
        if any(t is not None for t in times) or needs_times:
            if not all(_positive(t) for t in times):
                raise ValueError(f"decay_time_min and decay_time_max must both be positive numbers when set (required "
                                 f"by fgate_type='fixed'), got {times!r}")
            if self.fgate_type not in ("bias_only", "fixed"):
                raise ValueError(f"decay_time_min/decay_time_max initialise the bias of fgate_type 'bias_only' or "
                                 f"'fixed' only (as in the official code), got fgate_type={self.fgate_type!r}")

    def rank_for(self, d_model: int) -> int:
        """The gate bottleneck rank r for ``d_model`` (``gate_rank=None`` resolves to ceil(d_model / 16))."""
        return math.ceil(d_model / 16) if self.gate_rank is None else self.gate_rank

    @property
    def uses_rope(self) -> bool:
        """RoPE on or off after resolving ``rope=None`` to the layer's published default."""
        if self.rope is not None:
            return self.rope
        return self.attention != "fox"
