"""ExperimentSpec: one paper claim, its arms, and the comparator fixed in code before anything runs."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

TIERS = ("smoke", "quick", "full")
VERDICTS = ("reproduced", "not_reproduced", "inconclusive")

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
}


@dataclass(frozen=True)
class Comparator:
    """The pass rule for a claim statistic, e.g. ``Comparator("fp_reduction", ">=", 0.3, ...)``.

    Attributes:
        statistic: name of the per-seed claim statistic the spec's ``run`` returns.
        op: one of ``>=, >, <=, <``.
        threshold: the value the statistic is compared with.
        description: the rule in words, as it appears in the report.
    """

    statistic: str
    op: str
    threshold: float
    description: str

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Comparator.op must be one of {sorted(_OPS)}, got {self.op!r}")

    def holds(self, value: float) -> bool:
        return math.isfinite(value) and _OPS[self.op](value, self.threshold)


SeedRun = Callable[[Mapping[str, Any], int, Any], dict]
"""``run(config, seed, prepared) -> {"arms": {arm: {metric: float}}, "statistics": {name: float}, "curves": {...}}``."""


@dataclass(frozen=True)
class ExperimentSpec:
    """A claim check that the runner executes per seed and judges with its comparator.

    Attributes:
        id: unique within the room, used as the result file name.
        room: the room name.
        claim: the paper's claim in one sentence.
        paper_ref: where the claim is in the paper (arXiv id, table or figure).
        metric: what is measured, in words.
        arms: names of the arms (method first, then baselines), all given the same budget.
        baseline: which arm is the paper's baseline.
        comparator: the fixed pass rule on a per-seed statistic.
        run: runs all arms for one seed; gets the tier config, the seed and the output of ``prepare``.
        tiers: tier name -> the complete config for that tier (recorded verbatim in the result). "smoke" is
            required; a spec without a "quick" entry (e.g. one that needs a pretrained LM) is skipped by
            ``make reproduce`` and runs with ``--tier full``.
        seeds: tier name -> number of seeds.
        prepare: optional step run once per spec before the seeds (e.g. the learning-rate grid search on a
            tuning seed, identical for all arms); its JSON-able output is stored and passed to ``run``.
        plot: optional ``plot(result, ax)`` drawing the claim's figure from a result dict.
        notes: anything a reader of the result must know (what is reduced relative to the paper).
    """

    id: str
    room: str
    claim: str
    paper_ref: str
    metric: str
    arms: tuple[str, ...]
    baseline: str
    comparator: Comparator
    run: SeedRun
    tiers: Mapping[str, Mapping[str, Any]]
    seeds: Mapping[str, int] = field(default_factory=lambda: {"smoke": 1, "quick": 3, "full": 3})
    prepare: Callable[[Mapping[str, Any]], dict] | None = None
    plot: Callable[[dict, Any], None] | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in TIERS]
        if unknown or "smoke" not in self.tiers or len(self.tiers) < 2:
            raise ValueError(f"spec {self.id!r}: tiers must be a subset of {TIERS} with 'smoke' and at least one "
                             f"more, got {sorted(self.tiers)}")
        if self.baseline not in self.arms:
            raise ValueError(f"spec {self.id!r}: baseline {self.baseline!r} is not one of its arms {self.arms}")
        if any(self.seeds.get(t, 0) < 1 for t in self.tiers):
            raise ValueError(f"spec {self.id!r}: every tier needs at least one seed, got {dict(self.seeds)}")


def judge(comparator: Comparator, values: list[float], tier: str) -> tuple[str, str]:
    """Turn per-seed statistic values into a verdict and the sentence of the rule that produced it.

    The rule (fixed for every claim): at the smoke tier nothing is judged; with fewer than two finite seeds the
    result is inconclusive; otherwise the claim is *reproduced* when the mean satisfies the comparator and at least
    two thirds of the seeds do, *not reproduced* when the mean fails and at most one third of the seeds pass, and
    *inconclusive* in between.
    """
    if tier == "smoke":
        return "inconclusive", "smoke tier: checks that the experiment runs end to end, not the claim"
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return "inconclusive", f"only {len(finite)} finite seed value(s) of '{comparator.statistic}'; need at least 2"
    mean = sum(finite) / len(finite)
    passing = sum(comparator.holds(v) for v in finite)
    frac = passing / len(finite)
    rule = (f"mean {comparator.statistic} = {mean:.4g} {'satisfies' if comparator.holds(mean) else 'fails'} "
            f"'{comparator.op} {comparator.threshold:g}'; {passing}/{len(finite)} seeds pass "
            f"(reproduced: mean passes and >= 2/3 of seeds; not reproduced: mean fails and <= 1/3 of seeds)")
    if comparator.holds(mean) and frac >= 2 / 3:
        return "reproduced", rule
    if not comparator.holds(mean) and frac <= 1 / 3:
        return "not_reproduced", rule
    return "inconclusive", rule
