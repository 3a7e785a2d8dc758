"""Hyper-connections (KromHC, mHC, mHC-lite, HC) as a drop-in residual for Hugging Face Llama-family decoders.

    from icml26.methods.kromhc import convert_to_hyper_connections

    model = convert_to_hyper_connections(model, "kromhc", 4)   # in place: a KromHCLlamaForCausalLM
    model.save_pretrained("out")
    AutoModelForCausalLM.from_pretrained("out")                 # after `import icml26.methods.kromhc`

Supported hosts: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``. Their
decoder layers share one forward, verbatim (pre-norm ``input_layernorm -> self_attn``, then
``post_attention_layernorm -> mlp``, each added to the residual), as do many other transformers families
(Gemma, Olmo, Starcoder2, DeepseekV3, ... on transformers 5.24); only these four are registered and tested.

Shapes: B batch, T tokens, n streams, D hidden size.

What the conversion does, per decoder layer i of L:

* The residual stream (B, T, D) becomes n streams (B, T, n, D). Layer 0 expands the embeddings into n copies
  (the official expand), layer L - 1 reduces the streams to their mean (B, T, D) before the host's final norm, so
  the host model's forward, attention mask, positions and KV cache are used as they are: every hyper-connection
  operation is per token, and the sub-layers see ordinary (B, T, D) hidden states.
* Each sub-layer F (``input_layernorm -> self_attn``, ``post_attention_layernorm -> mlp``) is wrapped by a room
  layer (:class:`KromHC`, :class:`MHC`, :class:`MHCLite` or :class:`HC`, reference and fast paths unchanged) held
  as ``attn_hc`` / ``mlp_hc`` of the decoder layer; the host's own modules keep their names and weights, so a plain
  host checkpoint loads into a converted class and a converted checkpoint holds the host's tensor names plus
  ``model.layers.<i>.<attn_hc|mlp_hc>.*``.

**Identity-equivalent initialisation** (``init="identity"``, the default): the converted model computes the
host's function. With X[s] = x for every stream (the expand), a wrapped sub-layer gives
X_new[t] = sum_s H_res[s, t] x + H_post[t] F(sum_s H_pre[s] x). That is x + F(x) in every stream exactly when the
columns of H_res sum to 1 (every doubly stochastic H_res, and HC's identity), H_post = 1 and sum_s H_pre[s] = 1;
the streams then stay identical copies of the host's residual, and their mean is it. HC's official init already
has H_pre = e_k0, H_res = I, H_post = 1. For mHC, mHC-lite and KromHC the official biases (b_pre = b_post = +1 at
the home stream k0, -1 elsewhere) give H_post = 2 sigmoid(+-1) and sum H_pre = sigmoid(1) + (n - 1) sigmoid(-1),
which changes the function; ``init="identity"`` sets b_post = 0 (H_post = 2 sigmoid(0) = 1) and b_pre so that
H_pre is e q at k0 and q elsewhere with q = 1 / (e + n - 1): the official ratio sigmoid(1) / sigmoid(-1) = e
between the home stream and the others (so the streams' symmetry is broken, as the official init breaks it), with
sum 1. The projections phi start at zero as in the official code, so these hold for every token.
``init="official"`` keeps the room's (the official) biases instead: the model then starts as a different function.

The reduce is the mean of the streams, not the official sum: with the identity init the sum is n times the host's
residual, which the host's final RMSNorm undoes only up to its eps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, fields
from typing import Any

import torch
from torch import nn
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedConfig,
                          PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from ...models.hf import converted_config, register_tiny_lm
from .config import HyperConnectionConfig
from .layers import HC, MHC, LAYERS, HyperConnection, HyperResidual

__all__ = ["convert_to_hyper_connections", "drop_in_options", "identity_equivalent_init_"]

INITS = ("identity", "official")
DROP_IN_KINDS = tuple(LAYERS)
"""The hyper-connections a host can be converted to: hc, mhc, mhc_lite, kromhc."""


def drop_in_options(kind: str = "kromhc", num_streams: int = 4, *, init: str = "identity",
                    **options: Any) -> dict[str, Any]:
    """The validated, JSON-ready options of a conversion (stored in the converted config); raises before any change.

    ``options`` are :class:`HyperConnectionConfig` fields (``sinkhorn_iters``, ``scale_init``, ``res_logit_gap``,
    ``hc_tanh``, ``home_stream``, ``seed``, ``max_permutations``); ``init`` is 'identity' or 'official'.
    """
    if kind not in DROP_IN_KINDS:
        raise ValueError(f"kind must be one of {DROP_IN_KINDS}, got {kind!r}")
    if isinstance(num_streams, bool) or not isinstance(num_streams, int):
        raise TypeError(f"num_streams must be an int, got {type(num_streams).__name__} {num_streams!r}")
    if num_streams < 2:
        raise ValueError(f"num_streams must be at least 2 (n = 1 is the host's own residual), got {num_streams}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    known = {f.name for f in fields(HyperConnectionConfig)} - {"kind", "num_streams"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; options are {sorted(known)} and init")
    config = HyperConnectionConfig(kind=kind, num_streams=num_streams, **options)
    return {**asdict(config), "init": init}


def identity_equivalent_init_(layer: HyperConnection) -> HyperConnection:
    """Set ``layer``'s static biases so that, on n identical input streams, it adds F to each of them unchanged.

    mHC / mHC-lite / KromHC: b_post = 0 (H_post = 1) and b_pre = logit(e q) at the home stream, logit(q) elsewhere,
    q = 1 / (e + n - 1) (H_pre sums to 1; see the module docstring). HC's official init already qualifies and is
    left as it is. Returns ``layer``.
    """
    if not isinstance(layer, HyperConnection):
        raise TypeError(f"identity_equivalent_init_ takes a room layer (HC, MHC, MHCLite, KromHC), got "
                        f"{type(layer).__name__}")
    if isinstance(layer, HC):
        return layer
    n, home = layer.num_streams, layer.home_stream
    weights = torch.full((n,), 1.0 / (math.e + n - 1), dtype=torch.float64, device=layer.static_beta.device)
    weights[home] *= math.e
    with torch.no_grad():
        pre = layer.static_alpha[:, 0] if isinstance(layer, MHC) else layer.static_alpha[:n]
        pre.copy_(torch.logit(weights))
        layer.static_beta.zero_()
    return layer


def _build_hyper_connections(options: dict[str, Any], dim: int, layer_idx: int,
                             dtype: torch.dtype = torch.float32) -> tuple[HyperConnection, ...]:
    """The (attention, MLP) wrappers of decoder layer ``layer_idx``, built on the CPU in ``dtype`` without a branch.

    The identity init is set after the cast, so its logits are those of ``dtype`` (float32-rounded logits would
    leave sum H_pre = 1 + 1e-8 in a float64 model)."""
    cfg = HyperConnectionConfig(**{k: v for k, v in options.items() if k != "init"})
    residual = HyperResidual.from_config(cfg, dim)   # its home-stream rule: sub-layers 2i and 2i + 1
    # Explicitly on the CPU: from_pretrained builds the model under a meta-device context, and the identity init
    # needs values (the loaded checkpoint then overwrites them).
    with torch.device("cpu"):
        built = tuple(residual.wrap(None, layer_idx, part).to(dtype) for part in ("attn", "mlp"))
        if options["init"] == "identity":
            for layer in built:
                identity_equivalent_init_(layer)
    return built


class HyperConnectedDecoderLayer:
    """Mixin placed before a host decoder-layer class: its forward runs the host's sub-layers inside ``attn_hc`` and
    ``mlp_hc`` on n residual streams.

    Input: (B, T, D) hidden states for the first layer (``expands_streams``), else the (B, T, n, D) streams of the
    previous layer; output: the (B, T, n, D) streams, or their mean (B, T, D) for the last layer
    (``reduces_streams``). Keyword arguments (attention mask, positions, cache, ...) go to ``self_attn`` as the host
    layer passes them.
    """

    attn_hc: HyperConnection
    mlp_hc: HyperConnection
    expands_streams: bool
    reduces_streams: bool

    def _check_input(self, hidden_states: torch.Tensor) -> None:
        n, dim = self.attn_hc.num_streams, self.attn_hc.dim
        if self.expands_streams:
            if hidden_states.dim() != 3 or hidden_states.shape[-1] != dim:
                raise ValueError(f"decoder layer 0 takes hidden states (B, T, {dim}), got shape "
                                 f"{tuple(hidden_states.shape)}")
        elif hidden_states.dim() != 4 or hidden_states.shape[-2:] != (n, dim):
            raise ValueError(f"a hyper-connected decoder layer after the first takes the (B, T, {n}, {dim}) streams of "
                             f"the layer before it, got shape {tuple(hidden_states.shape)}")

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self._check_input(hidden_states)
        stream = self.expand(hidden_states) if self.expands_streams else hidden_states
        branch_input, add_residual = self.attn_hc(stream)
        attn_out, _ = self.self_attn(hidden_states=self.input_layernorm(branch_input), **kwargs)
        branch_input, add_residual = self.mlp_hc(add_residual(attn_out))
        stream = add_residual(self.mlp(self.post_attention_layernorm(branch_input)))
        # The mean, not the official sum: with the identity init it is the host's residual itself (module docstring).
        return stream.mean(dim=-2) if self.reduces_streams else stream

    def expand(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, n, D), every stream a copy (the official expand)."""
        n = self.attn_hc.num_streams
        return hidden_states.unsqueeze(-2).expand(*hidden_states.shape[:-1], n, hidden_states.shape[-1]).contiguous()


