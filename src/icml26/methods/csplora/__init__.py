"""CSPLoRA (ICML 2026): confidence-guided structural planning of per-module LoRA ranks ("probe once, deploy
everywhere"). The planner is a reconstruction from the abstract; see README.md."""

from .config import CSPLoRAConfig
from .plan import RankPlan, adapted_ranks, allocate_ranks, anchored_key, check_ranks, exact_target_regex
from .planner import (CSPLoRAPlanner, ProbeOutput, ProbeScores, classification_probe, normalise_weights,
                      per_sample_scores, sample_uncertainty, sequence_probe)

__all__ = ["CSPLoRAConfig", "CSPLoRAPlanner", "ProbeOutput", "ProbeScores", "RankPlan", "adapted_ranks",
           "allocate_ranks", "anchored_key", "check_ranks", "classification_probe", "exact_target_regex",
           "normalise_weights", "per_sample_scores", "sample_uncertainty", "sequence_probe"]
