"""RankPlan: CSPLoRA's scale-invariant structural prior, and its deployment at any budget on any LoRA backend.

A plan stores one proportion pi_m per module (summing to 1) and each module's shape. It holds no rank: ranks are
made only when a budget is given (:meth:`RankPlan.ranks_for_budget`), so one probe serves every budget
("probe once, deploy everywhere"). A LoRA module of rank r on a (d_out, d_in) weight costs r * (d_in + d_out)
parameters, and the budget of mean rank r_bar is uniform LoRA's count r_bar * sum_m (d_in + d_out).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
from torch import nn

from ...core.adapters import AdapterConfig, AdapterLinear
from ...core.assets import require
from ...core.io import atomic_write_json, read_json
from .config import ALPHA_MODES

PLAN_FORMAT = "icml26.csplora.RankPlan"
PLAN_VERSION = 1
_PEFT_INSTALL = "pip install 'icml26[llm]'"
# Bound on the exact-rounding programme's work (table entries times choices); beyond it the greedy result stands.
_MAX_DP_WORK = 50_000_000
# The plan owns these LoraConfig fields; passing them to to_peft_config would silently override the plan.
_PLAN_OWNED = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "exclude_modules",
               "layers_to_transform", "layers_pattern")


def anchored_key(name: str) -> str:
    """A rank_pattern/alpha_pattern key that matches exactly the module ``name`` and nothing else.

    peft matches a key with ``(.*\\.)?key$``; a leading ``^`` forbids any prefix (peft PR #2419), and escaping keeps
    the dots of the name literal, so ``layers.1.q_proj`` cannot also select ``layers.11.q_proj``.
    """
    return "^" + re.escape(name)


def exact_target_regex(names: Iterable[str]) -> str:
    """One regex that peft and :func:`icml26.core.adapters.find_target_modules` full-match against module names,
    selecting exactly ``names`` (a suffix list would let ``"0"`` also select ``"blocks.1.0"``)."""
    names = list(names)
    if not names:
        raise ValueError("exact_target_regex needs at least one module name (an empty list would select nothing)")
    return "(?:" + "|".join(re.escape(n) for n in names) + ")"


def allocate_ranks(proportions: list[float], costs: list[int], budget: int, lower: list[int],
                   upper: list[int], *, max_shift: int = 2) -> tuple[list[int], list[float]]:
    """Integer ranks r_m in [lower_m, upper_m] spending at most ``budget`` parameters (sum_m r_m * costs_m), and
    exactly ``budget`` whenever that is possible without moving any rank more than ``max_shift`` from step 2.

    1. Continuous targets t_m = clip(s * pi_m, lower_m, upper_m), with the scale s found by bisection so that
       sum_m t_m costs_m = budget (water-filling: clipped modules hand their share to the others).
    2. r_m = floor(t_m); then, greedily, one rank at a time to the module with the largest deficit t_m - r_m
       among those whose cost still fits in the remaining budget.
    3. A gap the greedy step cannot fill (smaller than the cost of any module that may grow) is closed exactly
       when some change of at most ``max_shift`` ranks per module does it (the change with the least
       sum_m (r_m - t_m)^2, found by a dynamic programme over the parameter sum). Otherwise the greedy ranks
       stand, a little under the budget.

    Why the shift is bounded: on a few modules of very different sizes, an exact hit can be far from the plan.
    For the MNIST MLP of the claim (a 784-input layer, three 128 x 128 layers and a 10-way head) every rank
    assignment that spends exactly uniform LoRA's count at mean rank 4 has rank 4 on the first layer and on the
    head, whatever the plan says; exactness there would quietly turn any plan back into near-uniform LoRA. On
    transformer shapes (many modules with a common cost unit) a shift of 1 or 2 always sufficed in our tests.

    Returns the ranks and the continuous targets t_m.
    """
    m = len(proportions)
    if not (len(costs) == len(lower) == len(upper) == m) or m == 0:
        raise ValueError("proportions, costs, lower and upper must be non-empty and of equal length")
    if not _is_int(budget) or budget <= 0:
        raise ValueError(f"budget must be a positive int (LoRA parameters to spend), got {budget!r}")
    for what, values in (("lower", lower), ("upper", upper)):
        if any(not _is_int(v) or v < 0 for v in values):
            raise ValueError(f"{what} rank bounds must be ints >= 0, got {list(values)}")
    if any(not _is_int(c) or c <= 0 for c in costs):
        raise ValueError(f"costs must be positive ints (d_in + d_out per unit of rank), got {list(costs)}")
    if any(not (isinstance(p, (int, float)) and math.isfinite(p) and p >= 0) for p in proportions):
        raise ValueError(f"proportions must be finite numbers >= 0, got {list(proportions)}")
    pi = np.asarray(proportions, dtype=np.float64)
    c = np.asarray(costs, dtype=np.int64)
    lo = np.asarray(lower, dtype=np.int64)
    hi = np.asarray(upper, dtype=np.int64)
    if np.any(lo > hi):
        raise ValueError("a module's lower rank bound exceeds its upper bound")
    floor_params, ceil_params = int((lo * c).sum()), int((hi * c).sum())
    if not floor_params <= budget <= ceil_params:
        raise ValueError(f"budget of {budget} parameters is outside what the rank bounds allow "
                         f"[{floor_params}, {ceil_params}] (r_min / r_max / min(d_in, d_out))")

    def spend(scale: float) -> float:
        return float((np.clip(scale * pi, lo, hi) * c).sum())

    s_lo, s_hi = 0.0, 1.0
    while spend(s_hi) < budget and s_hi < 1e18:
        s_hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (s_lo + s_hi)
        s_lo, s_hi = (mid, s_hi) if spend(mid) < budget else (s_lo, mid)
    target = np.clip(s_hi * pi, lo, hi)
    # Bisection lands a hair off integers (3.9999999 for a uniform plan); the tolerance keeps them integral.
    ranks = np.clip(np.floor(target + 1e-6), lo, hi).astype(np.int64)
    gap = budget - int((ranks * c).sum())
    if gap < 0:  # only possible through the tolerance above; give the excess back from the largest overshoot
        for i in np.argsort(target - ranks, kind="stable"):
            while gap < 0 and ranks[i] > lo[i]:
                ranks[i] -= 1
                gap += int(c[i])
    while gap > 0:
        fits = (ranks < hi) & (c <= gap)
        if not fits.any():
            break
        deficit = np.where(fits, target - ranks, -np.inf)
        i = int(np.argmax(deficit))
        ranks[i] += 1
        gap -= int(c[i])
    if gap > 0 and max_shift > 0:
        ranks = _close_gap(ranks, target, c, lo, hi, gap, max_shift)
    return [int(r) for r in ranks], [float(t) for t in target]


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_rank_map(ranks: Mapping[str, int], modules: Iterable[str] | None = None) -> None:
    """ValueError unless ``ranks`` maps module names to ints >= 0 (and, given ``modules``, names only those)."""
    bad = {n: r for n, r in ranks.items() if not _is_int(r) or r < 0}
    if bad:
        raise ValueError(f"ranks must be ints >= 0 (0 = module not adapted); got {dict(list(bad.items())[:5])}")
    if modules is not None:
        unknown = sorted(set(ranks) - set(modules))
        if unknown:
            raise ValueError(f"ranks name module(s) that are not in the plan: {unknown[:5]}")


def _close_gap(ranks: np.ndarray, target: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               gap: int, max_shift: int) -> np.ndarray:
    """Per-module changes d_m in [-K, K], K = 1 .. max_shift, with sum_m d_m c_m == gap and the least
    sum_m (r_m + d_m - t_m)^2 (exact dynamic programme); the ranks unchanged when there is none."""
    unit = math.gcd(*(int(x) for x in c))
    if gap % unit:
        return ranks  # no integer change of ranks can spend exactly this many parameters
    u = c // unit
    goal = gap // unit
    for k in range(1, max_shift + 1):
        span = int(k * u.sum())
        if (2 * span + 1) * (2 * k + 1) * len(c) > _MAX_DP_WORK:
            break
        size = 2 * span + 1
        best = np.full(size, np.inf)
        best[span] = 0.0
        choice = np.zeros((len(c), size), dtype=np.int32)
        for i in range(len(c)):
            new = np.full(size, np.inf)
            pick = np.zeros(size, dtype=np.int32)
            for d in range(-k, k + 1):
                r = ranks[i] + d
                if r < lo[i] or r > hi[i]:
                    continue
                step = (r - target[i]) ** 2 - (ranks[i] - target[i]) ** 2
                shift = int(d * u[i])
                moved = np.full(size, np.inf)
                if shift >= 0:
                    moved[shift:] = best[: size - shift] + step
                else:
                    moved[:shift] = best[-shift:] + step
                better = moved < new
                new[better], pick[better] = moved[better], d
            best, choice[i] = new, pick
        if math.isfinite(best[span + goal]):
            out, pos = ranks.copy(), span + goal
            for i in range(len(c) - 1, -1, -1):
                d = int(choice[i, pos])
                out[i] += d
                pos -= int(d * u[i])
            return out
    return ranks


@dataclass
class RankPlan:
    """Module name -> proportion pi_m (scale-invariant), with module shapes and the deployment defaults.

    Attributes:
        proportions: pi_m >= 0 per module, normalised to sum 1 on construction; the order is the model's.
        shapes: module name -> (in_features, out_features) of its weight W_m (d_out, d_in).
        r_min, r_max: default rank bounds of :meth:`ranks_for_budget` (r_max None: min(d_in, d_out) per module).
        alpha_mode, alpha_ratio: how alphas follow ranks (see :class:`CSPLoRAConfig`).
        metadata: how the plan was made (config, raw scores, probe statistics, timings); free-form, JSON-able.
    """

    proportions: dict[str, float]
    shapes: dict[str, tuple[int, int]]
    r_min: int = 1
    r_max: int | None = None
    alpha_mode: str = "proportional"
    alpha_ratio: float = 2.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.proportions:
            raise ValueError("proportions is empty: a plan needs at least one module")
        if set(self.proportions) != set(self.shapes):
            raise ValueError(f"proportions and shapes name different modules: "
                             f"{sorted(set(self.proportions) ^ set(self.shapes))[:5]}")
        for name, p in self.proportions.items():
            if not (isinstance(p, (int, float)) and math.isfinite(p) and p >= 0):
                raise ValueError(f"proportions[{name!r}] must be a finite number >= 0, got {p!r}")
        total = float(sum(self.proportions.values()))
        if total <= 0:
            raise ValueError("proportions sum to 0: at least one module must have a positive proportion")
        self.proportions = {n: float(p) / total for n, p in self.proportions.items()}
        shapes = {}
        for name in self.proportions:
            shape = tuple(self.shapes[name])
            if len(shape) != 2 or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in shape):
                raise ValueError(f"shapes[{name!r}] must be (in_features, out_features) positive ints, got {shape!r}")
            shapes[name] = shape
        self.shapes = shapes
        if not isinstance(self.r_min, int) or isinstance(self.r_min, bool) or self.r_min < 0:
            raise ValueError(f"r_min must be an int >= 0, got {self.r_min!r}")
        if self.r_max is not None and (not _is_int(self.r_max) or self.r_max < max(self.r_min, 1)):
            raise ValueError(f"r_max must be None or an int >= max(r_min, 1), got {self.r_max!r}")
        if self.alpha_mode not in ALPHA_MODES:
            raise ValueError(f"alpha_mode must be one of {ALPHA_MODES}, got {self.alpha_mode!r}")
        if not (isinstance(self.alpha_ratio, (int, float)) and math.isfinite(self.alpha_ratio)
                and self.alpha_ratio > 0):
            raise ValueError(f"alpha_ratio must be a positive finite number, got {self.alpha_ratio!r}")

    # -- budgets -------------------------------------------------------------------------------------------------
    @property
    def modules(self) -> list[str]:
        return list(self.proportions)

    def cost(self, name: str) -> int:
        """LoRA parameters per unit of rank in module ``name``: d_in + d_out."""
        d_in, d_out = self.shapes[name]
        return d_in + d_out

    def uniform_params(self, mean_rank: float) -> int:
        """Trainable parameters of uniform LoRA at rank ``mean_rank`` on every planned module."""
        return int(round(mean_rank * sum(self.cost(n) for n in self.modules)))

    def num_params(self, ranks: Mapping[str, int]) -> int:
        """LoRA parameters of a rank assignment (DoRA adds d_out per adapted module on top)."""
        _check_rank_map(ranks, self.modules)
        return sum(int(ranks[n]) * self.cost(n) for n in self.modules)

    def _budget(self, mean_rank: float | None, total_params: int | None) -> tuple[int, float]:
        if (mean_rank is None) == (total_params is None):
            raise ValueError("give exactly one of mean_rank and total_params")
        if mean_rank is not None:
            if not (isinstance(mean_rank, (int, float)) and not isinstance(mean_rank, bool)
                    and math.isfinite(mean_rank) and mean_rank > 0):
                raise ValueError(f"mean_rank must be a positive finite number, got {mean_rank!r}")
            return self.uniform_params(mean_rank), float(mean_rank)
        if not isinstance(total_params, int) or isinstance(total_params, bool) or total_params <= 0:
            raise ValueError(f"total_params must be a positive int, got {total_params!r}")
        return total_params, total_params / sum(self.cost(n) for n in self.modules)

    def ranks_for_budget(self, mean_rank: float | None = None, total_params: int | None = None, *,
                         r_min: int | None = None, r_max: int | None = None,
                         max_shift: int = 2) -> dict[str, int]:
        """Per-module ranks spending the budget of uniform LoRA at ``mean_rank`` (or ``total_params``).

        The parameter count never exceeds the budget and equals it whenever ranks within ``max_shift`` of the
        greedy rounding can (on transformer-shaped models, in every case we tried); see :func:`allocate_ranks`.
        ``max_shift=0`` keeps the greedy rounding. Ranks lie in [r_min, min(r_max, d_in, d_out)]; a rank of 0
        (possible only with r_min = 0) means the module is left out.
        """
        budget, _ = self._budget(mean_rank, total_params)
        r_min = self.r_min if r_min is None else r_min
        r_max = self.r_max if r_max is None else r_max
        if not _is_int(r_min) or r_min < 0:
            raise ValueError(f"r_min must be an int >= 0, got {r_min!r}")
        if r_max is not None and (not _is_int(r_max) or r_max < max(r_min, 1)):
            raise ValueError(f"r_max must be None or an int >= max(r_min, 1) = {max(r_min, 1)}, got {r_max!r}")
        if not _is_int(max_shift) or max_shift < 0:
            raise ValueError(f"max_shift must be an int >= 0, got {max_shift!r}")
        upper = [min(min(self.shapes[n]), r_max if r_max is not None else math.inf) for n in self.modules]
        lower = [min(r_min, u) for u in upper]
        ranks, _ = allocate_ranks([self.proportions[n] for n in self.modules],
                                  [self.cost(n) for n in self.modules], budget, lower, [int(u) for u in upper],
                                  max_shift=max_shift)
        return dict(zip(self.modules, ranks))

    def alphas_for(self, ranks: Mapping[str, int], mean_rank: float) -> dict[str, float]:
        """alpha_m per adapted module: alpha_ratio * r_m ('proportional') or alpha_ratio * mean_rank ('constant')."""
        _check_rank_map(ranks, self.modules)
        if not (isinstance(mean_rank, (int, float)) and not isinstance(mean_rank, bool)
                and math.isfinite(mean_rank) and mean_rank > 0):
            raise ValueError(f"mean_rank must be a positive finite number, got {mean_rank!r}")
        if self.alpha_mode == "proportional":
            return {n: float(self.alpha_ratio * r) for n, r in ranks.items() if r > 0}
        return {n: float(self.alpha_ratio * mean_rank) for n, r in ranks.items() if r > 0}

    # -- export --------------------------------------------------------------------------------------------------
    def rank_pattern(self, ranks: Mapping[str, int]) -> dict[str, int]:
        """``{anchored module name: rank}`` for every adapted module (peft's and AdapterConfig's key rule)."""
        _check_rank_map(ranks, self.modules)
        return {anchored_key(n): int(r) for n, r in ranks.items() if r > 0}

    def _deployment(self, mean_rank: float | None, total_params: int | None):
        ranks = self.ranks_for_budget(mean_rank, total_params)
        _, mean = self._budget(mean_rank, total_params)
        active = [n for n in self.modules if ranks[n] > 0]
        alphas = self.alphas_for(ranks, mean)
        base_r = max(1, int(round(mean)))
        base_alpha = float(self.alpha_ratio * base_r) if self.alpha_mode == "proportional" else self.alpha_ratio * mean
        return ranks, alphas, active, base_r, base_alpha

    def to_peft_config(self, mean_rank: float | None = None, total_params: int | None = None, **lora_kwargs: Any):
        """A ``peft.LoraConfig`` deploying this plan at the given budget.

        ``target_modules`` is a regex selecting exactly the adapted modules, and ``rank_pattern`` /
        ``alpha_pattern`` hold one ``^``-anchored full-name key per module, so no key can match a second module.
        Other LoraConfig options pass through (``use_dora=True``, ``lora_dropout``, ``init_lora_weights``, ...);
        the fields the plan owns (r, lora_alpha, target_modules, the patterns) are refused. After
        ``get_peft_model`` run :func:`check_ranks` to confirm every module received its rank.
        """
        clash = sorted(set(lora_kwargs) & set(_PLAN_OWNED))
        if clash:
            raise ValueError(f"to_peft_config sets {clash} from the plan; pass the budget instead")
        peft = require("peft", _PEFT_INSTALL, purpose="exporting a CSPLoRA plan to a peft LoraConfig")
        ranks, alphas, active, base_r, base_alpha = self._deployment(mean_rank, total_params)
        return peft.LoraConfig(r=base_r, lora_alpha=base_alpha, target_modules=exact_target_regex(active),
                               rank_pattern=self.rank_pattern(ranks),
                               alpha_pattern={anchored_key(n): a for n, a in alphas.items()}, **lora_kwargs)

    def to_adapter_config(self, mean_rank: float | None = None, total_params: int | None = None) -> AdapterConfig:
        """An :class:`icml26.core.adapters.AdapterConfig` deploying this plan on our own adapters.

        ``inject_adapters(model, plan.to_adapter_config(mean_rank=4), make)`` gives each module its planned rank
        and alpha, whatever the adapter class ``make`` builds (LoRA, or any rank-parameterised adapter).
        """
        ranks, alphas, active, base_r, base_alpha = self._deployment(mean_rank, total_params)
        return AdapterConfig(r=base_r, alpha=base_alpha, target_modules=exact_target_regex(active),
                             rank_pattern=self.rank_pattern(ranks),
                             alpha_pattern={anchored_key(n): a for n, a in alphas.items()})

    # -- persistence ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION,
            "modules": [{"name": n, "proportion": self.proportions[n], "in_features": self.shapes[n][0],
                         "out_features": self.shapes[n][1]} for n in self.modules],
            "r_min": self.r_min, "r_max": self.r_max, "alpha_mode": self.alpha_mode, "alpha_ratio": self.alpha_ratio,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RankPlan":
        if not isinstance(data, Mapping):
            raise ValueError(f"not a CSPLoRA plan: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a CSPLoRA plan: format is {data.get('format')!r}, expected {PLAN_FORMAT!r}")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')!r} is not supported (this code reads {PLAN_VERSION})")
        missing = [k for k in ("modules", "r_min", "r_max", "alpha_mode", "alpha_ratio") if k not in data]
        if missing:
            raise ValueError(f"CSPLoRA plan lacks {missing}")
        modules = data["modules"]
        keys = ("name", "proportion", "in_features", "out_features")
        if not isinstance(modules, list) or not all(isinstance(m, Mapping) and all(k in m for k in keys)
                                                    for m in modules):
            raise ValueError(f"CSPLoRA plan 'modules' must be a list of {{{', '.join(keys)}}} entries")
        return cls(proportions={m["name"]: m["proportion"] for m in modules},
                   shapes={m["name"]: (m["in_features"], m["out_features"]) for m in modules},
                   r_min=data["r_min"], r_max=data["r_max"], alpha_mode=data["alpha_mode"],
                   alpha_ratio=data["alpha_ratio"], metadata=dict(data.get("metadata", {})))

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (a reader never sees half a plan)."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RankPlan":
        return cls.from_dict(read_json(path))

    @classmethod
    def uniform(cls, shapes: Mapping[str, tuple[int, int]], **kwargs: Any) -> "RankPlan":
        """The flat plan pi_m = 1/M: at any integer mean rank it reproduces uniform LoRA exactly."""
        return cls(proportions=dict.fromkeys(shapes, 1.0), shapes=dict(shapes), **kwargs)


def adapted_ranks(model: nn.Module, adapter_name: str = "default") -> dict[str, tuple[int, float]]:
    """``{module name: (rank, alpha)}`` of every adapter in ``model``: peft LoRA/DoRA layers or our AdapterLinear.

    Names are those of the base model: peft's ``base_model.model.`` prefix is removed.
    """
    found: dict[str, tuple[int, float]] = {}
    for name, module in model.named_modules():
        name = name.removeprefix("base_model.model.")
        if isinstance(module, AdapterLinear):
            found[name] = (int(module.r), float(module.alpha))
        elif isinstance(getattr(module, "r", None), dict) and hasattr(module, "lora_A"):
            if adapter_name in module.r:
                found[name] = (int(module.r[adapter_name]), float(module.lora_alpha[adapter_name]))
    return found


def check_ranks(model: nn.Module, ranks: Mapping[str, int], alphas: Mapping[str, float] | None = None, *,
                adapter_name: str = "default") -> None:
    """Raise ValueError unless ``model``'s adapters are exactly the planned ones, each with its planned rank (and
    alpha when ``alphas`` is given). Modules planned at rank 0 must carry no adapter.

    Works after ``peft.get_peft_model`` (LoRA and DoRA layers) and after ``inject_adapters``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (after get_peft_model or inject_adapters), got "
                        f"{type(model).__name__}")
    _check_rank_map(ranks)
    found = adapted_ranks(model, adapter_name)
    wanted = {n: int(r) for n, r in ranks.items() if r > 0}
    problems = []
    for name, r in wanted.items():
        if name not in found:
            problems.append(f"{name}: planned rank {r}, but it has no adapter")
        elif found[name][0] != r:
            problems.append(f"{name}: planned rank {r}, got {found[name][0]}")
        elif alphas is not None and not math.isclose(found[name][1], alphas[name], rel_tol=1e-9):
            problems.append(f"{name}: planned alpha {alphas[name]}, got {found[name][1]}")
    problems += [f"{name}: adapted (rank {found[name][0]}) but not planned" for name in found if name not in wanted]
    if problems:
        raise ValueError(f"{len(problems)} module(s) do not follow the plan: " + "; ".join(problems[:10]))
