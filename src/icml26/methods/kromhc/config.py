"""Hyper-connection options. Defaults are the official code's (github.com/wz1119/KromHC @ 7b15834, ``hyper_conn/``)
and the paper's main setting (n = 4 streams)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KINDS = ("residual", "hc", "mhc", "mhc_lite", "kromhc")
"""``residual`` is the plain pre-norm residual (the reduction switch); the others widen it to n streams."""

HOME_STREAMS = ("random", "cyclic")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_streams(kind: str, num_streams: object, max_permutations: int = 5040, dim: int | None = None) -> None:
    """Raise ValueError, naming ``num_streams``, when ``kind`` cannot be built with that many streams.

    KromHC factors H_res into 2x2 Kronecker factors, so n must be a power of two (the official code asserts the
    same). mHC-lite mixes all n! permutation matrices, so n! must stay below ``max_permutations``.
    """
    if not _is_int(num_streams) or num_streams < 1:
        raise ValueError(f"num_streams must be a positive int, got {num_streams!r}")
    if kind == "kromhc" and num_streams > 1 and num_streams & (num_streams - 1):
        raise ValueError(
            f"num_streams must be a power of two for KromHC (H_res = U_1 (x) ... (x) U_K with K = log2(n) factors of "
            f"size 2x2, as in the official code), got {num_streams}; use {1 << (num_streams.bit_length() - 1)} or "
            f"{1 << num_streams.bit_length()}, or kind='mhc' for other n")
    if kind == "mhc_lite":
        perms = math.factorial(num_streams)
        if perms > max_permutations:
            width = f"n*C*n! = {num_streams * dim * perms:,}" if dim else f"n*C*n! = {num_streams}*C*{perms:,}"
            raise ValueError(
                f"num_streams={num_streams} is infeasible for mHC-lite: H_res mixes all n! = {perms:,} permutation "
                f"matrices, so its residual projection alone has {width} parameters per sub-layer "
                f"(limit max_permutations={max_permutations:,}). KromHC needs only 2*log2(n) coefficients; use "
                f"kind='kromhc' or raise max_permutations")


@dataclass
class HyperConnectionConfig:
    """Which residual connection wraps each sub-layer, and its options.

    Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field.
    """

    kind: str = field(default="kromhc", metadata={
        "help": "one of residual | hc | mhc | mhc_lite | kromhc (hyper_conn/__init__.py hyper_conn_init_func)"})
    num_streams: int = field(default=4, metadata={
        "help": "n, the number of residual streams (paper: n = 4); n = 1 is the plain residual (lucidrains' "
                "disable default); KromHC needs a power of two"})
    sinkhorn_iters: int = field(default=20, metadata={"help": "t_max of mHC's log-domain Sinkhorn-Knopp (mhc.py)"})
    scale_init: float = field(default=1e-2, metadata={
        "help": "initial value of the gating scalars alpha_pre, alpha_res, alpha_post (HC: s_alpha, s_beta)"})
    res_logit_gap: float = field(default=8.0, metadata={
        "help": "static residual logits are 0 for the identity and -gap for every other permutation / off-diagonal "
                "entry (official: 8); a smaller gap starts with more mixing"})
    hc_tanh: bool = field(default=True, metadata={
        "help": "HC only: tanh on the dynamic projections (hyper_connections.py)"})
    home_stream: str = field(default="random", metadata={
        "help": "how each wrapped sub-layer picks its home stream k0: 'random' (the official nanoGPT integration "
                "passes no layer_index, so k0 is random) or 'cyclic' (k0 = sub-layer index mod n)"})
    seed: int = field(default=0, metadata={"help": "seed of the random home streams (never the global RNG)"})
    max_permutations: int = field(default=5040, metadata={
        "help": "largest n! that mHC-lite accepts (5040: n <= 7); n = 8 would need 40,320 permutation logits"})

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not _is_int(self.max_permutations) or self.max_permutations < 2:
            raise ValueError(f"max_permutations must be an int >= 2, got {self.max_permutations!r}")
        check_num_streams(self.kind, self.num_streams, self.max_permutations)
        if not _is_int(self.sinkhorn_iters) or self.sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be a positive int, got {self.sinkhorn_iters!r}")
        if not (isinstance(self.scale_init, (int, float)) and math.isfinite(self.scale_init)):
            raise ValueError(f"scale_init must be a finite number, got {self.scale_init!r}")
        if not (isinstance(self.res_logit_gap, (int, float)) and math.isfinite(self.res_logit_gap)
                and self.res_logit_gap >= 0):
            raise ValueError(f"res_logit_gap must be a finite number >= 0, got {self.res_logit_gap!r}")
        if not isinstance(self.hc_tanh, bool):
            raise ValueError(f"hc_tanh must be a bool, got {self.hc_tanh!r}")
        if self.home_stream not in HOME_STREAMS:
            raise ValueError(f"home_stream must be one of {HOME_STREAMS}, got {self.home_stream!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

    @property
    def disabled(self) -> bool:
        """True when the connection is the plain residual (``kind='residual'`` or a single stream)."""
        return self.kind == "residual" or self.num_streams == 1
