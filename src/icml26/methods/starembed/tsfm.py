"""A tiny Chronos-style time-series foundation model, pretrained in the room on *non-astronomical* KernelSynth-style
Gaussian-process samples and used zero-shot with the StarEmbed recipe (notes 4.3/4.6): magnitudes only (timestamps
ignored), z-normalised, last ``context`` values, left-padded, mean-pooled encoder states.

Chronos itself ships no offline weights (offline-assets.md section 8), so this is a laptop stand-in (RECON): value
tokens by uniform quantisation (Chronos: 4096 bins of mean-scaled values; here 128 bins of z-scores), a 2-layer
transformer encoder, pretrained by masked-token prediction (Chronos trains an encoder-decoder on next-token
cross-entropy).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from .base import CurveEmbedder

N_BINS, PAD, MASK = 128, 128, 129
LIMIT = 4.0


def tokenize(values: np.ndarray, context: int) -> torch.Tensor:
    """[n] values -> [context] token ids: z-score, clip to +-4, 128 uniform bins; left-padded with PAD."""
    v = np.asarray(values, float)[-context:]
    v = (v - v.mean()) / (v.std() + 1e-8)
    ids = np.clip(((v + LIMIT) / (2 * LIMIT) * N_BINS).astype(int), 0, N_BINS - 1)
    out = np.full(context, PAD)
    out[context - len(ids):] = ids
    return torch.as_tensor(out)


def kernel_synth(rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    """[n, length] GP samples; kernels are random sums/products of RBF, periodic, linear, white (KernelSynth-style)."""
    x = np.linspace(0, 1, length)[:, None]
    d = x - x.T

    def random_kernel():
        kind = rng.integers(4)
        if kind == 0:
            return np.exp(-0.5 * d ** 2 / rng.choice([0.01, 0.05, 0.2]) ** 2)
        if kind == 1:
            p = rng.choice([0.02, 0.05, 0.1, 0.25, 0.5])
            return np.exp(-2 * np.sin(np.pi * np.abs(d) / p) ** 2 / rng.choice([0.5, 1.0]) ** 2)
        if kind == 2:
            return (x - rng.uniform()) @ (x - rng.uniform()).T
        return np.eye(length) * rng.choice([0.01, 0.1])

    out = np.empty((n, length))
    for i in range(n):
        K = random_kernel()
        for _ in range(rng.integers(0, 3)):
            K = K + random_kernel() if rng.random() < 0.5 else K * random_kernel()
        w, V = np.linalg.eigh(K + 1e-6 * np.eye(length))
        out[i] = V @ (np.sqrt(np.clip(w, 0, None)) * rng.standard_normal(length))
    return out


class TinyChronosEncoder(nn.Module):
    """Token ids [B, L] -> hidden states [B, L, d]; ``mlm_head`` predicts masked value bins."""

    def __init__(self, context: int, d: int = 32, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(N_BINS + 2, d)
        self.pos = nn.Parameter(0.02 * torch.randn(context, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.mlm_head = nn.Linear(d, N_BINS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.tok(ids) + self.pos, src_key_padding_mask=ids == PAD)


@functools.lru_cache(maxsize=2)
def pretrain(context: int, steps: int, n_series: int = 512, seed: int = 0) -> TinyChronosEncoder:
    """Masked-token pretraining on KernelSynth samples (seed fixed: the 'released' model is the same for every run)."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    series = kernel_synth(rng, n_series, context)
    lengths = rng.integers(context // 4, context + 1, size=n_series)
    data = torch.stack([tokenize(s[:k], context) for s, k in zip(series, lengths)])
    model = TinyChronosEncoder(context)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = data[torch.randint(0, n_series, (32,), generator=gen)]
        mask = (torch.rand(ids.shape, generator=gen) < 0.15) & (ids != PAD)
        logits = model.mlm_head(model(ids.masked_fill(mask, MASK)))
        loss = nn.functional.cross_entropy(logits[mask], ids[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _check_count(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class TSFMEmbedder(CurveEmbedder):
    """Zero-shot foundation-model embedder (scikit-learn transformer): ``transform(curves) -> [n, d]``, the encoder
    states mean-pooled over the non-pad tokens of the last ``context`` magnitudes.

    ``fit`` "loads the released model": the encoder pretrained on KernelSynth GPs with these sizes (seed 0, cached
    per process); it never looks at the light curves or labels, so the embedding is zero-shot. ``transform`` before
    ``fit`` raises NotFittedError.

    Args:
        context: magnitudes kept per curve (the last ones; shorter curves are left-padded).
        pretrain_steps: masked-token pretraining steps of the stand-in encoder.
        n_series: KernelSynth series in the pretraining set.
    """

    name = "tsfm"

    def __init__(self, context: int = 200, pretrain_steps: int = 300, n_series: int = 512):
        self.context = context
        self.pretrain_steps = pretrain_steps
        self.n_series = n_series

    def _check_params(self) -> None:
        _check_count("context", self.context)
        _check_count("pretrain_steps", self.pretrain_steps)
        _check_count("n_series", self.n_series)

    def _fit(self, curves: list) -> int:
        self.model_ = pretrain(int(self.context), int(self.pretrain_steps), int(self.n_series))
        return self.model_.tok.embedding_dim

    @torch.no_grad()
    def _embed(self, curves: list) -> np.ndarray:
        ids = torch.stack([tokenize(lc.mag, self.model_.pos.shape[0]) for lc in curves])
        out = []
        for chunk in ids.split(256):
            h = self.model_(chunk)
            keep = (chunk != PAD).unsqueeze(-1).float()
            out.append((h * keep).sum(1) / keep.sum(1))
        return torch.cat(out).numpy()


class RandomEmbedder(CurveEmbedder):
    """The paper's random baseline: i.i.d. Gaussian vectors [n, dim], independent of the light curves (row i is the
    same for every call with the same seed). Stateless, so ``transform`` also works unfitted.

    Args:
        dim: embedding width.
        seed: seed of the Gaussian draws.
    """

    name = "random"
    _requires_fit = False

    def __init__(self, dim: int = 32, seed: int = 0):
        self.dim = dim
        self.seed = seed

    def _check_params(self) -> None:
        _check_count("dim", self.dim)
        _check_count("seed", self.seed, minimum=0)

    def _fit(self, curves: list) -> int:
        return int(self.dim)

    def _embed(self, curves: list) -> np.ndarray:
        return np.random.default_rng(self.seed).standard_normal((len(curves), int(self.dim)))

    def _width(self) -> int:
        return int(self.dim)
