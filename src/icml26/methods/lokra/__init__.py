"""LoKRA (low Kruskal-rank adaptation) and LoKRA+ (Khatri-Rao factors): adapters, penalty and Kruskal-rank tools."""

from .adapter import (LOKRA_LAYERS, LoKRALinear, LoKRAPlusLinear, PlusLayout, kruskal_penalty, lokra_make,
                      lokra_plus_make, plus_delta, plus_factors, plus_layout, update_diagnostics)
from .config import LoKRAConfig
from .kruskal import (coherence_lower_bound, coherence_penalty, effective_rank, khatri_rao, khatri_rao_kruskal_bound,
                      kruskal_rank, mutual_coherence)

# Rows of the adapter contract matrix (tests/families/test_adapters_common.py). The contract uses r=3 on layers as
# small as 12x20, below LoKRA+'s LoRA-equal budget, so the LoKRA+ rows let the factors grow to the feasible minimum.
ADAPTER_CASES = [
    ("lokra", lokra_make()),
    ("lokra_soft_max_components", lokra_make(LoKRAConfig(coherence="soft_max", penalty_on="components"))),
    ("lokra_plus", lokra_plus_make(LoKRAConfig(plus_budget="grow"))),
    ("lokra_plus_rows_zero_v", lokra_plus_make(LoKRAConfig(plus_budget="grow", kr_axis="rows", plus_init="zero_v"))),
]

__all__ = ["ADAPTER_CASES", "LOKRA_LAYERS", "LoKRAConfig", "LoKRALinear", "LoKRAPeftConfig", "LoKRAPlusLinear",
           "LoKRAPlusPeftLinear", "PlusLayout", "coherence_lower_bound", "coherence_penalty", "effective_rank",
           "khatri_rao", "khatri_rao_kruskal_bound", "kruskal_penalty", "kruskal_rank", "lokra_make",
           "lokra_plus_make", "mutual_coherence", "plus_delta", "plus_factors", "plus_layout", "update_diagnostics"]

_PEFT_ROUTE = ("LoKRAPeftConfig", "LoKRAPlusPeftLinear")


def __getattr__(name: str):
    # The peft route imports peft and transformers; load it only when asked for.
    if name in _PEFT_ROUTE:
        from . import peft_route

        return getattr(peft_route, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
