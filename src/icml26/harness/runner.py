"""Run ExperimentSpecs: seeds and tiers, provenance, atomic result files, resume after a kill.

Result file ``OUT/ROOM/SPEC_ID.json`` (always written atomically) holds ``status`` in
{"running", "cancelled", "complete"}. After every finished seed the file is rewritten, so a killed run keeps
its finished seeds and a rerun with the same config resumes from them. A complete file is skipped unless
``force``. Ctrl-C rewrites the file with status "cancelled" and re-raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import platform
import subprocess
import sys
import time
from contextvars import ContextVar
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..core.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json
from ..core.logging import metric_log, read_jsonl
from ..core.memory import PeakRSS
from ..core.progress import progress
from ..core.registry import ROOMS, get_room, import_room
from .run_store import current_run_store, logged_by_stored_run, run_store
from .spec import TIERS, ExperimentSpec, judge
from .tuning import checkpointed_points, tuning_check, tuning_checkpoint


class ResultFileError(ValueError):
    """A result file that cannot be read back (truncated, corrupt, or not a result)."""

HARNESS_VERSION = 2
"""Bumped when the verdict rule or the result layout changes, so older result files are rerun, not resumed."""
_VERSIONED = ("torch", "numpy", "transformers", "peft", "scikit-learn", "gymnasium", "flwr", "icml26")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_version() -> dict:
    """``git_sha`` and ``git_dirty`` of this checkout ("unknown" / None outside git). Untracked (not ignored) files
    count as dirty: new code makes a tree dirty."""
    status = _git("status", "--porcelain")
    return {"git_sha": _git("rev-parse", "HEAD") or "unknown",
            "git_dirty": bool(status) if status is not None else None}


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo ('model name'); platform.processor() says only 'x86_64'."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def run_info(config: dict, tier: str, seeds: list[int], device: str | None = None,
             precision: str | None = None) -> dict:
    """Provenance recorded in every result: code version, environment, and the full config."""
    versions = {}
    for package in _VERSIONED:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    torch = sys.modules.get("torch")  # only read when a room already imported it
    return {
        **code_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "command": sys.argv,
        "tier": tier,
        "seeds": seeds,
        "config": config,
        "threads": torch.get_num_threads() if torch is not None else None,
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "cpu_count": os.cpu_count(),
        # The same commit gives other float results on another CPU (torch picks its kernels by the instruction set
        # it finds), and a near-tie in tuning can follow: recorded so two runs can be told apart by machine.
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability() if torch is not None else None,
        "device": device or "cpu (default)",
        "precision": precision or "fp32",
        "accelerator_available": _accelerator(torch),
    }


def _accelerator(torch) -> str | None:
    """The CUDA device this machine has, if any (recorded so a CPU run on a GPU machine says so)."""
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


@contextlib.contextmanager
def _default_device(device: str | None):
    """Tensors and modules the spec creates without naming a device go to ``device`` (torch's default-device
    context); None keeps torch's default (CPU)."""
    if device is None:
        yield
        return
    import torch

    with torch.device(device):
        yield


@contextlib.contextmanager
def _torch_threads_kept():
    """Restore torch's thread count after a spec: some specs pin one thread, and in a sequential run that
    would otherwise carry over into every later room (and change its numbers)."""
    torch = sys.modules.get("torch")  # a spec that imports torch itself starts from torch's default count
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}


@contextlib.contextmanager
def _autocast(precision: str | None, device: str | None):
    """Mixed precision as transformers' Trainer does it (``bf16=True``): matmuls and convolutions inside the
    spec run under ``torch.autocast`` in ``precision`` while parameters and optimizer state stay fp32.
    None keeps full fp32."""
    if precision is None:
        yield
        return
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)} (or None for fp32), got {precision!r}")
    import torch

    device_type = torch.device(device).type if device else "cpu"
    with torch.autocast(device_type=device_type, dtype=getattr(torch, PRECISIONS[precision])):
        yield


_PLACEMENT: ContextVar[tuple[str | None, str | None]] = ContextVar("icml26_placement", default=(None, None))


