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

    Every tokenizer of the room has this interface: ``encode`` (..., P) -> (...) codes in [0, K) and ``codebook``
    (K, P), the patch each code decodes to (so ``decode(c) = codebook[c]``). k-means (Lloyd, k-means++ seeding) is
    the nonparametric option: encode = nearest centroid; the same codebook serves every neuron, session and family.
    """

    def __init__(self, codebook: torch.Tensor):
        self.codebook = codebook.float()

    @classmethod
    def fit(cls, patches: torch.Tensor, codebook_size: int, *, seed: int = 0, iters: int = 25,
            max_points: int = 20_000) -> "PatchTokenizer":
        """Lloyd's k-means with k-means++-style seeding on at most ``max_points`` patches (M, P)."""
        gen = torch.Generator().manual_seed(seed)
        pts = patches.reshape(-1, patches.shape[-1]).float().cpu()
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
        return cls(centers.to(patches.device))

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """(..., P) -> (...) code indices."""
        flat = patches.reshape(-1, patches.shape[-1]).float()
        return torch.cdist(flat, self.codebook).argmin(1).reshape(patches.shape[:-1])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codebook[codes]


def _mlp(i: int, h: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, o))


def fsq_levels(codebook_size: int) -> tuple[int, ...]:
    """FSQ levels whose product is K: K's prime factors merged greedily while a level stays <= 8 (64 -> (8, 8)).
    Raises ValueError when K has a prime factor above 8 (a level that coarse is not FSQ's regime)."""
    k, primes = codebook_size, []
    for p in (2, 3, 5, 7):
        while k % p == 0:
            primes.append(p)
            k //= p
    if k != 1:
        raise ValueError(f"codebook_size={codebook_size} has a prime factor above 8; FSQ needs K = product of levels")
    levels: list[int] = []
    for p in sorted(primes, reverse=True):
        for i, lv in enumerate(levels):
            if lv * p <= 8:
                levels[i] *= p
                break
        else:
            levels.append(p)
    return tuple(sorted(levels, reverse=True))


