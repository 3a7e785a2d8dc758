"""TabICLv2 network, plain and readable (our own code; design read from soda-inria/tabicl at commit
8f1aa2098c894ab91dba15209cf2002ba4be6c6c, ``src/tabicl/_model/``).

A table of T rows (the first ``n_train`` labelled) and H features goes through three stages:

1. **Column stage** (``ColumnEmbedder``): features are grouped three at a time by circular shifts
   (group j = (x_{j+1}, x_{j+2}, x_{j+4}) mod H, so G = H groups and each feature appears in 3 groups); a linear
   map lifts each triple to E; the label embedding is added to the *training* cells; a shared induced set
   transformer runs down every column, its inducing points attending to training cells only (step A, with
   (QA)SSMax, n = n_train) and every cell attending to the inducing outputs (step B).
2. **Row stage** (``RowInteractor``): per row, [CLS x C] + G group tokens go through pre-LN transformer blocks
   with rotary position embeddings (half-split, base 1e5); the last block updates only the CLS tokens, which are
   layer-normed and concatenated into a row vector of width C*E.
3. **In-context stage** (``ICLearner``): the label embedding is added to the training rows; every row (train
   and test) attends only to the training rows, with (QA)SSMax, n = n_train; final LN and an MLP head give
   ``max_classes`` logits, or, for the regressor (``max_classes == 0``, the official convention), ``num_quantiles``
   quantiles of y at levels linspace(0, 1, Q + 2)[1:-1]. The regressor embeds the (standardised) target with a
   linear map 1 -> width instead of one-hot + linear, in both stages.

Nothing lets a training row see a test row, and nothing mixes two test rows, so a test row's prediction does not
depend on the other test rows; no stage has a row position, so permuting training rows does not change it.

``attention`` has a reference path (explicit softmax) and a fast path (``F.scaled_dot_product_attention``);
``tests/methods/test_tabicl2.py`` checks they agree in outputs and gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import TabICLConfig

_FAST = True
"""Use SDPA inside :func:`attention` (set to False by the parity test to run the explicit softmax)."""


def attention(q: Tensor, k: Tensor, v: Tensor, fast: bool | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d)) v over the last two dims: q (..., Tq, d), k/v (..., Tk, d) -> (..., Tq, d)."""
    if fast if fast is not None else _FAST:
        shape = q.shape
        q4, k4, v4 = (x.reshape(-1, 1, *x.shape[-2:]) for x in (q, k, v))
        return F.scaled_dot_product_attention(q4, k4, v4).reshape(shape)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


class SSMax(nn.Module):
    """Scalable softmax (Nakanishi 2025): q <- q * s_h * log n, one learnable s per head (init 1)."""

    def __init__(self, num_heads: int, head_dim: int, hidden: int = 64):
        super().__init__()
        self.scales = nn.Parameter(torch.ones(num_heads))

    def forward(self, q: Tensor, n: int) -> Tensor:
        """q (B, heads, Tq, d_h), n = number of keys -> scaled q, same shape."""
        return q * (self.scales.view(-1, 1, 1) * math.log(max(n, 1)))


class QASSMax(nn.Module):
    """Query-aware scalable softmax, element-wise (TabICLv2 default ``qassmax-mlp-elementwise``).

    q <- q * base_mlp(log n) * (1 + tanh(query_mlp(q))), with base_mlp: 1 -> hidden -> heads*d_h (GELU) giving a
    per-head, per-dimension length scale and query_mlp: d_h -> hidden -> d_h (GELU, shared across heads) giving a
    query-dependent modulation in (0, 2). query_mlp's last layer is zero-initialised, so at init the modulation is
    exactly 1 and QASSMax equals the base (SSMax-MLP) scaling.
    """

    def __init__(self, num_heads: int, head_dim: int, hidden: int = 64):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.base_mlp = nn.Sequential(nn.Linear(1, hidden), nn.GELU(), nn.Linear(hidden, num_heads * head_dim))
        self.query_mlp = nn.Sequential(nn.Linear(head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim))
        nn.init.zeros_(self.query_mlp[-1].weight)
        nn.init.zeros_(self.query_mlp[-1].bias)

    def base_scale(self, n: int, like: Tensor) -> Tensor:
        """base_mlp(log n) as (heads, 1, d_h)."""
        logn = torch.full((1, 1), math.log(max(n, 1)), dtype=like.dtype, device=like.device)
        return self.base_mlp(logn).view(self.num_heads, 1, self.head_dim)

    def forward(self, q: Tensor, n: int) -> Tensor:
        """q (..., heads, Tq, d_h), n = number of keys -> scaled q, same shape."""
        return q * self.base_scale(n, q) * (1 + torch.tanh(self.query_mlp(q)))


