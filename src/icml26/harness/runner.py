"""Run ExperimentSpecs: seeds and tiers, provenance, atomic result files, resume after a kill.

Result file ``OUT/ROOM/SPEC_ID.json`` (always written atomically) holds ``status`` in
{"running", "cancelled", "complete"}. After every finished seed the file is rewritten, so a killed run keeps
its finished seeds and a rerun with the same config resumes from them. A complete file is skipped unless
``force``. Ctrl-C rewrites the file with status "cancelled" and re-raises.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from ..core.io import atomic_write_bytes, atomic_write_json, read_json
from ..core.logging import metric_log
from ..core.memory import PeakRSS
from ..core.progress import progress
from ..core.registry import ROOMS, get_room, import_room
from .spec import TIERS, ExperimentSpec, judge

_VERSIONED = ("torch", "numpy", "transformers", "peft", "scikit-learn", "gymnasium", "flwr", "icml26")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_info(config: dict, tier: str, seeds: list[int]) -> dict:
    """Provenance recorded in every result: code version, environment, and the full config."""
    versions = {}
    for package in _VERSIONED:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    status = _git("status", "--porcelain")  # untracked (not ignored) files count: new code makes a tree dirty
    return {
        "git_sha": _git("rev-parse", "HEAD") or "unknown",
        "git_dirty": bool(status) if status is not None else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "command": sys.argv,
        "tier": tier,
        "seeds": seeds,
        "config": config,
    }


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _summarise(values: list[float]) -> dict:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    mean = sum(finite) / len(finite) if finite else float("nan")
    std = (sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) ** 0.5 if len(finite) > 1 else 0.0
    return {"per_seed": values, "mean": mean, "std": std}


def aggregate(seed_results: list[dict]) -> tuple[dict, dict]:
    """Per-arm metrics and claim statistics as {name: {per_seed, mean, std}} across seeds."""
    arms: dict[str, dict[str, list]] = {}
    stats: dict[str, list] = {}
    for res in seed_results:
        for arm, metrics in res["arms"].items():
            for name, value in metrics.items():
                arms.setdefault(arm, {}).setdefault(name, []).append(value)
        for name, value in res["statistics"].items():
            stats.setdefault(name, []).append(value)
    return ({arm: {m: _summarise(v) for m, v in ms.items()} for arm, ms in arms.items()},
            {s: _summarise(v) for s, v in stats.items()})


def result_path(out: Path, spec: ExperimentSpec) -> Path:
    return Path(out) / spec.room / f"{spec.id}.json"


def _plot(spec: ExperimentSpec, result: dict, path: Path) -> str | None:
    """Draw the claim's figure to ``path`` (PNG, atomic); returns the file name, or None when nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    try:
        if spec.plot is not None:
            spec.plot(result, ax)
        else:
            stat = result["statistics"].get(spec.comparator.statistic)
            if stat is None:
                return None
            values = [v for v in stat["per_seed"] if isinstance(v, (int, float))]
            ax.scatter(range(len(values)), values, label="per seed")
            ax.axhline(spec.comparator.threshold, color="k", ls="--", label="threshold")
            ax.set_xlabel("seed")
            ax.set_ylabel(spec.comparator.statistic)
            ax.legend()
        ax.set_title(f"{spec.room}: {spec.id} ({result['tier']})", fontsize=9)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        atomic_write_bytes(path, buf.getvalue())
        return path.name
    finally:
        plt.close(fig)


