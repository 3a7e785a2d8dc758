"""A tiny decoder-only language model: the shared testbed for pluggable attention and residual connections.

Shapes: B batch, T time, D ``d_model``, H heads, Dh ``head_dim``, V vocabulary.

Attention contract (every attention module in the project follows it)
    ``module(x, cache=None) -> y`` with ``x`` and ``y`` of shape (B, T, D); modules are built by an
    ``attention_factory(config, layer_idx)``. ``cache`` is ``None`` (no caching) or a mutable per-layer
    ``dict`` that the module alone reads and writes. It starts empty; the module appends its state for the
    ``T`` new tokens (here keys "k" and "v" of shape (B, H, T_total, Dh)) and derives the position of the
    new tokens from what is already cached, so the caller only hands the same dict back on every step.

Residual contract (plain residuals, hyper-connections with n streams, ...)
    ``residual.expand(x)`` turns the embeddings (B, T, D) into the residual stream (any shape),
    ``residual.reduce(stream)`` turns it back into (B, T, D) before the final norm, and
    ``residual.wrap(branch, layer_idx, kind)`` (``kind`` is "attn" or "mlp") returns a module whose
    ``forward(stream, **kw)`` mixes ``branch`` into the stream; ``kw`` (e.g. ``cache=``) must reach the
    branch. Branches include their pre-norm and map (B, T, D) to (B, T, D). A residual object that is an
    ``nn.Module`` is registered on the model, so its parameters are trained and saved with it.

Modules initialise their own weights, so a plugged-in layer keeps its method's initialisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyLMConfig:
    """Sizes of a :class:`TinyLM`; ``mlp_hidden=None`` picks the multiple of 32 nearest to 8/3 * ``d_model``."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 1024
    mlp_hidden: int | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "mlp_hidden"):
            value = getattr(self, name)
            if value is None and name == "mlp_hidden":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}).")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / n_heads must be even for RoPE, got {self.head_dim}.")
        for name in ("rope_base", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width: ``mlp_hidden`` or the multiple of 32 nearest to 8/3 * ``d_model``."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return max(32, 32 * round(8 * self.d_model / 3 / 32))


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned gain (no bias)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 so low-precision inputs do not lose the mean of squares.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def precompute_rope(head_dim: int, max_seq_len: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables, each (max_seq_len, head_dim // 2), for rotary position embeddings."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Rotate (B, H, T, Dh) by the angles of positions ``offset .. offset + T - 1``.

    Channel ``i`` is paired with channel ``i + Dh/2`` and the pair is rotated as a 2-D vector.
    """
    t = x.shape[-2]
    cos = cos[offset : offset + t].to(x.dtype)
    sin = sin[offset : offset + t].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class SwiGLU(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))``: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int, hidden: int, out_std: float = 0.02) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        nn.init.normal_(self.gate_proj.weight, std=0.02)
        nn.init.normal_(self.up_proj.weight, std=0.02)
        nn.init.normal_(self.down_proj.weight, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CausalSelfAttention(nn.Module):
    """Multi-head causal softmax attention with RoPE; follows the attention contract in the module docstring."""

    def __init__(self, config: TinyLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.max_seq_len = config.n_heads, config.head_dim, config.max_seq_len
        self.qkv_proj = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        nn.init.normal_(self.qkv_proj.weight, std=0.02)
        # GPT-2: each block adds two outputs to the residual stream, so shrink them to keep its variance flat.
        nn.init.normal_(self.out_proj.weight, std=0.02 / math.sqrt(2 * config.n_layers))
        cos, sin = precompute_rope(config.head_dim, config.max_seq_len, config.rope_base)
        # Non-persistent: derived from the config, so they follow .to() but stay out of the state dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, cache: dict[str, Any] | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); with ``cache`` the T tokens follow the cached ones."""
        b, t, d = x.shape
        offset = 0 if cache is None or "k" not in cache else cache["k"].shape[2]
        if offset + t > self.max_seq_len:
            raise ValueError(f"Positions up to {offset + t} exceed max_seq_len={self.max_seq_len}.")
        q, k, v = self.qkv_proj(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q = apply_rope(q, self.rope_cos, self.rope_sin, offset)
        k = apply_rope(k, self.rope_cos, self.rope_sin, offset)
        if cache is not None:
            if offset:
                k = torch.cat((cache["k"], k), dim=2)
                v = torch.cat((cache["v"], v), dim=2)
            cache["k"], cache["v"] = k, v
        if offset == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # is_causal aligns the mask top-left, which is wrong once keys outnumber queries: query i
            # (absolute position offset + i) may see every key j <= offset + i.
            mask = torch.ones(t, offset + t, dtype=torch.bool, device=x.device).tril(diagonal=offset)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class PreNorm(nn.Module):
    """A residual branch ``fn(norm(x), **kw)``: (B, T, D) -> (B, T, D)."""

    def __init__(self, norm: nn.Module, fn: nn.Module) -> None:
        super().__init__()
        self.norm, self.fn = norm, fn

    def forward(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        return self.fn(self.norm(x), **kw)


class Residual(Protocol):
    """What :class:`TinyLM` needs from a residual connection (see the module docstring)."""

    def expand(self, x: torch.Tensor) -> torch.Tensor: ...
    def reduce(self, stream: torch.Tensor) -> torch.Tensor: ...
    def wrap(self, branch: nn.Module, layer_idx: int, kind: str) -> nn.Module: ...


class AddBranch(nn.Module):
    """``stream + branch(stream, **kw)``: the wrapped branch of :class:`PlainResidual`."""

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, stream: torch.Tensor, **kw: Any) -> torch.Tensor:
        return stream + self.branch(stream, **kw)


class PlainResidual:
    """The standard pre-norm residual: one stream of shape (B, T, D)."""

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce(self, stream: torch.Tensor) -> torch.Tensor:
        return stream

    def wrap(self, branch: nn.Module, layer_idx: int, kind: str) -> nn.Module:
        return AddBranch(branch)


class Block(nn.Module):
    """One transformer layer: wrapped attention branch, then wrapped MLP branch, both on the residual stream."""

    def __init__(self, config: TinyLMConfig, layer_idx: int, attention: nn.Module, residual: Residual) -> None:
        super().__init__()
        out_std = 0.02 / math.sqrt(2 * config.n_layers)
        attn_branch = PreNorm(RMSNorm(config.d_model, config.norm_eps), attention)
        mlp = SwiGLU(config.d_model, config.hidden_dim, out_std)
        mlp_branch = PreNorm(RMSNorm(config.d_model, config.norm_eps), mlp)
        self.attn = residual.wrap(attn_branch, layer_idx, "attn")
        self.mlp = residual.wrap(mlp_branch, layer_idx, "mlp")

    def forward(self, stream: torch.Tensor, cache: dict[str, Any] | None = None) -> torch.Tensor:
        return self.mlp(self.attn(stream, cache=cache))


class TinyLM(nn.Module):
    """Decoder-only LM: embedding -> blocks -> RMSNorm -> LM head (tied to the embedding by default)."""

    def __init__(
        self,
        config: TinyLMConfig,
        *,
        attention_factory: Callable[[TinyLMConfig, int], nn.Module] | None = None,
        residual: Residual | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory = attention_factory or CausalSelfAttention
        # Assigned before use so an nn.Module residual is registered as a submodule.
        self.residual = residual if residual is not None else PlainResidual()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(config, i, factory(config, i), self.residual) for i in range(config.n_layers))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    def num_parameters(self) -> int:
        """Number of distinct trainable scalars (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def new_cache(self) -> list[dict[str, Any]]:
        """One empty per-layer cache dict for each block."""
        return [{} for _ in self.blocks]

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: list[dict[str, Any]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, T) long -> logits (B, T, V) and the mean token cross-entropy against ``targets`` (B, T)."""
        if idx.ndim != 2 or idx.dtype != torch.long:
            raise ValueError(f"idx must be a 2-D long tensor (B, T), got shape {tuple(idx.shape)} and {idx.dtype}.")
        if idx.shape[1] > self.config.max_seq_len:
            raise ValueError(f"Sequence length {idx.shape[1]} exceeds max_seq_len={self.config.max_seq_len}.")
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"cache must hold one dict per layer ({len(self.blocks)}), got {len(cache)}.")
        stream = self.residual.expand(self.tok_emb(idx))
        for i, block in enumerate(self.blocks):
            stream = block(stream, cache=None if cache is None else cache[i])
        logits = self.lm_head(self.norm_f(self.residual.reduce(stream)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens -> (B, T + max_new_tokens).

        ``temperature=0`` is greedy decoding; ``top_k`` keeps only the k most likely tokens. With ``use_cache``
        the prompt is prefilled once and then one token is fed per step.
        """
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k <= 0):
            raise ValueError("max_new_tokens and temperature must be >= 0 and top_k positive or None.")
        # The last sampled token is never fed back, so the model sees at most T + max_new_tokens - 1 positions.
        if idx.shape[-1] + max_new_tokens - 1 > self.config.max_seq_len:
            raise ValueError(f"Prompt plus {max_new_tokens} new tokens exceeds max_seq_len={self.config.max_seq_len}.")
        cache = self.new_cache() if use_cache else None
        out, step_input = idx, idx
        for _ in range(max_new_tokens):
            logits, _ = self(step_input, cache=cache)
            logits = logits[:, -1]
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            out = torch.cat((out, next_token), dim=1)
            step_input = next_token if use_cache else out
        return out
