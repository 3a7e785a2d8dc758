"""KromHC (arXiv 2601.21579) and the hyper-connection family it is compared with: HC, mHC, mHC-lite.

Each is a wrapper that turns a sub-layer into a hyper-connected one with n residual streams; ``HyperResidual``
plugs them into :class:`icml26.models.tiny_lm.TinyLM` and reduces to the plain residual with ``disable=True``.

For Hugging Face (when ``transformers`` is installed): ``KromHCLMConfig`` / ``KromHCForCausalLM`` (TinyLM models,
type "icml26_kromhc") and :func:`convert_to_hyper_connections`, which turns a Llama / Mistral / Qwen2 / Qwen3 causal
LM's residual into n hyper-connected streams (types "icml26_kromhc_llama", ...). Importing this package registers
all of them with ``AutoConfig`` / ``AutoModelForCausalLM``, so a saved model reloads with
``AutoModelForCausalLM.from_pretrained(dir)`` after ``import icml26.methods.kromhc`` (or only ``import icml26``,
whose deferred entries import this package when transformers first needs the classes: icml26.models.auto). This
package therefore imports transformers when it is installed; without it the TinyLM parts work alone.
"""

from __future__ import annotations

import importlib.util

from .config import KINDS, HyperConnectionConfig
from .diagnostics import amax_gain, composite, doubly_stochastic_error, mixing_report, record_mixing
from .layers import (HC, MHC, HyperConnection, HyperResidual, KromHC, MHCLite, hyper_connection, kron_factors,
                     parameter_count, permutation_matrices, sinkhorn_log)

__all__ = [
    "HC", "KINDS", "MHC", "HyperConnection", "HyperConnectionConfig", "HyperResidual", "KromHC", "MHCLite",
    "amax_gain", "composite", "doubly_stochastic_error", "hyper_connection", "kron_factors", "mixing_report",
    "parameter_count", "permutation_matrices", "record_mixing", "sinkhorn_log",
]

if importlib.util.find_spec("transformers") is not None:
    # Registration happens on import: a checkpoint's model_type is only known to transformers once its classes are.
    from .dropin import convert_to_hyper_connections, identity_equivalent_init_
    from .hf import KromHCForCausalLM, KromHCLMConfig

    __all__ += ["KromHCForCausalLM", "KromHCLMConfig", "convert_to_hyper_connections", "identity_equivalent_init_"]
