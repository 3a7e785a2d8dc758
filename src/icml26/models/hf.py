"""Hugging Face wrappers that make :class:`~icml26.models.tiny_lm.TinyLM` models first-class ``transformers`` models.

Shapes: B batch, T time, V vocabulary.

A room turns its TinyLM variant into an ``AutoModelForCausalLM`` in three steps::

    class FixConfig(TinyLMHFConfig):
        model_type = "icml26_fix"          # unique per room
        attention: str = "fix"             # extra fields are plain annotated defaults

    class FixForCausalLM(TinyLMForCausalLM):
        config_class = FixConfig

        def build_attention_factory(self, config):
            return lambda tiny_config, layer_idx: FixAttention(tiny_config, layer_idx, ...)

    register_tiny_lm(FixConfig, FixForCausalLM)

after which ``save_pretrained``, ``AutoModelForCausalLM.from_pretrained``, ``generate`` and ``Trainer`` work.

Choices made against transformers 5 (checked on 5.24):

* Weights. TinyLM and plugged modules initialise themselves, so ``_init_weights`` is a no-op. ``from_pretrained``
  builds the model on the meta device, loads the checkpoint, then fills the non-persistent buffers (RoPE tables)
  and any missing weight with ``torch.empty_like`` and expects ``_init_weights`` to compute them.
  :meth:`TinyLMForCausalLM.from_pretrained` instead copies exactly those tensors from a freshly built model with the
  same config, so buffers are right for any plugged module and missing weights get their module's own
  initialisation (e.g. a plain TinyLM checkpoint loaded into a hyper-connection subclass).
* Tied embeddings. ``_tied_weights_keys`` maps ``model.lm_head.weight`` to ``model.tok_emb.weight``; transformers only
  honours it when ``config.tie_word_embeddings`` is true, which the config aliases to ``tie_embeddings``. Saving then
  drops the head from the safetensors file and loading re-ties it to the loaded embedding.
* Generation. No ``transformers`` cache: ``_supports_default_dynamic_cache`` returns False so ``generate`` never makes
  a ``DynamicCache``, and :meth:`TinyLMForCausalLM.prepare_inputs_for_generation` always feeds the whole sequence
  (TinyLM has no padding, so an attention mask must be all ones). ``TinyLM.generate`` keeps its own fast KV cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from icml26.models.tiny_lm import Residual, TinyLM, TinyLMConfig

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "TinyLMForCausalLM", "TinyLMHFConfig", "register_tiny_lm"]


class TinyLMHFConfig(PreTrainedConfig):
    """``transformers`` config holding every :class:`TinyLMConfig` field; unknown keyword arguments pass through.

    transformers 5 turns every config subclass into a keyword-only dataclass, so a subclass adds its own fields as
    annotated class attributes with defaults and sets its own ``model_type``. The sizes are validated at
    construction by building the :class:`TinyLMConfig`.
    """

    model_type = "icml26_tiny_lm"
    # Standard transformers names read by library code (tying, Trainer, tooling) resolve to TinyLM's names.
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_seq_len",
        "tie_word_embeddings": "tie_embeddings",
    }

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 1024
    mlp_hidden: int | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.tiny_lm_config()

    def tiny_lm_config(self) -> TinyLMConfig:
        """The :class:`TinyLMConfig` with this config's sizes (raises ValueError if they are invalid)."""
        return TinyLMConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            max_seq_len=self.max_seq_len,
            mlp_hidden=self.mlp_hidden,
            rope_base=self.rope_base,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
        )


class TinyLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A :class:`TinyLM` as a ``transformers`` causal LM; the network lives in ``self.model``.

    Subclasses plug in their method by overriding :meth:`build_attention_factory` and/or :meth:`build_residual`
    and setting ``config_class`` to their config subclass.
    """

    config_class = TinyLMHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    # Target -> source; transformers applies it only when config.tie_word_embeddings (= tie_embeddings) is true.
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}

    def __init__(self, config: TinyLMHFConfig) -> None:
        super().__init__(config)
        self.model = TinyLM(
            config.tiny_lm_config(),
            attention_factory=self.build_attention_factory(config),
            residual=self.build_residual(config),
        )
        if self.generation_config is not None:
            # There is no transformers cache to fill (see prepare_inputs_for_generation).
            self.generation_config.use_cache = False
        self.post_init()

    def build_attention_factory(self, config: TinyLMHFConfig) -> Callable[[TinyLMConfig, int], nn.Module] | None:
        """``factory(tiny_lm_config, layer_idx) -> attention module``; None keeps TinyLM's softmax attention."""
        return None

    def build_residual(self, config: TinyLMHFConfig) -> Residual | None:
        """The residual connection object (see tiny_lm.py); None keeps the plain pre-norm residual."""
        return None

    def _init_weights(self, module: nn.Module) -> None:
        """Leave every weight as its module initialised it (transformers would otherwise redraw Linear/Embedding)."""

    def get_input_embeddings(self) -> nn.Module:
        return self.model.tok_emb

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.tok_emb = value

    def get_output_embeddings(self) -> nn.Module:
        return self.model.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.model.lm_head = new_embeddings

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.from_pretrained``, then restore what the checkpoint does not hold (module docstring)."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        unloaded = set(loading_info.get("missing_keys", ())) | {k[0] for k in loading_info.get("mismatched_keys", ())}
        model._materialize_unloaded(unloaded)
        return (model, loading_info) if output_loading_info else model

    def _materialize_unloaded(self, missing_keys: set[str]) -> None:
        """Copy non-persistent buffers and the ``missing_keys`` weights from a fresh model with the same config."""
        # Tied targets are already aliased to their loaded source; writing them would overwrite the source.
        tied_targets = set(getattr(self, "all_tied_weights_keys", {}))
        names = {name for name, _ in self.named_non_persistent_buffers(remove_duplicate=False)}
        names |= set(missing_keys) - tied_targets
        if not names:
            return
        # Built on the CPU with a forked RNG, so loading never moves the caller's random stream.
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            reference = type(self)(copy.deepcopy(self.config))
        source = dict(reference.named_parameters(remove_duplicate=False))
        source.update(reference.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name in sorted(names & source.keys()):
                self.get_parameter_or_buffer(name).copy_(source[name])

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # Keeps GenerationMixin from creating a DynamicCache: plugged attention modules keep per-layer dict caches
        # that a transformers Cache cannot describe.
        return False

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, next_sequence_length: int | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """GenerationMixin's inputs for one step, always with the full (B, T) prefix.

        With ``use_cache=True`` GenerationMixin asks for only the newest token; without a cache that would lose the
        context, so the slice is ignored and the prefix is recomputed each step.
        """
        return super().prepare_inputs_for_generation(input_ids, next_sequence_length=None, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple[torch.Tensor, ...]:
        """Tokens (B, T) long -> logits (B, T, V) and, with ``labels`` (B, T), the next-token loss.

        ``labels`` are aligned with ``input_ids`` and shifted here (position t predicts ``labels[:, t + 1]``);
        ``-100`` is ignored. The loss is the mean over counted tokens, or their sum divided by
        ``num_items_in_batch`` when ``Trainer`` passes it (so gradient accumulation weighs every token equally).
        ``attention_mask`` (B, T) must be all ones: TinyLM has no padding. ``use_cache`` is accepted and ignored;
        transformers caches (``past_key_values``/``cache``) are rejected.
        """
        if input_ids is None:
            raise ValueError("input_ids is required (inputs_embeds is not supported).")
        cache = kwargs.pop("cache", None)
        if past_key_values is not None or cache is not None:
            raise ValueError(
                f"{type(self).__name__} does not use a transformers cache; call generate() without one "
                "(it recomputes the prefix) or use model.model.generate for TinyLM's own KV cache."
            )
        for name in ("inputs_embeds", "position_ids"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} is not supported by {type(self).__name__}.")
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise ValueError(f"{name}=True is not supported by {type(self).__name__}.")
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {tuple(attention_mask.shape)}."
                )
            if not bool(attention_mask.all()):
                raise ValueError(
                    "TinyLM does not support padding: attention_mask must be all ones. "
                    "Batch sequences of equal length (or generate one prompt at a time)."
                )

        logits, _ = self.model(input_ids)
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}."
                )
            loss = self._shifted_loss(logits, labels, num_items_in_batch)

        output = CausalLMOutputWithPast(loss=loss, logits=logits)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    @staticmethod
    def _shifted_loss(
        logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None
    ) -> torch.Tensor:
        """Cross-entropy of logits (B, T, V) at t against labels (B, T) at t + 1, ignoring ``IGNORE_INDEX``."""
        # float32 so a low-precision model still gets an accurate log-softmax.
        shift_logits = logits[:, :-1].flatten(0, 1).float()
        shift_labels = labels[:, 1:].flatten().to(logits.device)
        if num_items_in_batch is None:
            return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)
        total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