def target_encoder(cfg: TabICLConfig, width: int) -> nn.Linear:
    """Label embedding: one-hot (max_classes) -> width for classes; scalar y -> width for regression."""
    return nn.Linear(1 if cfg.regression else cfg.max_classes, width)


def embed_target(encoder: nn.Linear, y: Tensor, cfg: TabICLConfig, dtype: torch.dtype) -> Tensor:
    """y (B, n) int64 class ids or float targets -> (B, n, width)."""
    if cfg.regression:
        return encoder(y.to(dtype)[..., None])
    return encoder(F.one_hot(y, cfg.max_classes).to(dtype))


def quantile_levels(num_quantiles: int, device=None, dtype=torch.float32) -> Tensor:
    """alpha_1..alpha_Q = linspace(0, 1, Q + 2)[1:-1], the levels the regression head predicts (official)."""
    return torch.linspace(0.0, 1.0, num_quantiles + 2, device=device, dtype=dtype)[1:-1]


def pinball_loss(pred: Tensor, y: Tensor) -> Tensor:
    """Mean pinball loss of quantile predictions pred (..., Q) for targets y (...) at :func:`quantile_levels`."""
    alphas = quantile_levels(pred.shape[-1], pred.device, pred.dtype)
    err = y[..., None] - pred
    return torch.maximum(alphas * err, (alphas - 1) * err).mean()


def make_ssmax(kind: str, num_heads: int, head_dim: int, hidden: int) -> nn.Module | None:
    if kind == "none":
        return None
    return {"ssmax": SSMax, "qassmax": QASSMax}[kind](num_heads, head_dim, hidden)


class RoPE(nn.Module):
    """Rotary embedding, half-split variant (pairs (x_i, x_{i+d/2})), frequencies base^(-2i/d)."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., L, d_h) rotated by position 0..L-1 along L."""
        pos = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
        ang = torch.outer(pos, self.inv_freq.to(x.device))
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MHA(nn.Module):
    """Multi-head attention with optional query scaling (``ssmax``) and RoPE on q and k."""

    def __init__(self, dim: int, num_heads: int, ssmax: str = "none", hidden: int = 64, rope: RoPE | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)
        self.ssmax = make_ssmax(ssmax, num_heads, self.head_dim, hidden)
        self.rope = rope

    def forward(self, x: Tensor, ctx: Tensor) -> Tensor:
        """x (..., Tq, dim) queries, ctx (..., Tk, dim) keys/values -> (..., Tq, dim)."""
        *batch, tq, dim = x.shape
        tk = ctx.shape[-2]
        q = self.q(x).view(*batch, tq, self.num_heads, self.head_dim).transpose(-3, -2)
        k, v = self.kv(ctx).view(*ctx.shape[:-2], tk, 2, self.num_heads, self.head_dim).unbind(-3)
        k, v = k.transpose(-3, -2), v.transpose(-3, -2)
        if self.rope is not None:
            # queries are a prefix of the keys' positions (CLS-only last row block), so rotate both from 0
            q, k = self.rope(q), self.rope(k)
        if self.ssmax is not None:
            q = self.ssmax(q, tk)
        o = attention(q, k, v)
        return self.out(o.transpose(-3, -2).reshape(*batch, tq, dim))


