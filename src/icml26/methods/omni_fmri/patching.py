"""Dynamic patching of 4-D fMRI chunks (Omni-fMRI, arXiv 2601.23090, Sec. 3.2), vectorised.

Follows the official rule (github.com/OneMore1/Omni-fMRI @ d27b2970, ``src/models/entropy_utils_3d.py`` and
``patch_tokenizer_3d.py``; our own code, not a copy):

1. complexity score per patch at every scale s (side ``p * 2**s``): with the T frames as channels,
   ``var_t = E_P[I_t^2] - E_P[I_t]^2`` (3-D average pooling), clamped at 0, averaged over frames; the default
   method 'std' returns ``sqrt(mean_t var_t + 1e-6)``.
2. foreground test: a patch is foreground when ``max |I|`` over its voxels and all frames exceeds ``bg_threshold``.
3. for every coarse scale s >= 1: keep the patch as ONE token when it is foreground and its score is below tau_s;
   then, from the coarsest scale down, every finer patch lying inside a kept coarser patch is dropped. The base
   scale keeps its foreground patches that no coarser token covers. So every foreground base patch is covered by
   exactly one token, and tau = 0 gives uniform (background-pruned) base patches.

Token order is the official one: all scale-0 tokens in raster order, then scale 1, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import OmniFMRIConfig


def _check_volume(x: torch.Tensor, multiple: int) -> None:
    if x.ndim != 5:
        raise ValueError(f"expected a batch of chunks (B, T, D, H, W), got shape {tuple(x.shape)}")
    if any(s % multiple for s in x.shape[2:]):
        raise ValueError(f"spatial sides {tuple(x.shape[2:])} must be divisible by the largest patch side "
                         f"{multiple}; pad the volume (nifti.pad_to_multiple)")


def _blocks(x: torch.Tensor, p: int) -> torch.Tensor:
    B, T, D, H, W = x.shape
    return x.reshape(B, T, D // p, p, H // p, p, W // p, p).permute(0, 1, 2, 4, 6, 3, 5, 7).reshape(
        B, T, D // p, H // p, W // p, p ** 3)


def complexity_maps(x: torch.Tensor, cfg: OmniFMRIConfig, *, generator: torch.Generator | None = None
                    ) -> list[torch.Tensor]:
    """Score of every patch at every scale.

    Args:
        x: (B, T, D, H, W) chunk, frames as channels.
    Returns:
        list over scales s of (B, D/p_s, H/p_s, W/p_s) scores (lower = simpler).
    """
    _check_volume(x, cfg.multiple)
    x = x.float()
    out = []
    for s, p in enumerate(cfg.patch_sizes):
        if cfg.method in ("std", "variance"):
            blocks = _blocks(x, p)  # (B, T, gd, gh, gw, p^3); the mean over the last axis is avg_pool3d(x, p, p)
            mean = blocks.mean(-1)
            mean_sq = (blocks * blocks).mean(-1)
            var = (mean_sq - mean * mean).clamp_min(0).mean(1)
            out.append(torch.sqrt(var + 1e-6) if cfg.method == "std" else var)
        elif cfg.method == "laplacian":
            # official variant: |3-D Laplacian| (26-neighbour kernel) of the frame-mean image, averaged per patch
            img = x.mean(1, keepdim=True)
            k = torch.ones(1, 1, 3, 3, 3, dtype=img.dtype, device=img.device)
            k[0, 0, 1, 1, 1] = -26.0
            resp = F.conv3d(F.pad(img, (1,) * 6, mode="reflect"), k).abs()
            out.append(F.avg_pool3d(resp, p, p)[:, 0])
        elif cfg.method == "entropy":
            # official variant: Shannon entropy (bits) of the frame-mean intensities quantised into 512 bins of
            # width 0.5 (the code's v * 512/256, clamped to [0, 511], written for [0, 255]-range images)
            img = x.mean(1)
            q = (img * 2.0).long().clamp(0, 511)
            B, D, H, W = q.shape
            blocks = q.reshape(B, D // p, p, H // p, p, W // p, p).permute(0, 1, 3, 5, 2, 4, 6).reshape(-1, p ** 3)
            counts = torch.zeros(blocks.shape[0], 512, device=x.device).scatter_add_(
                1, blocks, torch.ones_like(blocks, dtype=torch.float32))
            prob = counts / p ** 3
            ent = -(prob * torch.log2(prob + 1e-10)).sum(1)
            out.append(ent.reshape(B, D // p, H // p, W // p))
        elif cfg.method == "random":
            # official variant: one random map shared by the batch; score 1 (keep fine) with probability 0.5
            B = x.shape[0]
            grid = tuple(n // p for n in x.shape[2:])
            r = torch.rand((1, *grid), generator=generator).to(x.device)
            out.append((r < 0.5).float().expand(B, *grid))
        else:
            raise ValueError(f"unknown complexity method {cfg.method!r}")
    return out


def foreground_maps(x: torch.Tensor, cfg: OmniFMRIConfig) -> list[torch.Tensor]:
    """(B, grid_s) bool per scale: max |I| over the patch's voxels and frames above ``bg_threshold``."""
    _check_volume(x, cfg.multiple)
    mx = x.abs().amax(1, keepdim=True).float()
    return [F.max_pool3d(mx, p, p)[:, 0] > cfg.bg_threshold for p in cfg.patch_sizes]


