"""Janus-LoRA's layer-level pieces: the adapter, Gradient Rectification, Online Estimation and the DML loss."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...core.adapters import AdapterLinear


def _check_rank_alpha(r: int, alpha: float) -> None:
    if not isinstance(r, int) or isinstance(r, bool):
        raise TypeError(f"r (adapter rank) must be an int, got {type(r).__name__}")
    if r < 1:
        raise ValueError(f"r (adapter rank) must be >= 1, got {r}")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0 (the update is scaled by alpha / r), got {alpha!r}")


def _check_basis_rows(V: torch.Tensor, dim: int, who: str) -> None:
    if V.ndim != 2 or V.shape[0] != dim:
        raise ValueError(f"{who}: the basis V must be (d_in={dim}, k), got shape {tuple(V.shape)}")


class JanusLoRALinear(AdapterLinear):
    """LoRA whose factors a continual trainer re-draws per task: delta W = (alpha / r) B A.

    A (r, d_in) Kaiming-uniform, B (d_out, r) zero, as LoRA. Two additions used by
    :class:`~icml26.methods.janus_lora.JanusTrainer`: :meth:`fold_and_reset` merges the finished task's update into
    the frozen base and starts a fresh adapter (A optionally drawn in the complement of a basis V), and, while
    ``track_inputs`` is on, the forward pass accumulates the input covariance sum_x x x^T (Online Estimation) without
    storing any sample.
    """

    prefix = "janus_"
    rank_limited = True

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        # Checked before the base layer is frozen, so a refused layer leaves the model as it was.
        _check_rank_alpha(r, alpha)
        super().__init__(base, r, alpha)
        dtype, device = base.weight.dtype, base.weight.device
        self.janus_A = nn.Parameter(torch.empty(r, base.in_features, dtype=dtype, device=device))
        self.janus_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.janus_A, a=math.sqrt(5))
        self.track_inputs = False
        self.input_cov = torch.zeros(base.in_features, base.in_features, dtype=torch.float64)
        self.input_count = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def delta_weight(self) -> torch.Tensor:
        return self.scaling * self.janus_B @ self.janus_A

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaling * nn.functional.linear(nn.functional.linear(x, self.janus_A), self.janus_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"JanusLoRALinear expects inputs (..., {self.in_features}), got shape {tuple(x.shape)}")
        if x.device != self.janus_A.device:
            raise ValueError(f"input is on {x.device} but the adapter is on {self.janus_A.device}: move one of them")
        if self.track_inputs:
            with torch.no_grad():
                flat = x.detach().reshape(-1, x.shape[-1]).double()
                update = flat.T @ flat
                # A NaN/inf input would poison the whole task's covariance, and with it the protected basis.
                if not bool(torch.isfinite(update).all()):
                    raise ValueError(f"non-finite input to a JanusLoRALinear ({self.in_features} -> "
                                     f"{self.out_features}) while it collects inputs for Online Estimation")
                if self.input_cov.device != update.device:  # the covariance follows the model's device
                    self.input_cov = self.input_cov.to(update.device)
                self.input_cov += update
                self.input_count += flat.shape[0]
        return super().forward(x)

    def expected_trainable(self) -> int:
        return self.r * (self.in_features + self.out_features)

    @torch.no_grad()
    def fold_and_reset(self, basis: torch.Tensor | None = None) -> None:
        """base W += delta W; B = 0; A re-drawn (Kaiming-uniform), then A <- A (I - V V^T) when ``basis`` is given."""
        if self.merged:
            raise RuntimeError("unmerge the adapter before starting a new task")
        self.base.weight += self.delta_weight().to(self.base.weight.dtype)
        self.janus_B.zero_()
        nn.init.kaiming_uniform_(self.janus_A, a=math.sqrt(5))
        if basis is not None and basis.shape[1] > 0:
            V = basis.to(self.janus_A)
            self.janus_A -= (self.janus_A @ V) @ V.T


def project_off(M: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """M (I - V V^T): remove the components of M's rows in span(V); M (r, d), V (d, k) orthonormal."""
    _check_basis_rows(V, M.shape[-1], "project_off")
    if V.shape[1] == 0:
        return M
    V = V.to(M)
    return M - (M @ V) @ V.T


