"""ScaLoRA (arXiv 2510.23818): merge the LoRA update into the frozen weight and restart it with optimally
column-scaled factors, so low-rank steps accumulate into a high-rank update; ReLoRA as the baseline."""

from .adapter import (ScaLoRALinear, effective_rank, effective_weight, lora_factors, lora_layers, merge_reinit_,
                      merge_rescale_)
from .config import ReLoRAConfig, ScaLoRAConfig
from .optimizer import ReLoRAOptimizer, ScaLoRAOptimizer
from .scaling import gram_adam, gram_sgd, nnls_gram, solve_coefficients

# Rows of the shared adapter contract matrix (tests/families/test_adapters_common.py).
ADAPTER_CASES = [("scalora", lambda linear, r, alpha, name: ScaLoRALinear(linear, r, alpha))]

__all__ = ["ADAPTER_CASES", "ReLoRAConfig", "ReLoRAOptimizer", "ScaLoRAConfig", "ScaLoRALinear", "ScaLoRAOptimizer",
           "effective_rank", "effective_weight", "gram_adam", "gram_sgd", "lora_factors", "lora_layers",
           "merge_reinit_", "merge_rescale_", "nnls_gram", "solve_coefficients"]
