"""CalM at laptop scale: a shared patch tokenizer and a dual-axis autoregressive transformer with a forecasting
and a behaviour-decoding head.

Shapes: a window of traces is (B, N, T) with T = n_patches * P; tokens are (B, N, n_patches) integers in [0, K).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .config import CalMConfig


def patchify(traces: torch.Tensor, patch_len: int) -> torch.Tensor:
    """(..., T) -> (..., T // P, P): non-overlapping patches, the tail dropped."""
    n_p = traces.shape[-1] // patch_len
    return traces[..., :n_p * patch_len].reshape(*traces.shape[:-1], n_p, patch_len)


class PatchTokenizer:
    """Shared discrete vocabulary: a k-means codebook (K, P) over z-scored single-neuron patches.

    A nonparametric stand-in for the paper's learned tokenizer (which is not public): encode = nearest centroid,
    decode = centroid lookup; the same codebook serves every neuron, session and family.
    """

    def __init__(self, codebook: torch.Tensor):
        self.codebook = codebook.float()

    @classmethod
    def fit(cls, patches: torch.Tensor, codebook_size: int, *, seed: int = 0, iters: int = 25,
            max_points: int = 20_000) -> "PatchTokenizer":
        """Lloyd's k-means with k-means++-style seeding on at most ``max_points`` patches (M, P)."""
        gen = torch.Generator().manual_seed(seed)
        pts = patches.reshape(-1, patches.shape[-1]).float()
        if len(pts) > max_points:
            pts = pts[torch.randperm(len(pts), generator=gen)[:max_points]]
        if len(pts) < codebook_size:
            raise ValueError(f"need at least codebook_size={codebook_size} patches to fit, got {len(pts)}")
        centers = pts[torch.randint(len(pts), (1,), generator=gen)]
        for _ in range(codebook_size - 1):
            d2 = torch.cdist(pts, centers).min(1).values ** 2
            centers = torch.cat([centers, pts[torch.multinomial(d2 + 1e-12, 1, generator=gen)]])
        for _ in range(iters):
            assign = torch.cdist(pts, centers).argmin(1)
            sums = torch.zeros_like(centers).index_add_(0, assign, pts)
            counts = torch.bincount(assign, minlength=codebook_size).unsqueeze(1)
            centers = torch.where(counts > 0, sums / counts.clamp_min(1), centers)
        return cls(centers)

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """(..., P) -> (...) code indices."""
        flat = patches.reshape(-1, patches.shape[-1]).float()
        return torch.cdist(flat, self.codebook).argmin(1).reshape(patches.shape[:-1])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codebook[codes]


class DualAxisBlock(nn.Module):
    """Temporal causal self-attention per neuron, then attention across neurons at each patch, then an MLP."""

    def __init__(self, d: int, heads: int, neural: bool):
        super().__init__()
        self.ln_t, self.ln_n, self.ln_m = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn_t = nn.MultiheadAttention(d, heads, batch_first=True)
        self.attn_n = nn.MultiheadAttention(d, heads, batch_first=True) if neural else None
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, N, T, d = h.shape
        x = h.reshape(B * N, T, d)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1)
        y = self.ln_t(x)
        x = x + self.attn_t(y, y, y, attn_mask=causal, need_weights=False)[0]
        h = x.reshape(B, N, T, d)
        if self.attn_n is not None:
            # every state at patch t is already causal in time, so mixing neurons at the same t leaks no future
            x = h.transpose(1, 2).reshape(B * T, N, d)
            y = self.ln_n(x)
            x = x + self.attn_n(y, y, y, need_weights=False)[0]
            h = x.reshape(B, T, N, d).transpose(1, 2)
        return h + self.mlp(self.ln_m(h))