@contextlib.contextmanager
def _placed(device: str | None, precision: str | None):
    """The run's ``--device`` and ``--precision`` (:func:`_default_device`, :func:`_autocast`), also kept where
    ``run_store.run_ahead`` reads them, so that its workers compute as the run's own calls do."""
    token = _PLACEMENT.set((device, precision))
    try:
        with _default_device(device), _autocast(precision, device):
            yield
    finally:
        _PLACEMENT.reset(token)


def read_result(path: Path) -> dict:
    """A result file's contents; a truncated or corrupt file raises :class:`ResultFileError` naming it."""
    try:
        data = read_json(path)
    except (ValueError, UnicodeDecodeError) as err:
        raise ResultFileError(f"result file {path} is unreadable ({err}); rerun with --force to replace it") from err
    if not isinstance(data, dict) or "spec" not in data or "comparator" not in data:
        raise ResultFileError(f"result file {path} is not an icml26 result (no 'spec'/'comparator'); rerun with "
                              f"--force to replace it")
    return data


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
             overrides: dict | None = None, device: str | None = None, precision: str | None = None,
             seed_jobs: int = 1) -> dict:
    """Run one spec at ``tier`` and write its result file; returns the result dict.

    ``device`` (e.g. "cuda") becomes torch's default device while the spec runs, and ``precision`` ("bf16" or
    "fp16") runs it under autocast; both are part of the result's identity, so results from different devices
    or precisions never mix seeds. ``seed_jobs`` > 1 runs that many of the remaining seeds at once in worker
    processes with ``cpu_count // seed_jobs`` torch threads each, after the prepare phase (which stays in this
    process); seed ``s`` goes to worker ``s % seed_jobs``, and inside :func:`room_seed_workers` (which
    ``reproduce`` opens per room) a room's specs share those workers. A spec with an ``ahead`` hook first hands
    its seeds' trainings to the workers one training at a time (``ExperimentSpec.ahead``). A seed's result is a
    function of its seed, so this does not change the numbers, only the wall time (and ``peak_rss_bytes``, which
    then covers this process only). The workers find the spec again by room and id, so it must be one a room
    registers (``specs_for``)."""
    if not isinstance(seed_jobs, int) or seed_jobs < 1:
        raise ValueError(f"seed_jobs must be a positive integer, got {seed_jobs!r}")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)} (or None for fp32), got {precision!r}")
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
    identity = {"config": config, "tier": tier, "harness": HARNESS_VERSION}
    placement = {k: v for k, v in (("device", device), ("precision", precision)) if v}
    key = config_hash({**identity, **placement})

    if force:  # a forced rerun scores its tuning grid afresh too
        path.with_suffix(".tuning.ckpt").unlink(missing_ok=True)
    try:
        previous = read_result(path) if path.exists() else None
    except ResultFileError:
        if not force:
            raise
        previous = None
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
        "run_info": run_info(config, tier, seeds, device, precision), "status": "running", "prepared": prepared,
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

    # Finished trainings go to OUT/ROOM/runs/ (runs-DEVICE[-PRECISION] when placed), where the room's other specs
    # and a resumed run find them.
    store_dir = path.parent / "-".join(["runs", *placement.values()])
    # Per-step metrics of every arm go to SPEC_ID.metrics.jsonl, each record tagged with its seed (or the
    # prepare phase). A resumed run keeps only the records of what it keeps, so no seed is logged twice, and the
    # records of stored trainings, which it reads back instead of training (and logging) again, and those of the
    # tuning points whose scores the tuning checkpoint replays.
    from_store = logged_by_stored_run(None if force else store_dir)
    tuning_path = path.with_suffix(".tuning.ckpt")
    replayed = checkpointed_points(tuning_path, key) if prepared is None else set()
    metrics_path = path.with_suffix(".metrics.jsonl")
    if metrics_path.exists():
        kept = [r for r in read_jsonl(metrics_path)
                if r.get("seed") in done or from_store(r)
                or (r.get("phase") == "prepare" and (prepared is not None or r.get("tuning") in replayed))]
        atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
    try:
        stored = run_store(store_dir, read=not force)
        with PeakRSS() as mem, metric_log(metrics_path) as logger, _placed(device, precision), \
                _torch_threads_kept(), stored:
            # Worker logs a killed run left behind (SPEC.metrics.jsonl.*.part): their stored trainings' records only.
            for part in sorted(metrics_path.parent.glob(f"{metrics_path.name}.*.part")):
                logger.absorb(part, keep=from_store)
            if spec.prepare is not None and prepared is None:
                logger.tags = {"phase": "prepare"}
                # Each tuning score is checkpointed (JSON in SPEC.tuning.ckpt, a name the report does not read as a
                # result) as it finishes: a killed prepare phase resumes mid-grid.
                with tuning_checkpoint(tuning_path, key):
                    result["prepared"] = prepared = spec.prepare(config)
                write("running")
                tuning_path.unlink(missing_ok=True)
            todo = [s for s in seeds if s not in done]
            if seed_jobs > 1 and spec.ahead is not None and todo:
                logger.tags = {"phase": "ahead"}
                with _seed_workers(seed_jobs) as workers:
                    token = _ROOM_SEED_WORKERS.set(workers)  # where run_ahead finds them
                    try:
                        spec.ahead(config, todo, prepared)
                    finally:
                        _ROOM_SEED_WORKERS.reset(token)
            if seed_jobs > 1 and len(todo) > 1:
                finished = _run_seeds_in_workers(spec, config, todo, prepared, seed_jobs, device, precision, logger)
            else:
                finished = _run_seeds_here(spec, config, todo, prepared, logger)
            for res in progress(finished, total=len(todo), desc=f"{spec.room}/{spec.id} [{tier}] seeds"):
                seed_results.append(res)
                seed_results.sort(key=lambda r: r["seed"])
                write("running")
        result["peak_rss_bytes"] = mem.peak_bytes
        result["peak_rss_delta_bytes"] = mem.delta_bytes
    except KeyboardInterrupt:
        write("cancelled")
        raise
    values = [r["statistics"].get(spec.comparator.statistic, float("nan")) for r in seed_results]
    result["mechanism_checks"] = evaluate_checks(spec, seed_results, prepared)
    verdict = judge(spec.comparator, values, tier, checks=result["mechanism_checks"])
    result["verdict"], result["verdict_rule"] = verdict.pop("verdict"), verdict.pop("rule")
    result["bound"] = verdict
    write("complete")
    result["plot"] = _plot(spec, result, path.with_suffix(".png"))
    atomic_write_json(path, result)
    return result