def _same_class(a: type, b: type) -> bool:
    # A reloaded module (notebook autoreload, importlib.reload) defines new class objects with the same name;
    # treating them as the same registration keeps re-import from failing.
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def converted_config(config: PreTrainedConfig, config_cls: type[PreTrainedConfig], **changes) -> PreTrainedConfig:
    """A host model's ``config`` re-created as ``config_cls`` (a subclass with its own model_type) with
    ``changes`` applied; the attention implementation the host runs with is kept. Used by the drop-in
    conversions (FiX attention, hyper-connections) that turn a Llama-family model into a registered subclass."""
    values = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        values.pop(key, None)
    new = config_cls.from_dict({**values, **changes})
    new._attn_implementation = config._attn_implementation
    return new


def register_tiny_lm(config_cls: type[PreTrainedConfig], model_cls: type[PreTrainedModel]) -> None:
    """Register ``config_cls`` with ``AutoConfig`` and ``model_cls`` with ``AutoModelForCausalLM``.

    Idempotent: registering the same pair again does nothing. Raises ValueError (and registers nothing) if
    ``config_cls.model_type`` is empty or already belongs to another config class (including the built-in
    transformers ones), if ``config_cls`` is already mapped to another model class, or if
    ``model_cls.config_class`` is not ``config_cls``.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, PreTrainedConfig)):
        raise TypeError(f"config_cls must be a PreTrainedConfig subclass, got {config_cls!r}.")
    if not (isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel)):
        raise TypeError(f"model_cls must be a PreTrainedModel subclass, got {model_cls!r}.")
    model_type = config_cls.model_type
    if not model_type:
        raise ValueError(f"{config_cls.__name__} must set a non-empty model_type.")
    if model_cls.config_class is not config_cls:
        raise ValueError(
            f"{model_cls.__name__}.config_class is {model_cls.config_class.__name__}, not {config_cls.__name__}."
        )

    registered_config = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if registered_config is not None and not _same_class(registered_config, config_cls):
        raise ValueError(
            f"model_type {model_type!r} is already registered to {registered_config.__module__}."
            f"{registered_config.__qualname__}; give {config_cls.__qualname__} its own model_type."
        )
    registered_model = AutoModelForCausalLM._model_mapping.get(config_cls, None)
    if registered_model is not None and not _same_class(registered_model, model_cls):
        raise ValueError(
            f"{config_cls.__qualname__} is already registered to {registered_model.__module__}."
            f"{registered_model.__qualname__}; cannot register {model_cls.__qualname__} for it."
        )
    if registered_config is config_cls and registered_model is model_cls:
        return
    AutoConfig.register(model_type, config_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


register_tiny_lm(TinyLMHFConfig, TinyLMForCausalLM)
