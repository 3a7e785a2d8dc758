"""Pretraining loop and downstream probes for Omni-fMRI (used by the experiments; usable on a user's own chunks).

Pretraining follows the official optimiser setting (pretrain.yaml): AdamW with betas (0.9, 0.95), weight decay 0.05,
linear warmup then cosine decay to 1e-6, gradient clipping at 1.0; the step count and batch are laptop-sized.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ...core.logging import log_metrics
from ...core.progress import progress
from .config import OmniFMRIConfig
from .model import OmniMAE
from .patching import Tokens, layout, tokenize


class TokenCache:
    """Dynamic-patching masks of a fixed set of chunks, computed once (the patching has no parameters), so a batch's
    token layout costs one ``layout`` call instead of the complexity scores."""

    def __init__(self, chunks: Callable[[np.ndarray], torch.Tensor], n: int, cfg: OmniFMRIConfig, *,
                 batch: int = 16, generator: torch.Generator | None = None):
        self.cfg = cfg
        parts = [tokenize(chunks(np.arange(i, min(i + batch, n))), cfg, generator=generator).masks
                 for i in range(0, n, batch)]
        self.masks = [torch.cat([p[s] for p in parts]) for s in range(cfg.num_scales)]

    def tokens(self, idx) -> Tokens:
        idx = torch.as_tensor(idx)
        return layout([m[idx] for m in self.masks], self.cfg.patch_sizes)

    def counts(self) -> torch.Tensor:
        """(n, K) tokens per chunk and scale."""
        return torch.stack([m.flatten(1).sum(1) for m in self.masks], 1)


def cosine_lr(step: int, total: int, lr: float, warmup_frac: float = 0.1, min_lr: float = 1e-6) -> float:
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))


def pretrain(model: OmniMAE, chunks: Callable[[np.ndarray], torch.Tensor], n: int, cache: TokenCache, *,
             steps: int, batch: int, lr: float, seed: int, desc: str = "Omni-fMRI MAE") -> list[float]:
    """MAE pretraining on ``n`` chunks (``chunks(idx) -> (b, T, D, H, W)``); returns the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    losses = []
    model.train()
    for step in progress(range(steps), desc=desc):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr)
        idx = torch.randperm(n, generator=gen)[:batch].sort().values.numpy()
        out = model(chunks(idx).to(device), tokens=_to(cache.tokens(idx), device), generator=gen)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out["loss"].detach()))
        if step % 20 == 0 or step == steps - 1:
            log_metrics(step, loss=losses[-1], desc=desc)
    return losses


def _to(tokens: Tokens, device) -> Tokens:
    if tokens.scale.device == torch.device(device):
        return tokens
    return Tokens(scale=tokens.scale.to(device), coords=tokens.coords.to(device), valid=tokens.valid.to(device),
                  masks=[m.to(device) for m in tokens.masks], grid_index=tokens.grid_index.to(device))


@torch.no_grad()
def evaluate_mae(model: OmniMAE, chunks, n: int, cache: TokenCache, *, batch: int = 8, seed: int = 0) -> dict:
    """Masked-token reconstruction MSE per voxel on held-out chunks, and the same for the mean predictor (zero: the
    mask's mean after the global z-score), pooled the same way."""
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    model.eval()
    se = zero = count = 0.0
    for i in range(0, n, batch):
        idx = np.arange(i, min(i + batch, n))
        out = model(chunks(idx).to(device), tokens=_to(cache.tokens(idx), device), generator=gen)
        for pred, tgt in zip(out["pred"], out["target"]):
            if pred is None:
                continue
            se += float(((pred - tgt) ** 2).mean(-1).sum())
            zero += float((tgt ** 2).mean(-1).sum())
            count += tgt.shape[0]
    model.train()
    return {"mse": se / max(count, 1), "mse_mean_predictor": zero / max(count, 1)}


@torch.no_grad()
def embeddings(model: OmniMAE, chunks, n: int, cache: TokenCache, *, batch: int = 16, regions: int = 1
               ) -> np.ndarray:
    """(n, regions**3 * E) pooled encoder features of every chunk, no masking.

    ``regions = 1`` is global average pooling over the valid patch tokens (the paper's ``global_pool``);
    ``regions = r`` splits the grid into r^3 equal boxes and mean-pools the tokens whose patch centre lies in each
    box (an empty box gives zeros), concatenated: the same readout for every patching, and one that keeps *where*
    activity is, which is what a brain state is made of (a global mean of position-mixed tokens largely loses it).
    """
    if not (isinstance(regions, int) and regions >= 1):
        raise ValueError(f"regions must be a positive integer, got {regions!r}")
    device = next(model.parameters()).device
    model.eval()
    out = []
    grid = torch.tensor(model.grid, dtype=torch.float32, device=device)
    for i in range(0, n, batch):
        idx = np.arange(i, min(i + batch, n))
        x = chunks(idx).to(device)
        tokens = _to(cache.tokens(idx), device)
        h, tokens = model.encode(x, tokens)
        h = h[:, 1:]
        size = (model.cfg.patch_size * 2 ** tokens.scale.clamp_min(0)).float()
        centre = tokens.coords.float() + size[..., None] / 2
        box = (centre / grid * regions).long().clamp(0, regions - 1)  # (B, N, 3) box index per axis
        region = (box[..., 0] * regions + box[..., 1]) * regions + box[..., 2]
        onehot = F.one_hot(region, regions ** 3).to(h.dtype) * tokens.valid[..., None].to(h.dtype)  # (B, N, R)
        pooled = torch.einsum("bnr,bne->bre", onehot, h) / onehot.sum(1)[..., None].clamp_min(1)
        out.append(pooled.flatten(1).cpu())
    model.train()
    return torch.cat(out).numpy()


def raw_features(chunks, n: int, *, pool: int = 4, batch: int = 32) -> np.ndarray:
    """(n, T * (D/pool) * (H/pool) * (W/pool)) average-pooled raw chunks: the plain baseline readout showing that
    a label is linearly decodable from the data at all (no model)."""
    out = []
    for i in range(0, n, batch):
        x = chunks(np.arange(i, min(i + batch, n)))
        out.append(F.avg_pool3d(x.float(), pool).flatten(1).cpu())
    return torch.cat(out).numpy()


def probe_scores(feats: np.ndarray, labels: dict[str, np.ndarray], train: np.ndarray, test: np.ndarray,
                 seed: int = 0) -> dict:
    """Linear probes on frozen features: logistic regression for the classes (accuracy), ridge for the age-like
    variable (R^2); features standardised on the training part."""
    from sklearn.linear_model import LogisticRegression, RidgeCV
    from sklearn.preprocessing import StandardScaler

    sc = StandardScaler().fit(feats[train])
    ftr, fte = sc.transform(feats[train]), sc.transform(feats[test])
    out = {}
    for name, y in labels.items():
        if name == "age":
            r = RidgeCV(alphas=np.logspace(-2, 4, 13)).fit(ftr, y[train])
            pred = r.predict(fte)
            out["age_r2"] = float(1 - ((pred - y[test]) ** 2).sum() / ((y[test] - y[test].mean()) ** 2).sum())
        elif len(np.unique(y[train])) < 2:  # one class only in a tiny training split: the constant predictor
            out[f"{name}_acc"] = float((y[test] == y[train][0]).mean())
        else:
            clf = LogisticRegression(C=1.0, max_iter=2000, random_state=seed).fit(ftr, y[train])
            out[f"{name}_acc"] = float((clf.predict(fte) == y[test]).mean())
    return out