_LAYER_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _hyper_layer_class(host: type[nn.Module]) -> type[nn.Module]:
    """``KromHC<Host>`` (e.g. KromHCLlamaDecoderLayer): the mixin over the host decoder layer, made once per host."""
    if host not in _LAYER_CLASSES:
        name = f"KromHC{host.__name__}"
        _LAYER_CLASSES[host] = type(name, (HyperConnectedDecoderLayer, host), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"A {host.__name__} on n hyper-connected residual streams (see HyperConnectedDecoderLayer)."})
    return _LAYER_CLASSES[host]


def _convert_layers(model: PreTrainedModel, options: dict[str, Any]) -> None:
    """Give every decoder layer its two wrappers (all built, on the host's device and dtype, before the first swap)."""
    layers = model.model.layers
    ref = model.model.embed_tokens.weight
    dtype = ref.dtype if ref.is_floating_point() else torch.float32
    built = [[hc.to(ref.device) for hc in _build_hyper_connections(options, ref.shape[-1], i, dtype)]
             for i in range(len(layers))]
    for i, (layer, (attn_hc, mlp_hc)) in enumerate(zip(layers, built)):
        layer.__class__ = _hyper_layer_class(type(layer))
        layer.attn_hc, layer.mlp_hc = attn_hc, mlp_hc
        layer.expands_streams, layer.reduces_streams = i == 0, i == len(layers) - 1


