"""Recovery fine-tuning of a compressed model that keeps its compressed structure (and so its parameter count).

A practitioner who compresses a trained model after the fact (SVD truncation, magnitude pruning, RPCA) fine-tunes
the compressed model for a few steps before deploying it. Here every compressed block W (m, n) is re-expressed as

    W = U V + S * M      U (m, k), V (k, n) trainable; S (m, n) trainable on the fixed support M (nnz entries)

with k and nnz taken from the compression's :class:`~icml26.methods.salaad.budget.CompressionReport`, so the fine-tuned
model has exactly the reported parameter count. A block whose report cost is its dense size is fine-tuned dense.
Everything outside the blocks (norms) trains as usual. The same routine, with the same steps, is applied to every
arm, SALAAD's HPA deployment included (equal budget).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from .budget import CompressionReport


class LowRankSparse(nn.Module):
    """Parametrization ``W = U V + S * M`` (the original tensor is ignored; U, V, S are this module's parameters)."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, s: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.u, self.v = nn.Parameter(u.clone()), nn.Parameter(v.clone())
        self.s = nn.Parameter((s * mask).clone())
        self.register_buffer("mask", mask.to(s.dtype))

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return self.u @ self.v + self.s * self.mask


def factor_block(w: torch.Tensor, rank: int, nnz: int, low: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, V, S, M with U V + S M == w for a block of rank-``rank`` part plus ``nnz`` sparse entries.

    ``low`` (the untruncated L of an HPA deployment) gives the low-rank subspace; without it the rank-``rank`` SVD
    of ``w`` itself is used (pure low rank when ``nnz`` is 0). The sparse support is the ``nnz`` largest entries of
    ``w - U V`` (for HPA exactly the kept entries of S; for pruning the non-zeros of ``w``).
    """
    m, n = w.shape
    if rank > 0:
        u_, sig, vh = torch.linalg.svd(low if low is not None else w, full_matrices=False)
        root = sig[:rank].sqrt()
        u, v = u_[:, :rank] * root, root[:, None] * vh[:rank]
    else:
        u, v = w.new_zeros(m, 0), w.new_zeros(0, n)
    rest = w - u @ v
    mask = torch.zeros_like(w)
    if nnz > 0:
        idx = rest.abs().flatten().topk(min(nnz, w.numel())).indices
        mask.view(-1)[idx] = 1.0
    return u, v, rest * mask, mask


def structured_copy(model: nn.Module, report: CompressionReport,
                    lows: Mapping[str, torch.Tensor] | None = None) -> tuple[nn.Module, float]:
    """``model`` (a compressed model, modified in place) with every non-dense block parametrized as U V + S M.

    Returns the model and the largest relative reconstruction error max ||W - (U V + S M)|| / ||W|| (0 up to
    rounding when the structure is right). Tied weights (e.g. TinyLM's embedding and LM head) share one
    parametrization.
    """
    worst = 0.0
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, info in report.blocks.items():
        m, n = info["shape"]
        if info["cost"] >= m * n:
            continue  # stored dense: fine-tuned dense
        w = params[name].detach()
        u, v, s, mask = factor_block(w, int(info["rank"]), int(info["nnz"]), None if lows is None else lows.get(name))
        par = LowRankSparse(u, v, s, mask)
        with torch.no_grad():
            worst = max(worst, float((w - par(w)).norm() / w.norm().clamp_min(1e-12)))
        target = params[name]
        for module in list(model.modules()):
            if getattr(module, "weight", None) is target and isinstance(module.weight, nn.Parameter):
                parametrize.register_parametrization(module, "weight", par, unsafe=True)
    return model, worst


def recover(model: nn.Module, report: CompressionReport, batches: Callable[[], tuple[torch.Tensor, torch.Tensor]],
            steps: int, lr: float, lows: Mapping[str, torch.Tensor] | None = None) -> tuple[nn.Module, dict]:
    """Fine-tune the compressed ``model`` for ``steps`` AdamW steps (betas 0.9/0.95, no weight decay, cosine from
    ``lr`` to 0, clip 1) on ``batches()`` while keeping every block's rank and sparse support.

    Returns the fine-tuned model and {"reconstruction_error", "steps"}.
    """
    model, err = structured_copy(model, report, lows)
    if steps <= 0:
        return model, {"reconstruction_error": err, "steps": 0}
    trainable = [p for n, p in model.named_parameters() if not n.endswith(".original")]
    unique = list({id(p): p for p in trainable}.values())
    opt = torch.optim.AdamW(unique, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        x, y = batches()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unique, 1.0)
        opt.step()
    model.eval()
    return model, {"reconstruction_error": err, "steps": steps}


def sparse_entries_kept(model: nn.Module) -> dict[str, Any]:
    """For tests: every LowRankSparse parametrization's rank and support size."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LowRankSparse):
            out[name] = {"rank": module.u.shape[1], "nnz": int(module.mask.sum())}
    return out