def _run_seeds_here(spec: ExperimentSpec, config: dict, seeds: list[int], prepared: Any,
                    logger) -> Iterator[dict]:
    """Each seed's result, one after another in this process (metrics tagged with the seed)."""
    for seed in seeds:
        logger.tags = {"seed": seed}
        res = spec.run(config, seed, prepared)
        res["seed"] = seed
        yield res


def _run_seeds_in_workers(spec: ExperimentSpec, config: dict, seeds: list[int], prepared: Any, jobs: int,
                          device: str | None, precision: str | None, logger) -> Iterator[dict]:
    """Each seed's result as its worker process finishes it. A worker logs to its own metrics file, whose records
    are appended to ``logger``'s when the seed is done, so SPEC.metrics.jsonl never interleaves two seeds' lines
    and a killed run keeps only whole seeds (and what their stored trainings logged: those are not run again)."""
    from concurrent.futures import FIRST_COMPLETED, wait

    parts = {seed: logger.path.with_name(f"{logger.path.name}.seed{seed}.part") for seed in seeds}
    store = current_run_store()
    try:
        with _seed_workers(jobs) as (workers, threads):
            pending = {workers[seed % len(workers)].submit(_run_seed_in_worker, spec.room, spec.id, config, seed,
                                                           prepared, threads, device, precision, str(parts[seed]),
                                                           store):
                       seed for seed in seeds}
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    seed = pending.pop(future)
                    res = future.result()  # a failed seed re-raises here; the others are cancelled
                    logger.absorb(parts[seed])
                    yield res
    finally:
        # What an unfinished seed logged is dropped with it, except its stored trainings' records (not rerun).
        stored = logged_by_stored_run(store[0] if store and store[1] else None)
        for part in parts.values():
            logger.absorb(part, keep=stored)