class Block(nn.Module):
    """Pre-LN attention + feed-forward block. ``forward(x, ctx)``: x attends to LN(ctx) (same LN as the queries)."""

    def __init__(self, dim: int, num_heads: int, ff_factor: int, ssmax: str = "none", hidden: int = 64,
                 rope: RoPE | None = None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MHA(dim, num_heads, ssmax, hidden, rope)
        self.ff = nn.Sequential(nn.Linear(dim, dim * ff_factor), nn.GELU(), nn.Linear(dim * ff_factor, dim))

    def forward(self, x: Tensor, ctx: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), self.norm1(ctx))
        return x + self.ff(self.norm2(x))


class InducedBlock(nn.Module):
    """Induced set attention block over the cells of one column.

    Step A: M inducing points I (M, E) attend to the first ``n_train`` cells -> H (..., M, E) (query scaling with
    n = n_train); step B: every cell attends to H. Cost is O(T M) instead of O(T^2), and test cells never reach H.
    """

    def __init__(self, cfg: TabICLConfig):
        super().__init__()
        E = cfg.embed_dim
        self.inducing = nn.Parameter(torch.empty(cfg.col_num_inds, E))
        nn.init.trunc_normal_(self.inducing, std=0.02)
        self.step_a = Block(E, cfg.col_nhead, cfg.ff_factor, cfg.ssmax, cfg.ssmax_hidden)
        self.step_b = Block(E, cfg.col_nhead, cfg.ff_factor, "none")

    def forward(self, cells: Tensor, n_train: int) -> Tensor:
        """cells (..., T, E) -> (..., T, E)."""
        ind = self.inducing.expand(*cells.shape[:-2], *self.inducing.shape)
        h = self.step_a(ind, cells[..., :n_train, :])
        return self.step_b(cells, h)


def group_features(X: Tensor, size: int = 3) -> Tensor:
    """X (B, T, H) -> (B, T, H, size): group j holds features (j + 2^i) mod H for i < size ("same" grouping)."""
    H = X.shape[-1]
    idx = torch.arange(H, device=X.device)
    return torch.stack([X[..., (idx + 2 ** i) % H] for i in range(size)], dim=-1)


class ColumnEmbedder(nn.Module):
    """Column stage: grouped cells -> target-aware induced set transformer per column. Output (B, T, G, E)."""

    def __init__(self, cfg: TabICLConfig):
        super().__init__()
        self.cfg = cfg
        self.in_linear = nn.Linear(cfg.feature_group_size, cfg.embed_dim)
        self.y_encoder = target_encoder(cfg, cfg.embed_dim)
        self.blocks = nn.ModuleList(InducedBlock(cfg) for _ in range(cfg.col_num_blocks))

    def forward(self, X: Tensor, y_train: Tensor) -> Tensor:
        n_train = y_train.shape[1]
        cells = self.in_linear(group_features(X, self.cfg.feature_group_size)).transpose(1, 2)  # (B, G, T, E)
        y_emb = embed_target(self.y_encoder, y_train, self.cfg, cells.dtype)  # (B, n_train, E)
        cells = torch.cat([cells[:, :, :n_train] + y_emb[:, None], cells[:, :, n_train:]], dim=2)
        for block in self.blocks:
            cells = block(cells, n_train)
        return cells.transpose(1, 2)