def rectify_min_norm(A: torch.Tensor, B: torch.Tensor, V: torch.Tensor, dA: torch.Tensor, dB: torch.Tensor,
                     *, rcond: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient Rectification (min-norm form): the closest (dA', dB') to the plain step with (B dA' + dB' A) V = 0.

    The correction is (dA', dB') = (dA - B^T L V^T, dB - L (A V)^T) where L (d_out, k) solves the Sylvester
    equation B B^T L + L (AV)^T (AV) = R, R = (B dA + dB A) V, through the eigenbases of both sides (eigenvalue sums
    below ``rcond`` times the largest are treated as zero: a pseudo-inverse). Returns the plain step unchanged when
    V has no columns. Solved in float64, returned in the input dtype.
    """
    if A.ndim != 2 or B.ndim != 2 or B.shape[1] != A.shape[0]:
        raise ValueError(f"rectify_min_norm needs A (r, d_in) and B (d_out, r), got {tuple(A.shape)} and "
                         f"{tuple(B.shape)}")
    if dA.shape != A.shape or dB.shape != B.shape:
        raise ValueError(f"the steps must have the factors' shapes: dA {tuple(dA.shape)} vs A {tuple(A.shape)}, "
                         f"dB {tuple(dB.shape)} vs B {tuple(B.shape)}")
    _check_basis_rows(V, A.shape[1], "rectify_min_norm")
    if not (isinstance(rcond, (int, float)) and not isinstance(rcond, bool) and 0.0 < rcond < 1.0):
        raise ValueError(f"rcond must lie in (0, 1), got {rcond!r}")
    if V.shape[1] == 0:
        return dA, dB
    dtype = dA.dtype
    A64, B64, dA64, dB64 = (t.double() for t in (A, B, dA, dB))
    V64 = V.to(A64)
    AV = A64 @ V64                                        # (r, k)
    R = B64 @ (dA64 @ V64) + dB64 @ AV                    # (d_out, k)
    m, U = torch.linalg.eigh(B64 @ B64.T)                 # d_out eigenpairs of B B^T
    n, Q = torch.linalg.eigh(AV.T @ AV)                   # k eigenpairs of (AV)^T AV
    denom = m.clamp_min(0)[:, None] + n.clamp_min(0)[None, :]
    # The cut-off is relative to the factors' own scale, not to the largest eigenvalue sum: at a task start B = 0 and
    # A is drawn in the complement of V, so AV is rounding noise (~1e-8 |A|) whose tiny eigenvalues would otherwise
    # count as a real constraint dB (AV) = 0 and force dB = 0 (the adapter could never leave B = 0).
    scale = max(float((B64 * B64).sum()), float((A64 * A64).sum()))
    if scale == 0.0 or not denom.numel():
        return dA, dB
    keep = denom > rcond * scale
    inv = torch.where(keep, 1.0 / torch.where(keep, denom, torch.ones_like(denom)), torch.zeros_like(denom))
    L = U @ ((U.T @ R @ Q) * inv) @ Q.T
    return (dA64 - B64.T @ L @ V64.T).to(dtype), (dB64 - L @ AV.T).to(dtype)


class OnlineSubspace:
    """Online Estimation of one layer's protected input basis V (d_in, k), orthonormal, without stored samples.

    ``update(cov)`` takes a task's accumulated input covariance C = sum_x x x^T and extends V GPM-style: it keeps V,
    measures the energy V already captures, and adds the fewest top eigenvectors of (I - VV^T) C (I - VV^T) that
    bring the captured fraction of trace(C) to ``tau``.
    """

    def __init__(self, dim: int, tau: float):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"dim (the layer's input size d_in) must be a positive int, got {dim!r}")
        if not (isinstance(tau, (int, float)) and not isinstance(tau, bool) and 0.0 < tau <= 1.0):
            raise ValueError(f"tau (energy threshold) must lie in (0, 1], got {tau!r}")
        self.dim, self.tau = dim, tau
        self.basis = torch.zeros(dim, 0, dtype=torch.float64)

    def update(self, cov: torch.Tensor) -> int:
        """Extend the basis with this task's covariance (dim, dim); returns the number of directions added."""
        self.check_covariance(cov)
        C = cov.double().to(self.basis.device)
        total = float(torch.trace(C))
        if total <= 0.0:
            return 0
        V = self.basis
        captured = float(torch.trace(V.T @ C @ V))
        P = torch.eye(self.dim, dtype=torch.float64) - V @ V.T
        evals, evecs = torch.linalg.eigh(P @ C @ P)
        evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
        need = self.tau * total - captured
        k = 0
        if need > 1e-12 * total:
            cum = torch.cumsum(evals, 0)
            k = int(torch.searchsorted(cum, torch.tensor(need, dtype=torch.float64)).item()) + 1
            k = min(k, self.dim - V.shape[1])
        if k > 0:
            new = evecs[:, :k] - V @ (V.T @ evecs[:, :k])
            Qn, _ = torch.linalg.qr(new)
            self.basis = torch.cat([V, Qn], dim=1)
        return k

    def check_covariance(self, cov: torch.Tensor, name: str = "cov") -> None:
        """Raise ValueError unless ``cov`` is a finite (dim, dim) tensor (called before the basis changes)."""
        if not isinstance(cov, torch.Tensor) or tuple(cov.shape) != (self.dim, self.dim):
            shape = tuple(cov.shape) if isinstance(cov, torch.Tensor) else type(cov).__name__
            raise ValueError(f"{name} must be a ({self.dim}, {self.dim}) input covariance, got {shape}")
        if not bool(torch.isfinite(cov).all()):
            raise ValueError(f"{name} has NaN or inf entries: the protected basis would be meaningless")

    def captured_fraction(self, cov: torch.Tensor) -> float:
        """trace(V^T C V) / trace(C): the share of C's energy inside span(V)."""
        C = cov.double()
        return float(torch.trace(self.basis.T @ C @ self.basis) / torch.trace(C))


def decoupled_margin_loss(features: torch.Tensor, prototypes: torch.Tensor, margin: float) -> torch.Tensor:
    """L_DML = mean_i sum_c max(0, cos(f_i, mu_c) - m): pushes new features (n, D) away from old prototypes (C, D).

    Zero when there are no old prototypes or every cosine is at most the margin. Kept apart from ("decoupled" from)
    the cross-entropy of the current task (RECON: the exact form is not public).
    """
    if features.ndim != 2:
        raise ValueError(f"features must be (n, D), got shape {tuple(features.shape)}")
    if not (isinstance(margin, (int, float)) and not isinstance(margin, bool) and -1.0 <= margin < 1.0):
        raise ValueError(f"margin must be a cosine in [-1, 1), got {margin!r}")
    if prototypes.shape[0] == 0:
        return features.sum() * 0.0
    if prototypes.ndim != 2 or prototypes.shape[1] != features.shape[1]:
        raise ValueError(f"features have dimension {features.shape[1]} but the prototypes are "
                         f"{tuple(prototypes.shape)}: they must come from the same feature extractor")
    cos = nn.functional.normalize(features, dim=-1) @ nn.functional.normalize(prototypes, dim=-1).T
    return torch.clamp(cos - margin, min=0.0).sum(dim=1).mean()