class LearnedTokenizer(nn.Module):
    """A learned patch tokenizer: MLP encoder -> quantiser -> MLP decoder, fit by reconstruction on pretraining
    patches and then frozen. After :meth:`fit`, ``codebook`` (K, P) holds the decoder's output for every code.

    kind="vqvae": VQ-VAE (van den Oord et al. 2017) with an EMA codebook (decay 0.99, k-means initialised on
        encoder outputs), commitment loss beta ||z_e - sg(e)||^2 (beta = 0.25, notes 5.2), straight-through
        gradients; codes used under 10% of a uniform share are restarted from encoder outputs every 50 steps.
    kind="fsq": finite scalar quantisation (Mentzer et al. 2023): d = len(levels) bounded latents, each rounded
        to its level grid, straight-through; K = prod(levels); no codebook loss.
    kind="rvq": residual VQ (SoundStream, Zeghidour et al. 2021): ``stages`` S EMA codebooks of k = K^(1/S) codes;
        stage s quantises what stages < s left, z_q = sum_s e_s[i_s]; the token is the index sum_s i_s k^s, so the
        vocabulary is all K = k^S combinations and ``codebook`` (K, P) decodes each of them. Commitment on z - z_q.
    """

    def __init__(self, patch_len: int, codebook_size: int, *, kind: str = "vqvae", code_dim: int = 8,
                 hidden: int = 64, beta: float = 0.25, decay: float = 0.99, stages: int = 2):
        super().__init__()
        if kind not in ("vqvae", "fsq", "rvq"):
            raise ValueError(f"kind must be 'vqvae', 'fsq' or 'rvq', got {kind!r}")
        self.kind, self.beta, self.decay, self.K = kind, beta, decay, codebook_size
        self.stages, self.k = 1, codebook_size
        if kind == "rvq":
            if not (isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1):
                raise ValueError(f"stages must be a positive integer, got {stages!r}")
            k = round(codebook_size ** (1 / stages))
            if k < 2 or k ** stages != codebook_size:
                raise ValueError(f"rvq needs codebook_size = k**stages with k >= 2; {codebook_size} is not a "
                                 f"{stages}-th power of an integer >= 2")
            self.stages, self.k = stages, k
        if kind == "fsq":
            self.levels = fsq_levels(codebook_size)
            code_dim = len(self.levels)
            basis = torch.cumprod(torch.tensor((1,) + self.levels[:-1]), 0)
            self.register_buffer("basis", basis)
        self.enc, self.dec = _mlp(patch_len, hidden, code_dim), _mlp(code_dim, hidden, patch_len)
        # (S, k, d) stage codebooks; VQ-VAE and FSQ use one stage of K (FSQ ignores it)
        self.register_buffer("embed", torch.randn(self.stages, self.k, code_dim))
        self.register_buffer("ema_count", torch.ones(self.stages, self.k))
        self.register_buffer("ema_sum", self.embed.clone())
        self.register_buffer("codebook", torch.zeros(codebook_size, patch_len))

    # ---------------------------------------------------------------------------------------- quantisers
    def _fsq(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounded latent u = (tanh z + 1)/2 (L-1) in [0, L-1], rounded (straight-through) to the integer grid;
        returns the latent rescaled to [-1, 1] and the code index sum_i q_i * prod_{j<i} L_j."""
        L = torch.tensor(self.levels, dtype=z.dtype, device=z.device)
        u = (torch.tanh(z) + 1) / 2 * (L - 1)
        q = u + (torch.round(u) - u).detach()
        idx = (torch.round(u).long() * self.basis).sum(-1)
        return q / (L - 1) * 2 - 1, idx

    def _fsq_grid(self) -> torch.Tensor:
        """(K, d) rescaled latent of every FSQ code, in index order."""
        idx = torch.arange(self.K, device=self.basis.device)
        digits = torch.stack([(idx // b) % lv for b, lv in zip(self.basis.tolist(), self.levels)], -1).float()
        return digits / (torch.tensor(self.levels, device=idx.device).float() - 1) * 2 - 1

    def _quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Greedy residual nearest-code search over the stages: z (M, d) -> (z_q (M, d), token (M,), the residual
        each stage saw). One stage is plain VQ."""
        zq, r, idx, seen = torch.zeros_like(z), z, torch.zeros(len(z), dtype=torch.long, device=z.device), []
        for s in range(self.stages):
            i = torch.cdist(r, self.embed[s]).argmin(1)
            seen.append((r, i))
            e = self.embed[s][i]
            zq, r, idx = zq + e, r - e, idx + i * self.k ** s
        return zq, idx, seen

    def _table_latents(self) -> torch.Tensor:
        """(K, d) quantised latent of every token index: sum over stages of the code its base-k digit names."""
        idx = torch.arange(self.K, device=self.embed.device)
        return sum(self.embed[s][(idx // self.k ** s) % self.k] for s in range(self.stages))

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """(..., P) -> (...) code indices (no gradient)."""
        with torch.no_grad():
            z = self.enc(patches.reshape(-1, patches.shape[-1]).float())
            idx = self._fsq(z)[1] if self.kind == "fsq" else self._quantize(z)[1]
        return idx.reshape(patches.shape[:-1])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codebook[codes]

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction MSE (+ beta * commitment for VQ-VAE) on patches x (M, P); updates the EMA codebook."""
        z = self.enc(x)
        if self.kind == "fsq":
            return nn.functional.mse_loss(self.dec(self._fsq(z)[0]), x)
        e, _, seen = self._quantize(z.detach())
        if self.training:
            with torch.no_grad():
                for s, (r, i) in enumerate(seen):  # each stage's EMA tracks the residuals assigned to its codes
                    onehot = nn.functional.one_hot(i, self.k).type_as(z)
                    self.ema_count[s].mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                    self.ema_sum[s].mul_(self.decay).add_(onehot.T @ r, alpha=1 - self.decay)
                    n = self.ema_count[s].sum()
                    count = (self.ema_count[s] + 1e-5) / (n + self.k * 1e-5) * n  # Laplace smoothing
                    self.embed[s].copy_(self.ema_sum[s] / count.unsqueeze(1))
        zq = z + (e - z).detach()
        return nn.functional.mse_loss(self.dec(zq), x) + self.beta * nn.functional.mse_loss(z, e)

    @classmethod
    def fit(cls, patches: torch.Tensor, codebook_size: int, *, kind: str = "vqvae", seed: int = 0,
            steps: int = 1500, batch: int = 512, lr: float = 2e-3, **kw) -> "LearnedTokenizer":
        """Train on patches (M, P) for ``steps`` Adam steps; return the frozen tokenizer with its decoded table."""
        pts = patches.reshape(-1, patches.shape[-1]).float()
        if len(pts) < codebook_size:
            raise ValueError(f"need at least codebook_size={codebook_size} patches to fit, got {len(pts)}")
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tok = cls(pts.shape[-1], codebook_size, kind=kind, **kw).to(pts.device)
        if kind != "fsq":  # k-means init of each stage on encoder outputs' residuals (as SoundStream): no dead codes
            with torch.no_grad():
                r = tok.enc(pts[torch.randperm(len(pts), generator=gen)[:8 * 1024].to(pts.device)])
                for s in range(tok.stages):
                    init = PatchTokenizer.fit(r, tok.k, seed=seed + s, iters=10).codebook
                    tok.embed[s].copy_(init)
                    tok.ema_sum[s].copy_(init)
                    r = r - init[torch.cdist(r, init).argmin(1)]
        opt = torch.optim.Adam([p for p in tok.parameters()], lr=lr)
        for step in range(steps):
            x = pts[torch.randint(len(pts), (batch,), generator=gen).to(pts.device)]
            loss = tok.loss(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if kind != "fsq" and (step + 1) % 50 == 0 and step + 1 < steps:
                with torch.no_grad():  # restart codes the EMA says are rarely used (< 10% of a uniform share)
                    for s in range(tok.stages):
                        dead = tok.ema_count[s] < 0.1 * batch / tok.k
                        if dead.any():  # from residuals that stage s sees
                            z = tok.enc(pts[torch.randint(len(pts), (int(dead.sum()),), generator=gen)
                                            .to(pts.device)])
                            r = tok._quantize(z)[2][s][0]
                            tok.embed[s][dead], tok.ema_sum[s][dead], tok.ema_count[s][dead] = r, r, 1.0
        tok.eval().requires_grad_(False)
        with torch.no_grad():
            tok.codebook.copy_(tok.dec(tok._fsq_grid() if kind == "fsq" else tok._table_latents()))
        return tok


def fit_tokenizer(kind: str, patches: torch.Tensor, codebook_size: int, *, seed: int = 0,
                  steps: int = 1500, stages: int = 2) -> PatchTokenizer | LearnedTokenizer:
    """The tokenizer ``CalMConfig.tokenizer`` names ("kmeans", "vqvae", "fsq", "rvq" with ``stages`` stages of
    codebook_size ** (1 / stages) codes), fit on patches (M, P)."""
    if kind == "kmeans":
        return PatchTokenizer.fit(patches, codebook_size, seed=seed)
    if kind in ("vqvae", "fsq"):
        return LearnedTokenizer.fit(patches, codebook_size, kind=kind, seed=seed, steps=steps)
    if kind == "rvq":
        return LearnedTokenizer.fit(patches, codebook_size, kind=kind, seed=seed, steps=steps, stages=stages)
    raise ValueError(f"no discrete tokenizer named {kind!r}; expected 'kmeans', 'vqvae', 'fsq' or 'rvq'")


def scalar_quantize(patches: torch.Tensor, levels: int, lo: float, hi: float) -> torch.Tensor:
    """Chronos-style scalar quantisation of every frame to ``levels`` uniform bins on [lo, hi] (bin centres);
    a per-frame vocabulary (P log2 K bits per patch, not log2 K), used only as a fidelity reference."""
    width = (hi - lo) / levels
    idx = ((patches - lo) / width).floor().clamp(0, levels - 1)
    return lo + (idx + 0.5) * width


def reconstruction_r2(recon: torch.Tensor, patches: torch.Tensor) -> float:
    """1 - MSE / Var over all entries of patches (M, P)."""
    return 1.0 - float(((recon - patches) ** 2).mean() / patches.var(unbiased=False))


class DualAxisBlock(nn.Module):
    """Temporal causal self-attention per neuron, then attention across all neurons at each patch, then an MLP.

    Every state at patch t is causal in time, so mixing neurons at the same t leaks nothing from t+1 on (reading
    (i) of "autoregressive along the neural axis", notes 5.2).
    """

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
            x = h.transpose(1, 2).reshape(B * T, N, d)
            y = self.ln_n(x)
            x = x + self.attn_n(y, y, y, need_weights=False)[0]
            h = x.reshape(B, T, N, d).transpose(1, 2)
        return h + self.mlp(self.ln_m(h))


class RasterReadout(nn.Module):
    """Reading (ii) of the neural axis: the state at (n, t) also reads the next tokens X[n', t+1] of neurons
    earlier in a fixed order (n' < n). Keys/values: the N past-only states at t plus the N next-token embeddings
    ``nxt`` under a strictly lower-triangular mask. It sits after the dual-axis blocks, because a state that has
    read X[n', t+1] must not be read by another neuron's state (that would leak X[n', t+1] to neurons n <= n').
    """

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_q, self.ln_kv = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        B, N, T, d = h.shape
        x = h.transpose(1, 2).reshape(B * T, N, d)
        y = self.ln_q(x)
        kv = torch.cat([y, self.ln_kv(nxt.transpose(1, 2).reshape(B * T, N, d))], 1)  # (B*T, 2N, d)
        later = torch.ones(N, N, dtype=torch.bool, device=h.device).triu(0)  # next tokens of n' >= n are hidden
        mask = torch.cat([torch.zeros(N, N, dtype=torch.bool, device=h.device), later], 1)
        x = x + self.attn(y, kv, kv, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(x)
        return x.reshape(B, T, N, d).transpose(1, 2)


class CalM(nn.Module):
    """Dual-axis autoregressive transformer over neuron x patch tokens.

    forward(inputs, next_inputs=None) -> next-token logits (B, N, T, K) for a discrete tokenizer (inputs: codes
    (B, N, T)), or the next patch (B, N, T, P) for ``tokenizer="continuous"`` (inputs: patches (B, N, T, P)).
    Position t predicts t+1. ``next_inputs`` (same shape as inputs; entry t = X[:, t+1]) is read only by
    ``neural_axis="raster"``, and only for neurons earlier in the order.
    """

    def __init__(self, config: CalMConfig, tokenizer=None):
        super().__init__()
        self.config, self.tokenizer = config, tokenizer
        c = config
        if c.tokenizer != "continuous":
            book = getattr(tokenizer, "codebook", None)
            if book is None or tuple(book.shape) != (c.codebook_size, c.patch_len):
                raise ValueError(f"tokenizer={c.tokenizer!r} needs a fitted tokenizer with a (codebook_size, "
                                 f"patch_len) = ({c.codebook_size}, {c.patch_len}) codebook")
            self.embed = nn.Embedding(c.codebook_size, c.d_model)
            self.out = nn.Linear(c.d_model, c.codebook_size)
        else:
            self.embed = nn.Linear(c.patch_len, c.d_model)
            self.out = nn.Linear(c.d_model, c.patch_len)
        self.pos = nn.Parameter(torch.randn(c.max_patches, c.d_model) * 0.02)
        self.blocks = nn.ModuleList(DualAxisBlock(c.d_model, c.n_heads, c.neural_axis != "none")
                                    for _ in range(c.n_blocks))
        self.raster = RasterReadout(c.d_model, c.n_heads) if c.neural_axis == "raster" else None
        self.ln_f = nn.LayerNorm(c.d_model)

    @property
    def discrete(self) -> bool:
        return self.config.tokenizer != "continuous"

    def inputs_from_traces(self, traces: torch.Tensor) -> torch.Tensor:
        patches = patchify(traces, self.config.patch_len)
        return self.tokenizer.encode(patches) if self.discrete else patches

    def features(self, inputs: torch.Tensor, next_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (B, N, T, d)."""
        h = self.embed(inputs)
        T = h.shape[2]
        if T + (next_inputs is not None) > self.config.max_patches:
            raise ValueError(f"window of {T} patches exceeds max_patches={self.config.max_patches}")
        h = h + self.pos[:T]
        for blk in self.blocks:
            h = blk(h)
        if self.raster is not None and next_inputs is not None:  # without next tokens (decoding): reading (i)
            h = self.raster(h, self.embed(next_inputs) + self.pos[1:T + 1])
        return self.ln_f(h)

    def forward(self, inputs: torch.Tensor, next_inputs: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.features(inputs, next_inputs))

    def loss(self, traces: torch.Tensor) -> torch.Tensor:
        """Next-token objective on a window (B, N, T_frames): CE over the codebook, or MSE for continuous."""
        inputs = self.inputs_from_traces(traces)
        pred = self(inputs[:, :, :-1], inputs[:, :, 1:])
        if self.discrete:
            return nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), inputs[:, :, 1:].reshape(-1))
        return nn.functional.mse_loss(pred, inputs[:, :, 1:])

    def _point(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forecast patch, token fed back) from the last position's output: the expected decoded patch under the
        predicted code distribution (MSE-optimal given the logits) and the argmax code; continuous: the patch."""
        if self.discrete:
            return last.softmax(-1) @ self.tokenizer.codebook, last.argmax(-1)
        return last, last

    @torch.no_grad()
    def forecast(self, context: torch.Tensor, horizon_patches: int) -> torch.Tensor:
        """Forecasting head: (B, N, T_ctx) frames -> (B, N, horizon_patches * P) frames, autoregressively in time;
        with ``neural_axis="raster"`` also neuron by neuron within each step (N passes per step)."""
        inputs = self.inputs_from_traces(context)
        outs = []
        for _ in range(horizon_patches):
            if self.config.neural_axis != "raster":
                patch, tok = self._point(self(inputs)[:, :, -1])
            else:
                nxt = torch.cat([inputs[:, :, 1:], inputs[:, :, -1:]], 2)  # last slot filled neuron by neuron
                patch = torch.zeros(*inputs.shape[:2], self.config.patch_len, device=inputs.device)
                for n in range(inputs.shape[1]):
                    p_n, t_n = self._point(self(inputs, nxt)[:, n, -1])
                    patch[:, n], nxt[:, n, -1] = p_n, t_n
                tok = nxt[:, :, -1]
            outs.append(patch)
            inputs = torch.cat([inputs, tok.unsqueeze(2)], dim=2)
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