class CalM(nn.Module):
    """Dual-axis autoregressive transformer over neuron x patch tokens.

    forward(inputs) -> next-token logits (B, N, T, K) for ``tokenizer="vq"`` (inputs: codes (B, N, T)), or the
    next patch (B, N, T, P) for ``tokenizer="continuous"`` (inputs: patches (B, N, T, P)). Position t predicts t+1.
    """

    def __init__(self, config: CalMConfig, tokenizer: PatchTokenizer | None = None):
        super().__init__()
        self.config, self.tokenizer = config, tokenizer
        c = config
        if c.tokenizer == "vq":
            if tokenizer is None or tokenizer.codebook.shape != (c.codebook_size, c.patch_len):
                raise ValueError("tokenizer='vq' needs a PatchTokenizer with a (codebook_size, patch_len) codebook")
            self.embed = nn.Embedding(c.codebook_size, c.d_model)
            self.out = nn.Linear(c.d_model, c.codebook_size)
        else:
            self.embed = nn.Linear(c.patch_len, c.d_model)
            self.out = nn.Linear(c.d_model, c.patch_len)
        self.pos = nn.Parameter(torch.randn(c.max_patches, c.d_model) * 0.02)
        self.blocks = nn.ModuleList(DualAxisBlock(c.d_model, c.n_heads, c.neural_axis != "none")
                                    for _ in range(c.n_blocks))
        self.ln_f = nn.LayerNorm(c.d_model)

    def inputs_from_traces(self, traces: torch.Tensor) -> torch.Tensor:
        patches = patchify(traces, self.config.patch_len)
        return self.tokenizer.encode(patches) if self.config.tokenizer == "vq" else patches

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, N, T, d)."""
        h = self.embed(inputs)
        T = h.shape[2]
        if T > self.config.max_patches:
            raise ValueError(f"window of {T} patches exceeds max_patches={self.config.max_patches}")
        h = h + self.pos[:T]
        for blk in self.blocks:
            h = blk(h)
        return self.ln_f(h)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(inputs))

    def loss(self, traces: torch.Tensor) -> torch.Tensor:
        """Next-token objective on a window (B, N, T_frames): CE over the codebook, or MSE for continuous."""
        inputs = self.inputs_from_traces(traces)
        pred = self(inputs[:, :, :-1])
        if self.config.tokenizer == "vq":
            return nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), inputs[:, :, 1:].reshape(-1))
        return nn.functional.mse_loss(pred, inputs[:, :, 1:])

    @torch.no_grad()
    def forecast(self, context: torch.Tensor, horizon_patches: int) -> torch.Tensor:
        """Forecasting head: (B, N, T_ctx) frames -> (B, N, horizon_patches * P) frames, autoregressively.

        vq: each step's forecast is the expected centroid under the predicted code distribution (the MSE-optimal
        point forecast given the logits); the argmax code is fed back for the next step."""
        inputs = self.inputs_from_traces(context)
        outs = []
        for _ in range(horizon_patches):
            last = self(inputs)[:, :, -1]
            if self.config.tokenizer == "vq":
                outs.append(last.softmax(-1) @ self.tokenizer.codebook)
                inputs = torch.cat([inputs, last.argmax(-1, keepdim=True)], dim=2)
            else:
                outs.append(last)
                inputs = torch.cat([inputs, last.unsqueeze(2)], dim=2)
        return torch.cat(outs, dim=-1)

    @torch.no_grad()
    def pooled_features(self, traces: torch.Tensor) -> torch.Tensor:
        """Decoding-head input: hidden states averaged over neurons, (B, T_patches, d) (permutation invariant)."""
        return self.features(self.inputs_from_traces(traces)).mean(1)


def poco_score(pred: np.ndarray, target: np.ndarray, last: np.ndarray) -> float:
    """Prediction score 1 - MSE(pred) / MSE(copy-last) (POCO's convention); pred/target (..., H), last (...)."""
    mse = float(np.mean((pred - target) ** 2))
    mse_copy = float(np.mean((last[..., None] - target) ** 2))
    return 1.0 - mse / mse_copy


def ridge_fit(X: np.ndarray, Y: np.ndarray, alpha: float) -> np.ndarray:
    """Closed-form ridge with an unpenalised intercept; returns W (F+1, O) for [X, 1] @ W."""
    mu_x, mu_y = X.mean(0), Y.mean(0)
    Xc, Yc = X - mu_x, Y - mu_y
    W = np.linalg.solve(Xc.T @ Xc + alpha * np.eye(X.shape[1]), Xc.T @ Yc)
    return np.vstack([W, mu_y - mu_x @ W])


def ridge_predict(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    return X @ W[:-1] + W[-1]


def r2_score(pred: np.ndarray, target: np.ndarray) -> float:
    target, pred = target.reshape(len(target), -1), pred.reshape(len(pred), -1)
    return 1.0 - float(((target - pred) ** 2).sum()) / float(((target - target.mean(0)) ** 2).sum())
