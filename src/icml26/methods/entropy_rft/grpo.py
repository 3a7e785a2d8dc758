"""Vectorised GRPO pieces and the entropy-discriminator utilities (arXiv 2602.03392).

Shapes: N responses (N = prompts x G), L response positions, V vocabulary. ``mask`` is (N, L), 1 for a valid
response token and 0 for padding. ``reference.py`` holds plain per-token loops of every function here.

Entropy discriminator (Sec. 3): with p = softmax(z) and H = -sum_j p_j log p_j,
    dH/dz_k = -p_k (log p_k + H) = -S_k,    S_k = p_k (H + log p_k),
so raising logit k by eps changes the entropy by -eps S_k + O(eps^2). A policy-gradient step on sampled
token k with advantage A moves the logits by alpha A (e_k - p) (Theorem 3.3), hence
    Delta H ~= -alpha A (S_k - E_{j~p}[S_j]),    E_{j~p}[S_j] = sum_j p_j S_j.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` (..., V) and ``tokens`` (...) -> log p of each token (...) and full-vocabulary entropy H (...)."""
    logp_all = F.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def entropy_discriminator(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """S = exp(LP) (H + LP) per token: minus the derivative of the entropy w.r.t. the token's own logit."""
    return logp.exp() * (entropy + logp)


def vocab_discriminator(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_j for every vocabulary entry (..., V) and its expectation E_{j~p}[S_j] = sum_j p_j S_j (...)."""
    logp_all = F.log_softmax(logits.float(), dim=-1)
    p = logp_all.exp()
    entropy = -(p * logp_all).sum(-1, keepdim=True)
    s_all = p * (entropy + logp_all)
    return s_all, (p * s_all).sum(-1)


def predicted_entropy_change(logits: torch.Tensor, tokens: torch.Tensor, advantages: torch.Tensor,
                             alpha: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Theorem 3.3, first order: Delta H = -alpha A (S_k - E_{j~p}[S_j]) per position (same shape as ``tokens``).

    ``alpha`` is the step size on the logits (for a logit table trained by SGD on a loss averaged over N tokens:
    lr / N). Sum the result over the positions that share one logit vector to get that vector's Delta H.
    """
    s_all, expected = vocab_discriminator(logits)
    s_k = s_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return -alpha * advantages * (s_k - expected)


def group_normalized_advantages(rewards: torch.Tensor, group_index: torch.Tensor, epsilon: float = 1e-6
                                ) -> torch.Tensor:
    """GRPO advantages (r - mean_g) / (std_g + epsilon) with the unbiased (n - 1) group std, as ClipBAdvantageFn.

    ``rewards`` (N,) float, ``group_index`` (N,) long with values in [0, n_groups). A group of one response
    gets mean 0 and std 1 (the official rule), so its advantage is r / (1 + epsilon).
    """
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards and group_index must both be (N,), got {tuple(rewards.shape)} and "
                         f"{tuple(group_index.shape)}")
    r = rewards.double()
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group_index, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group_index, r) / count.clamp_min(1)
    sq = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group_index, (r - mean[group_index]) ** 2)
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return ((r - mean[group_index]) / (std[group_index] + epsilon)).to(rewards.dtype)


