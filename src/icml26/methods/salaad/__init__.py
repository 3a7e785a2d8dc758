"""SALAAD (arXiv 2602.00942): sparse plus low-rank structure induced during training by ADMM, truncated to any budget.

SALAAD trains every weight of the model (it does not add a frozen-base update), so it does not join the
AdapterLinear contract matrix; see README.md.
"""

from __future__ import annotations

from .admm import SALAAD, ThresholdController, energy_rank, rho_at, select_blocks, soft_threshold, svt
from .baselines import ialm_rpca, magnitude_prune, rpca_components, svd_truncate
from .budget import CompressionReport, block_cost, count_parameters
from .config import BlockConfig, ControllerConfig, RhoConfig, SALAADConfig, official_block_config, with_rho_scale
from .hpa import HPAPlan, plan_hpa, truncate_to_budget

__all__ = [
    "SALAAD", "SALAADConfig", "BlockConfig", "ControllerConfig", "RhoConfig", "official_block_config",
    "with_rho_scale", "ThresholdController", "energy_rank", "rho_at", "select_blocks", "soft_threshold", "svt",
    "truncate_to_budget", "plan_hpa", "HPAPlan", "CompressionReport", "block_cost", "count_parameters",
    "svd_truncate", "magnitude_prune", "ialm_rpca", "rpca_components",
]
