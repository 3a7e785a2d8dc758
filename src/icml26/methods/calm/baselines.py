"""Forecasting baselines at one interface: ``model(context) -> forecast``, context (B, N, L) frames -> (B, N, H).

* :class:`NLinear` (Zeng et al. 2023): subtract the last value, one linear map L -> H shared by every neuron.
* :class:`TSMixer` (Chen et al. 2023): RevIN, then blocks of a time-mixing MLP (along L, per neuron) and a
  channel-mixing MLP (across the session's N neurons), then a linear L -> H head. Channel mixing ties it to one
  session's neurons, so it is trained on the target session only, as in its paper (one model per dataset).
* :class:`GRUForecaster`: a univariate GRU over each neuron's context, a linear head to H frames (weights shared
  across neurons, so one model trains on many sessions).
* :class:`POCOLite`: POCO's shape (Duan et al. 2025, github yuvenduan/POCO) without its per-unit embeddings (our
  target neurons are new): a per-neuron MLP forecaster whose hidden layer is FiLM-modulated by a population
  summary, read out by a few learned queries attending over all neurons' context embeddings (Perceiver style).
  RECONSTRUCTED from the POCO paper's description; no POCO code was copied.

Ridge AR and copy-last are closed-form and live in ``experiments.py``.
"""

from __future__ import annotations

import torch
from torch import nn


class NLinear(nn.Module):
    def __init__(self, context: int, horizon: int):
        super().__init__()
        self.lin = nn.Linear(context, horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = x[..., -1:]
        return self.lin(x - last) + last


class TSMixer(nn.Module):
    def __init__(self, context: int, horizon: int, n_channels: int, *, hidden: int = 64, n_blocks: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.time = nn.ModuleList(nn.Sequential(nn.Linear(context, context), nn.ReLU(), nn.Dropout(dropout))
                                  for _ in range(n_blocks))
        self.chan = nn.ModuleList(nn.Sequential(nn.Linear(n_channels, hidden), nn.ReLU(), nn.Dropout(dropout),
                                                nn.Linear(hidden, n_channels)) for _ in range(n_blocks))
        self.ln_t = nn.ModuleList(nn.LayerNorm(n_channels) for _ in range(n_blocks))
        self.ln_c = nn.ModuleList(nn.LayerNorm(n_channels) for _ in range(n_blocks))
        self.head = nn.Linear(context, horizon)
        self.n_channels = n_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.n_channels:
            raise ValueError(f"TSMixer was built for {self.n_channels} neurons, got {x.shape[1]}")
        mu, sd = x.mean(-1, keepdim=True), x.std(-1, keepdim=True).clamp_min(1e-5)  # RevIN (no affine)
        h = ((x - mu) / sd).transpose(1, 2)  # (B, L, N)
        for t, c, lt, lc in zip(self.time, self.chan, self.ln_t, self.ln_c):
            h = h + t(lt(h).transpose(1, 2)).transpose(1, 2)
            h = h + c(lc(h))
        return self.head(h.transpose(1, 2)) * sd + mu


class GRUForecaster(nn.Module):
    def __init__(self, context: int, horizon: int, *, hidden: int = 32):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, L = x.shape
        _, h = self.gru(x.reshape(B * N, L, 1))
        return (self.head(h[-1]) + x.reshape(B * N, L)[:, -1:]).reshape(B, N, -1)


class POCOLite(nn.Module):
    def __init__(self, context: int, horizon: int, *, hidden: int = 64, d: int = 32, n_queries: int = 4,
                 heads: int = 4):
        super().__init__()
        self.unit = nn.Sequential(nn.Linear(context, d), nn.GELU(), nn.Linear(d, d))
        self.queries = nn.Parameter(torch.randn(n_queries, d) * 0.1)
        self.pool = nn.MultiheadAttention(d, heads, batch_first=True)
        self.film = nn.Linear(n_queries * d, 2 * hidden)
        self.inp = nn.Linear(context, hidden)
        self.out = nn.Sequential(nn.GELU(), nn.Linear(hidden, horizon))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        e = self.unit(x)  # (B, N, d)
        summary = self.pool(self.queries.expand(B, -1, -1), e, e, need_weights=False)[0].flatten(1)
        scale, shift = self.film(summary).unsqueeze(1).chunk(2, -1)  # (B, 1, hidden) each
        return self.out(self.inp(x) * (1 + scale) + shift) + x[..., -1:]


def build_baseline(name: str, context: int, horizon: int, n_channels: int) -> nn.Module:
    """Build one of ``nlinear, tsmixer, gru, poco`` at the room's default sizes."""
    if name == "nlinear":
        return NLinear(context, horizon)
    if name == "tsmixer":
        return TSMixer(context, horizon, n_channels)
    if name == "gru":
        return GRUForecaster(context, horizon)
    if name == "poco":
        return POCOLite(context, horizon)
    raise ValueError(f"unknown baseline {name!r}; expected one of nlinear, tsmixer, gru, poco")
