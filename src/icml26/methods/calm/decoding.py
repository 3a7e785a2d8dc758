"""Behaviour decoding: a task head on CalM's backbone and the supervised / self-supervised decoders it is compared to.

All decoders map one target session to a per-patch behaviour estimate (patch-mean running speed):
* :class:`DecodingHead`: attention pooling over neurons (one learned query; permutation invariant, any N) of the
  backbone's hidden states (B, N, T, d), then a linear readout -> (B, T). Trained with the backbone frozen
  ("head"), or with LoRA factors on the backbone's MLPs ("lora", via ``core.adapters``).
* :class:`PatchMLP`: an MLP on the session's per-neuron patch means (T, N) -> (T,).
* :class:`PatchGRU`: a causal GRU over the sequence of per-neuron patch means -> (T,).
* :class:`ContrastiveEncoder`: CEBRA-time style (Schneider et al. 2023; RECONSTRUCTED, no code copied): an MLP
  embedding of the patch means on the unit sphere trained with InfoNCE, the next patch as the positive and the other
  patches of the batch as negatives; a ridge readout on the embedding then uses the labels.
"""

from __future__ import annotations

import torch
from torch import nn


class DecodingHead(nn.Module):
    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.out = nn.Linear(d, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, N, T, d) -> (B, T)."""
        B, N, T, d = h.shape
        x = self.ln(h.transpose(1, 2).reshape(B * T, N, d))
        pooled = self.attn(self.query.expand(B * T, -1, -1), x, x, need_weights=False)[0]
        return self.out(pooled).reshape(B, T)


class PatchMLP(nn.Module):
    def __init__(self, n_in: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


class PatchGRU(nn.Module):
    def __init__(self, n_in: int, hidden: int = 32):
        super().__init__()
        self.gru = nn.GRU(n_in, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, N) -> (T,), causal."""
        return self.out(self.gru(x[None])[0][0]).squeeze(-1)


class ContrastiveEncoder(nn.Module):
    def __init__(self, n_in: int, dim: int = 8, hidden: int = 64, temperature: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=-1)

    def loss(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """InfoNCE over anchors x[idx] with positives x[idx + 1]; x (T, N), idx (B,) < T - 1."""
        a, p = self(x[idx]), self(x[idx + 1])
        logits = a @ p.T / self.temperature
        return nn.functional.cross_entropy(logits, torch.arange(len(idx), device=x.device))