def _restore_unloaded(model: PreTrainedModel, missing: set[str]) -> None:
    """Rebuild what a checkpoint does not hold: mHC-lite's permutation buffer (non-persistent; transformers leaves
    it empty) and any hyper-connection parameter in ``missing`` (a plain host checkpoint), from fresh wrappers."""
    options = model.config.hyper_connections
    for i, layer in enumerate(model.model.layers):
        fresh = _build_hyper_connections(options, layer.attn_hc.dim, i, layer.attn_hc.static_beta.dtype)
        for part, source in zip(("attn_hc", "mlp_hc"), fresh):
            target, prefix = getattr(layer, part), f"model.layers.{i}.{part}."
            with torch.no_grad():
                for name, buf in source.named_buffers():
                    target.get_buffer(name).copy_(buf)
                for name, param in source.named_parameters():
                    if prefix + name in missing:
                        target.get_parameter(name).copy_(param)


def _derive(base_config: type[PreTrainedConfig], base_model: type[PreTrainedModel], name: str):
    """``KromHC<name>Config`` (model_type ``icml26_kromhc_<base type>``, plus the field ``hyper_connections``: the
    options of :func:`drop_in_options`) and ``KromHC<name>ForCausalLM``, subclasses of the base pair."""

    def config_post_init(self, **kwargs: Any) -> None:
        base_config.__post_init__(self, **kwargs)
        self.hyper_connections = drop_in_options(**(self.hyper_connections or {}))

    config_cls = type(f"KromHC{name}Config", (base_config,), {
        "__module__": __name__, "__qualname__": f"KromHC{name}Config",
        "model_type": f"icml26_kromhc_{base_config.model_type}",
        "__annotations__": {"hyper_connections": "dict | None"}, "hyper_connections": None,
        "__post_init__": config_post_init,
        "__doc__": f"A {base_config.__name__} whose residual is n hyper-connected streams; ``hyper_connections`` "
                   "holds the kind, num_streams, the HyperConnectionConfig options and init."})

    def model_init(self, config: PreTrainedConfig) -> None:
        base_model.__init__(self, config)
        # from_pretrained(..., hyper_connections=...) sets the field after the config validated it: validate again.
        config.hyper_connections = drop_in_options(**config.hyper_connections)
        _convert_layers(self, config.hyper_connections)

    # wraps: GenerationMixin reads the host forward's signature (logits_to_keep, ...) through __wrapped__.
    @functools.wraps(base_model.forward)
    def forward(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any):
        # As the host's forward; token ids must be (B, T) and inputs_embeds (B, T, D).
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None and (embeds.dim() != 3 or embeds.shape[-1] != self.config.hidden_size):
            raise ValueError(f"inputs_embeds must be (B, T, {self.config.hidden_size}), got shape "
                             f"{tuple(embeds.shape)}")
        return base_model.forward(self, input_ids, *args, **kwargs)

    def from_pretrained(cls, *args: Any, **kwargs: Any):
        want_info = kwargs.pop("output_loading_info", False)
        model, info = base_model.from_pretrained.__func__(cls, *args, output_loading_info=True, **kwargs)
        _restore_unloaded(model, set(info.get("missing_keys", ())))
        return (model, info) if want_info else model

    model_cls = type(f"KromHC{name}ForCausalLM", (base_model,), {
        "__module__": __name__, "__qualname__": f"KromHC{name}ForCausalLM", "config_class": config_cls,
        "__init__": model_init, "forward": forward, "from_pretrained": classmethod(from_pretrained),
        "_can_compile_fullgraph": False,
        "__doc__": f"A {base_model.__name__} whose residual is n hyper-connected streams "
                   "(see :func:`convert_to_hyper_connections`)."})
    return config_cls, model_cls