def _run_seed_in_worker(room: str, spec_id: str, config: dict, seed: int, prepared: Any, threads: int,
                        device: str | None, precision: str | None, metrics_part: str,
                        store: tuple[str, bool] | None = None) -> dict:
    """Worker-process entry of ``run_spec(seed_jobs > 1)``: one seed of one spec, logging to ``metrics_part`` and
    keeping finished trainings in the parent's run store (``store``: directory and read flag)."""
    import torch

    torch.set_num_threads(threads)
    spec = {s.id: s for s in specs_for(room)}[spec_id]
    stored = run_store(store[0], read=store[1]) if store else contextlib.nullcontext()
    with metric_log(metrics_part) as logger, _placed(device, precision), stored:
        logger.tags = {"seed": seed}
        res = spec.run(config, seed, prepared)
    res["seed"] = seed
    return res


def evaluate_checks(spec: ExperimentSpec, seed_results: list[dict], prepared: Any) -> list[dict]:
    """The spec's declared mechanism checks on the per-seed ``checks`` values, plus the tuning check."""
    checks = [c.evaluate([r.get("checks", {}).get(c.name, float("nan")) for r in seed_results]) for c in spec.checks]
    tuned = tuning_check(prepared)
    return checks + ([tuned] if tuned is not None else [])


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
              force: bool = False, spec_ids: Iterable[str] | None = None, device: str | None = None,
              precision: str | None = None, jobs: int = 1, seed_jobs: int = 1) -> list[dict]:
    """Run every spec of ``rooms`` (all implemented rooms when None) and return their results, in spec order.

    ``jobs`` > 1 runs that many rooms at once, each in a fresh worker process with ``cpu_count // jobs`` torch
    threads (so ``jobs=2`` on 2 cores gives each room one core). A room's specs stay together in one process
    because several rooms share trainings between their specs in memory. A fresh process per room also keeps one
    room's global settings (torch threads, default dtype, RNG state) from leaking into the next. Rooms whose
    earlier results in ``out`` took longest start first, which packs the workers better on a rerun. ``seed_jobs``
    goes to :func:`run_spec` (seeds of one spec at once, in worker processes)."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    names = list(rooms) if rooms else reproducible_rooms()
    wanted = set(spec_ids or [])
    chosen = [spec for name in names for spec in specs_for(name)]
    unknown = wanted - {spec.id for spec in chosen}
    if unknown:
        raise ValueError(f"unknown --spec {', '.join(sorted(unknown))}; the specs of {', '.join(names)} are: "
                         f"{', '.join(spec.id for spec in chosen)}")
    todo = [spec for spec in chosen if (not wanted or spec.id in wanted) and tier in spec.tiers]
    options = dict(n_seeds=n_seeds, force=force, device=device, precision=precision, seed_jobs=seed_jobs)
    by_room: dict[str, list[str]] = {}
    for spec in todo:
        by_room.setdefault(spec.room, []).append(spec.id)
    if jobs == 1 or len(by_room) <= 1:
        return [result for room in by_room
                for result in _run_room_specs([s for s in todo if s.room == room], tier, out, options)]
    return _reproduce_in_workers(todo, by_room, tier, out, jobs, options)


def _run_room_specs(specs: list[ExperimentSpec], tier: str, out: Path, options: dict) -> list[dict]:
    """One room's specs, in order, sharing one set of seed workers (:func:`room_seed_workers`)."""
    with room_seed_workers(options.get("seed_jobs", 1)):
        return [run_spec(spec, tier, out, **options) for spec in specs]


