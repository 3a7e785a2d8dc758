"""FiX / FoX / softmax TinyLMs as Hugging Face models: ``AutoConfig`` / ``AutoModelForCausalLM`` type "icml26_fix".

    from icml26.methods.fix_attention.hf import FixLMConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(FixLMConfig(d_model=128, n_layers=4, attention="fix"))
    model.save_pretrained("out"); AutoModelForCausalLM.from_pretrained("out")   # in any process that ran `import icml26`

Every :class:`~icml26.methods.fix_attention.config.FixConfig` field is a config field of the same name, except two
that TinyLM's config already owns: the attention output-norm eps is ``attention_norm_eps`` (``norm_eps`` is TinyLM's
block norm) and RoPE uses TinyLM's ``rope_base``. Importing this module registers the pair (it needs transformers);
``import icml26.methods.fix_attention`` imports it whenever transformers is installed.
"""

from __future__ import annotations

from typing import Any

from ...models.hf import TinyLMForCausalLM, TinyLMHFConfig, register_tiny_lm
from .config import FixConfig
from .layers import attach_token_gates, attention_factory


class FixLMConfig(TinyLMHFConfig):
    """A TinyLM config plus the attention choice (``attention``: 'softmax' | 'fox' | 'fix') and its options."""

    model_type = "icml26_fix"

    attention: str = "fix"
    rope: bool | None = None
    attention_norm_eps: float = 1e-6
    output_gate: bool = False
    gate_form: str = "mamba"
    gate_granularity: str = "channel"
    gate_rank: int | None = None
    gate_bottleneck_norm: bool = True
    gate_layer0_source: str = "token"
    output_norm_shared: bool = True
    gate_temperature: float = 16.0
    a_init_range: tuple[float, float] = (0.0, 16.0)
    dt_init_range: tuple[float, float] = (1e-3, 1e-1)
    fgate_type: str = "full"
    decay_time_min: float | None = None
    decay_time_max: float | None = None
    fox_output_norm: bool = False
    qk_norm: bool = False
    qk_norm_eps: float = 1e-5
    chunk_size: int = 4

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.attention_config()

    def attention_config(self) -> FixConfig:
        """The validated :class:`FixConfig` (raises ValueError naming a bad field)."""
        return FixConfig(
            attention=self.attention, rope=self.rope, norm_eps=self.attention_norm_eps, output_gate=self.output_gate,
            gate_form=self.gate_form, gate_granularity=self.gate_granularity, gate_rank=self.gate_rank,
            gate_temperature=self.gate_temperature, a_init_range=tuple(self.a_init_range),
            dt_init_range=tuple(self.dt_init_range), fgate_type=self.fgate_type, decay_time_min=self.decay_time_min,
            decay_time_max=self.decay_time_max, fox_output_norm=self.fox_output_norm, qk_norm=self.qk_norm,
            chunk_size=self.chunk_size, gate_bottleneck_norm=self.gate_bottleneck_norm,
            gate_layer0_source=self.gate_layer0_source, output_norm_shared=self.output_norm_shared,
            qk_norm_eps=self.qk_norm_eps,
        )


class FixForCausalLM(TinyLMForCausalLM):
    """A TinyLM whose attention is FiX, FoX or softmax + RoPE, as a ``transformers`` causal LM."""

    config_class = FixLMConfig

    def __init__(self, config: FixLMConfig) -> None:
        super().__init__(config)
        attach_token_gates(self.model)  # layer-0 token gates get each forward pass's token ids

    def build_attention_factory(self, config: FixLMConfig):
        return attention_factory(config.attention_config())


register_tiny_lm(FixLMConfig, FixForCausalLM)
