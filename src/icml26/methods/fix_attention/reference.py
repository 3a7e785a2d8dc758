"""The plain O(T^2) forms with the explicit decay: the ground truth for the tests (use float64).

Shapes: B batch, H heads, T time, d head dim (q, k), dv value dim. Every function is causal: query i sees keys
j <= i. ``log_f`` holds log forget gates (<= 0); Lambda_t = sum_{s <= t} log f_s is their cumulative sum.

    softmax:  o_i = sum_j softmax_j(s_ij) v_j,                         s_ij = q_i . k_j * scale
    FoX:      o_i = sum_j softmax_j(s_ij + Lambda_i - Lambda_j) v_j    (one gate per head)
    FiX:      u_i = sum_j softmax_j(s_ij) exp(Lambda_i - Lambda_j) (.) v_j   (one gate per value channel)
              o_i = RMSNorm(u_i)                                       (per head, gain, small eps)

FiX keeps the softmax denominator of the undecayed scores, so ``log_f = 0`` gives softmax attention exactly;
under the RMSNorm any positive per-row scale (for instance that denominator) cancels up to eps.
"""

from __future__ import annotations

import math

import torch


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None, rows: torch.Tensor,
            key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (B, H, R, T) of the query rows ``rows`` (R,) and the mask, True where j <= i and key j is not masked:
    (R, T), or (B, 1, R, T) with ``key_mask`` (B, T) bool."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q[:, :, rows] @ k.transpose(-1, -2) * scale
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows[:, None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    return scores, mask


def _rows(q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return torch.arange(q.shape[2], device=q.device) if rows is None else rows


def softmax_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                                rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention: (B, H, T, d), (B, H, T, d), (B, H, T, dv) -> (B, H, R, dv) for query ``rows``."""
    rows = _rows(q, rows)
    scores, mask = _scores(q, k, scale, rows)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def fox_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, *,
                            scale: float | None = None, rows: torch.Tensor | None = None,
                            key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Forgetting attention (FoX): the decay bias D_ij = Lambda_i - Lambda_j is added to the scores.

    Args:
        log_f: (B, H, T), log f_t <= 0 per head.
        key_mask: (B, T) bool, False for keys no query attends to (padding).
    Returns:
        (B, H, R, dv).
    """
    rows = _rows(q, rows)
    scores, mask = _scores(q, k, scale, rows, key_mask)
    lam = log_f.cumsum(-1)
    bias = lam[:, :, rows, None] - lam[:, :, None, :]
    return (scores + bias).masked_fill(~mask, float("-inf")).softmax(-1) @ v


def fix_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, *,
                            scale: float | None = None, rows: torch.Tensor | None = None,
                            key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Fine-grained forgetting attention before the output norm: u_i = sum_j a_ij exp(Lambda_i - Lambda_j) (.) v_j.

    Materialises the (B, H, R, T, dv) decay tensor, so keep shapes small.

    Args:
        log_f: (B, H, T, dv) per-channel log gates, or (B, H, T, 1) for gates tied across the channels of a head.
        key_mask: (B, T) bool, False for keys no query attends to (padding); their log f should be 0.
    Returns:
        u: (B, H, R, dv), with a_ij = softmax_j(s_ij) the causal attention weights over the unmasked keys.
    """
    rows = _rows(q, rows)
    scores, mask = _scores(q, k, scale, rows, key_mask)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    lam = log_f.cumsum(2)
    log_decay = lam[:, :, rows, None, :] - lam[:, :, None, :, :]
    # Positions j > i have a positive exponent that may overflow; they are masked before the exp.
    causal = torch.arange(k.shape[2], device=q.device)[None, :] <= rows[:, None]
    decay = log_decay.masked_fill(~causal[None, None, :, :, None], float("-inf")).exp()
    return (weights[..., None] * decay * v[:, :, None]).sum(3)


def head_rms_norm(u: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over the last axis: (B, H, T, dv) -> same; ``weight`` is (H * dv,) or None."""
    out = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.view(1, u.shape[1], 1, u.shape[-1])
    return out