def _reproduce_in_workers(todo: list[ExperimentSpec], by_room: dict[str, list[str]], tier: str, out: Path,
                          jobs: int, options: dict) -> list[dict]:
    from concurrent.futures import FIRST_EXCEPTION, wait

    earlier = {room: sum(_earlier_wall_time(result_path(out, s)) for s in todo if s.room == room) for room in by_room}
    futures = {}
    with _worker_pool(jobs) as (pool, threads):
        for room in sorted(by_room, key=lambda r: -earlier[r]):
            futures[room] = pool.submit(_run_room_in_worker, room, by_room[room], tier, str(out), threads, options)
        finished, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        for future in finished:
            future.result()  # re-raises the first room that failed, after the running ones finish
    results = {(r["room"], r["spec"]): r for future in futures.values() for r in future.result()}
    return [results[(spec.room, spec.id)] for spec in todo]


@contextlib.contextmanager
def _worker_pool(jobs: int):
    """``(pool, threads)``: ``jobs`` spawned worker processes, each running one task in a fresh interpreter (one
    room's global settings never leak into the next), and the torch threads each gets, cpu_count // jobs. Work
    is sent by room name and spec id, not pickled: several rooms build their run functions as closures. On an
    error or Ctrl-C the queued tasks are cancelled and the running ones finish before it propagates."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               max_tasks_per_child=1)
    try:
        yield pool, max(1, (os.cpu_count() or 1) // jobs)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


_ROOM_SEED_WORKERS: ContextVar[tuple[list, int] | None] = ContextVar("room_seed_workers", default=None)
"""The open :func:`room_seed_workers` set, ``(workers, threads)``, or None."""


@contextlib.contextmanager
def room_seed_workers(jobs: int):
    """Within this block, ``run_spec(seed_jobs=jobs)`` sends seed ``s`` to worker ``s % jobs`` of one set of
    ``jobs`` long-lived worker processes, shared by every spec run inside (one room's; ``reproduce`` opens one per
    room). Why: several rooms memoise a seed's trainings in memory for all their specs (lockin's three claims read
    the same runs), so a spec after the first finds its seed's runs in the worker that made them, as it would in
    one process with ``seed_jobs=1``. A new room gets new workers, so one room's settings never reach another's.
    ``jobs`` 1 opens nothing."""
    if jobs <= 1:
        yield
        return
    with _spawn_workers(jobs) as workers:
        token = _ROOM_SEED_WORKERS.set(workers)
        try:
            yield
        finally:
            _ROOM_SEED_WORKERS.reset(token)


@contextlib.contextmanager
def _seed_workers(jobs: int):
    """``(workers, threads)`` for one spec's seeds: the room's shared set when one with ``jobs`` workers is open
    (:func:`room_seed_workers`), else a set for this spec alone."""
    shared = _ROOM_SEED_WORKERS.get()
    if shared is not None and len(shared[0]) == jobs:
        yield shared
        return
    with _spawn_workers(jobs) as workers:
        yield workers


@contextlib.contextmanager
def _spawn_workers(jobs: int):
    """``(workers, threads)``: ``jobs`` spawned single-process executors (a task can be sent to a given one) and
    the torch threads each gets, cpu_count // jobs. On an error or Ctrl-C queued tasks are cancelled and running
    ones finish before it propagates."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")
    workers = [ProcessPoolExecutor(max_workers=1, mp_context=spawn) for _ in range(jobs)]
    try:
        yield workers, max(1, (os.cpu_count() or 1) // jobs)
    except BaseException:
        for worker in workers:
            worker.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.shutdown(wait=True)
        raise
    for worker in workers:
        worker.shutdown(wait=True)


def _earlier_wall_time(path: Path) -> float:
    """Wall time of an earlier result at ``path`` (0 when there is none or it cannot be read)."""
    try:
        return float(read_json(path).get("wall_time_s", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def _run_room_in_worker(room: str, spec_ids: list[str], tier: str, out: str, threads: int,
                        options: dict) -> list[dict]:
    """Worker-process entry of ``reproduce(jobs > 1)``: run the given specs of one room, in order."""
    import torch

    torch.set_num_threads(threads)
    specs = {s.id: s for s in specs_for(room)}
    return _run_room_specs([specs[spec_id] for spec_id in spec_ids], tier, Path(out), options)
