"""The public layers: ``FiXAttention``, ``FoXAttention`` and a factory that plugs them (or softmax + RoPE) into TinyLM.

Both follow the project's attention contract (``icml26.models.tiny_lm``): ``forward(x (B, T, D), cache=None)
-> (B, T, D)``, where ``cache`` is a per-layer dict the layer fills itself.

Shapes: B batch, T time, D ``d_model``, H ``n_heads``, Dh = D / H. Paper symbols: f_t forget gate,
Lambda_t = sum_{s <= t} log f_s, s_ij = q_i . k_j / sqrt(Dh).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...models.tiny_lm import CausalSelfAttention, TinyLM, TinyLMConfig, apply_rope, precompute_rope
from .chunked import fix_attention_chunked, fix_decode_step, fox_attention_chunked
from .config import FixConfig


def _resolve(config: FixConfig | None, attention: str, options: dict[str, Any]) -> FixConfig:
    """``config`` (or the defaults) with ``options`` overriding fields and ``attention`` forced; validated."""
    base = asdict(config) if config is not None else {}
    unknown = set(options) - set(asdict(FixConfig()))
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; options are the fields of FixConfig")
    return FixConfig(**{**base, **options, "attention": attention})


def _check_sizes(d_model: object, n_heads: object) -> None:
    """Raise ValueError unless D and H are positive ints with D divisible by H (before any parameter is built)."""
    for name, value in (("d_model", d_model), ("n_heads", n_heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")


def check_hidden_states(x: object, width: int, owner: str) -> None:
    """Raise at the layer entry (not deep in a kernel) unless ``x`` is a floating (B, T, width) tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner} expects a tensor of shape (batch, time, {width}), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(f"{owner} expects hidden states of shape (batch, time, {width}), got {tuple(x.shape)}; "
                         f"add a batch axis with x.unsqueeze(0) for one sequence")
    if not x.is_floating_point():
        raise TypeError(f"{owner} expects floating-point hidden states, got {x.dtype}")


