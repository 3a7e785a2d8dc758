"""Dual-path multi-scale embedding and the scale-aware masked autoencoder of Omni-fMRI (arXiv 2601.23090, Sec. 3.3-3.4).

Written from the official code's behaviour (github.com/OneMore1/Omni-fMRI @ d27b2970: ``patch_embed_3d.py``
``TokenizedZeroConvPatchAttn3D`` and ``mae_model.py`` ``AdaptiveMAE``), vectorised over whole volumes instead of
packed patch lists (``reference.py`` has the per-token version; the tests check they agree).

Embedding of a token of scale s (patch side ``p * 2**s``):
    s = 0:  z = phi(P) + pos
    s >= 1: z = phi(down_s(P)) + ZeroLinear(Conv^s(phi(P_grid))) + resample_s(pos)
phi is the base Conv3d patch embedding (T frames as channels), down_s the trilinear downsampling by 2**s, P_grid the
(2**s)^3 base sub-patches, Conv a 2x2x2 stride-2 Conv3d applied s times (shared weights), ZeroLinear a linear layer
initialised to zero (training starts from the low-frequency embedding), resample_s the trilinear resampling of the
learned base-grid positional table to scale s's grid.

Decoder input of token i: u_i = h_i + p_i + e_{s_i}, p_i the decoder positional volume sampled at the patch centre
(trilinear ``grid_sample``), e_s a learned scale embedding; scale-specific heads psi_s predict T * (p 2**s)^3 voxels.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import OmniFMRIConfig
from .patching import Tokens, patch_targets, tokenize


class Block(nn.Module):
    """Pre-norm transformer block with qk-norm (the official encoder sets qk_norm true), padding-aware."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm, self.k_norm = nn.LayerNorm(dim // heads), nn.LayerNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x: (B, L, dim); keep: (B, L) bool, False for padding (never attended to)."""
        B, L, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, C))
        return x + self.mlp(self.norm2(x))


