"""Trajectory lock-in (ICML 2026; paper and code not found, room reconstructed): objective-agnostic probes of a
fine-tuning trajectory (update subspace, drift, curvature harm signal, degradation-curve collapse) and a
stabilised fine-tuner with the standard stabilisers and a curvature-aware projection.

``LockInCallback`` (the probe inside ``transformers.Trainer``) loads transformers on first access only."""

from .config import CURVATURES, STABILISERS, LockInConfig
from .curves import first_crossing, fit_degradation_curve, matched_spread
from .geometry import (batch_size, fisher_top_directions, fisher_vp, hvp, lanczos_top_eigs, per_example_grads,
                       principal_angles, project_out, subspace_overlap, top_subspace)
from .probe import LockInProbe
from .trainer import StabilisedFineTuner

_HF_EXPORTS = ("LockInCallback", "model_loss")

__all__ = ["CURVATURES", "LockInCallback", "LockInConfig", "LockInProbe", "STABILISERS", "StabilisedFineTuner",
           "batch_size", "first_crossing", "fisher_top_directions", "fisher_vp", "fit_degradation_curve", "hvp",
           "lanczos_top_eigs", "matched_spread", "model_loss", "per_example_grads", "principal_angles",
           "project_out", "subspace_overlap", "top_subspace"]


def __getattr__(name: str):
    # transformers (the `llm` extra) is heavy and optional: import it only when the callback is asked for.
    if name in _HF_EXPORTS:
        from . import hf_callback

        return getattr(hf_callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
