"""Trajectory lock-in (ICML 2026; paper and code not found, room reconstructed): objective-agnostic probes of a
fine-tuning trajectory (update subspace, drift, curvature harm signal, degradation-curve collapse) and a
stabilised fine-tuner with the standard stabilisers and a curvature-aware projection."""

from .config import CURVATURES, STABILISERS, LockInConfig
from .curves import first_crossing, fit_degradation_curve, matched_spread
from .geometry import (fisher_top_directions, fisher_vp, hvp, lanczos_top_eigs, per_example_grads, principal_angles,
                       project_out, subspace_overlap, top_subspace)
from .probe import LockInProbe
from .trainer import StabilisedFineTuner

__all__ = ["CURVATURES", "LockInConfig", "LockInProbe", "STABILISERS", "StabilisedFineTuner", "first_crossing",
           "fisher_top_directions", "fisher_vp", "fit_degradation_curve", "hvp", "lanczos_top_eigs",
           "matched_spread", "per_example_grads", "principal_angles", "project_out", "subspace_overlap",
           "top_subspace"]
