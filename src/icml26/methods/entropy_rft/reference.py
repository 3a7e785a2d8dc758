"""Plain per-token loops: the ground truth that ``grpo.py`` is tested against. Slow on purpose; float64 inside."""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def token_stats_reference(logits: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One position's logits (V,) -> (log p_k, H, S_k) computed entry by entry."""
    z = logits.double()
    zmax = max(float(v) for v in z)
    denom = sum(torch.exp(z[j] - zmax) for j in range(z.shape[0]))
    logp = [z[j] - zmax - torch.log(denom) for j in range(z.shape[0])]
    entropy = -sum(torch.exp(lp) * lp for lp in logp)
    s_k = torch.exp(logp[token]) * (entropy + logp[token])
    return logp[token], entropy, s_k


def predicted_entropy_change_reference(logits: torch.Tensor, token: int, advantage: float, alpha: float) -> float:
    """-alpha A (S_k - sum_j p_j S_j) for one position (V,), by explicit sums over the vocabulary."""
    z = logits.double()
    p = torch.softmax(z, -1)
    entropy = -sum(float(p[j]) * math.log(float(p[j])) for j in range(len(p)))
    s = [float(p[j]) * (entropy + math.log(float(p[j]))) for j in range(len(p))]
    expected = sum(float(p[j]) * s[j] for j in range(len(p)))
    return -alpha * advantage * (s[token] - expected)


def group_advantages_reference(rewards: list[float], uids: list, epsilon: float = 1e-6) -> list[float]:
    """Dictionary-of-groups GRPO normalisation, the structure of ClipBAdvantageFn (unbiased std, singleton 0/1)."""
    groups: dict = defaultdict(list)
    for r, u in zip(rewards, uids):
        groups[u].append(float(r))
    stats = {}
    for u, scores in groups.items():
        if len(scores) == 1:
            stats[u] = (0.0, 1.0)
        else:
            mean = sum(scores) / len(scores)
            stats[u] = (mean, math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1)))
    return [(float(r) - stats[u][0]) / (stats[u][1] + epsilon) for r, u in zip(rewards, uids)]


def clip_b_keep_reference(s: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, mu: float) -> torch.Tensor:
    """Keep mask (N, L) by a loop over tokens: batch mean / population std of S over valid tokens."""
    valid = [(i, t) for i in range(s.shape[0]) for t in range(s.shape[1]) if mask[i, t] > 0]
    n = max(len(valid), 1)
    mean = sum(float(s[i, t]) for i, t in valid) / n
    std = math.sqrt(sum((float(s[i, t]) - mean) ** 2 for i, t in valid) / n)
    keep = torch.ones(s.shape, dtype=torch.float64)
    if std < 1e-12:
        return keep
    for i in range(s.shape[0]):
        for t in range(s.shape[1]):
            if float(advantages[i, t]) < 0 and float(s[i, t]) - mean < -mu * std:
                keep[i, t] = 0.0
    return keep


def grpo_loss_reference(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        *, clip_range_low: float = 0.2, clip_range_high: float = 0.2, clip_ratio_c: float = 3.0,
                        entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                        ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                        loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """The same loss as ``grpo.grpo_loss`` token by token with scalar ops (keeps autograd through ``logp`` and
    ``entropy``); aggregation by explicit sums over the valid tokens."""
    n_seq, n_pos = logp.shape
    per_token: list[list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]] = []
    for i in range(n_seq):
        row = []
        for t in range(n_pos):
            if mask[i, t] <= 0:
                continue
            a = float(advantages[i, t])
            ratio = torch.exp(torch.clamp(logp[i, t] - old_logp[i, t], -20.0, 20.0))
            unclipped = -a * ratio
            clipped = -a * torch.clamp(ratio, 1.0 - clip_range_low, 1.0 + clip_range_high)
            pg = torch.maximum(unclipped, clipped)
            if a < 0:
                pg = torch.minimum(torch.as_tensor(-a * clip_ratio_c, dtype=pg.dtype), pg)
            ent = entropy[i, t] if entropy is not None and entropy_coef else None
            kl = None
            if ref_logp is not None and kl_coef:
                d = torch.clamp(ref_logp[i, t] - logp[i, t], -20.0, 20.0)
                kl = torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
            row.append((pg, ent, kl))
        per_token.append(row)

    def aggregate(k: int) -> torch.Tensor:
        if loss_agg_mode == "token-mean":
            items = [tok[k] for row in per_token for tok in row]
            return sum(items) / max(len(items), 1)
        seq_means = [sum(tok[k] for tok in row) / len(row) for row in per_token if row]
        return sum(seq_means) / max(len(seq_means), 1)

    loss = aggregate(0)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * aggregate(1)
    if ref_logp is not None and kl_coef:
        loss = loss + kl_coef * aggregate(2)
    return loss