def clip_b_keep_mask(s: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, mu: float, *,
                     reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip_B (ClipBAdvantageFn): keep mask (N, L) and monitoring metrics.

    E[S] and the population std sigma_S are taken over the valid tokens of the whole batch. Tokens with A >= 0
    are kept; a token with A < 0 is kept only if S - E[S] >= -mu sigma_S. If sigma_S < 1e-12 every token is
    kept. The caller multiplies its response mask by the keep mask, so loss normalisation uses the clipped mask.

    ``reduce_sum`` sums a tensor over data-parallel processes (e.g. ``accelerator.reduce(t, "sum")``), so that
    E[S], sigma_S and the metrics are those of the global batch, as in the official single-batch code; None:
    this process's batch is the whole batch.
    """
    total = reduce_sum if reduce_sum is not None else (lambda t: t)
    xs, m = s.detach().float(), mask.float()
    sums = total(torch.stack(((xs * m).sum(), m.sum())))
    n = sums[1].clamp_min(1.0)
    mean = sums[0] / n
    var = total(((xs - mean) ** 2 * m).sum()) / n
    std = var.sqrt()
    if std.item() < 1e-12:
        keep = torch.ones_like(m)
    else:
        a = advantages.detach().float()
        keep = torch.where(a < 0, (xs - mean >= -(mu * std)).float(), torch.ones_like(m))
    clipped = m * keep
    pos, neg = (advantages > 0).float() * m, (advantages < 0).float() * m
    kept, kept_pos, n_pos, kept_neg, n_neg = total(torch.stack(
        (clipped.sum(), (clipped * pos).sum(), pos.sum(), (clipped * neg).sum(), neg.sum())))
    metrics = {
        "frac_clipped": 1.0 - float(kept / n),
        "frac_clipped_pos": 1.0 - float(kept_pos / n_pos.clamp_min(1.0)),
        "frac_clipped_neg": 1.0 - float(kept_neg / n_neg.clamp_min(1.0)),
        "S_mean": float(mean), "S_var": float(var),
    }
    return keep, metrics


def check_rewards(rewards: torch.Tensor, n: int, source: str) -> None:
    """Raise ValueError unless ``rewards`` is an (n,) tensor of finite numbers.

    Called before any parameter changes: one NaN reward makes a group's advantages NaN, and one infinite reward
    makes them inf - inf = NaN, which a gradient step then writes into every parameter. ``source`` names the
    reward function in the message.
    """
    if rewards.shape != (n,):
        raise ValueError(f"{source} must return one reward per response, shape ({n},), got {tuple(rewards.shape)}")
    bad = ~torch.isfinite(rewards)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"{source} returned non-finite rewards {rewards[bad][:5].tolist()} for responses "
                         f"{rows[:5]}{' ...' if len(rows) > 5 else ''}; rewards must be finite numbers")


def masked_aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Mean over valid tokens ('token-mean') or mean over responses of each response's token mean."""
    m = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * m).sum() / m.sum().clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        per_seq = (values * m).sum(-1) / m.sum(-1).clamp_min(1.0)
        has = (m.sum(-1) > 0).to(values.dtype)
        return (per_seq * has).sum() / has.sum().clamp_min(1.0)
    raise ValueError(f"loss_agg_mode must be 'token-mean' or 'seq-mean-token-mean', got {mode!r}")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_range_low: float = 0.2, clip_range_high: float = 0.2, clip_ratio_c: float = 3.0,
              entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
              ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
              loss_agg_mode: str = "token-mean") -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped policy loss (PPO with dual clip, as Trinity's PPOPolicyLossFn), optional k3 KL penalty
    and entropy bonus; all tensors (N, L), ``mask`` already multiplied by the Clip_B keep mask.

    loss = agg(pg) - entropy_coef agg(H) + kl_coef agg(k3),  pg = where(A < 0, min(c(-A), max(-A r, -A clip(r))),
    max(-A r, -A clip(r))),  r = exp(clamp(logp - old_logp, -20, 20)),  k3 = exp(ref - logp) - (ref - logp) - 1.
    """
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_range_low, 1.0 + clip_range_high)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.minimum(-advantages * clip_ratio_c, clip1)
    pg = torch.where(advantages < 0, clip2, clip1)
    loss = masked_aggregate(pg, mask, loss_agg_mode)
    metrics = {"pg_loss": float(loss.detach()),
               "pg_clipfrac": float(masked_aggregate((pg2 > pg1).float(), mask)),
               "ppo_kl": float(masked_aggregate(-log_ratio.detach(), mask))}
    if entropy is not None and entropy_coef:
        ent = masked_aggregate(entropy, mask, loss_agg_mode)
        loss = loss - entropy_coef * ent
        metrics["entropy_bonus"] = float(ent.detach())
    if ref_logp is not None and kl_coef:
        delta = torch.clamp(ref_logp - logp, -20.0, 20.0)
        kl = torch.clamp(delta.exp() - delta - 1.0, -10.0, 10.0)
        kl_term = masked_aggregate(kl, mask, loss_agg_mode)
        loss = loss + kl_coef * kl_term
        metrics["kl"] = float(kl_term.detach())
    return loss, metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"need 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
