"""The one tuning rule every arm of every claim goes through: a grid of the same size around each arm's own
natural scale, scored on tuning seeds that are never reported, extended at the edge until the choice is interior.

Why per arm: an SGD-style and an Adam-style update do not share a natural learning rate, so one shared grid
tunes one of them at its edge. Why extension: a choice on the grid's edge means the best value may lie outside,
so that arm would be under-tuned; the grid grows by its own pre-declared step on that side until the choice is
interior, or ``max_extensions`` is spent (then the spec's verdict is inconclusive by a mechanism check, as it is
when every value of an arm diverged or missed its target). A grid may pre-declare the side on which such an arm
would score (``LogGrid.unscored_toward``); then the same budget searches that side before giving up.

Use from a spec's ``prepare``::

    grids = {"adamezo": LogGrid(center=1e-3), "mezo": LogGrid(center=1e-5)}
    tuning = tune_per_arm(grids, lambda arm, lr, seed: train(arm, lr, seed)["val_loss"], mode="min")
    return {"tuning": tuning}        # the runner turns on_edge / no_finite_score into a mechanism check
    ...
    lr = prepared["tuning"]["chosen"][arm]
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from ..core.io import atomic_write_json, read_json
from ..core.logging import tagged
from ..core.progress import progress

TUNING_SEEDS = (1000,)
"""Seeds used for tuning only; reported seeds are 0..n-1, so no tuning seed is ever reported."""

MAX_EXTENSIONS = 2
"""How many times one arm's grid may grow past an edge unless a spec's tier sets its own (the same for every
arm of a claim)."""


@dataclass(frozen=True)
class LogGrid:
    """``size`` values ``center * factor**k`` (k symmetric around 0), extended by ``factor`` at an edge.

    Attributes:
        center: the arm's natural scale (its usual learning rate, say).
        factor: the step between grid points (pre-declared, also the extension step).
        size: number of points before any extension; equal for every arm of a claim (equal budget).
        lower, upper: hard limits (e.g. a rate cannot exceed 1); a choice at a hard limit counts as interior.
        unscored_toward: where no value scores finite, the side to search (-1: smaller, +1: larger, 0: none),
            pre-declared for a strength whose weak end is the untuned arm (a penalty too strong at every value
            never reaches its target; a weaker one does). It spends the same extension budget as an edge.
    """

    center: float
    factor: float = 3.0
    size: int = 3
    lower: float = 0.0
    upper: float = math.inf
    unscored_toward: int = 0

    def __post_init__(self) -> None:
        if not (self.center > 0 and math.isfinite(self.center)):
            raise ValueError(f"LogGrid.center must be a positive finite number, got {self.center}")
        if not self.factor > 1:
            raise ValueError(f"LogGrid.factor must be > 1, got {self.factor}")
        if self.size < 1:
            raise ValueError(f"LogGrid.size must be >= 1, got {self.size}")
        if self.unscored_toward not in (-1, 0, 1):
            raise ValueError(f"LogGrid.unscored_toward must be -1, 0 or 1, got {self.unscored_toward}")

    def points(self) -> list[float]:
        first = -(self.size - 1) / 2
        values = [self.center * self.factor ** (first + i) for i in range(self.size)]
        return [v for v in values if self.lower <= v <= self.upper]

    def beyond(self, value: float, direction: int) -> float | None:
        """The next point past ``value`` (direction -1: smaller, +1: larger), or None past a hard limit."""
        nxt = value * self.factor ** direction
        return nxt if self.lower <= nxt <= self.upper else None


@dataclass(frozen=True)
class ListGrid:
    """An explicit ordered list of options (e.g. ranks, or a reconstructed part's variants); no extension."""

    values: tuple

    def points(self) -> list:
        return list(self.values)

    def beyond(self, value, direction: int):
        return None


class _ScoreCheckpoint:
    """Scores of finished grid evaluations, written atomically after each one, so a killed tuning phase resumes
    where it stopped instead of from its first point (a full tier's tuning can take hours). Entries are keyed by
    the ``tune_per_arm`` call's index within the phase, its ``desc``, the arm, the value and the seed; the file
    carries ``identity`` (the runner passes the spec's config hash) and is ignored when that differs."""

    def __init__(self, path: Path, identity: str) -> None:
        self.path, self.identity, self.calls = path, identity, 0
        self.scores: dict[str, float] = {}
        if path.exists():
            try:
                data = read_json(path)
            except (OSError, ValueError):
                data = None  # a damaged checkpoint only costs the evaluations it held
            if isinstance(data, dict) and data.get("identity") == identity and isinstance(data.get("scores"), dict):
                self.scores = {k: float(v) for k, v in data["scores"].items()}

    def get(self, key: str) -> float | None:
        return self.scores.get(key)

    def put(self, key: str, value: float) -> None:
        self.scores[key] = value
        atomic_write_json(self.path, {"identity": self.identity, "scores": self.scores})


def checkpointed_points(path: str | os.PathLike, identity: str) -> set[str]:
    """The grid evaluations whose scores the tuning checkpoint at ``path`` holds for ``identity``: a resumed prepare
    phase replays them without scoring (or logging) again, so the runner keeps the lines they logged (their
    ``"tuning"`` tag names the evaluation)."""
    return set(_ScoreCheckpoint(Path(path), identity).scores)  # empty for a missing, damaged or foreign file


_CHECKPOINT: ContextVar[_ScoreCheckpoint | None] = ContextVar("icml26_tuning_checkpoint", default=None)


@contextmanager
def tuning_checkpoint(path: str | os.PathLike, identity: str) -> Iterator[None]:
    """Within this block every :func:`tune_per_arm` call reuses the scores recorded in ``path`` (for the same
    ``identity``) and records each new one there. The runner wraps a spec's ``prepare`` in it; the file is left
    for the caller to delete once the tuning result itself is saved."""
    token = _CHECKPOINT.set(_ScoreCheckpoint(Path(path), identity))
    try:
        yield
    finally:
        _CHECKPOINT.reset(token)


def tune_per_arm(grids: Mapping[str, LogGrid | ListGrid], score: Callable[[str, float, int], float], *,
                 mode: str = "min", seeds: Iterable[int] = TUNING_SEEDS, max_extensions: int = MAX_EXTENSIONS,
                 desc: str = "tuning", ahead: Callable[[list[tuple[str, Any, int]]], Any] | None = None) -> dict:
    """Choose one value per arm by the same rule for every arm.

    Args:
        grids: arm -> its grid around its own natural scale. ``LogGrid`` sizes must be equal (equal budget).
        score: ``score(arm, value, seed) -> float``, e.g. the validation loss after the full training budget.
            Non-finite scores (divergence) lose. Under :func:`tuning_checkpoint` (the runner's prepare phase) a
            resumed run replays recorded scores without calling ``score``, so it must not leave results that the
            caller needs behind as side effects (lazy caches it refills itself are fine).
        mode: "min" or "max": which score is better.
        seeds: tuning seeds; the score of a value is its mean over them.
        max_extensions: how many times one arm's grid may grow past an edge.
        ahead: called with the ``(arm, value, seed)`` evaluations about to be scored that no checkpoint holds yet
            (first every arm's initial grid, then each extension's seeds), so the room can compute them at once
            (``run_store.run_ahead``) before ``score`` reads them one by one. It must not change any score.

    Returns a JSON-able dict: ``chosen`` (arm -> value), ``scores`` (arm -> {repr(value): mean score}),
    ``on_edge`` (arms whose choice is still on a grid edge after the extensions), ``no_finite_score`` (arms for
    which every value diverged or missed its target: their ``chosen`` value is only the first of equals, not a
    tuned one), ``evaluations`` (arm -> how many values were scored), ``seeds`` and the ``rule`` in words.
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    sizes = {arm: g.size for arm, g in grids.items() if isinstance(g, LogGrid)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"every arm needs a grid of the same size (equal tuning budget), got {sizes}")
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("tune_per_arm needs at least one tuning seed")
    sign = 1.0 if mode == "min" else -1.0
    checkpoint = _CHECKPOINT.get()
    call = ""
    if checkpoint is not None:
        call = f"{checkpoint.calls}:{desc}"
        checkpoint.calls += 1

    def key(value: float) -> float:
        return sign * value if math.isfinite(value) else math.inf

    def scored(arm: str, value, seed: int) -> float:
        if checkpoint is None:
            return float(score(arm, value, seed))
        name = f"{call}|{arm}|{value!r}|{seed}"
        found = checkpoint.get(name)
        if found is None:
            with tagged(tuning=name):  # a resumed run keeps these lines once the score is checkpointed
                found = float(score(arm, value, seed))
            checkpoint.put(name, found)
        return found

    def run_ahead(points: list[tuple[str, Any, int]]) -> None:
        if ahead is not None:
            todo = [(arm, value, seed) for arm, value, seed in points
                    if checkpoint is None or checkpoint.get(f"{call}|{arm}|{value!r}|{seed}") is None]
            if todo:
                ahead(todo)

    run_ahead([(arm, value, seed) for arm, grid in grids.items() for value in grid.points() for seed in seeds])
    chosen, scores, on_edge, no_finite, evaluations = {}, {}, [], [], {}
    for arm, grid in grids.items():
        table: dict = {}

        def evaluate(value) -> None:
            runs = [scored(arm, value, s) for s in seeds]
            table[value] = sum(runs) / len(runs) if all(math.isfinite(r) for r in runs) else math.inf * sign

        def extend(value) -> None:  # a point past the initial grid (run ahead above): its seeds at once
            run_ahead([(arm, value, s) for s in seeds])
            evaluate(value)

        for value in progress(grid.points(), desc=f"{desc} [{arm}]"):
            evaluate(value)
        best = min(table, key=lambda v: key(table[v]))
        if isinstance(grid, LogGrid):
            for _ in range(max_extensions):
                ordered = sorted(table)
                if not any(math.isfinite(v) for v in table.values()):  # nothing scored: no edge to speak of
                    if not grid.unscored_toward:
                        break
                    nxt = grid.beyond(ordered[0] if grid.unscored_toward < 0 else ordered[-1], grid.unscored_toward)
                    if nxt is None:
                        break
                    extend(nxt)
                    best = min(table, key=lambda v: key(table[v]))
                    continue
                if len(ordered) < 2 or ordered[0] < best < ordered[-1]:
                    break
                nxt = grid.beyond(best, -1 if best == ordered[0] else 1)
                if nxt is None:  # a hard limit: the choice is as far as the arm can go
                    break
                extend(nxt)
                best = min(table, key=lambda v: key(table[v]))
            ordered = sorted(table)
            at_edge = len(ordered) >= 2 and best in (ordered[0], ordered[-1])
            if at_edge and grid.beyond(best, -1 if best == ordered[0] else 1) is not None \
                    and math.isfinite(table[best]):
                on_edge.append(arm)
        if not any(math.isfinite(v) for v in table.values()):
            no_finite.append(arm)  # listed here, not in on_edge: its "choice" is only the first of equals
        chosen[arm] = best
        scores[arm] = {repr(v): table[v] for v in table}
        evaluations[arm] = len(table)
    return {"chosen": chosen, "scores": scores, "on_edge": on_edge, "no_finite_score": no_finite,
            "evaluations": evaluations, "seeds": list(seeds), "mode": mode,
            "rule": f"per-arm grid around its own scale, same size for every arm, mean {mode} score over tuning "
                    f"seeds {list(seeds)}, extended at an edge up to {max_extensions} times"}


def tuning_check(prepared: Mapping | None) -> dict | None:
    """The mechanism check that every tuned arm was tuned: its chosen value is interior to its grid, and at least
    one value it tried scored finite (an arm that diverged or missed its target at every value has no tuned value
    at all; its "choice" is the first of equally bad ones). From ``prepared["tuning"]`` (one :func:`tune_per_arm`
    output, or a dict of them by name); None when the spec tunes nothing this way."""
    tuning = (prepared or {}).get("tuning") if isinstance(prepared, Mapping) else None
    if not isinstance(tuning, Mapping):
        return None
    outputs = {"": tuning} if "chosen" in tuning else {k: v for k, v in tuning.items() if isinstance(v, Mapping)}
    failed = []
    for name, out in outputs.items():
        prefix = f"{name}:" if name else ""
        failed += [prefix + arm for arm in out.get("on_edge", [])]
        failed += [f"{prefix}{arm} (no finite score)" for arm in out.get("no_finite_score", [])]
    return {"name": "tuned_inside_grid", "description": "every tuned arm's chosen value is inside its grid "
            "after the edge extensions, and scored finite", "rule": "no arm on a grid edge, none without a finite "
            "score", "values": failed, "passed": not failed}
