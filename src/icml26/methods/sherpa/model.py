"""A promptable segmenter in SAM's shape, small enough for a CPU: ViT image encoder, point/box prompt encoder with
random Fourier position features, and a two-way-transformer mask decoder with a hypernetwork output token
(Kirillov et al. 2023, Sec. 3; no SAM code or weights are used).

Shapes: image (B, 1, S, S) -> encoder tokens (B, N = (S/p)^2, d) -> neck (B, N, c) -> mask logits (B, S, S).
The encoder keeps each block's queries and keys of the last forward (``block.last_q``, ``block.last_k``, (B, N, d)
before the head split) so that guidance losses can read attention without a second pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class SegmenterSize:
    dim: int
    depth: int
    heads: int
    decoder_dim: int
    patch: int = 4
    image_size: int = 32


SMALL = SegmenterSize(dim=32, depth=2, heads=2, decoder_dim=32)
LARGE = SegmenterSize(dim=64, depth=4, heads=4, decoder_dim=32)


class LoRALinear(nn.Module):
    """y = W x + b + (alpha / r) B A x with A (r, in) Gaussian-initialised and B (out, r) zero: starts equal to the
    frozen base layer."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, base.in_features, generator=generator) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = (alpha if alpha is not None else rank) / rank

    def delta(self) -> torch.Tensor:
        """(out, in) weight update B A * scale."""
        return self.scale * self.B @ self.A

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight + self.delta()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.A), self.B)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_dim: int | None = None):
        super().__init__()
        self.heads = heads
        kv_dim = kv_dim or dim
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(kv_dim, dim), nn.Linear(kv_dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None, *, keep: bool = False):
        ctx = x if ctx is None else ctx
        q, k, v = self.q(x), self.k(ctx), self.v(ctx)
        B, N, C = q.shape
        h = self.heads

        def split(t):
            return t.reshape(B, t.shape[1], h, C // h).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v))
        out = self.proj(out.transpose(1, 2).reshape(B, N, C))
        return (out, q, k) if keep else out


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.last_q = self.last_k = self.last_in = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        a, self.last_q, self.last_k = self.attn(h, keep=True)
        self.last_in = h
        x = x + a
        return x + self.mlp(self.norm2(x))

    def attention_map(self) -> torch.Tensor:
        """(B, N, N) head-averaged softmax(Q_h K_h^T / sqrt(d_h)) of the last forward."""
        q, k = self.last_q, self.last_k
        B, N, C = q.shape
        h = self.attn.heads
        qh, kh = q.reshape(B, N, h, C // h).transpose(1, 2), k.reshape(B, N, h, C // h).transpose(1, 2)
        return torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(C // h), -1).mean(1)


class PromptableSegmenter(nn.Module):
    """``forward(image, point, box=None) -> mask logits (B, S, S)``; point (B, 2) and box (B, 4) in pixels."""

    def __init__(self, size: SegmenterSize):
        super().__init__()
        self.size = size
        d, c, p = size.dim, size.decoder_dim, size.patch
        self.grid = size.image_size // p
        self.patch_embed = nn.Linear(p * p, d)
        self.pos = nn.Parameter(torch.randn(1, self.grid ** 2, d) * 0.02)
        self.blocks = nn.ModuleList([EncoderBlock(d, size.heads) for _ in range(size.depth)])
        self.neck = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, c))
        # prompt encoder: random Fourier features of the normalised coordinates + a learned type embedding
        self.register_buffer("fourier", torch.randn(2, c // 2))
        self.point_type = nn.Parameter(torch.randn(3, c) * 0.02)  # foreground point, box corner 1, box corner 2
        self.no_mask = nn.Parameter(torch.zeros(1, 1, c))
        # mask decoder (one two-way layer + final token-to-image attention), SAM style
        self.out_token = nn.Parameter(torch.randn(1, 1, c) * 0.02)
        self.self_attn = Attention(c, 2)
        self.t2i = Attention(c, 2)
        self.i2t = Attention(c, 2)
        self.final = Attention(c, 2)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.norms = nn.ModuleList([nn.LayerNorm(c) for _ in range(5)])
        self.upscale = nn.Sequential(nn.ConvTranspose2d(c, c // 2, 2, 2), nn.GELU(),
                                     nn.ConvTranspose2d(c // 2, c // 4, 2, 2))
        self.hyper = nn.Sequential(nn.Linear(c, c), nn.GELU(), nn.Linear(c, c // 4))

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """(B, 1, S, S) -> (B, N, d) encoder tokens (raster order over the S/p x S/p grid)."""
        B, _, S, _ = image.shape
        p, g = self.size.patch, self.grid
        patches = image.reshape(B, g, p, g, p).permute(0, 1, 3, 2, 4).reshape(B, g * g, p * p)
        x = self.patch_embed(patches) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return x

    def _pe(self, coords: torch.Tensor) -> torch.Tensor:
        """(B, n, 2) pixel coordinates -> (B, n, c) Fourier features."""
        u = (coords + 0.5) / self.size.image_size * 2 - 1
        proj = 2 * math.pi * u @ self.fourier
        return torch.cat([proj.sin(), proj.cos()], -1)

    def _image_pe(self) -> torch.Tensor:
        g, p = self.grid, self.size.patch
        centres = (torch.arange(g, device=self.fourier.device, dtype=torch.float32) + 0.5) * p - 0.5
        yy, xx = torch.meshgrid(centres, centres, indexing="ij")
        return self._pe(torch.stack([yy, xx], -1).reshape(1, g * g, 2))

    def decode(self, feats: torch.Tensor, point: torch.Tensor, box: torch.Tensor | None = None) -> torch.Tensor:
        B = feats.shape[0]
        img = self.neck(feats) + self.no_mask
        img_pe = self._image_pe()
        prompts = self._pe(point[:, None].float()) + self.point_type[0]
        if box is not None:
            corners = box.float().reshape(B, 2, 2)
            prompts = torch.cat([prompts, self._pe(corners) + self.point_type[1:]], 1)
        tok = torch.cat([self.out_token.expand(B, -1, -1), prompts], 1)
        pe_tok = tok
        tok = self.norms[0](tok + self.self_attn(tok))
        tok = self.norms[1](tok + self.t2i(tok + pe_tok, img + img_pe))
        tok = self.norms[2](tok + self.mlp(tok))
        img = self.norms[3](img + self.i2t(img + img_pe, tok + pe_tok))
        tok = self.norms[4](tok + self.final(tok + pe_tok, img + img_pe))
        g = self.grid
        up = self.upscale(img.transpose(1, 2).reshape(B, -1, g, g))  # (B, c/4, S, S)
        w = self.hyper(tok[:, 0])  # (B, c/4)
        return torch.einsum("bc,bchw->bhw", w, up)

    def forward(self, image: torch.Tensor, point: torch.Tensor, box: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode(self.encode(image), point, box)


def add_lora(model: PromptableSegmenter, rank: int, *, generator: torch.Generator | None = None
             ) -> list[nn.Parameter]:
    """Freeze the encoder, put LoRA on every encoder attention's q, k, v and proj; the neck, prompt encoder and mask
    decoder stay trainable (the usual SAM PEFT recipe). Returns the trainable parameters."""
    for p in model.parameters():
        p.requires_grad_(True)
    for p in [model.patch_embed.weight, model.patch_embed.bias, model.pos]:
        p.requires_grad_(False)
    for blk in model.blocks:
        for p in blk.parameters():
            p.requires_grad_(False)
        for name in ("q", "k", "v", "proj"):
            setattr(blk.attn, name, LoRALinear(getattr(blk.attn, name), rank, generator=generator))
    return [p for p in model.parameters() if p.requires_grad]


def seg_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SAM's mask loss at 20:1 focal-to-dice in spirit, simplified: BCE + soft Dice (equal weights)."""
    bce = F.binary_cross_entropy_with_logits(logits, mask)
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * mask).sum((1, 2)) + 1) / (p.sum((1, 2)) + mask.sum((1, 2)) + 1)
    return bce + dice.mean()


@torch.no_grad()
def dice_iou(logits: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean Dice and mean IoU of the thresholded masks (per image, then averaged)."""
    pred = (logits > 0).float()
    inter = (pred * mask).sum((1, 2))
    union = pred.sum((1, 2)) + mask.sum((1, 2))
    dice = (2 * inter / union.clamp_min(1)).mean()
    iou = (inter / (union - inter).clamp_min(1)).mean()
    return float(dice), float(iou)
