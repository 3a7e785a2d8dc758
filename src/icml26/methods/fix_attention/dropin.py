"""FiX / FoX as drop-in attention for Hugging Face Llama-family decoders (Llama, Mistral, Qwen2, Qwen3).

    from icml26.methods.fix_attention import convert_to_fix

    model = convert_to_fix(model, "fix")          # in place: a FixLlamaForCausalLM, still a LlamaForCausalLM
    model.save_pretrained("out")
    AutoModelForCausalLM.from_pretrained("out")   # after `import icml26.methods.fix_attention`

Each decoder layer's ``self_attn`` becomes a :class:`FiXDropInAttention` or :class:`FoXDropInAttention` that keeps
the pretrained ``q_proj``/``k_proj``/``v_proj``/``o_proj`` modules (and Qwen3's ``q_norm``/``k_norm``) as they are,
adds the forget-gate parameters with the room's initialisation, and runs the room's kernels
(:func:`fix_attention_chunked`, :func:`fox_attention_chunked`). The host model keeps computing positions and RoPE.

Shapes: B batch, T new tokens, P cached tokens, D hidden size, H query heads, G key-value heads (grouped-query
attention: H = G * groups), Dh head dim.

What the host model gives the layer and how it is honoured:

* **Attention mask.** transformers turns the (B, P + T) padding mask into a (B, 1, T, P + T) causal mask (or None
  when nothing is padded). The layer reads the key validity from its last query row, the only row that sees every
  key (so only padding masks are supported: no sliding windows, which the conversion switches off, and no packed
  sequences). Padded keys are masked inside the kernels (``key_mask``) and padded positions get log f = 0, so they
  neither receive attention nor decay anything: left- and right-padded batches give the unpadded logits.
* **KV cache.** The layer swaps the cache's empty ``DynamicLayer`` for a :class:`ForgetGateCacheLayer` on first
  use. FiX stores keys and the values pre-decayed to the latest token (exp(Lambda_last - Lambda_j) v_j, the bytes of
  a plain KV cache); FoX stores keys, values and log f per query head (float32). Beam search reorders all of them;
  other cache kinds (static, offloaded, quantized) raise a TypeError instead of returning wrong tokens.
* **Grouped-query attention.** FiX gates the value channels of the G key-value heads (so the decayed value cache
  stays G x Dh, and all queries of a group see the same decay); FoX has one gate per query head, as the official
  layer has one per head. The kernels get keys, values and gates repeated to H heads.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedConfig,
                          PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.cache_utils import Cache, DynamicLayer

from ...models.hf import converted_config, register_tiny_lm
from .chunked import fix_attention_chunked, fox_attention_chunked
from .config import FixConfig
from .layers import FiXGates, FoXGates, HeadRMSNorm, attach_token_gates, check_hidden_states

__all__ = ["ForgetGateCacheLayer", "FiXDropInAttention", "FoXDropInAttention", "convert_to_fix", "drop_in_config"]

VARIANTS = ("fix", "fox")


def drop_in_config(variant: str = "fix", **options: Any) -> FixConfig:
    """The validated :class:`FixConfig` of a drop-in layer; raises before anything is built.

    ``variant`` is 'fix' or 'fox'; ``options`` are FixConfig fields. ``rope`` defaults to True for both (the
    pretrained q/k projections were trained with RoPE; pass ``rope=False`` for NoPE, the official FoX default).
    The host model's rotary embedding and q/k norms are used, so ``rope_base`` and ``qk_norm`` are rejected.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    unknown = set(options) - set(asdict(FixConfig()))
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; options are the fields of FixConfig")
    if "attention" in options:
        raise TypeError("pass the attention as variant='fix' or 'fox', not attention=")
    if options.get("rope_base") is not None:
        raise ValueError("rope_base is not an option of the drop-in layer: RoPE comes from the host model's config")
    if options.get("qk_norm"):
        raise ValueError("qk_norm is not an option of the drop-in layer: the host model's own q/k norms are kept")
    return FixConfig(**{"rope": True, **options, "attention": variant})


