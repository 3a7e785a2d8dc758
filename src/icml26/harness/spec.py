"""ExperimentSpec: one paper claim, its arms, and the comparator fixed in code before anything runs."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .stats import mean_and_bounds

TIERS = ("smoke", "quick", "full")
VERDICTS = ("reproduced", "not_reproduced", "inconclusive")
CONFIDENCE = 0.9
"""One-sided confidence of the bound that decides every verdict (Student t on the per-seed statistic)."""
MIN_SEEDS = {"quick": 3, "full": 3}
"""Fewest reported seeds a judged tier may declare; five or more where a seed costs under a minute."""

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
        return isinstance(value, (int, float)) and math.isfinite(value) and _OPS[self.op](value, self.threshold)

    @property
    def larger_is_better(self) -> bool:
        return self.op in (">=", ">")


@dataclass(frozen=True)
class MechanismCheck:
    """A condition under which the claim is testable at all, e.g. ``MechanismCheck("clip_fraction", ">=", 0.01,
    "Clip_B clipped at least 1% of tokens")``.

    The spec's ``run`` reports the value per seed under ``"checks"`` (``{"checks": {"clip_fraction": 0.03}}``).
    The check passes only when it holds on every reported seed (``reduce="all"``) or on the seed mean
    (``reduce="mean"``); a failed check makes the verdict *inconclusive* whatever the statistic says.
    """

    name: str
    op: str
    threshold: float
    description: str
    reduce: str = "all"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"MechanismCheck.op must be one of {sorted(_OPS)}, got {self.op!r}")
        if self.reduce not in ("all", "mean"):
            raise ValueError(f"MechanismCheck.reduce must be 'all' or 'mean', got {self.reduce!r}")

    def evaluate(self, values: list[float]) -> dict:
        """``{"name", "description", "values", "passed"}`` for the per-seed ``values`` (missing ones fail)."""
        finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        if not values or len(finite) < len(values):
            passed = False
        elif self.reduce == "mean":
            passed = _OPS[self.op](sum(finite) / len(finite), self.threshold)
        else:
            passed = all(_OPS[self.op](v, self.threshold) for v in finite)
        return {"name": self.name, "description": self.description, "rule": f"{self.reduce} {self.op} "
                f"{self.threshold:g}", "values": values, "passed": bool(passed)}


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
        checks: the mechanism checks, declared before the run (see :class:`MechanismCheck`). Tuning done with
            :func:`icml26.harness.tuning.tune_per_arm` and stored under ``prepared["tuning"]`` adds its own
            check (every tuned arm's choice is inside its grid).
        null_value: the statistic's value when the method arm is switched back to the baseline (0 for a gain,
            1 for a ratio). The comparator must reject it; ``tests/claims`` checks that for every spec.
        ahead: optional ``ahead(config, seeds, prepared)`` for specs whose seeds are a few long trainings: with
            ``seed_jobs`` > 1 the runner calls it before the seeds run, and it hands those seeds' trainings to the
            room's workers with :func:`icml26.harness.run_store.run_ahead` (each to the next free worker), so that
            three seeds on two workers do not leave one idle while the other trains its second seed. The seeds
            then read their trainings back from the run store; the numbers do not change.
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
    checks: tuple[MechanismCheck, ...] = ()
    null_value: float | None = None
    ahead: Callable[[Mapping[str, Any], list[int], Any], None] | None = None

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in TIERS]
        if unknown or "smoke" not in self.tiers or len(self.tiers) < 2:
            raise ValueError(f"spec {self.id!r}: tiers must be a subset of {TIERS} with 'smoke' and at least one "
                             f"more, got {sorted(self.tiers)}")
        if self.baseline not in self.arms:
            raise ValueError(f"spec {self.id!r}: baseline {self.baseline!r} is not one of its arms {self.arms}")
        if any(self.seeds.get(t, 0) < 1 for t in self.tiers):
            raise ValueError(f"spec {self.id!r}: every tier needs at least one seed, got {dict(self.seeds)}")
        few = {t: self.seeds.get(t) for t in self.tiers if self.seeds.get(t, 0) < MIN_SEEDS.get(t, 1)}
        if few:
            raise ValueError(f"spec {self.id!r}: judged tiers need at least {MIN_SEEDS} seeds, got {few}")
        names = [c.name for c in self.checks]
        if len(set(names)) != len(names):
            raise ValueError(f"spec {self.id!r}: mechanism check names must be unique, got {names}")
        if self.null_value is not None and self.comparator.holds(self.null_value):
            raise ValueError(f"spec {self.id!r}: the comparator '{self.comparator.op} {self.comparator.threshold:g}' "
                             f"accepts the null value {self.null_value:g} (method switched back to the baseline), "
                             f"so the claim could pass without any effect")


def judge(comparator: Comparator, values: list[float], tier: str, *, checks: list[dict] | None = None,
          confidence: float = CONFIDENCE) -> dict:
    """Turn per-seed statistic values into a verdict, with the bound and the sentence of the rule behind it.

    The rule, fixed for every claim: at the smoke tier nothing is judged. Otherwise a one-sided Student t bound
    at ``confidence`` is put on the mean of the per-seed statistic, on each side. The claim is *reproduced* only
    when the bound on the unfavourable side still satisfies the comparator (for ``>=``: the lower bound is above
    the threshold), *not reproduced* only when the bound on the favourable side fails it (the upper bound is
    below the threshold), and *inconclusive* otherwise. Any failed mechanism check, a non-finite seed value, or
    fewer than two seeds makes it inconclusive.

    Returns ``{"verdict", "rule", "confidence", "n", "mean", "std", "lower", "upper", "failed_checks"}``.
    """
    out: dict = {"confidence": confidence, "n": len(values), "mean": None, "std": None, "lower": None,
                 "upper": None, "failed_checks": [c["name"] for c in (checks or []) if not c["passed"]]}
    name, target = comparator.statistic, f"{comparator.op} {comparator.threshold:g}"
    if tier == "smoke":
        return {**out, "verdict": "inconclusive",
                "rule": "smoke tier: checks that the experiment runs end to end, not the claim"}
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if len(finite) < len(values) or len(finite) < 2:
        return {**out, "verdict": "inconclusive",
                "rule": f"{len(finite)} finite of {len(values)} seed value(s) of '{name}'; every seed must be finite "
                        f"and at least 2 are needed for a bound"}
    mean, std, lower, upper = mean_and_bounds(finite, confidence)
    out.update(mean=mean, std=std, lower=lower, upper=upper)
    unfavourable, favourable = (lower, upper) if comparator.larger_is_better else (upper, lower)
    pct = f"{100 * confidence:g}%"
    rule = (f"{name} = {mean:.4g} (n={len(finite)}, one-sided {pct} Student t bounds [{lower:.4g}, {upper:.4g}]) "
            f"against '{target}': reproduced when the {pct} bound on the unfavourable side satisfies it, not "
            f"reproduced when the bound on the favourable side fails it")
    if out["failed_checks"]:
        failed = "; ".join(f"{c['name']} ({c['description']}; values {c['values']})" for c in checks if not c["passed"])
        return {**out, "verdict": "inconclusive", "rule": f"mechanism did not act: {failed}. {rule}"}
    if comparator.holds(unfavourable):
        return {**out, "verdict": "reproduced", "rule": rule}
    if not comparator.holds(favourable):
        return {**out, "verdict": "not_reproduced", "rule": rule}
    return {**out, "verdict": "inconclusive", "rule": rule}