class HeadRMSNorm(nn.Module):
    """RMSNorm of each head's vector with a per-channel gain: H * Dh weights (the official FoX
    ``GroupNorm(is_rms_norm=True)``), or with ``shared=True`` one gain of size Dh used by every head (the FiX
    layout of the official-kernel benchmark).

    (B, H, T, Dh) -> (B, H, T, Dh); computed in at least float32.
    """

    def __init__(self, n_heads: int, head_dim: int, eps: float, shared: bool = False) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.eps, self.shared = n_heads, head_dim, eps, shared
        self.weight = nn.Parameter(torch.ones(head_dim if shared else n_heads * head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        heads = 1 if self.shared else self.n_heads
        return (xf * self.weight.to(dtype).view(1, heads, 1, self.head_dim)).to(x.dtype)


class _GatedAttention(nn.Module):
    """Shared parts: fused q/k/v projection, optional RoPE, output projection (TinyLM initialisation)."""

    def __init__(self, d_model: int, n_heads: int, cfg: FixConfig, *, max_seq_len: int, rope_base: float,
                 out_std: float, layer_idx: int) -> None:
        super().__init__()
        _check_sizes(d_model, n_heads)
        self.cfg, self.layer_idx = cfg, layer_idx
        self.d_model, self.n_heads, self.head_dim, self.max_seq_len = d_model, n_heads, d_model // n_heads, max_seq_len
        self.use_rope = cfg.uses_rope
        if self.use_rope and self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / n_heads must be even for RoPE, got {self.head_dim}")
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        nn.init.normal_(self.qkv_proj.weight, std=0.02)
        nn.init.normal_(self.out_proj.weight, std=out_std)
        if self.use_rope:
            cos, sin = precompute_rope(self.head_dim, max_seq_len, cfg.rope_base or rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.ogate_proj = None
        if cfg.output_gate:
            self.ogate_proj = nn.Linear(d_model, d_model, bias=False)
            nn.init.normal_(self.ogate_proj.weight, std=0.02)

    def _qkv(self, x: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, D) -> q, k, v each (B, H, T, Dh), RoPE applied to q and k at positions offset .. offset + T - 1."""
        check_hidden_states(x, self.d_model, type(self).__name__)
        b, t, _ = x.shape
        if self.use_rope and offset + t > self.max_seq_len:
            raise ValueError(f"Positions up to {offset + t} exceed max_seq_len={self.max_seq_len} (RoPE table).")
        q, k, v = self.qkv_proj(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self._qk_transform(q, k)
        if self.use_rope:
            q = apply_rope(q, self.rope_cos, self.rope_sin, offset)
            k = apply_rope(k, self.rope_cos, self.rope_sin, offset)
        return q, k, v

    def _qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def _finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, Dh) attention output -> optional sigmoid output gate -> output projection (B, T, D)."""
        b, _, t, _ = o.shape
        o = o.transpose(1, 2).reshape(b, t, self.d_model)
        if self.ogate_proj is not None:
            o = o * torch.sigmoid(self.ogate_proj(x))
        return self.out_proj(o)


class FoXGates:
    """FoX's forget gate, shared by :class:`FoXAttention` and the drop-in layer for Hugging Face decoders.

    A mixin: the host sets ``self.cfg`` and calls :meth:`_init_fox_gates`. Parameters (official code):
    ``fgate_proj`` (D -> H, weight N(0, 0.02), bias 0) for 'full', ``fgate_bias`` (H,) for 'bias_only' / 'fixed'.
    """

    def _init_fox_gates(self, d_model: int, n_gate_heads: int) -> None:
        cfg, h = self.cfg, n_gate_heads
        self.n_gate_heads = h
        if cfg.fgate_type == "full":
            self.fgate_proj = nn.Linear(d_model, h, bias=True)
            nn.init.normal_(self.fgate_proj.weight, std=0.02)
            nn.init.zeros_(self.fgate_proj.bias)
        elif cfg.fgate_type in ("bias_only", "fixed"):
            bias = torch.zeros(h)
            if cfg.decay_time_min is not None:
                # Official fgate_bias_init: log-spaced decay times tau, with -1 / log sigmoid(b) = tau.
                tau = torch.exp(torch.linspace(math.log(cfg.decay_time_min), math.log(cfg.decay_time_max), h))
                bias = -torch.log(torch.expm1(1.0 / tau))
            if cfg.fgate_type == "bias_only":
                self.fgate_bias = nn.Parameter(bias)
            else:
                self.register_buffer("fgate_bias", bias)

    def log_forget(self, x: torch.Tensor) -> torch.Tensor:
        """log f_t per head: (B, T, D) -> (B, H, T), logsigmoid of the logit in at least float32 (as in the code)."""
        b, t, _ = x.shape
        dtype = torch.promote_types(x.dtype, torch.float32)
        if self.cfg.fgate_type == "none":
            return torch.zeros(b, self.n_gate_heads, t, dtype=dtype, device=x.device)
        if self.cfg.fgate_type == "full":
            logit = self.fgate_proj(x)
        else:
            logit = self.fgate_bias.expand(b, t, self.n_gate_heads)
        return F.logsigmoid(logit.to(dtype)).transpose(1, 2)


class FiXGates:
    """FiX's per-channel forget gates, shared by :class:`FiXAttention` and the drop-in layer for HF decoders.

    A mixin: the host sets ``self.cfg`` and calls :meth:`_init_fix_gates` with the gated heads G and their width
    Dh (G = H in TinyLM; the key-value heads in a grouped-query model, so the gates follow the value cache). The
    pre-activation is g = W_up RMSNorm(W_down x) (or W_up W_down x, or one Linear at rank 0); layer 0 may take
    W_down x from a token embedding instead (``token_gates``, ids set per forward by :func:`attach_token_gates`).
    """

    def _init_fix_gates(self, d_model: int, gate_heads: int, head_dim: int, *, layer_idx: int,
                        vocab_size: int | None) -> None:
        cfg = self.cfg
        self.gate_heads, self.gate_width = gate_heads, head_dim
        self.n_gates = gate_heads * head_dim if cfg.gate_granularity == "channel" else gate_heads
        self.gate_down = self.gate_up = self.gate_proj = self.gate_embed = None
        self.token_ids: torch.Tensor | None = None  # set per forward by attach_token_gates (layer-0 token gates)
        rank = cfg.rank_for(d_model)
        # Layer 0 takes its gates from a token embedding when the host model can pass token ids (vocab_size set).
        self.token_gates = (cfg.gate_form != "none" and cfg.gate_layer0_source == "token" and layer_idx == 0
                            and vocab_size is not None)
        if cfg.gate_form != "none":
            if rank > 0:
                if self.token_gates:
                    self.gate_embed = nn.Embedding(vocab_size, rank)
                    nn.init.normal_(self.gate_embed.weight, std=0.02)
                else:
                    self.gate_down = nn.Linear(d_model, rank, bias=False)
                    nn.init.normal_(self.gate_down.weight, std=0.02)
                self.gate_up = nn.Linear(rank, self.n_gates, bias=False)
                # Mamba's dt_proj init: uniform with std ~ rank^-1/2, so g starts small next to the bias.
                bound = rank ** -0.5
                nn.init.uniform_(self.gate_up.weight, -bound, bound)
            elif self.token_gates:
                self.gate_embed = nn.Embedding(vocab_size, self.n_gates)
                nn.init.normal_(self.gate_embed.weight, std=0.02)
            else:
                self.gate_proj = nn.Linear(d_model, self.n_gates, bias=False)
                nn.init.normal_(self.gate_proj.weight, std=0.02)
        self.bottleneck_norm = cfg.gate_bottleneck_norm and rank > 0
        if cfg.gate_form == "mamba":
            a_lo, a_hi = cfg.a_init_range
            dt_lo, dt_hi = cfg.dt_init_range
            # A ~ U(a_lo, a_hi]: 1 - U[0, 1) lies in (0, 1], so A > 0 even for a_lo = 0.
            a = a_lo + (a_hi - a_lo) * (1.0 - torch.rand(self.n_gates))
            self.A_log = nn.Parameter(a.log())
            dt = torch.exp(torch.empty(self.n_gates).uniform_(math.log(dt_lo), math.log(dt_hi))).clamp_min(1e-4)
            # Inverse softplus, so softplus(dt_bias) = dt at init (Mamba's dt initialisation).
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        elif cfg.gate_form == "sigmoid":
            self.gate_bias = nn.Parameter(torch.zeros(self.n_gates))

    def _gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """The gate pre-activation g before its bias: (B, T, D) -> (B, T, n_gates)."""
        if self.gate_proj is not None:
            return self.gate_proj(x)
        if self.gate_embed is not None:
            ids = self.token_ids
            if ids is None or ids.shape != x.shape[:2]:
                raise ValueError("layer-0 token gates need the token ids of this forward pass (input_ids, not "
                                 "inputs_embeds); build the model with build_tiny_lm / FixForCausalLM / "
                                 "convert_to_fix (which attach them), or set gate_layer0_source='hidden'")
            h = self.gate_embed(ids)
        else:
            h = self.gate_down(x)
        if self.gate_up is None:
            return h
        if self.bottleneck_norm:
            hf = h.to(torch.promote_types(h.dtype, torch.float32))
            h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        return self.gate_up(h)

    def log_forget(self, x: torch.Tensor) -> torch.Tensor:
        """log f_t: (B, T, D) -> (B, G, T, Dh) per channel, or (B, G, T, 1) tied per head; <= 0, in at least
        float32 (bfloat16 gates would round the decays the kernel accumulates)."""
        b, t, _ = x.shape
        dtype = torch.promote_types(x.dtype, torch.float32)
        width = self.gate_width if self.cfg.gate_granularity == "channel" else 1
        if self.cfg.gate_form == "none":
            return torch.zeros(b, self.gate_heads, t, 1, dtype=dtype, device=x.device)
        g = self._gate_input(x).to(dtype)
        if self.cfg.gate_form == "mamba":
            log_f = -torch.exp(self.A_log.to(dtype)) * F.softplus(g + self.dt_bias.to(dtype))
        else:
            log_f = F.logsigmoid(g + self.gate_bias.to(dtype)) / self.cfg.gate_temperature
        return log_f.view(b, t, self.gate_heads, width).transpose(1, 2)


class FoXAttention(FoXGates, _GatedAttention):
    """Forgetting attention (FoX, Lin et al., ICLR 2025), equations of the official code.

    o_i = sum_j softmax_j(s_ij + Lambda_i - Lambda_j) v_j, with f_t = sigmoid(w_h . x_t + b_h) per head (``full``).
    Cache keys: "k", "v" (B, H, T, Dh) and "log_f" (B, H, T), one float per head and token, as in the official
    ``FgateDynamicCache``.

    Args:
        d_model, n_heads: D and H.
        config: a :class:`FixConfig` (its ``attention`` field is ignored); keyword ``options`` override its fields.
        max_seq_len: RoPE table length (only used with ``rope=True``).
        rope_base: RoPE base when the config leaves it None.
        out_std: init std of the output projection (TinyLM uses 0.02 / sqrt(2 n_layers)).
    """

    def __init__(self, d_model: int, n_heads: int, *, config: FixConfig | None = None, max_seq_len: int = 1024,
                 rope_base: float = 10000.0, out_std: float = 0.02, layer_idx: int = 0, **options: Any) -> None:
        cfg = _resolve(config, "fox", options)
        super().__init__(d_model, n_heads, cfg, max_seq_len=max_seq_len, rope_base=rope_base, out_std=out_std,
                         layer_idx=layer_idx)
        h = n_heads
        self._init_fox_gates(d_model, h)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            # The official QK-norm takes the layer-norm default eps (1e-5), not norm_eps.
            self.q_norm = HeadRMSNorm(h, self.head_dim, cfg.qk_norm_eps)
            self.k_norm = HeadRMSNorm(h, self.head_dim, cfg.qk_norm_eps)
        self.output_norm = HeadRMSNorm(h, self.head_dim, cfg.norm_eps) if cfg.fox_output_norm else None

    def _qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The official layer normalises q and k before RoPE.
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def forward(self, x: torch.Tensor, cache: dict[str, Any] | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); with ``cache`` the T tokens follow the cached ones."""
        offset = 0 if cache is None or "k" not in cache else cache["k"].shape[2]
        q, k, v = self._qkv(x, offset)
        log_f = self.log_forget(x)
        if cache is not None:
            if offset:
                k = torch.cat((cache["k"], k), dim=2)
                v = torch.cat((cache["v"], v), dim=2)
                log_f = torch.cat((cache["log_f"], log_f), dim=2)
            cache["k"], cache["v"], cache["log_f"] = k, v, log_f
        o = fox_attention_chunked(q, k, v, log_f)
        if self.output_norm is not None:
            o = self.output_norm(o)
        return self._finish(o, x)


class FiXAttention(FiXGates, _GatedAttention):
    """Fine-grained forgetting attention (FiX): per-channel forget gates on the values, then a per-head RMSNorm.

    u_i = sum_j softmax_j(s_ij) exp(Lambda_i - Lambda_j) (.) v_j,   o_i = RMSNorm_eps(u_i)   (per head, gain)

    Gates (``gate_form``): 'mamba' log f_t = -exp(A_log) (.) softplus(W_up W_down x_t + dt_bias); 'sigmoid'
    log f_t = logsigmoid(W_up W_down x_t + b) / tau; 'none' f = 1, which makes the layer RMSNorm(softmax + RoPE).
    ``gate_granularity='head'`` ties the gate across a head's channels: with the 'sigmoid' form, rank 0 and tau = 1
    this is exactly RMSNorm(FoX + RoPE) up to eps.

    Decode cache: "k" (B, H, T, Dh) and "v" (B, H, T, Dh) holding exp(Lambda_last - Lambda_j) v_j, the values
    already decayed to the latest token. It costs the bytes of a plain KV cache; each new token multiplies it by
    its gate f_t (O(T Dh) per step, the same order as reading it).

    Args:
        d_model, n_heads: D and H.
        config: a :class:`FixConfig` (its ``attention`` field is ignored); keyword ``options`` override its fields.
        max_seq_len: RoPE table length.
        rope_base: RoPE base when the config leaves it None.
        out_std: init std of the output projection (TinyLM uses 0.02 / sqrt(2 n_layers)).
    """

    def __init__(self, d_model: int, n_heads: int, *, config: FixConfig | None = None, max_seq_len: int = 1024,
                 rope_base: float = 10000.0, out_std: float = 0.02, layer_idx: int = 0, vocab_size: int | None = None,
                 **options: Any) -> None:
        cfg = _resolve(config, "fix", options)
        super().__init__(d_model, n_heads, cfg, max_seq_len=max_seq_len, rope_base=rope_base, out_std=out_std,
                         layer_idx=layer_idx)
        self._init_fix_gates(d_model, n_heads, self.head_dim, layer_idx=layer_idx, vocab_size=vocab_size)
        self.output_norm = HeadRMSNorm(n_heads, self.head_dim, cfg.norm_eps, shared=cfg.output_norm_shared)

    def forward(self, x: torch.Tensor, cache: dict[str, Any] | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); with ``cache`` the T tokens follow the cached ones."""
        offset = 0 if cache is None or "k" not in cache else cache["k"].shape[2]
        q, k, v = self._qkv(x, offset)
        log_f = self.log_forget(x)
        chunk = self.cfg.chunk_size
        if cache is None:
            u = fix_attention_chunked(q, k, v, log_f, chunk_size=chunk)
        elif offset and q.shape[2] == 1:
            # Decode: one pass writes each cache (no second concatenation of the keys).
            u, cache["k"], cache["v"] = fix_decode_step(q, k, v, log_f, cache["k"], cache["v"])
        else:
            prefix_k, prefix_v = (cache["k"], cache["v"]) if offset else (None, None)
            u, state = fix_attention_chunked(q, k, v, log_f, prefix_k=prefix_k, prefix_v=prefix_v, chunk_size=chunk,
                                             return_state=True)
            cache["k"] = k if prefix_k is None else torch.cat((prefix_k, k), dim=2)
            cache["v"] = state
        return self._finish(self.output_norm(u), x)


def attention_factory(config: FixConfig | None = None, **options: Any) -> Callable[[TinyLMConfig, int], nn.Module]:
    """An ``attention_factory(tiny_config, layer_idx)`` for :class:`~icml26.models.tiny_lm.TinyLM`.

    ``attention='softmax'`` gives TinyLM's own :class:`CausalSelfAttention` (softmax + RoPE, the baseline);
    'fox' and 'fix' give the layers above, sized and initialised like it.
    """
    base = asdict(config) if config is not None else {}
    cfg = FixConfig(**{**base, **options})
    if cfg.attention == "softmax" and cfg.rope is False:
        raise ValueError("rope=False is not offered for attention='softmax' (the baseline is softmax + RoPE)")

    def build(tiny: TinyLMConfig, layer_idx: int) -> nn.Module:
        if cfg.attention == "softmax":
            return CausalSelfAttention(tiny, layer_idx)
        extra = {"vocab_size": tiny.vocab_size} if cfg.attention == "fix" else {}
        cls = FoXAttention if cfg.attention == "fox" else FiXAttention
        return cls(tiny.d_model, tiny.n_heads, config=cfg, max_seq_len=tiny.max_seq_len, rope_base=tiny.rope_base,
                   out_std=0.02 / math.sqrt(2 * tiny.n_layers), layer_idx=layer_idx, **extra)

    return build


def attach_token_gates(model: nn.Module, *, host: nn.Module | None = None, ids_arg: str = "idx") -> nn.Module:
    """Give every FiX layer of ``model`` with token gates (layer 0, ``gate_layer0_source='token'``) the token ids of
    each forward pass of ``host`` (default ``model``); returns ``model``.

    The ids (B, T) are ``host``'s first positional argument or its keyword ``ids_arg``: ``idx`` for a
    :class:`TinyLM`, ``input_ids`` for a Hugging Face base model. A call without ids (``inputs_embeds``) clears them,
    so the token gates raise instead of reusing the previous call's ids.
    """
    layers = [m for m in model.modules() if isinstance(m, FiXGates) and m.token_gates]
    if layers:
        def hook(module, args, kwargs):
            idx = args[0] if args else kwargs.get(ids_arg)
            for layer in layers:
                layer.token_ids = idx
        (host or model).register_forward_pre_hook(hook, with_kwargs=True)
    return model


def build_tiny_lm(tiny: TinyLMConfig, config: FixConfig | None = None, **options: Any) -> TinyLM:
    """A :class:`TinyLM` whose attention is chosen by ``config.attention`` ('softmax', 'fox' or 'fix')."""
    return attach_token_gates(TinyLM(tiny, attention_factory=attention_factory(config, **options)))
