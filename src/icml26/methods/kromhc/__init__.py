"""KromHC (arXiv 2601.21579) and the hyper-connection family it is compared with: HC, mHC, mHC-lite.

Each is a wrapper that turns a sub-layer into a hyper-connected one with n residual streams; ``HyperResidual``
plugs them into :class:`icml26.models.tiny_lm.TinyLM` and reduces to the plain residual with ``disable=True``.
``KromHCLMConfig``/``KromHCForCausalLM`` (module ``hf``, needs transformers) are the Hugging Face versions.
"""

from .config import KINDS, HyperConnectionConfig
from .diagnostics import amax_gain, composite, doubly_stochastic_error, mixing_report, record_mixing
from .layers import (HC, MHC, HyperConnection, HyperResidual, KromHC, MHCLite, hyper_connection, kron_factors,
                     parameter_count, permutation_matrices, sinkhorn_log)

_HF = ("KromHCForCausalLM", "KromHCLMConfig")


def __getattr__(name: str):
    # The Hugging Face classes import transformers (the "llm" extra), so they load on first use only.
    if name in _HF:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HC", "KINDS", "MHC", "HyperConnection", "HyperConnectionConfig", "HyperResidual", "KromHC", "KromHCForCausalLM",
    "KromHCLMConfig", "MHCLite",
    "amax_gain", "composite", "doubly_stochastic_error", "hyper_connection", "kron_factors", "mixing_report",
    "parameter_count", "permutation_matrices", "record_mixing", "sinkhorn_log",
]