def run_spec(spec: ExperimentSpec, tier: str, out: Path, *, n_seeds: int | None = None, force: bool = False,
             overrides: dict | None = None) -> dict:
    """Run one spec at ``tier`` and write its result file; returns the result dict."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    if tier not in spec.tiers:
        raise ValueError(f"spec {spec.id!r} has no {tier!r} tier; it has {sorted(spec.tiers)}")
    config = {**spec.tiers[tier], **(overrides or {})}
    unknown = set(overrides or {}) - set(spec.tiers[tier])
    if unknown:
        raise ValueError(f"spec {spec.id!r} has no config field(s) {sorted(unknown)}; fields: {sorted(spec.tiers[tier])}")
    seeds = list(range(n_seeds if n_seeds is not None else spec.seeds[tier]))
    path = result_path(out, spec)
    key = config_hash({"config": config, "tier": tier})

    previous = read_json(path) if path.exists() else None
    if previous and previous.get("config_hash") == key and previous.get("seeds") == seeds:
        if previous.get("status") == "complete" and not force:
            return previous
    resumable = previous if previous and previous.get("config_hash") == key and not force else None
    done = {r["seed"]: r for r in (resumable or {}).get("seed_results", [])}
    prepared = (resumable or {}).get("prepared")

    result: dict[str, Any] = {
        "spec": spec.id, "room": spec.room, "claim": spec.claim, "paper_ref": spec.paper_ref, "metric": spec.metric,
        "arms_order": list(spec.arms), "baseline": spec.baseline,
        "comparator": {"statistic": spec.comparator.statistic, "op": spec.comparator.op,
                       "threshold": spec.comparator.threshold, "description": spec.comparator.description},
        "notes": spec.notes, "tier": tier, "seeds": seeds, "config_hash": key,
        "run_info": run_info(config, tier, seeds), "status": "running", "prepared": prepared,
    }
    start = time.perf_counter()
    # A resumed run adds the wall time its earlier attempts spent on the seeds it keeps.
    earlier_wall = (resumable or {}).get("wall_time_s", 0.0)
    seed_results = [done[s] for s in seeds if s in done]

    def write(status: str) -> None:
        arms, stats = aggregate(seed_results)
        result.update(status=status, seed_results=seed_results, arms=arms, statistics=stats,
                      wall_time_s=earlier_wall + time.perf_counter() - start)
        atomic_write_json(path, result)

    # Per-step metrics of every arm go to SPEC_ID.metrics.jsonl; a fresh (not resumed) run starts it anew.
    metrics_path = path.with_suffix(".metrics.jsonl")
    if not done and metrics_path.exists():
        metrics_path.unlink()
    try:
        with PeakRSS() as mem, metric_log(metrics_path):
            if spec.prepare is not None and prepared is None:
                result["prepared"] = prepared = spec.prepare(config)
                write("running")
            for seed in progress([s for s in seeds if s not in done], desc=f"{spec.room}/{spec.id} [{tier}] seeds"):
                res = spec.run(config, seed, prepared)
                res["seed"] = seed
                seed_results.append(res)
                seed_results.sort(key=lambda r: r["seed"])
                write("running")
        result["peak_rss_bytes"] = mem.peak_bytes
        result["peak_rss_delta_bytes"] = mem.delta_bytes
    except KeyboardInterrupt:
        write("cancelled")
        raise
    values = [r["statistics"].get(spec.comparator.statistic, float("nan")) for r in seed_results]
    result["verdict"], result["verdict_rule"] = judge(spec.comparator, values, tier)
    write("complete")
    result["plot"] = _plot(spec, result, path.with_suffix(".png"))
    atomic_write_json(path, result)
    return result


def specs_for(room: str) -> list[ExperimentSpec]:
    """The ExperimentSpecs a room registers (``icml26.methods.<room>.experiments.SPECS``)."""
    import importlib

    import_room(room)
    module = importlib.import_module(f"{get_room(room).import_path}.experiments")
    return list(module.SPECS)


def reproducible_rooms() -> list[str]:
    """Rooms that are implemented (not 'planned') and so have claims to run."""
    return [r.name for r in ROOMS if r.status != "planned"]


def reproduce(rooms: Iterable[str] | None, tier: str, out: Path, *, n_seeds: int | None = None,
              force: bool = False, spec_ids: Iterable[str] | None = None) -> list[dict]:
    """Run every spec of ``rooms`` (all implemented rooms when None) and return their results."""
    names = list(rooms) if rooms else reproducible_rooms()
    wanted = set(spec_ids or [])
    results = []
    for name in names:
        for spec in specs_for(name):
            if (wanted and spec.id not in wanted) or tier not in spec.tiers:
                continue
            results.append(run_spec(spec, tier, out, n_seeds=n_seeds, force=force))
    return results