def select_patches(scores: list[torch.Tensor], foreground: list[torch.Tensor], thresholds: tuple[float, ...]
                   ) -> list[torch.Tensor]:
    """Which patch of which scale becomes a token: list over scales of (B, grid_s) bool masks.

    ``thresholds[s - 1]`` is tau for scale s. Coarse-to-fine: a scale's kept patches remove every finer patch inside
    them, so the masks never overlap and jointly cover every foreground base patch exactly once.
    """
    K = len(scores)
    if len(thresholds) != K - 1:
        raise ValueError(f"need {K - 1} thresholds for {K} scales, got {thresholds}")
    masks = [foreground[0].clone()] + [foreground[s] & (scores[s] < thresholds[s - 1]) for s in range(1, K)]
    for s in range(K - 1, 0, -1):
        for j in range(s):
            f = 2 ** (s - j)
            up = masks[s].repeat_interleave(f, 1).repeat_interleave(f, 2).repeat_interleave(f, 3)
            masks[j] = masks[j] & ~up
    return masks


@dataclass
class Tokens:
    """The token layout of a batch, padded to the longest sequence.

    Attributes:
        scale: (B, N) long, scale index s of each token, -1 on padding.
        coords: (B, N, 3) long, voxel corner (z, y, x) of each token's patch (0 on padding).
        valid: (B, N) bool, False on padding.
        masks: list over scales of (B, grid_s) bool, the selection masks.
        grid_index: (B, N) long, raster index of the token in its scale's grid (0 on padding).
    """

    scale: torch.Tensor
    coords: torch.Tensor
    valid: torch.Tensor
    masks: list[torch.Tensor]
    grid_index: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.valid.sum(1)

    def count(self, s: int | None = None) -> torch.Tensor:
        """Tokens per sample (of scale ``s`` when given)."""
        return self.lengths if s is None else ((self.scale == s) & self.valid).sum(1)


def layout(masks: list[torch.Tensor], patch_sizes: tuple[int, ...]) -> Tokens:
    """Turn per-scale masks into the padded token list (scale 0 first, raster order within a scale)."""
    B = masks[0].shape[0]
    device = masks[0].device
    per_sample: list[list[torch.Tensor]] = [[] for _ in range(B)]
    for s, (m, p) in enumerate(zip(masks, patch_sizes)):
        flat = m.reshape(B, -1)
        grid = m.shape[1:]
        for b in range(B):
            idx = flat[b].nonzero().squeeze(1)
            z = idx // (grid[1] * grid[2])
            y = (idx // grid[2]) % grid[1]
            xx = idx % grid[2]
            per_sample[b].append(torch.stack([torch.full_like(idx, s), idx, z * p, y * p, xx * p], 1))
    rows = [torch.cat(r) if r else torch.zeros(0, 5, dtype=torch.long, device=device) for r in per_sample]
    N = max(max(r.shape[0] for r in rows), 1)
    scale = torch.full((B, N), -1, dtype=torch.long, device=device)
    gidx = torch.zeros(B, N, dtype=torch.long, device=device)
    coords = torch.zeros(B, N, 3, dtype=torch.long, device=device)
    valid = torch.zeros(B, N, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        n = r.shape[0]
        scale[b, :n], gidx[b, :n], coords[b, :n], valid[b, :n] = r[:, 0], r[:, 1], r[:, 2:], True
    return Tokens(scale=scale, coords=coords, valid=valid, masks=masks, grid_index=gidx)


def tokenize(x: torch.Tensor, cfg: OmniFMRIConfig, *, generator: torch.Generator | None = None) -> Tokens:
    """Dynamic patching of a batch (B, T, D, H, W): scores, foreground test, coarse-to-fine selection, layout."""
    scores = complexity_maps(x, cfg, generator=generator)
    return layout(select_patches(scores, foreground_maps(x, cfg), cfg.thresholds), cfg.patch_sizes)


def patch_targets(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, T, D, H, W) -> (B, n_grid, T * p**3): every p-cube in raster order, voxels flattened as (T, pd, ph, pw)
    (the official target layout)."""
    B, T, D, H, W = x.shape
    return (x.reshape(B, T, D // p, p, H // p, p, W // p, p).permute(0, 2, 4, 6, 1, 3, 5, 7)
            .reshape(B, (D // p) * (H // p) * (W // p), T * p ** 3))