class ForgetGateCacheLayer(DynamicLayer):
    """One layer of a transformers ``DynamicCache`` for FiX or FoX attention.

    ``keys`` (B, G, P, Dh) after RoPE; ``values`` (B, G, P, Dh): FoX's plain values, or FiX's values decayed to the
    last cached token; ``log_f`` (B, H, P) float32 for FoX, None for FiX. Written whole by the attention layer
    (:meth:`store`); ``update`` (the plain append) is refused because appending would skip FiX's decay.
    """

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.log_f: torch.Tensor | None = None
        # FiX's values are decayed to the last token; dropping tokens would need the inverse decay, which overflows.
        self.is_croppable = variant == "fox"

    def store(self, keys: torch.Tensor, values: torch.Tensor, log_f: torch.Tensor | None = None) -> None:
        self.keys, self.values, self.log_f = keys, values, log_f
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        raise TypeError("a FiX/FoX cache layer is written by its attention layer only (FiX values are pre-decayed)")

    def reset(self) -> None:
        self.log_f = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_croppable and tokens_to_remove:
            raise ValueError("a FiX cache cannot be cropped (its values are decayed to the last token); generate "
                             "without assisted decoding or contrastive search")
        super().crop(tokens_to_remove)
        if self.log_f is not None and tokens_to_remove:
            self.log_f = self.log_f[..., :tokens_to_remove]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.log_f is not None:
            self.log_f = self.log_f.index_select(0, beam_idx.to(self.log_f.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.log_f is not None:
            self.log_f = self.log_f.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.log_f is not None:
            self.log_f = self.log_f[indices, ...]


def _cache_layer(cache: Cache | None, layer_idx: int, variant: str) -> ForgetGateCacheLayer | None:
    """This layer's :class:`ForgetGateCacheLayer` in ``cache``, swapped in for an empty ``DynamicLayer``."""
    if cache is None:
        return None
    if not isinstance(cache, Cache):
        raise TypeError(f"FiX/FoX attention needs a transformers DynamicCache, got {type(cache).__name__}")
    if getattr(cache, "offloading", False):
        raise TypeError("FiX/FoX attention does not support an offloaded cache")
    if cache.layer_class_to_replicate is not None:
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[layer_idx]
    if isinstance(layer, ForgetGateCacheLayer):
        return layer
    if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
        cache.layers[layer_idx] = layer = ForgetGateCacheLayer(variant)
        return layer
    raise TypeError(f"FiX/FoX attention needs a DynamicCache (plain dynamic layers); layer {layer_idx} of this cache "
                    f"is a {type(layer).__name__} (static, sliding or quantized caches cannot hold FiX's decayed "
                    "values or FoX's gates); call generate without cache_implementation")


def _key_mask(attention_mask: Any, b: int, n_keys: int) -> torch.Tensor | None:
    """Key validity (B, n_keys) bool from the mask transformers passes to attention, or None when nothing is masked.

    Accepts a (B, n_keys) padding mask (flash-attention style), a boolean (B, 1, T, n_keys) mask (sdpa, True =
    attend) or an additive float one (eager, 0 = attend). The last query row sees every earlier key, so it holds
    the padding of all of them.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"FiX/FoX attention takes a padding or causal mask tensor, got {type(attention_mask).__name__} "
                        "(flex attention block masks are not supported; use attn_implementation='sdpa' or 'eager')")
    if attention_mask.dim() == 2:
        valid = attention_mask.bool()
    elif attention_mask.dim() == 4:
        last = attention_mask[:, 0, -1, :]
        valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    else:
        raise ValueError(f"attention mask must be (B, keys) or (B, 1, queries, keys), "
                         f"got {tuple(attention_mask.shape)}")
    if valid.shape[-1] != n_keys:
        raise ValueError(f"attention mask covers {valid.shape[-1]} keys but the layer has {n_keys} (cached + new); "
                         "FiX/FoX need a dynamic cache and a mask over every key")
    valid = valid.expand(b, n_keys)
    return None if bool(valid.all()) else valid


def _repeat_heads(x: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """(B, G, ...) -> (B, G * groups, ...): key-value head g serves query heads g * groups .. (g + 1) * groups - 1."""
    return x if x is None or groups == 1 else x.repeat_interleave(groups, dim=1)


class _DropInAttention(nn.Module):
    """Shared parts: the host's projections (and q/k norms), RoPE from the host, the optional output gate.

    Built from the host's attention module ``base``; ``forward`` has the host attention's signature and returns
    ``(output (B, T, D), None)`` (no attention weights).
    """

    variant = ""

    def __init__(self, base: nn.Module, config: PreTrainedConfig, cfg: FixConfig) -> None:
        super().__init__()
        self.cfg, self.config, self.layer_idx = cfg, config, base.layer_idx
        self.hidden_size = config.hidden_size
        self.head_dim, self.scaling = base.head_dim, base.scaling
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = base.num_key_value_groups
        self.num_key_value_heads = self.num_heads // self.num_key_value_groups
        self.is_causal = True
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = base.q_proj, base.k_proj, base.v_proj, base.o_proj
        self.q_norm, self.k_norm = getattr(base, "q_norm", None), getattr(base, "k_norm", None)
        # The host modelling file's own RoPE (same signature across the family: q, k, cos, sin).
        self._apply_rope = sys.modules[type(base).__module__].apply_rotary_pos_emb if cfg.uses_rope else None
        self.ogate_proj = None
        if cfg.output_gate:
            self.ogate_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
            nn.init.normal_(self.ogate_proj.weight, std=0.02)

    def _project(self, x: torch.Tensor, position_embeddings: Any) -> tuple[torch.Tensor, ...]:
        """(B, T, D) -> q (B, H, T, Dh), k and v (B, G, T, Dh), with the host's q/k norms and RoPE."""
        shape = (*x.shape[:2], -1, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self._apply_rope is not None:
            if position_embeddings is None:
                raise ValueError("position_embeddings (cos, sin) from the host model are required with rope=True")
            q, k = self._apply_rope(q, k, *position_embeddings)
        return q, k, v

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                cache: Cache | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """(B, T, D) hidden states -> ((B, T, D), None); ``cache`` holds the P earlier tokens, if any."""
        check_hidden_states(hidden_states, self.hidden_size, type(self).__name__)
        x = hidden_states
        b, t, _ = x.shape
        q, k, v = self._project(x, position_embeddings)
        layer = _cache_layer(cache, self.layer_idx, self.variant)
        n_past = 0 if layer is None else layer.get_seq_length()
        key_mask = _key_mask(attention_mask, b, n_past + t)
        log_f = self.log_forget(x)
        if key_mask is not None:
            # Padding decays nothing: log f = 0 there (gates have T on dim 2 for both variants).
            new_valid = key_mask[:, n_past:].view(b, 1, t, *([1] * (log_f.dim() - 3)))
            log_f = log_f.masked_fill(~new_valid, 0.0)
        o = self._attend(q, k, v, log_f, layer, key_mask)
        o = o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        if self.ogate_proj is not None:
            o = o * torch.sigmoid(self.ogate_proj(x))
        return self.o_proj(o), None

    def _fresh_gates(self) -> nn.Module:
        """A new holder of this layer's gate parameters, freshly initialised (for gates a checkpoint lacks)."""
        holder = nn.Module()
        holder.cfg = self.cfg
        if self.variant == "fix":
            FiXGates._init_fix_gates(holder, self.hidden_size, self.num_key_value_heads, self.head_dim,
                                     layer_idx=self.layer_idx, vocab_size=self.config.vocab_size)
        else:
            FoXGates._init_fox_gates(holder, self.hidden_size, self.num_heads)
        return holder

    def _gate_device_dtype(self) -> None:
        """Move the parameters this layer added (gates, norms) to the device and dtype of the host's projections."""
        ref = next(self.q_proj.parameters(), None)
        if ref is None:
            return
        reused = {id(p) for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.q_norm, self.k_norm)
                  if m is not None for p in m.parameters()}
        dtype = ref.dtype if ref.is_floating_point() else torch.float32
        with torch.no_grad():
            for p in self.parameters():
                if id(p) not in reused:
                    p.data = p.data.to(device=ref.device, dtype=dtype)
            for name, buf in self.named_buffers(recurse=False):
                setattr(self, name, buf.to(device=ref.device))


class FiXDropInAttention(FiXGates, _DropInAttention):
    """FiX attention in place of a Llama-family ``self_attn``: u = sum_j softmax_j(s_ij) exp(Lambda_i - Lambda_j) v_j
    per channel of the G value heads, o = o_proj(RMSNorm(u)). Gate parameters as :class:`FiXAttention`."""

    variant = "fix"

    def __init__(self, base: nn.Module, config: PreTrainedConfig, cfg: FixConfig) -> None:
        super().__init__(base, config, cfg)
        self._init_fix_gates(self.hidden_size, self.num_key_value_heads, self.head_dim, layer_idx=self.layer_idx,
                             vocab_size=config.vocab_size)
        self.output_norm = HeadRMSNorm(self.num_heads, self.head_dim, cfg.norm_eps, shared=cfg.output_norm_shared)
        self._gate_device_dtype()

    def _attend(self, q, k, v, log_f, layer, key_mask):
        """q (B, H, T, Dh), k v (B, G, T, Dh), log f (B, G, T, Dh | 1) -> RMSNorm(u) (B, H, T, Dh)."""
        groups = self.num_key_value_groups
        n_past = 0 if layer is None else layer.get_seq_length()
        pre_k, pre_v = (layer.keys, layer.values) if n_past else (None, None)
        out = fix_attention_chunked(q, _repeat_heads(k, groups), _repeat_heads(v, groups), _repeat_heads(log_f, groups),
                                    prefix_k=_repeat_heads(pre_k, groups), prefix_v=_repeat_heads(pre_v, groups),
                                    scale=self.scaling, chunk_size=self.cfg.chunk_size, key_mask=key_mask,
                                    return_state=layer is not None)
        if layer is not None:
            out, state = out
            # Every query head of a group holds the same decayed values; keep one per key-value head.
            layer.store(k if pre_k is None else torch.cat((pre_k, k), dim=2), state[:, ::groups])
        return self.output_norm(out)


class FoXDropInAttention(FoXGates, _DropInAttention):
    """FoX attention in place of a Llama-family ``self_attn``: o = sum_j softmax_j(s_ij + Lambda_i - Lambda_j) v_j
    with one forget gate per query head; optional per-head output norm (``fox_output_norm``) as the official code.
    With ``fgate_type='none'`` it is the host's softmax attention (a test checks the logits)."""

    variant = "fox"

    def __init__(self, base: nn.Module, config: PreTrainedConfig, cfg: FixConfig) -> None:
        super().__init__(base, config, cfg)
        self._init_fox_gates(self.hidden_size, self.num_heads)
        self.output_norm = HeadRMSNorm(self.num_heads, self.head_dim, cfg.norm_eps) if cfg.fox_output_norm else None
        self._gate_device_dtype()

    def _attend(self, q, k, v, log_f, layer, key_mask):
        """q (B, H, T, Dh), k v (B, G, T, Dh), log f (B, H, T) -> (B, H, T, Dh)."""
        if layer is not None:
            if layer.get_seq_length():
                k, v = torch.cat((layer.keys, k), dim=2), torch.cat((layer.values, v), dim=2)
                log_f = torch.cat((layer.log_f, log_f), dim=2)
            layer.store(k, v, log_f)
        groups = self.num_key_value_groups
        o = fox_attention_chunked(q, _repeat_heads(k, groups), _repeat_heads(v, groups), log_f, scale=self.scaling,
                                  key_mask=key_mask)
        return o if self.output_norm is None else self.output_norm(o)


# ------------------------------------------------------------------------------------ converted model classes
def _convert_layers(model: PreTrainedModel, config: PreTrainedConfig, cfg: FixConfig) -> None:
    """Swap every decoder layer's ``self_attn`` (all new modules are built before the first swap)."""
    cls = FiXDropInAttention if cfg.attention == "fix" else FoXDropInAttention
    layers = model.model.layers
    new = [cls(layer.self_attn, config, cfg) for layer in layers]
    for layer, attn in zip(layers, new):
        layer.self_attn = attn
    attach_token_gates(model, host=model.model, ids_arg="input_ids")


def _init_missing_gates(model: PreTrainedModel, missing: set[str]) -> None:
    """Initialise the attention parameters named in ``missing`` as a new drop-in layer would (gates: their own
    init; output norm: 1; output gate: N(0, 0.02))."""
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.self_attn."
        names = {key[len(prefix):] for key in missing if key.startswith(prefix)}
        if not names:
            continue
        attn = layer.self_attn
        fresh = dict(attn._fresh_gates().named_parameters())
        with torch.no_grad():
            for name in names:
                target = attn.get_parameter(name)
                if name in fresh:
                    target.copy_(fresh[name])
                elif name.startswith("output_norm."):
                    target.fill_(1.0)
                elif name.startswith("ogate_proj."):
                    target.normal_(0.0, 0.02)


def _stored_options(cfg: FixConfig) -> dict[str, Any]:
    """A JSON-ready FixConfig (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}


def _derive(base_config: type[PreTrainedConfig], base_model: type[PreTrainedModel], name: str):
    """``Fix<name>Config`` (model_type ``icml26_fix_<base type>``, plus the field ``fix_attention``: the FixConfig
    as a dict) and ``Fix<name>ForCausalLM``, subclasses of the base pair that build FiX/FoX attention."""

    def config_post_init(self, **kwargs: Any) -> None:
        base_config.__post_init__(self, **kwargs)
        options = dict(self.fix_attention or {"attention": "fix"})
        variant = options.pop("attention", "fix")
        self.fix_attention = _stored_options(drop_in_config(variant, **options))

    config_cls = type(f"Fix{name}Config", (base_config,), {
        "__module__": __name__, "__qualname__": f"Fix{name}Config",
        "model_type": f"icml26_fix_{base_config.model_type}",
        "__annotations__": {"fix_attention": "dict | None"}, "fix_attention": None,
        "__post_init__": config_post_init,
        "__doc__": f"A {base_config.__name__} whose attention is FiX or FoX; ``fix_attention`` holds the FixConfig "
                   "fields (``attention`` = 'fix' | 'fox'); sliding windows are off (the gates do the forgetting)."})

    def model_init(self, config: PreTrainedConfig) -> None:
        base_model.__init__(self, config)
        options = dict(config.fix_attention)
        cfg = drop_in_config(options.pop("attention", "fix"), **options)
        # from_pretrained(..., fix_attention=...) sets the field after the config validated it: store it complete.
        config.fix_attention = _stored_options(cfg)
        _convert_layers(self, config, cfg)

    def from_pretrained(cls, *args: Any, **kwargs: Any):
        # A plain host checkpoint (no gates) loads too: transformers leaves the gate parameters it lacks to the
        # host's _init_weights, which knows nothing of them, so they get the gate's own initialisation here.
        want_info = kwargs.pop("output_loading_info", False)
        model, info = base_model.from_pretrained.__func__(cls, *args, output_loading_info=True, **kwargs)
        _init_missing_gates(model, set(info.get("missing_keys", ())))
        return (model, info) if want_info else model

    model_cls = type(f"Fix{name}ForCausalLM", (base_model,), {
        "__module__": __name__, "__qualname__": f"Fix{name}ForCausalLM", "config_class": config_cls,
        "__init__": model_init, "from_pretrained": classmethod(from_pretrained), "_supports_flex_attn": False,
        "_can_compile_fullgraph": False,
        "__doc__": f"A {base_model.__name__} with FiX or FoX attention (see :func:`convert_to_fix`)."})
    return config_cls, model_cls


FixLlamaConfig, FixLlamaForCausalLM = _derive(LlamaConfig, LlamaForCausalLM, "Llama")
FixMistralConfig, FixMistralForCausalLM = _derive(MistralConfig, MistralForCausalLM, "Mistral")
FixQwen2Config, FixQwen2ForCausalLM = _derive(Qwen2Config, Qwen2ForCausalLM, "Qwen2")
FixQwen3Config, FixQwen3ForCausalLM = _derive(Qwen3Config, Qwen3ForCausalLM, "Qwen3")
CONVERTED = {LlamaForCausalLM: (FixLlamaConfig, FixLlamaForCausalLM),
             MistralForCausalLM: (FixMistralConfig, FixMistralForCausalLM),
             Qwen2ForCausalLM: (FixQwen2Config, FixQwen2ForCausalLM),
             Qwen3ForCausalLM: (FixQwen3Config, FixQwen3ForCausalLM)}
__all__ += [cls.__name__ for pair in CONVERTED.values() for cls in pair]
for _config_cls, _model_cls in CONVERTED.values():
    register_tiny_lm(_config_cls, _model_cls)


def _converted_config(config: PreTrainedConfig, config_cls: type[PreTrainedConfig], cfg: FixConfig):
    """The host config as ``config_cls`` with the FiX/FoX options, full attention in every layer."""
    changes = {"fix_attention": _stored_options(cfg), "sliding_window": None}
    if hasattr(config, "use_sliding_window"):
        changes["use_sliding_window"] = False
    if getattr(config, "layer_types", None) is not None:
        changes["layer_types"] = ["full_attention"] * config.num_hidden_layers
    return converted_config(config, config_cls, **changes)


def convert_to_fix(model: PreTrainedModel, variant: str = "fix", **options: Any) -> PreTrainedModel:
    """Turn a Hugging Face Llama-family causal LM into FiX (``variant='fix'``) or FoX (``'fox'``) attention, in place.

    Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` (the ones that
    share Llama's attention layout). Every ``self_attn`` keeps its pretrained q/k/v/o projections and gains the
    gate parameters, initialised as in the room's layers (FiX: Mamba-style A and dt; FoX: the official zero-bias
    gate). The model becomes the matching ``Fix<Name>ForCausalLM`` (a subclass of its class, registered with
    ``AutoModelForCausalLM``), its config the matching ``Fix<Name>Config`` with sliding windows off.

    Args:
        model: the model to convert (any device and dtype; new parameters follow its q_proj).
        variant: 'fix' or 'fox'.
        options: :class:`FixConfig` fields (see :func:`drop_in_config`; ``rope`` defaults to True).
    Returns:
        ``model`` itself, converted.
    Raises:
        TypeError: unsupported or already converted model, unknown option. ValueError: a bad option value.
        Either is raised before the model is changed.
    """
    if isinstance(model, tuple(pair[1] for pair in CONVERTED.values())):
        variant = model.config.fix_attention["attention"]
        raise TypeError(f"{type(model).__name__} is already converted (its attention is {variant!r})")
    pair = CONVERTED.get(type(model))
    if pair is None:
        names = ", ".join(cls.__name__ for cls in CONVERTED)
        raise TypeError(f"convert_to_fix supports {names}; got {type(model).__name__}")
    cfg = drop_in_config(variant, **options)
    config_cls, model_cls = pair
    old_config = model.config
    config = _converted_config(old_config, config_cls, cfg)
    _convert_layers(model, config, cfg)
    for module in model.modules():
        if getattr(module, "config", None) is old_config:
            module.config = config
    model.__class__ = model_cls
    return model
