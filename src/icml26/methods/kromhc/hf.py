"""KromHC (and HC, mHC, mHC-lite) TinyLMs as Hugging Face causal LMs.

Importing this module registers ``model_type="icml26_kromhc"`` with ``AutoConfig`` and ``AutoModelForCausalLM``::

    from transformers import AutoConfig, AutoModelForCausalLM
    import icml26.methods.kromhc.hf  # noqa: F401  (registers the Auto classes)

    config = AutoConfig.for_model("icml26_kromhc", residual_kind="kromhc", num_streams=4, d_model=128)
    model = AutoModelForCausalLM.from_config(config)

``save_pretrained``/``from_pretrained``, ``generate`` and ``Trainer`` then work as for any causal LM (see
:mod:`icml26.models.hf`). The weights of a wrapped sub-layer keep the plain model's names
(``model.blocks.<i>.<attn|mlp>.branch...``), so a plain TinyLM checkpoint loads into a hyper-connected model and
the hyper-connection parameters start from their own initialisation.
"""

from __future__ import annotations

from typing import Any

from ...models.hf import TinyLMForCausalLM, TinyLMHFConfig, register_tiny_lm
from .config import HyperConnectionConfig
from .layers import HyperResidual

__all__ = ["KromHCForCausalLM", "KromHCLMConfig"]


class KromHCLMConfig(TinyLMHFConfig):
    """TinyLM sizes plus the residual connection (the fields of :class:`HyperConnectionConfig`).

    ``residual_kind`` is one of residual | hc | mhc | mhc_lite | kromhc and ``num_streams`` is n; invalid
    combinations (e.g. KromHC with n = 6) raise ValueError at construction.
    """

    model_type = "icml26_kromhc"

    residual_kind: str = "kromhc"
    num_streams: int = 4
    sinkhorn_iters: int = 20
    scale_init: float = 1e-2
    res_logit_gap: float = 8.0
    hc_tanh: bool = True
    home_stream: str = "random"
    home_stream_seed: int = 0
    max_permutations: int = 5040

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.hyper_connection_config()

    def hyper_connection_config(self) -> HyperConnectionConfig:
        """The validated :class:`HyperConnectionConfig` of these fields."""
        return HyperConnectionConfig(
            kind=self.residual_kind, num_streams=self.num_streams, sinkhorn_iters=self.sinkhorn_iters,
            scale_init=self.scale_init, res_logit_gap=self.res_logit_gap, hc_tanh=self.hc_tanh,
            home_stream=self.home_stream, seed=self.home_stream_seed, max_permutations=self.max_permutations)


class KromHCForCausalLM(TinyLMForCausalLM):
    """A :class:`~icml26.models.tiny_lm.TinyLM` whose sub-layers are wrapped by :class:`HyperResidual`."""

    config_class = KromHCLMConfig

    def build_residual(self, config: KromHCLMConfig) -> HyperResidual:
        return HyperResidual.from_config(config.hyper_connection_config(), config.d_model)


register_tiny_lm(KromHCLMConfig, KromHCForCausalLM)
