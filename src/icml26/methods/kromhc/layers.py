"""Hyper-connections: HC, mHC, mHC-lite and KromHC as wrappers that turn a sub-layer into an n-stream one.

Written from a reading of github.com/wz1119/KromHC @ 7b15834f90737fc7156ceeb65e66f16f2b5a7650 (``hyper_conn/``);
no code was copied. Parameter names follow the official modules so the symbol map in the README is one-to-one.

Notation: ``...`` leading (batch, time) dims, n streams, D = C the per-stream width, K = log2(n) (KromHC).
A residual stream is a tensor (..., n, D). Every wrapped sub-layer F computes, per token,

    h = sum_s H_pre[s] X[s]                               branch input, (..., D)
    X_new[t] = sum_s H_res[s, t] X[s] + H_post[t] F(h)    new stream, (..., n, D)

i.e. x_{l+1} = H_res^T x_l + H_post^T F(H_pre x_l). The official code contracts H_res over its first index; the
transpose of a doubly stochastic matrix is doubly stochastic, so the constraint is unaffected.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...models.tiny_lm import AddBranch  # the plain residual that the reduction switch produces
from .config import check_num_streams
from .fast import NORM_EPS, DepthConnection, NormedProjection, StreamMix


class StreamRMSNorm(nn.Module):
    """The official code's RMSNorm: ``x / max(||x||, 1e-12) * sqrt(dim) * (1 + gamma)``, gamma zero-initialised.

    Only its ``gamma`` is used on the fast path (the normalisation is folded into the projection, see
    :class:`~icml26.methods.kromhc.fast.NormedProjection`); ``forward`` is the plain form.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.gamma = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1, eps=NORM_EPS) * math.sqrt(self.dim) * (1 + self.gamma)