KromHCLlamaConfig, KromHCLlamaForCausalLM = _derive(LlamaConfig, LlamaForCausalLM, "Llama")
KromHCMistralConfig, KromHCMistralForCausalLM = _derive(MistralConfig, MistralForCausalLM, "Mistral")
KromHCQwen2Config, KromHCQwen2ForCausalLM = _derive(Qwen2Config, Qwen2ForCausalLM, "Qwen2")
KromHCQwen3Config, KromHCQwen3ForCausalLM = _derive(Qwen3Config, Qwen3ForCausalLM, "Qwen3")
CONVERTED = {LlamaForCausalLM: (KromHCLlamaConfig, KromHCLlamaForCausalLM),
             MistralForCausalLM: (KromHCMistralConfig, KromHCMistralForCausalLM),
             Qwen2ForCausalLM: (KromHCQwen2Config, KromHCQwen2ForCausalLM),
             Qwen3ForCausalLM: (KromHCQwen3Config, KromHCQwen3ForCausalLM)}
__all__ += [cls.__name__ for pair in CONVERTED.values() for cls in pair]
for _config_cls, _model_cls in CONVERTED.values():
    register_tiny_lm(_config_cls, _model_cls)


def _converted_config(config: PreTrainedConfig, config_cls: type[PreTrainedConfig], options: dict[str, Any]):
    """The host config as ``config_cls`` with the hyper-connection options."""
    return converted_config(config, config_cls, hyper_connections=options)


def convert_to_hyper_connections(model: PreTrainedModel, kind: str = "kromhc", num_streams: int = 4, *,
                                 init: str = "identity", **options: Any) -> PreTrainedModel:
    """Turn a Hugging Face Llama-family causal LM's residual into n hyper-connected streams, in place.

    Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``. Every
    decoder layer's attention and MLP sub-layers are wrapped by the room's ``kind`` layer; layer 0 expands the
    (B, T, D) embeddings into (B, T, n, D) streams and the last layer reduces them to their mean. With
    ``init="identity"`` (default) the converted model computes the host's function (logits equal up to float
    rounding); ``init="official"`` keeps the official biases (module docstring). The model becomes the matching
    ``KromHC<Name>ForCausalLM`` (a subclass of its class, registered with ``AutoModelForCausalLM`` when the room is
    imported), its config the matching ``KromHC<Name>Config``.

    Args:
        model: the model to convert (any device and dtype; new parameters follow its embedding).
        kind: 'kromhc', 'mhc_lite', 'mhc' or 'hc'.
        num_streams: n >= 2 (KromHC: a power of two; mHC-lite: n! <= max_permutations).
        init: 'identity' or 'official'.
        options: :class:`HyperConnectionConfig` fields (sinkhorn_iters, scale_init, res_logit_gap, hc_tanh,
            home_stream, seed, max_permutations).
    Returns:
        ``model`` itself, converted.
    Raises:
        TypeError: unsupported or already converted model, unknown option, non-int num_streams. ValueError: a bad
        kind, num_streams or option value. Either is raised before the model is changed.
    """
    if isinstance(model, tuple(pair[1] for pair in CONVERTED.values())):
        hc = model.config.hyper_connections
        raise TypeError(f"{type(model).__name__} is already converted ({hc['kind']}, {hc['num_streams']} streams)")
    pair = CONVERTED.get(type(model))
    if pair is None:
        names = ", ".join(cls.__name__ for cls in CONVERTED)
        raise TypeError(f"convert_to_hyper_connections supports {names}; got {type(model).__name__}")
    stored = drop_in_options(kind, num_streams, init=init, **options)
    config_cls, model_cls = pair
    old_config = model.config
    config = _converted_config(old_config, config_cls, stored)
    _convert_layers(model, stored)
    for module in model.modules():
        if getattr(module, "config", None) is old_config:
            module.config = config
    model.__class__ = model_cls
    return model
