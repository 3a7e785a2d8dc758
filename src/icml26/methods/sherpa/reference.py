"""Plain, slow versions of SHERPA's pieces, one channel / one token at a time: the tests' ground truth for
``method.py`` (Fisher ratio, restricted attention, attention KL, token labels)."""

from __future__ import annotations

import math

import torch


def fisher_ratio(features: torch.Tensor, labels: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per channel c: (mean_fg - mean_bg)^2 / (var_fg + var_bg + eps), with unbiased variances."""
    out = []
    for c in range(features.shape[1]):
        fg = [float(v) for v, lab in zip(features[:, c], labels) if lab]
        bg = [float(v) for v, lab in zip(features[:, c], labels) if not lab]
        mf, mb = sum(fg) / len(fg), sum(bg) / len(bg)
        vf = sum((v - mf) ** 2 for v in fg) / (len(fg) - 1)
        vb = sum((v - mb) ** 2 for v in bg) / (len(bg) - 1)
        out.append((mf - mb) ** 2 / (vf + vb + eps))
    return torch.tensor(out)


def restricted_attention(q: torch.Tensor, k: torch.Tensor, channels: list[int]) -> torch.Tensor:
    """(N, C) one image's queries/keys: A[i, j] = exp(s_ij) / sum_j' exp(s_ij'), s_ij = sum_{c in U} q_ic k_jc / sqrt(|U|)."""
    N = q.shape[0]
    out = torch.zeros(N, N, dtype=torch.float64)
    for i in range(N):
        s = [sum(float(q[i, c]) * float(k[j, c]) for c in channels) / math.sqrt(len(channels)) for j in range(N)]
        m = max(s)
        e = [math.exp(v - m) for v in s]
        z = sum(e)
        for j in range(N):
            out[i, j] = e[j] / z
    return out


def attention_kl(target: torch.Tensor, pred: torch.Tensor, eps: float = 1e-8) -> float:
    """(N, N) maps: mean over queries i of sum_j t_ij (log(t_ij + eps) - log(p_ij + eps))."""
    N = target.shape[0]
    total = 0.0
    for i in range(N):
        total += sum(float(target[i, j]) * (math.log(float(target[i, j]) + eps) - math.log(float(pred[i, j]) + eps))
                     for j in range(N))
    return total / N


def token_labels(mask: torch.Tensor, patch: int) -> list[bool]:
    """(S, S) mask -> raster list over the patch grid: more than half of the patch's pixels are foreground."""
    S = mask.shape[0]
    out = []
    for r in range(0, S, patch):
        for c in range(0, S, patch):
            out.append(float(mask[r:r + patch, c:c + patch].mean()) > 0.5)
    return out