def strided_conv(x: torch.Tensor, conv: nn.Conv3d) -> torch.Tensor:
    """``conv(x)`` for a Conv3d whose stride equals its kernel (non-overlapping patches), computed as one matmul over
    the patches: the same numbers, several times faster than the CPU conv kernel at these shapes."""
    k = conv.kernel_size[0]
    B, C, D, H, W = x.shape
    patches = (x.reshape(B, C, D // k, k, H // k, k, W // k, k).permute(0, 2, 4, 6, 1, 3, 5, 7)
               .reshape(B, -1, C * k ** 3))
    out = F.linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)
    return out.transpose(1, 2).reshape(B, conv.out_channels, D // k, H // k, W // k)


def sub_patch_index(base_grid: tuple[int, int, int], s: int, coarse_index: torch.Tensor) -> torch.Tensor:
    """Raster indices of the (2**s)^3 base patches inside each scale-s patch, in (dz, dy, dx) order.

    coarse_index: (...,) raster index in scale s's grid -> (..., 8**s) indices in the base grid."""
    f = 2 ** s
    gd, gh, gw = base_grid
    ch, cw = gh // f, gw // f
    z, y, x = coarse_index // (ch * cw), (coarse_index // cw) % ch, coarse_index % cw
    r = torch.arange(f, device=coarse_index.device)
    dz, dy, dx = torch.meshgrid(r, r, r, indexing="ij")
    return (((z[..., None] * f + dz.flatten()) * gh + (y[..., None] * f + dy.flatten())) * gw
            + (x[..., None] * f + dx.flatten()))


def assemble(sub: torch.Tensor, frames: int, p: int) -> torch.Tensor:
    """(M, f^3, T * p^3) base sub-patches in (dz, dy, dx) order -> (M, T, f p, f p, f p) voxels of the big patch."""
    M, n, _ = sub.shape
    f = round(n ** (1 / 3))
    v = sub.reshape(M, f, f, f, frames, p, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return v.reshape(M, frames, f * p, f * p, f * p)


class DualPathEmbed(nn.Module):
    """Multi-scale token embedding. ``forward(x, tokens) -> (B, N, embed_dim)``, zeros on padding.

    Works on the base patches of the chunk (one reshape of the volume) and gathers, per coarse token, its base
    sub-patches: the down-sampled path and the detail path are computed for the selected tokens only."""

    def __init__(self, cfg: OmniFMRIConfig, grid: tuple[int, int, int]):
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.base_grid = tuple(g // p for g in grid)
        self.phi = nn.Conv3d(cfg.in_frames, cfg.embed_dim, p, p)
        self.detail = nn.Conv3d(cfg.embed_dim, cfg.embed_dim, 2, 2)
        self.zero_linear = nn.Linear(cfg.embed_dim, cfg.embed_dim)
        if cfg.zero_init:
            nn.init.zeros_(self.zero_linear.weight)
            nn.init.zeros_(self.zero_linear.bias)
        self.pos = nn.Parameter(torch.randn(1, cfg.embed_dim, *self.base_grid) * 0.02)

    def scale_pos(self, s: int) -> torch.Tensor:
        """(1, E, *grid_s): the base positional table, trilinearly resampled to scale s's grid."""
        if s == 0:
            return self.pos
        size = tuple(g // 2 ** s for g in self.base_grid)
        return F.interpolate(self.pos, size=size, mode="trilinear", align_corners=False)

    def _phi(self, patches: torch.Tensor) -> torch.Tensor:
        """phi on flattened (..., T p^3) patches (the Conv3d with stride = kernel, as a matmul)."""
        return F.linear(patches, self.phi.weight.reshape(self.cfg.embed_dim, -1), self.phi.bias)

    def coarse(self, base_patches: torch.Tensor, base_emb: torch.Tensor, b: torch.Tensor, g: torch.Tensor, s: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings (M, E) (without position) and voxels (M, T, fp, fp, fp) of scale-s tokens (batch b, index g)."""
        cfg, p = self.cfg, self.cfg.patch_size
        sub = sub_patch_index(self.base_grid, s, g)  # (M, 8^s)
        vox = assemble(base_patches[b[:, None], sub], cfg.in_frames, p)
        low = F.interpolate(vox, scale_factor=0.5 ** s, mode="trilinear", align_corners=False)
        z = self._phi(low.reshape(low.shape[0], -1))
        if cfg.coarse_embed == "dual_path":
            f = 2 ** s
            d = base_emb[b[:, None], sub].reshape(-1, f, f, f, cfg.embed_dim).permute(0, 4, 1, 2, 3)
            for _ in range(s):
                d = strided_conv(d, self.detail)
            z = z + self.zero_linear(d.reshape(-1, cfg.embed_dim))
        return z, vox

    def forward(self, x: torch.Tensor, tokens: Tokens, base_patches: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        if base_patches is None:
            base_patches = patch_targets(x, cfg.patch_size)
        base_emb = self._phi(base_patches)  # (B, n0, E)
        out = torch.zeros(*tokens.scale.shape, cfg.embed_dim, dtype=base_emb.dtype, device=x.device)
        rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(tokens.scale)
        for s in range(cfg.num_scales):
            sel = (tokens.scale == s) & tokens.valid
            if not sel.any():
                continue
            b, g = rows[sel], tokens.grid_index[sel]
            pos = self.scale_pos(s).flatten(2)[0].T[g]
            z = base_emb[b, g] if s == 0 else self.coarse(base_patches, base_emb, b, g, s)[0]
            out = out.index_put((b, tokens_position(sel)), z + pos)
        return out


def tokens_position(sel: torch.Tensor) -> torch.Tensor:
    """Column index of every True entry of a (B, N) mask, in row-major order (matches ``t[sel]``)."""
    return torch.arange(sel.shape[1], device=sel.device)[None].expand_as(sel)[sel]


class OmniMAE(nn.Module):
    """Scale-aware MAE over dynamically patched chunks.

    Args:
        cfg: options (paper defaults except the sizes).
        grid: spatial shape (D, H, W) of the chunks, each side divisible by ``cfg.multiple``.

    ``forward(x)`` with x (B, T, D, H, W) returns ``{"loss", "tokens", "masked", "pred", "target", ...}``;
    ``embed(x)`` the (B, embed_dim) mean of the unmasked encoder outputs (for probes).
    """

    def __init__(self, cfg: OmniFMRIConfig, grid: tuple[int, int, int]):
        super().__init__()
        if any(g % cfg.multiple for g in grid):
            raise ValueError(f"grid {grid} must have sides divisible by {cfg.multiple}")
        self.cfg, self.grid = cfg, tuple(grid)
        E, Ed = cfg.embed_dim, cfg.decoder_embed_dim
        self.embed_tokens = DualPathEmbed(cfg, self.grid)
        self.cls = nn.Parameter(torch.randn(1, 1, E) * 1e-6)
        self.blocks = nn.ModuleList([Block(E, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(E)
        self.decoder_embed = nn.Linear(E, Ed)
        self.mask_token = nn.Parameter(torch.randn(1, 1, Ed) * 0.02)
        self.dec_pos = nn.Parameter(torch.randn(1, Ed, *self.embed_tokens.base_grid) * 0.02)
        self.scale_embed = nn.Parameter(torch.randn(cfg.num_scales, Ed) * 0.02)
        self.dec_blocks = nn.ModuleList([Block(Ed, cfg.decoder_num_heads, cfg.mlp_ratio)
                                         for _ in range(cfg.decoder_depth)])
        self.dec_norm = nn.LayerNorm(Ed)
        self.heads = nn.ModuleList([nn.Linear(Ed, cfg.in_frames * p ** 3) for p in cfg.patch_sizes])

    # --- input checks -------------------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor) -> None:
        if x.ndim != 5 or x.shape[1] != self.cfg.in_frames or tuple(x.shape[2:]) != self.grid:
            raise ValueError(f"expected chunks of shape (B, {self.cfg.in_frames}, {', '.join(map(str, self.grid))}), "
                             f"got {tuple(x.shape)}")

    def tokenize(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Tokens:
        return tokenize(x, self.cfg, generator=generator)

    # --- encoder --------------------------------------------------------------------------------------------------
    def _encode(self, z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        z = torch.cat([self.cls.expand(z.shape[0], -1, -1), z], 1)
        keep = torch.cat([torch.ones_like(keep[:, :1]), keep], 1)
        for blk in self.blocks:
            z = blk(z, keep)
        return self.norm(z)

    def encode(self, x: torch.Tensor, tokens: Tokens | None = None) -> tuple[torch.Tensor, Tokens]:
        """All tokens, no masking: ((B, 1 + N, E) with the cls token first, tokens)."""
        self._check(x)
        tokens = tokens if tokens is not None else self.tokenize(x)
        return self._encode(self.embed_tokens(x, tokens), tokens.valid), tokens

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, E): mean over the valid patch tokens of the final encoder layer (global average pooling)."""
        h, tokens = self.encode(x)
        v = tokens.valid[..., None].to(h.dtype)
        return (h[:, 1:] * v).sum(1) / v.sum(1).clamp_min(1)

    # --- masking and decoder --------------------------------------------------------------------------------------
    def random_masking(self, tokens: Tokens, generator: torch.Generator | None = None):
        """Per sample keep floor(n (1 - mask_ratio)) (at least 1) random valid tokens.

        Returns (ids_keep (B, L), keep_valid (B, L) bool, masked (B, N) bool over valid tokens)."""
        B, N = tokens.valid.shape
        noise = torch.rand(B, N, generator=generator).to(tokens.valid.device)
        noise = noise.masked_fill(~tokens.valid, 2.0)
        ids = noise.argsort(1)
        n_keep = (tokens.lengths.float() * (1 - self.cfg.mask_ratio)).long().clamp_min(1)
        L = int(n_keep.max())
        ids_keep = ids[:, :L]
        keep_valid = torch.arange(L, device=ids.device)[None] < n_keep[:, None]
        masked = tokens.valid.clone()
        masked.scatter_(1, ids_keep, ~keep_valid & torch.gather(masked, 1, ids_keep))
        return ids_keep, keep_valid, masked

    def decoder_pos(self, tokens: Tokens) -> torch.Tensor:
        """(B, N, Ed): decoder positional volume sampled at each patch centre, plus the scale embedding."""
        size = self.cfg.patch_size * 2 ** tokens.scale.clamp_min(0)
        centre = tokens.coords.float() + size[..., None].float() / 2
        extent = torch.tensor(self.grid, dtype=centre.dtype, device=centre.device)
        g = (2 * centre / extent - 1).flip(-1)  # grid_sample wants (x, y, z) in [-1, 1]
        B, N = tokens.scale.shape
        pos = F.grid_sample(self.dec_pos.expand(B, -1, -1, -1, -1), g.view(B, 1, 1, N, 3), mode="bilinear",
                            padding_mode="border", align_corners=False)
        return pos.view(B, -1, N).transpose(1, 2) + self.scale_embed[tokens.scale.clamp_min(0)]

    def forward(self, x: torch.Tensor, *, generator: torch.Generator | None = None,
                tokens: Tokens | None = None) -> dict:
        self._check(x)
        tokens = tokens if tokens is not None else self.tokenize(x)
        base_patches = patch_targets(x, self.cfg.patch_size)
        z = self.embed_tokens(x, tokens, base_patches)
        ids_keep, keep_valid, masked = self.random_masking(tokens, generator)
        vis = torch.gather(z, 1, ids_keep[..., None].expand(-1, -1, z.shape[-1]))
        latent = self._encode(vis, keep_valid)
        dec = self.decoder_embed(latent)
        B, N = tokens.valid.shape
        full = self.mask_token.expand(B, N, -1).clone()
        rows = torch.arange(B, device=x.device)[:, None].expand_as(ids_keep)
        full[rows[keep_valid], ids_keep[keep_valid]] = dec[:, 1:][keep_valid]
        full = full + self.decoder_pos(tokens)
        h = torch.cat([dec[:, :1], full], 1)
        keep = torch.cat([torch.ones_like(tokens.valid[:, :1]), tokens.valid], 1)
        for blk in self.dec_blocks:
            h = blk(h, keep)
        h = self.dec_norm(h)[:, 1:]
        return self.loss(x, h, tokens, masked, base_patches)

    def loss(self, x: torch.Tensor, hidden: torch.Tensor, tokens: Tokens, masked: torch.Tensor,
             base_patches: torch.Tensor | None = None) -> dict:
        """Scale-aware reconstruction loss on the masked tokens (see ``OmniFMRIConfig.loss_norm``)."""
        per_scale_sum, per_scale_n, preds, targets = [], [], [], []
        B = x.shape[0]
        rows = torch.arange(B, device=x.device)[:, None].expand_as(tokens.scale)
        for s, p in enumerate(self.cfg.patch_sizes):
            sel = masked & (tokens.scale == s)
            n = int(sel.sum())
            if n == 0:
                per_scale_sum.append(hidden.new_zeros(()))
                per_scale_n.append(0)
                preds.append(None)
                targets.append(None)
                continue
            pred = self.heads[s](hidden[sel])
            tgt = self._targets(x, base_patches, rows[sel], tokens.grid_index[sel], s)
            if self.cfg.patch_norm:
                tgt = (tgt - tgt.mean(-1, keepdim=True)) / (tgt.var(-1, keepdim=True).sqrt() + 1e-5)
            per_scale_sum.append(((pred - tgt) ** 2).mean(-1).sum())
            per_scale_n.append(n)
            preds.append(pred)
            targets.append(tgt)
        total = max(sum(per_scale_n), 1)
        if self.cfg.loss_norm == "pooled":
            loss = sum(per_scale_sum) / total
        else:
            loss = sum(ss / n for ss, n in zip(per_scale_sum, per_scale_n) if n)
        return {"loss": loss, "tokens": tokens, "masked": masked, "pred": preds, "target": targets,
                "per_scale_sum": [float(v.detach()) for v in per_scale_sum], "per_scale_n": per_scale_n}

    def _targets(self, x, base_patches, b, g, s) -> torch.Tensor:
        """(M, T * (p 2^s)^3) voxels of the given tokens, flattened as (T, pd, ph, pw) (the official layout)."""
        if base_patches is None:
            base_patches = patch_targets(x, self.cfg.patch_size)
        if s == 0:
            return base_patches[b, g]
        sub = sub_patch_index(self.embed_tokens.base_grid, s, g)
        return assemble(base_patches[b[:, None], sub], self.cfg.in_frames, self.cfg.patch_size).reshape(len(g), -1)

    def reconstruct(self, x: torch.Tensor, *, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Paste the predictions of the masked tokens into a copy of x: (reconstruction, masked-voxel mask), both
        (B, T, D, H, W); the visible tokens keep the input values (MAE convention)."""
        with torch.no_grad():
            out = self.forward(x, generator=generator)
        recon, vox = x.clone(), torch.zeros_like(x, dtype=torch.bool)
        tokens, masked = out["tokens"], out["masked"]
        T = x.shape[1]
        for s, p in enumerate(self.cfg.patch_sizes):
            if out["pred"][s] is None:
                continue
            sel = masked & (tokens.scale == s)
            b_idx = torch.arange(x.shape[0])[:, None].expand_as(tokens.scale)[sel]
            for b, c, pr in zip(b_idx.tolist(), tokens.coords[sel].tolist(), out["pred"][s]):
                z, y, w = c
                recon[b, :, z:z + p, y:y + p, w:w + p] = pr.view(T, p, p, p)
                vox[b, :, z:z + p, y:y + p, w:w + p] = True
        return recon, vox


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