def normed_projection(x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``StreamRMSNorm(x) @ weight`` for x (..., k), gamma (k,) and weight (k, m) -> (..., m)."""
    return NormedProjection.apply(x.reshape(-1, x.shape[-1]), gamma, weight).reshape(*x.shape[:-1], weight.shape[-1])


def sinkhorn_log(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """mHC's Sinkhorn-Knopp in the log domain: (..., n, n) logits -> (..., n, n) approximately doubly stochastic.

    Each iteration normalises over dim -2 (for each column t, sum_s = 1) and then over dim -1 (each row sums to 1),
    as in the official ``sinkhorn_knopps``; the last step is a row step, so rows are exact and columns approximate.
    """
    for _ in range(iters):
        logits = logits - logits.logsumexp(dim=-2, keepdim=True)
        logits = logits - logits.logsumexp(dim=-1, keepdim=True)
    return logits.exp()


def permutation_matrices(n: int) -> torch.Tensor:
    """All n! permutation matrices (n!, n, n) in ``itertools.permutations`` order (identity first):
    ``P_r[i, j] = 1`` iff ``j == perm_r[i]``."""
    index = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long)
    return torch.eye(n)[index]


def kron_factors(factors: torch.Tensor) -> torch.Tensor:
    """Batched Kronecker product U_1 (x) U_2 (x) ... (x) U_K of factors (..., K, a, a) -> (..., a^K, a^K).

    U_1 indexes the most significant digit of the stream index, as in ``torch.kron(U_1, U_2)``.
    """
    result = factors[..., 0, :, :]
    for k in range(1, factors.shape[-3]):
        mat = factors[..., k, :, :]
        rows, cols = result.shape[-2] * mat.shape[-2], result.shape[-1] * mat.shape[-1]
        result = (result[..., :, None, :, None] * mat[..., None, :, None, :]).reshape(*mat.shape[:-2], rows, cols)
    return result


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Mixing weights are formed in at least float32 (Megatron's advice for mHC); float64 stays float64 for tests.
    return torch.promote_types(dtype, torch.float32)


class HyperConnection(nn.Module):
    """Base class: wraps ``branch`` F with n residual streams; subclasses define H_pre, H_res and H_post.

    ``forward(stream, **kw)`` maps the stream (..., n, D) to the new stream (..., n, D) and passes ``kw`` (e.g. a KV
    ``cache=``) to the branch. Without a branch, ``forward(stream)`` returns ``(branch_input, add_residual)`` like
    lucidrains' hyper-connections: call ``add_residual(F(branch_input))`` to get the new stream.
    """

    kind = ""

    def __init__(self, num_streams: int, dim: int, branch: nn.Module | None = None, *, home_stream: int = 0,
                 max_permutations: int = 5040) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        check_num_streams(self.kind, num_streams, max_permutations, dim)
        if not isinstance(home_stream, int) or not 0 <= home_stream < num_streams:
            raise ValueError(f"home_stream must be an int in [0, {num_streams}), got {home_stream!r}")
        self.num_streams, self.dim, self.home_stream = num_streams, dim, home_stream
        self.branch = branch
        # When a list, width_connection appends its detached (H_pre, H_res, H_post); see diagnostics.record_mixing.
        self.recorder: list[dict[str, torch.Tensor]] | None = None

    def coefficients(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """H_pre (..., n), H_res (..., n, n), H_post (..., n) for the stream (..., n, D)."""
        raise NotImplementedError

    def width_connection(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stream (..., n, D) -> branch input h (..., D), mixed residual H_res^T X (N, n, D), H_post (N, n).

        The last two are flattened over the leading dims (N tokens); :meth:`depth_connection` restores them.
        """
        n, dim = self.num_streams, self.dim
        if stream.shape[-2:] != (n, dim):
            raise ValueError(f"stream must have shape (..., {n}, {dim}), got {tuple(stream.shape)}")
        lead = stream.shape[:-2]
        x = stream.reshape(-1, n, dim)
        h_pre, h_res, h_post = self.coefficients(x)
        if self.recorder is not None:
            self.recorder.append({"h_pre": h_pre.detach().reshape(*lead, n),
                                  "h_res": h_res.detach().reshape(*lead, n, n),
                                  "h_post": h_post.detach().reshape(*lead, n)})
        # A = [H_pre | H_res] (N, n, 1 + n): one batched matmul A^T X gives the branch input (row 0) and the mixed
        # residual (rows 1..n), as the official single einsum over alpha does.
        mix = torch.cat((h_pre.unsqueeze(-1), h_res), dim=-1).to(x.dtype)
        branch_input, residual = StreamMix.apply(x, mix)
        return branch_input.reshape(*lead, dim), residual, h_post.to(x.dtype)

    def depth_connection(self, branch_output: torch.Tensor, residual: torch.Tensor,
                         h_post: torch.Tensor) -> torch.Tensor:
        """F(h) (..., D), mixed residual (N, n, D), H_post (N, n) -> new stream (..., n, D)."""
        y = branch_output.reshape(-1, self.dim)
        out = DepthConnection.apply(residual, h_post, y)
        return out.reshape(*branch_output.shape[:-1], self.num_streams, self.dim)

    def forward(self, stream: torch.Tensor, **branch_kwargs: Any):
        branch_input, residual, h_post = self.width_connection(stream)

        def add_residual(branch_output: torch.Tensor) -> torch.Tensor:
            return self.depth_connection(branch_output, residual, h_post)

        if self.branch is None:
            return branch_input, add_residual
        return add_residual(self.branch(branch_input, **branch_kwargs))

    def extra_repr(self) -> str:
        return f"num_streams={self.num_streams}, dim={self.dim}, home_stream={self.home_stream}"


class HC(HyperConnection):
    """Dynamic hyper-connections (Zhu et al. 2024, arXiv 2409.19606), the official code's ``HyperConnections``.

    Per stream s, x̄_s = RMSNorm(X[s]) (width D, shared gain), and
        A = A_static + s_alpha * tanh(x̄ W_alpha)    (..., n, 1 + n),  W_alpha (D, 1 + n) zero-init, shared by streams
        B = B_static + s_beta * tanh(x̄ w_beta)      (..., n),         w_beta (D,) zero-init
    with A_static = [e_k0 | I], B_static = 1, s_alpha = s_beta = 0.01. H_pre = A[:, 0], H_res = A[:, 1:], H_post = B.
    Nothing constrains H_res, so products over depth can grow (the instability mHC fixes).
    """

    kind = "hc"

    def __init__(self, num_streams: int, dim: int, branch: nn.Module | None = None, *, home_stream: int = 0,
                 scale_init: float = 1e-2, tanh: bool = True) -> None:
        super().__init__(num_streams, dim, branch, home_stream=home_stream)
        n = num_streams
        self.tanh = tanh
        self.norm = StreamRMSNorm(dim)
        static_alpha = torch.zeros(n, 1 + n)
        static_alpha[home_stream, 0] = 1.0
        static_alpha[:, 1:] = torch.eye(n)
        self.static_alpha = nn.Parameter(static_alpha)
        self.dynamic_alpha_fn = nn.Parameter(torch.zeros(dim, 1 + n))
        self.dynamic_alpha_scale = nn.Parameter(torch.tensor(float(scale_init)))
        self.static_beta = nn.Parameter(torch.ones(n))
        self.dynamic_beta_fn = nn.Parameter(torch.zeros(dim))
        self.dynamic_beta_scale = nn.Parameter(torch.tensor(float(scale_init)))

    def coefficients(self, stream):
        n, dtype = self.num_streams, _compute_dtype(stream.dtype)
        weight = torch.cat((self.dynamic_alpha_fn, self.dynamic_beta_fn.unsqueeze(-1)), dim=-1).to(dtype)
        logits = normed_projection(stream.to(dtype), self.norm.gamma.to(dtype), weight)  # (..., n, n + 2)
        if self.tanh:
            logits = torch.tanh(logits)
        alpha = logits[..., : n + 1] * self.dynamic_alpha_scale + self.static_alpha
        h_post = logits[..., n + 1] * self.dynamic_beta_scale + self.static_beta
        return alpha[..., 0], alpha[..., 1:], h_post


class _FlatNormHyperConnection(HyperConnection):
    """Shared skeleton of mHC, mHC-lite and KromHC: projections of x̃ = RMSNorm(vec X) (width nD).

    H_pre = sigmoid(alpha_pre * x̃ phi_pre + b_pre) and H_post = 2 sigmoid(alpha_post * x̃ phi_post + b_post), with
    b_pre = b_post = +1 at the home stream k0 and -1 elsewhere, phi zero-init and alpha initialised to 0.01.
    Subclasses build H_res from their residual logits.
    """

    def __init__(self, num_streams: int, dim: int, branch: nn.Module | None, *, home_stream: int,
                 scale_init: float, max_permutations: int = 5040) -> None:
        super().__init__(num_streams, dim, branch, home_stream=home_stream, max_permutations=max_permutations)
        n = num_streams
        self.norm = StreamRMSNorm(n * dim)
        self.pre_branch_scale = nn.Parameter(torch.full((1,), float(scale_init)))
        self.residual_scale = nn.Parameter(torch.full((1,), float(scale_init)))
        static_beta = -torch.ones(n)
        static_beta[home_stream] = 1.0
        self.static_beta = nn.Parameter(static_beta)
        self.dynamic_beta_fn = nn.Parameter(torch.zeros(n * dim, n))
        self.h_post_scale = nn.Parameter(torch.tensor(float(scale_init)))

    def _static_pre(self) -> torch.Tensor:
        pre = -torch.ones(self.num_streams)
        pre[self.home_stream] = 1.0
        return pre

    def _logits(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One fused matmul [phi_alpha | phi_post] on x̃ (as the official KromHC): alpha logits, H_post (..., n)."""
        dtype = _compute_dtype(stream.dtype)
        weight = torch.cat((self.dynamic_alpha_fn, self.dynamic_beta_fn), dim=-1).to(dtype)
        logits = normed_projection(stream.flatten(-2).to(dtype), self.norm.gamma.to(dtype), weight)
        split = self.dynamic_alpha_fn.shape[-1]
        h_post = 2 * torch.sigmoid(logits[..., split:] * self.h_post_scale + self.static_beta)
        return logits[..., :split], h_post


class MHC(_FlatNormHyperConnection):
    """Manifold-constrained hyper-connections (DeepSeek, arXiv 2512.24880), the official ``mhc.py`` variant.

    alpha = mat(x̃ phi_alpha) * [alpha_pre | alpha_res, ...] + static_alpha, with phi_alpha (nD, n(1 + n)) laid out
    per stream s as [pre_s, res_s0 .. res_s(n-1)] and static_alpha (n, 1 + n) = [b_pre | b_res] where b_res is 0 on
    the diagonal and -gap off it. H_pre = sigmoid(alpha[:, 0]); H_res = Sinkhorn-Knopp(alpha[:, 1:]) in the log
    domain with t_max iterations: rows sum to 1 exactly, columns approximately.
    """

    kind = "mhc"

    def __init__(self, num_streams: int, dim: int, branch: nn.Module | None = None, *, home_stream: int = 0,
                 scale_init: float = 1e-2, res_logit_gap: float = 8.0, sinkhorn_iters: int = 20) -> None:
        n = num_streams
        super().__init__(n, dim, branch, home_stream=home_stream, scale_init=scale_init)
        self.sinkhorn_iters = sinkhorn_iters
        static_res = torch.full((n, n), -float(res_logit_gap))
        static_res.fill_diagonal_(0.0)
        self.static_alpha = nn.Parameter(torch.cat((self._static_pre().unsqueeze(-1), static_res), dim=-1))
        self.dynamic_alpha_fn = nn.Parameter(torch.zeros(n * dim, n * (1 + n)))

    def coefficients(self, stream):
        n = self.num_streams
        dyn, h_post = self._logits(stream)
        dyn = dyn.unflatten(-1, (n, 1 + n))
        scale = torch.cat((self.pre_branch_scale, self.residual_scale.expand(n)))
        alpha = dyn * scale + self.static_alpha
        return torch.sigmoid(alpha[..., 0]), sinkhorn_log(alpha[..., 1:], self.sinkhorn_iters), h_post


class MHCLite(_FlatNormHyperConnection):
    """mHC-lite (arXiv 2601.05732), the official ``mhc_lite.py``: H_res is a convex combination of all n! permutations.

    a = softmax(alpha_res * x̃ phi_res + b_res) over the n! permutations (b_res = 0 for the identity, -gap for the
    others), H_res = sum_r a_r P_r: exactly doubly stochastic (Birkhoff-von Neumann), but phi_res is (nD, n!).
    """

    kind = "mhc_lite"

    def __init__(self, num_streams: int, dim: int, branch: nn.Module | None = None, *, home_stream: int = 0,
                 scale_init: float = 1e-2, res_logit_gap: float = 8.0, max_permutations: int = 5040) -> None:
        n = num_streams
        check_num_streams(self.kind, n, max_permutations, dim)
        perms = math.factorial(n)
        super().__init__(n, dim, branch, home_stream=home_stream, scale_init=scale_init,
                         max_permutations=max_permutations)
        static_res = torch.full((perms,), -float(res_logit_gap))
        static_res[0] = 0.0
        self.static_alpha = nn.Parameter(torch.cat((self._static_pre(), static_res)))
        self.dynamic_alpha_fn = nn.Parameter(torch.zeros(n * dim, n + perms))
        # Derived from n, so it follows .to() but stays out of the state dict.
        self.register_buffer("perms", permutation_matrices(n), persistent=False)

    def coefficients(self, stream):
        n = self.num_streams
        dyn, h_post = self._logits(stream)
        h_pre = torch.sigmoid(dyn[..., :n] * self.pre_branch_scale + self.static_alpha[:n])
        weights = torch.softmax(dyn[..., n:] * self.residual_scale + self.static_alpha[n:], dim=-1)
        h_res = (weights @ self.perms.flatten(1).to(weights.dtype)).unflatten(-1, (n, n))
        return h_pre, h_res, h_post


class KromHC(_FlatNormHyperConnection):
    """KromHC (arXiv 2601.21579): H_res = U_1 (x) U_2 (x) ... (x) U_K, each U_k a 2x2 doubly stochastic factor.

    For n = 2^K, a^k = softmax(alpha_res * x̃ phi_res^k + b_res^k) over {identity, swap} with one alpha_res shared by
    all factors and b_res^k = (0, -gap); U_k = a^k_0 I + a^k_1 swap = [[p, 1 - p], [1 - p, p]]. A Kronecker product of
    doubly stochastic matrices is doubly stochastic, so H_res is exact with 2K residual logits instead of n!.
    """

    kind = "kromhc"

    def __init__(self, num_streams: int, dim: int, branch: nn.Module | None = None, *, home_stream: int = 0,
                 scale_init: float = 1e-2, res_logit_gap: float = 8.0) -> None:
        check_num_streams(self.kind, num_streams, dim=dim)
        if num_streams < 2:
            raise ValueError("num_streams must be at least 2 for KromHC (n = 1 is the plain residual)")
        n, k = num_streams, num_streams.bit_length() - 1
        super().__init__(n, dim, branch, home_stream=home_stream, scale_init=scale_init)
        self.num_factors = k
        static_res = torch.tensor([0.0, -float(res_logit_gap)]).repeat(k)
        self.static_alpha = nn.Parameter(torch.cat((self._static_pre(), static_res)))
        self.dynamic_alpha_fn = nn.Parameter(torch.zeros(n * dim, n + 2 * k))

    def _identity_weights(self, dyn: torch.Tensor) -> torch.Tensor:
        """p_k = a^k_0, the weight of the identity in each factor (..., K), from the alpha logits (..., n + 2K)."""
        n = self.num_streams
        coeffs = (dyn[..., n:] * self.residual_scale + self.static_alpha[n:]).unflatten(-1, (self.num_factors, 2))
        return torch.softmax(coeffs, dim=-1)[..., 0]

    @staticmethod
    def _factor_matrices(p: torch.Tensor) -> torch.Tensor:
        # 1 - p (not the second softmax entry) makes every row and column sum to 1 up to a single rounding.
        q = 1 - p
        return torch.stack((torch.stack((p, q), dim=-1), torch.stack((q, p), dim=-1)), dim=-2)

    def factors(self, stream: torch.Tensor) -> torch.Tensor:
        """The K factors U_k = [[p_k, 1 - p_k], [1 - p_k, p_k]] (..., K, 2, 2) for the stream (..., n, D)."""
        return self._factor_matrices(self._identity_weights(self._logits(stream)[0]))

    def coefficients(self, stream):
        n = self.num_streams
        dyn, h_post = self._logits(stream)
        h_pre = torch.sigmoid(dyn[..., :n] * self.pre_branch_scale + self.static_alpha[:n])
        return h_pre, kron_factors(self._factor_matrices(self._identity_weights(dyn))), h_post


LAYERS: dict[str, type[HyperConnection]] = {"hc": HC, "mhc": MHC, "mhc_lite": MHCLite, "kromhc": KromHC}


def hyper_connection(kind: str, num_streams: int, dim: int, branch: nn.Module | None = None, *, home_stream: int = 0,
                     scale_init: float = 1e-2, res_logit_gap: float = 8.0, sinkhorn_iters: int = 20,
                     hc_tanh: bool = True, max_permutations: int = 5040) -> HyperConnection:
    """Build the ``kind`` wrapper ("hc", "mhc", "mhc_lite" or "kromhc") around ``branch`` with the given options."""
    if kind not in LAYERS:
        raise ValueError(f"kind must be one of {tuple(LAYERS)}, got {kind!r}")
    options: dict[str, Any] = {"home_stream": home_stream, "scale_init": scale_init}
    if kind == "hc":
        options["tanh"] = hc_tanh
    else:
        options["res_logit_gap"] = res_logit_gap
    if kind == "mhc":
        options["sinkhorn_iters"] = sinkhorn_iters
    if kind == "mhc_lite":
        options["max_permutations"] = max_permutations
    return LAYERS[kind](num_streams, dim, branch, **options)


def parameter_count(kind: str, num_streams: int, dim: int) -> int:
    """Parameters one wrapped sub-layer adds, in closed form (C = dim, n = num_streams, K = log2 n).

    HC: C(n + 3) + n(n + 2) + 2; mHC: nC(n + 1)^2 + (n + 1)^2 + 2; mHC-lite: nC(2n + 1 + n!) + 2n + n! + 3;
    KromHC: nC(2n + 1 + 2K) + 2n + 2K + 3; the plain residual (or n = 1): 0.
    """
    n, c = num_streams, dim
    if kind == "residual" or n == 1:
        return 0
    if kind == "hc":
        return c * (n + 3) + n * (n + 2) + 2
    if kind == "mhc":
        return n * c * (n + 1) ** 2 + (n + 1) ** 2 + 2
    if kind == "mhc_lite":
        r = math.factorial(n)
        return n * c * (2 * n + 1 + r) + 2 * n + r + 3
    if kind == "kromhc":
        k = int(math.log2(n))
        return n * c * (2 * n + 1 + 2 * k) + 2 * n + 2 * k + 3
    raise ValueError(f"unknown kind {kind!r}")


_SUBLAYER_SLOT = {"attn": 0, "mlp": 1}


class HyperResidual(nn.Module):
    """The residual contract of :class:`icml26.models.tiny_lm.TinyLM` with n hyper-connected streams.

    ``expand`` repeats the embeddings (B, T, D) into n streams (B, T, n, D), ``wrap`` wraps each sub-layer in a
    ``kind`` hyper-connection, and ``reduce`` sums the streams back to (B, T, D) (the official reduce function).
    ``kind="residual"`` or ``disable=True`` (the default when n = 1) is exactly the plain residual. The object has
    no parameters; the wrappers it returns hold them. Home streams never draw from the global RNG, so a model's
    other weights are the same whichever residual it uses.

    Args:
        num_streams: n.
        dim: D, the model width.
        kind: "kromhc" (default), "mhc_lite", "mhc", "hc" or "residual".
        home_stream: "random" (the official nanoGPT integration, k0 drawn per sub-layer from ``seed``) or
            "cyclic" (k0 = sub-layer index mod n, the official code's ``layer_index`` option).
        seed: seed of the random home streams.
        disable: force the plain residual.
        **options: passed to :func:`hyper_connection` (scale_init, res_logit_gap, sinkhorn_iters, hc_tanh,
            max_permutations).
    """

    def __init__(self, num_streams: int, dim: int, *, kind: str = "kromhc", home_stream: str = "random",
                 seed: int = 0, disable: bool | None = None, **options: Any) -> None:
        super().__init__()
        if kind not in ("residual", *LAYERS):
            raise ValueError(f"kind must be one of {('residual', *LAYERS)}, got {kind!r}")
        if home_stream not in ("random", "cyclic"):
            raise ValueError(f"home_stream must be 'random' or 'cyclic', got {home_stream!r}")
        self.disabled = kind == "residual" or (num_streams == 1 if disable is None else bool(disable))
        check_num_streams("residual" if self.disabled else kind, num_streams, options.get("max_permutations", 5040),
                          dim)
        self.num_streams, self.dim, self.kind = num_streams, dim, kind
        self.home_stream_rule, self.seed, self.options = home_stream, seed, options

    @classmethod
    def from_config(cls, config, dim: int) -> "HyperResidual":
        """Build from a :class:`~icml26.methods.kromhc.config.HyperConnectionConfig`."""
        return cls(config.num_streams, dim, kind=config.kind, home_stream=config.home_stream, seed=config.seed,
                   disable=config.disabled, scale_init=config.scale_init, res_logit_gap=config.res_logit_gap,
                   sinkhorn_iters=config.sinkhorn_iters, hc_tanh=config.hc_tanh,
                   max_permutations=config.max_permutations)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, n, D), every stream a copy of the embeddings."""
        if self.disabled:
            return x
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.num_streams, x.shape[-1]).contiguous()

    def reduce(self, stream: torch.Tensor) -> torch.Tensor:
        """(B, T, n, D) -> (B, T, D), the sum over streams."""
        return stream if self.disabled else stream.sum(dim=-2)

    def home_stream(self, layer_idx: int, kind: str) -> int:
        """k0 of the sub-layer ``kind`` ("attn" or "mlp") of layer ``layer_idx``."""
        if kind not in _SUBLAYER_SLOT:
            raise ValueError(f"kind must be 'attn' or 'mlp', got {kind!r}")
        index = 2 * layer_idx + _SUBLAYER_SLOT[kind]
        if self.home_stream_rule == "cyclic":
            return index % self.num_streams
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        # An explicit CPU device: from_pretrained builds models under a meta-device context.
        return int(torch.randint(self.num_streams, (1,), generator=gen, device="cpu"))

    def wrap(self, branch: nn.Module, layer_idx: int, kind: str) -> nn.Module:
        """The sub-layer ``branch`` (B, T, D) -> (B, T, D) wrapped into a stream -> stream module."""
        if self.disabled:
            return AddBranch(branch)
        return hyper_connection(self.kind, self.num_streams, self.dim, branch,
                                home_stream=self.home_stream(layer_idx, kind), **self.options)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, num_streams={self.num_streams}, dim={self.dim}, disabled={self.disabled}"

