"""The optimal column scaling, solved from the factors and their gradients in O((m + n) r^2).

Notation (module docstring of ``adapter.py``): W = W0 + s B A, G = dl/dW (m, n), never formed. LoRA's
backward already gives gB = dl/dB = s G A^T (m, r) and gA = dl/dA = s B^T G (r, n).

Rescale A~ = diag(v) A, B~ = B diag(u) and shift W0 so that W is unchanged. The next step on (A~, B~) moves W
by a combination of 2r fixed matrices, and we pick the combination closest, in Frobenius norm, to the full
fine-tuning step -gamma eta G (the minimiser of the paper's smoothness bound, up to the step size):

    min_{c >= 0} || gamma G - sum_i c_i F_i - sum_k c_{r+k} H_k ||_F^2.

Proxy "sgd" (a gradient step on the factors, to first order; coefficients are squared multipliers):
    Delta W = -eta s^2 (G A~^T A~ + B~ B~^T G),  F_i = s^2 G a_i a_i^T,  H_k = s^2 b_k b_k^T G,
    c = (v^2, u^2).
Proxy "adam" (the inner Adam step, which is invariant to the rescale once the moments are carried over, so
that only the factors it multiplies change; coefficients are the multipliers themselves):
    Delta W = -eta s (P_B A~ + B~ P_A),  F_i = s P_B[:, i] a_i^T,  H_k = s b_k P_A[k, :],  c = (v, u),
    with P_A, P_B the Adam directions m^ / (sqrt(v^) + eps) of this step.

The normal equations K c = g need only r x r products of the thin matrices (derivations next to each entry
below), so the cost is O((m + n) r^2): the same order as LoRA's own backward. ``reference.py`` forms G and the
2r matrices explicitly and solves with ``torch.linalg.lstsq``; the tests hold the two to each other.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

# Columns whose Gram diagonal is below this fraction of the largest carry (numerically) no step: e.g. every
# H_k when B = 0 at initialisation. Their coefficient is undetermined; they keep multiplier 1.
DEGENERATE_RTOL = 1e-12


def _work_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Detached, in the widest of the inputs' dtypes and at least float32: the r x r products need no more, and
    converting the thin (m + n) x r matrices to float64 would cost more than the products themselves."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)
    return tuple(t.detach() if t.dtype == dtype else t.detach().to(dtype) for t in tensors)


def _assemble(k_aa: torch.Tensor, k_ab: torch.Tensor, k_bb: torch.Tensor) -> torch.Tensor:
    r = k_aa.shape[0]
    K = torch.empty(2 * r, 2 * r, dtype=torch.float64, device=k_aa.device)
    K[:r, :r], K[:r, r:], K[r:, :r], K[r:, r:] = k_aa, k_ab, k_ab.T, k_bb
    return K


def gram_sgd(A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor, s: float,
             target_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal equations (K (2r, 2r), g (2r,)) of the 'sgd' proxy, returned in float64; unknowns (v^2, u^2).

    Args:
        A: (r, n) factor; B: (m, r) factor; gA: (r, n) = s B^T G; gB: (m, r) = s G A^T; s: alpha / r.
        target_scale: gamma in the target gamma G.
    """
    A, B, gA, gB = _work_dtype(A, B, gA, gB)
    r, s2 = A.shape[0], float(s) ** 2
    # Two (2r x 2r) Gram products hold every r x r block needed below.
    left = torch.cat([gB, B], 1)
    left = left.T @ left  # [[gB^T gB, gB^T B], [B^T gB, B^T B]]
    right = torch.cat([A, gA], 0)
    right = right @ right.T  # [[A A^T, A gA^T], [gA A^T, gA gA^T]]
    # <F_i, F_k> = s^4 (a_i^T a_k)(G a_i)^T(G a_k) and G a_i = gB[:, i] / s.
    k_aa = s2 * right[:r, :r] * left[:r, :r]
    # <H_i, H_k> = s^4 (b_i^T b_k)(G^T b_i)^T(G^T b_k) and G^T b_i = gA[i, :] / s.
    k_bb = s2 * left[r:, r:] * right[r:, r:]
    # <F_i, H_k> = s^4 (b_k^T G a_i)^2 and b_k^T G a_i = (B^T gB)[k, i] / s = (gB^T B)[i, k] / s.
    k_ab = s2 * left[:r, r:] ** 2
    # <G, F_i> = s^2 ||G a_i||^2 = ||gB[:, i]||^2 and <G, H_k> = ||gA[k, :]||^2.
    g = target_scale * torch.cat([left.diagonal()[:r], right.diagonal()[r:]]).double()
    return _assemble(k_aa, k_ab, k_bb), g


