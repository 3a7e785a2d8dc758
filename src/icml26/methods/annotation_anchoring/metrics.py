"""Diversity / mode-collapse metrics over a set of samples (one prompt, many samples).

The paper's exact diversity metric is not published (the notes guess NoveltyBench-style partitions or semantic
entropy); these are the standard ones: entropy of the category distribution, collapse H_ref - H, coverage, KL
to a reference distribution, and distinct-n.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Iterable, Mapping, Sequence


def category_distribution(labels: Iterable[Hashable | None]) -> dict[Hashable, float]:
    """Empirical distribution of ``labels``; ``None`` (unclassifiable sample) is left out. Empty -> {}."""
    counts = Counter(label for label in labels if label is not None)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def category_entropy(labels: Iterable[Hashable | None]) -> float:
    """Shannon entropy (nats) of the empirical category distribution; nan when no sample is classifiable."""
    dist = category_distribution(labels)
    if not dist:
        return math.nan
    return -sum(p * math.log(p) for p in dist.values() if p > 0)


def collapse(labels: Iterable[Hashable | None], reference_entropy: float) -> float:
    """Diversity collapse H_ref - H(labels) in nats (the notes' 'Collapse = H_pretrain - H_model')."""
    return reference_entropy - category_entropy(labels)


def coverage(labels: Iterable[Hashable | None], categories: Sequence[Hashable]) -> float:
    """Fraction of ``categories`` that at least one sample falls in."""
    if not categories:
        raise ValueError("categories must be non-empty")
    seen = {label for label in labels if label is not None}
    return sum(c in seen for c in categories) / len(categories)


def kl_to_reference(labels: Iterable[Hashable | None], reference: Mapping[Hashable, float],
                    smoothing: float = 0.0) -> float:
    """KL(P_samples || Q_reference) in nats; P is first mixed as ``(1 - smoothing) P + smoothing Q``.

    A sample category outside Q's support gives inf.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    p = category_distribution(labels)
    if not p:
        return math.nan
    keys = set(p) | set(reference)
    total = 0.0
    for k in keys:
        pk = (1 - smoothing) * p.get(k, 0.0) + smoothing * reference.get(k, 0.0)
        qk = reference.get(k, 0.0)
        if pk == 0:
            continue
        if qk == 0:
            return math.inf
        total += pk * math.log(pk / qk)
    return total


def distinct_n(texts: Sequence[Sequence[Hashable]], n: int) -> float:
    """Distinct-n: unique n-grams / total n-grams over all ``texts`` (each a token or word sequence)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    grams = [tuple(t[i:i + n]) for t in texts for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else math.nan


def gap_closed(h_method: float, h_baseline: float, h_reference: float) -> float:
    """Fraction of the diversity gap the method closes: (H_method - H_base) / (H_ref - H_base); nan if no gap."""
    gap = h_reference - h_baseline
    return (h_method - h_baseline) / gap if gap > 1e-12 else math.nan