class RowInteractor(nn.Module):
    """Row stage: [CLS]*C + G tokens per row, RoPE transformer; returns concatenated LN(CLS) (B, T, C*E)."""

    def __init__(self, cfg: TabICLConfig):
        super().__init__()
        E = cfg.embed_dim
        self.cls = nn.Parameter(torch.empty(cfg.row_num_cls, E))
        nn.init.trunc_normal_(self.cls, std=0.02)
        rope = RoPE(E // cfg.row_nhead, cfg.rope_base)
        self.blocks = nn.ModuleList(Block(E, cfg.row_nhead, cfg.ff_factor, "none", rope=rope)
                                    for _ in range(cfg.row_num_blocks))
        self.out_ln = nn.LayerNorm(E)

    def forward(self, emb: Tensor) -> Tensor:
        B, T, G, E = emb.shape
        x = torch.cat([self.cls.expand(B, T, *self.cls.shape), emb], dim=2)
        C = self.cls.shape[0]
        for block in self.blocks[:-1]:
            x = block(x, x)
        # the last block only needs the CLS outputs (their queries sit at positions 0..C-1 like the keys')
        cls = self.blocks[-1](x[:, :, :C], x)
        return self.out_ln(cls).flatten(-2)


class ICLearner(nn.Module):
    """In-context stage: rows attend to training rows only; logits (B, T, max_classes) or quantiles (B, T, Q)."""

    def __init__(self, cfg: TabICLConfig):
        super().__init__()
        D = cfg.icl_dim
        self.cfg = cfg
        self.y_encoder = target_encoder(cfg, D)
        self.blocks = nn.ModuleList(Block(D, cfg.icl_nhead, cfg.ff_factor, cfg.ssmax, cfg.ssmax_hidden)
                                    for _ in range(cfg.icl_num_blocks))
        self.ln = nn.LayerNorm(D)
        self.decoder = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, cfg.out_dim))

    def forward(self, R: Tensor, y_train: Tensor) -> Tensor:
        n_train = y_train.shape[1]
        y_emb = embed_target(self.y_encoder, y_train, self.cfg, R.dtype)
        x = torch.cat([R[:, :n_train] + y_emb, R[:, n_train:]], dim=1)
        for block in self.blocks:
            x = block(x, x[:, :n_train])
        return self.decoder(self.ln(x))


class TabICL(nn.Module):
    """TabICLv2 network (classifier, or quantile regressor when ``cfg.max_classes == 0``).

    ``forward(X, y_train)``: X (B, T, H) float (standardised), y_train (B, n_train) int64 in [0, max_classes)
    (classes) or float (standardised targets, regression); returns logits (B, T - n_train, max_classes) or raw
    quantiles (B, T - n_train, num_quantiles) for the test rows (rows n_train..T-1).
    """

    def __init__(self, cfg: TabICLConfig | None = None):
        super().__init__()
        self.cfg = cfg or TabICLConfig()
        self.col = ColumnEmbedder(self.cfg)
        self.row = RowInteractor(self.cfg)
        self.icl = ICLearner(self.cfg)

    def forward(self, X: Tensor, y_train: Tensor) -> Tensor:
        if X.dim() != 3 or y_train.dim() != 2 or X.shape[0] != y_train.shape[0]:
            raise ValueError(f"expected X (B, T, H) and y_train (B, n_train), got {tuple(X.shape)}, "
                             f"{tuple(y_train.shape)}")
        n_train = y_train.shape[1]
        if not 0 < n_train < X.shape[1]:
            raise ValueError(f"need 0 < n_train < T, got n_train={n_train}, T={X.shape[1]}")
        R = self.row(self.col(X, y_train))
        return self.icl(R, y_train)[:, n_train:]

    @torch.no_grad()
    def predict_quantiles(self, X: Tensor, y_train: Tensor) -> Tensor:
        """Monotone quantiles (B, T - n_train, Q): the raw head sorted along Q (the official default
        ``crossing_method="sort"``); their mean over Q is the predicted mean (official ``output_type="mean"``)."""
        if not self.cfg.regression:
            raise ValueError("predict_quantiles needs a regression network (TabICLConfig.max_classes == 0)")
        return self.forward(X, y_train).sort(-1).values

    @torch.no_grad()
    def predict_proba(self, X: Tensor, y_train: Tensor, n_classes: int, temperature: float | None = None) -> Tensor:
        """Class probabilities (B, T - n_train, n_classes): logits truncated to n_classes, softmax(logits / 0.9)."""
        t = self.cfg.softmax_temperature if temperature is None else temperature
        return (self.forward(X, y_train)[..., :n_classes] / t).softmax(-1)