def gram_adam(A: torch.Tensor, B: torch.Tensor, gA: torch.Tensor, gB: torch.Tensor, PA: torch.Tensor,
              PB: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal equations (K (2r, 2r), g (2r,)) of the 'adam' proxy for the target G, in float64; unknowns (v, u).

    Args:
        PA: (r, n) and PB: (m, r): the Adam step directions of A and B at this step (old parameterization).
        The other arguments as in :func:`gram_sgd`.
    """
    A, B, gA, gB, PA, PB = _work_dtype(A, B, gA, gB, PA, PB)
    r, s2 = A.shape[0], float(s) ** 2
    left = torch.cat([PB, B], 1)
    left = left.T @ left  # [[PB^T PB, PB^T B], [B^T PB, B^T B]]
    right = torch.cat([A, PA], 0)
    right = right @ right.T  # [[A A^T, A PA^T], [PA A^T, PA PA^T]]
    # <F_i, F_k> = s^2 (P_B[:, i]^T P_B[:, k]) (a_i^T a_k).
    k_aa = s2 * left[:r, :r] * right[:r, :r]
    # <H_i, H_k> = s^2 (b_i^T b_k) (P_A[i]^T P_A[k]).
    k_bb = s2 * left[r:, r:] * right[r:, r:]
    # <F_i, H_k> = s^2 (P_B[:, i]^T b_k) (a_i^T P_A[k]).
    k_ab = s2 * left[:r, r:] * right[:r, r:]
    # <G, F_i> = s P_B[:, i]^T G a_i = P_B[:, i]^T gB[:, i];  <G, H_k> = s b_k^T G P_A[k] = gA[k]^T P_A[k].
    g = torch.cat([(PB * gB).sum(0), (PA * gA).sum(1)]).double()
    return _assemble(k_aa, k_ab, k_bb), g


def _nnls_gram_np(K: np.ndarray, g: np.ndarray, tol: float, max_iter: int,
                  start: np.ndarray | None = None) -> np.ndarray:
    """Lawson-Hanson on the Gram form in NumPy (p <= a few hundred; NumPy's per-call cost is far below torch's).

    ``start`` (bool (p,)) warm-starts the passive set, e.g. with the positive part of the unconstrained solution:
    the first inner loop then drops its infeasible coordinates from x = 0, after which the usual outer loop
    adds coordinates until the KKT conditions hold. That usually ends after one or two solves instead of one
    per passive coordinate.
    """
    p = g.shape[0]
    x = np.zeros(p)
    passive = np.zeros(p, dtype=bool) if start is None else start.copy()
    scale = float(np.abs(g).max()) if p else 0.0
    if scale == 0.0:
        return x
    for _ in range(max_iter):
        if passive.any():
            for _inner in range(p + 1):
                idx = np.flatnonzero(passive)
                z = np.zeros(p)
                z[idx] = np.linalg.solve(K[np.ix_(idx, idx)], g[idx])
                if (z[idx] > 0).all():
                    x = z
                    break
                # Step from x towards z until the first passive coordinate reaches zero, then drop it.
                bad = idx[z[idx] <= 0]
                alpha = float((x[bad] / (x[bad] - z[bad])).min())
                x = x + alpha * (z - x)
                passive &= x > tol * max(float(np.abs(x).max()), 1e-300)
                x = np.where(passive, x, 0.0)
                if not passive.any():
                    break
        w = g - K @ x
        candidates = ~passive & (w > tol * scale)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, w, -np.inf)))] = True
    return x


def nnls_gram(K: torch.Tensor, g: torch.Tensor, *, tol: float = 1e-12, max_iter: int | None = None) -> torch.Tensor:
    """Lawson-Hanson active set for ``min_{x >= 0} 0.5 x^T K x - g^T x`` with K (p, p) symmetric positive definite.

    This is non-negative least squares written with the Gram matrix (K = M^T M, g = M^T y), so it never needs
    the tall matrix M. Exact up to the linear solves; at most ``max_iter`` (default 3p) outer iterations.
    """
    x = _nnls_gram_np(K.detach().double().cpu().numpy(), g.detach().double().cpu().numpy(), tol,
                      max_iter or 3 * g.shape[0])
    return torch.from_numpy(x).to(dtype=g.dtype, device=g.device)


def _solve_np(K: np.ndarray, g: np.ndarray, nonneg: str, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    p = g.shape[-1]
    diag = np.diagonal(K, axis1=-2, axis2=-1)
    mask = diag > DEGENERATE_RTOL * diag.max(-1, keepdims=True)
    d = np.where(mask, 1.0 / np.sqrt(np.where(mask, diag, 1.0)), 1.0)
    eye = np.eye(p)
    # Undetermined coefficients get an identity row and a zero right-hand side, so a batch shares one solve.
    Ks = np.where(mask[..., :, None] & mask[..., None, :], K * d[..., :, None] * d[..., None, :], eye) + ridge * eye
    gs = np.where(mask, g * d, 0.0)
    y = np.linalg.solve(Ks, gs[..., None])[..., 0]
    if nonneg == "nnls":
        flat_y, flat_K, flat_g = y.reshape(-1, p), Ks.reshape(-1, p, p), gs.reshape(-1, p)
        for i in np.flatnonzero((flat_y < 0).any(-1)):
            flat_y[i] = _nnls_gram_np(flat_K[i], flat_g[i], 1e-12, 3 * p, start=flat_y[i] > 0)
        y = flat_y.reshape(y.shape)
    return np.where(mask, y * d, 0.0), mask


def _multipliers_np(c: np.ndarray, mask: np.ndarray, K: np.ndarray, proxy: str,
                    bounds: tuple[float, float]) -> np.ndarray:
    if proxy == "sgd":
        m = np.sqrt(np.maximum(c, 0.0))
    elif proxy == "adam":
        ones = mask.astype(c.dtype)
        plain = np.einsum("...i,...ij,...j->...", ones, K, ones)
        fitted = np.einsum("...i,...ij,...j->...", c, K, c)
        ok = fitted > 0
        ratio = np.sqrt(np.where(ok, plain, 1.0) / np.where(ok, fitted, 1.0))
        m = np.where(ok[..., None], c * ratio[..., None], 1.0)
    else:
        raise ValueError(f"proxy must be 'sgd' or 'adam', got {proxy!r}")
    return np.where(mask, np.clip(m, *bounds), 1.0)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(dtype=torch.float64, device="cpu").numpy()


def solve_coefficients(K: torch.Tensor, g: torch.Tensor, *, nonneg: str = "nnls",
                       ridge: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``K c = g`` (c >= 0) for the determined coefficients; batched over leading dimensions.

    Args:
        K: (..., p, p) Gram matrices; g: (..., p) right-hand sides.
        nonneg: "nnls" gives the exact constrained optimum (the unconstrained solution when it is already
            >= 0, else Lawson-Hanson as in :func:`nnls_gram`, warm-started from its positive part); "clamp"
            returns the unconstrained solution for the caller to clamp.
        ridge: added to the unit diagonal of the Jacobi-scaled system.

    Returns:
        c (..., p) float64 and the mask (..., p) of determined coefficients. A column whose Gram diagonal is
        below ``DEGENERATE_RTOL`` times the largest one moves nothing (e.g. every H_k while B = 0); it gets
        c = 0 and mask False.

    The system is Jacobi-scaled (c = D y, D = diag(K)^(-1/2)) because the A and B blocks can differ by many
    orders of magnitude (B is tiny early on); c >= 0 is invariant under that scaling. The arithmetic runs in
    NumPy float64: these systems are tiny, and per-call overhead, not flops, is what they cost.
    """
    if nonneg not in ("nnls", "clamp"):
        raise ValueError(f"nonneg must be 'nnls' or 'clamp', got {nonneg!r}")
    c, mask = _solve_np(_numpy(K), _numpy(g), nonneg, ridge)
    return torch.from_numpy(c).to(K.device), torch.from_numpy(mask).to(K.device)


def multipliers_from_coefficients(c: torch.Tensor, mask: torch.Tensor, *, proxy: str,
                                  bounds: tuple[float, float], K: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn solved coefficients (..., 2r) into column multipliers ``(u (..., r), v (..., r))`` within ``bounds``.

    'sgd': c = (v^2, u^2), so the multiplier is sqrt(c). 'adam': c = (v, u) up to the unknown magnitude of the
    target, fixed by matching the norm of plain LoRA's Adam step (c = 1): c <- c sqrt(1^T K 1 / c^T K c).
    Undetermined columns keep multiplier 1.
    """
    if proxy == "adam" and K is None:
        raise ValueError("the 'adam' proxy needs K to fix the step magnitude")
    Kn = _numpy(K) if K is not None else np.zeros(c.shape + c.shape[-1:])
    m = torch.from_numpy(_multipliers_np(_numpy(c), mask.cpu().numpy(), Kn, proxy, bounds)).to(c.device)
    r = c.shape[-1] // 2
    return m[..., r:], m[..., :r]


def optimal_multipliers(K: torch.Tensor, g: torch.Tensor, *, proxy: str, nonneg: str, ridge: float,
                        bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`solve_coefficients` then :func:`multipliers_from_coefficients` in one NumPy pass (the hot path).

    Args:
        K: (L, 2r, 2r) and g: (L, 2r), one system per layer.

    Returns:
        u (L, r) multipliers of the columns of B and v (L, r) of the rows of A, float64 on the CPU.
    """
    Kn = _numpy(K)
    c, mask = _solve_np(Kn, _numpy(g), nonneg, ridge)
    m = torch.from_numpy(_multipliers_np(c, mask, Kn, proxy, bounds))
    r = m.shape[-1] // 2
    return m[..., r:], m[..., :r]


def adam_direction(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """The direction ``m^ / (sqrt(v^) + eps)`` that torch's Adam/AdamW is about to apply for ``grad``.

    Mirrors torch's update with its bias corrections (state empty -> first step); AMSGrad uses the running max.
    Weight decay is left out: it does not depend on the scaling choice.
    """
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    step = float(state["step"]) + 1 if "step" in state else 1.0
    (g,) = _work_dtype(grad)
    m = state["exp_avg"].to(g.dtype) * beta1 + (1 - beta1) * g if "exp_avg" in state else (1 - beta1) * g
    v = (state["exp_avg_sq"].to(g.dtype) * beta2 + (1 - beta2) * g * g if "exp_avg_sq" in state
         else (1 - beta2) * g * g)
    if group.get("amsgrad") and "max_exp_avg_sq" in state:
        v = torch.maximum(state["max_exp_avg_sq"].to(g.dtype), v)
    m_hat = m / (1 - beta1 ** step)
    v_hat = v / (1 - beta2 ** step)
    return m_hat / (v_hat.sqrt() + eps)
