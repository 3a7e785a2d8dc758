"""Plain, slow, obviously-correct Omni-fMRI: one patch and one token at a time. The ground truth for the tests of
``patching.py`` (vectorised selection) and ``model.py`` (vectorised embedding and loss).

The rule, written recursively (equivalent to the official mask arithmetic, see ``patching.py``): visit the patches of
the coarsest scale; a foreground patch whose complexity score is below tau of its scale becomes one token; any other
patch is split into its 8 children at the next finer scale, which are visited the same way; at the base scale every
foreground patch becomes a token.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import OmniFMRIConfig


def patch_score(patch: np.ndarray, method: str) -> float:
    """Complexity of one patch (T, p, p, p): the within-patch variance of each frame, averaged over frames
    ('variance'), or the square root of that plus 1e-6 ('std')."""
    var = np.mean([max(float(np.mean(f.astype(np.float64) ** 2) - np.mean(f.astype(np.float64)) ** 2), 0.0)
                   for f in patch])
    if method == "variance":
        return var
    if method == "std":
        return float(np.sqrt(var + 1e-6))
    raise ValueError(f"the reference implements 'std' and 'variance', not {method!r}")


def is_foreground(patch: np.ndarray, bg_threshold: float) -> bool:
    return float(np.abs(patch).max()) > bg_threshold


def select_tokens(volume: np.ndarray, cfg: OmniFMRIConfig) -> list[tuple[int, tuple[int, int, int]]]:
    """Tokens of one chunk (T, D, H, W) as a list of (scale, (z, y, x) voxel corner), in no particular order."""
    tokens: list[tuple[int, tuple[int, int, int]]] = []

    def visit(s: int, z: int, y: int, x: int) -> None:
        p = cfg.patch_sizes[s]
        patch = volume[:, z:z + p, y:y + p, x:x + p]
        fg = is_foreground(patch, cfg.bg_threshold)
        if s == 0:
            if fg:
                tokens.append((0, (z, y, x)))
            return
        if fg and patch_score(patch, cfg.method) < cfg.thresholds[s - 1]:
            tokens.append((s, (z, y, x)))
            return
        half = p // 2
        for dz in (0, half):
            for dy in (0, half):
                for dx in (0, half):
                    visit(s - 1, z + dz, y + dy, x + dx)

    top = cfg.patch_sizes[-1]
    _, D, H, W = volume.shape
    for z in range(0, D, top):
        for y in range(0, H, top):
            for x in range(0, W, top):
                visit(cfg.num_scales - 1, z, y, x)
    return tokens


def embed_token(embed, volume: torch.Tensor, s: int, corner: tuple[int, int, int]) -> torch.Tensor:
    """The (E,) embedding of one token by the paper's formula, with ``embed`` a ``model.DualPathEmbed``:
    s = 0: phi(P) + pos;  s >= 1: phi(down(P)) + ZeroLinear(Conv^s(phi(P_grid))) + resampled pos."""
    cfg = embed.cfg
    p = cfg.patch_size
    f = 2 ** s
    z, y, x = corner
    patch = volume[:, z:z + f * p, y:y + f * p, x:x + f * p][None]  # (1, T, fp, fp, fp)
    pos = embed.scale_pos(s)[0, :, z // (f * p), y // (f * p), x // (f * p)]
    if s == 0:
        return F.conv3d(patch, embed.phi.weight, embed.phi.bias, stride=p).flatten() + pos
    low = F.interpolate(patch, scale_factor=0.5 ** s, mode="trilinear", align_corners=False)
    out = F.conv3d(low, embed.phi.weight, embed.phi.bias, stride=p).flatten() + pos
    if cfg.coarse_embed == "dual_path":
        grid = torch.zeros(1, cfg.embed_dim, f, f, f, dtype=volume.dtype)
        for a in range(f):
            for b in range(f):
                for c in range(f):
                    sub = patch[:, :, a * p:(a + 1) * p, b * p:(b + 1) * p, c * p:(c + 1) * p]
                    grid[0, :, a, b, c] = F.conv3d(sub, embed.phi.weight, embed.phi.bias, stride=p).flatten()
        for _ in range(s):
            grid = F.conv3d(grid, embed.detail.weight, embed.detail.bias, stride=2)
        out = out + embed.zero_linear(grid.flatten())
    return out


def token_loss(preds: list[torch.Tensor], targets: list[torch.Tensor], scales: list[int], num_scales: int,
               loss_norm: str) -> torch.Tensor:
    """Scale-aware MAE loss from per-token predictions and targets (each a flat vector of that token's voxels).

    'pooled' (official code): sum_i mean_v (pred_i - y_i)^2 / (number of masked tokens of all scales);
    'per_scale' (paper's equation): sum_s 1/(|M_s| V_s) sum_{i in M_s} ||pred_i - y_i||^2."""
    per_token = [((pr - tg) ** 2).mean() for pr, tg in zip(preds, targets)]
    if loss_norm == "pooled":
        return torch.stack(per_token).sum() / len(per_token)
    total = torch.zeros(())
    for s in range(num_scales):
        mine = [v for v, sc in zip(per_token, scales) if sc == s]
        if mine:
            total = total + torch.stack(mine).sum() / len(mine)
    return total
