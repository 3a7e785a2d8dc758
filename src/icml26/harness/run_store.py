"""Finished trainings kept on disk, so that a full tier interrupted after hours never repeats one.

A room's specs often share trainings: the tuning grid and the reported seeds of two claims come from the same runs,
which the room memoises in-process with ``functools.lru_cache``. That sharing dies with the process. A full tier
takes longer than a session on this machine (fix_attention about 7 core-hours, kromhc about 18), and a resumed run
would redo every training the lost process had finished for a spec that was not yet written: the tuning
checkpoint keeps only scores, and only for the spec whose tuning was running.

:func:`stored_run` marks a deterministic training function whose arguments and result are JSON values. Inside
:func:`run_store` (the runner opens one per room, at ``OUT/ROOM/runs/``) each call is looked up in that directory
first and written there, atomically, when it finishes. Outside it the function runs as written. The result is
passed through JSON either way, so a stored result and a fresh one are the same value (lists, not tuples; floats
exactly, inf and nan included).

A stored run is keyed by the function, its arguments (the runner's configs are part of them) and a fingerprint of
the source files of the function's package (the room's ``*.py``): editing the room's code retrains. Code shared
with other rooms (``icml26.models``, ``icml26.core``) is not in the fingerprint; after changing what a room's
trainings compute there, delete ``OUT/ROOM/runs`` or run with ``--force``, which recomputes and overwrites instead
of reading. Each file records the git sha and the CPU that wrote it, for the card. A run placed with ``--device``
or ``--precision`` gets its own directory (``runs-cuda``, ``runs-cuda-bf16``): its trainings are not the CPU's.
(Not ``core.io.atomic_write_json``: it stores inf and nan as strings, and a stored result must read back as written.)

What a call logs while it computes (``log_metrics``) is tagged ``"run": FILE``, the name of the file its result is
stored in. A read-back call logs nothing, so the runner keeps a stored call's records when it drops the rest of an
unfinished seed or tuning phase (:func:`logged_by_stored_run`): a resumed run has every stored training's log
lines once, not twice and not never.

A training that returns a model, not JSON, is stored with ``@stored_run(save=..., load=...)``: ``save(result)``
gives tensors in dicts and lists (a ``state_dict``), written with ``torch.save`` to ``NAME-DIGEST.pt`` and read
back with ``weights_only=True`` (no pickled code runs on load); ``load(saved, *args, **kwargs)`` rebuilds the result
from them and the call's arguments. A fresh call returns ``load(save(result))`` too, so the caller gets the same
object whether it was trained now or read back.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..core.io import atomic_write_bytes, atomic_write_text
from ..core.logging import current_metric_log, metric_log, tagged


@dataclass(frozen=True)
class _Store:
    directory: Path
    read: bool


_STORE: ContextVar[_Store | None] = ContextVar("icml26_run_store", default=None)


@contextlib.contextmanager
def run_store(directory: str | os.PathLike, *, read: bool = True) -> Iterator[Path]:
    """Within this block every :func:`stored_run` call reuses (``read=True``) and records its result in
    ``directory``. ``read=False`` (a forced rerun) recomputes every call and overwrites what was stored."""
    directory = Path(directory)
    token = _STORE.set(_Store(directory, read))
    try:
        yield directory
    finally:
        _STORE.reset(token)


def current_run_store() -> tuple[str, bool] | None:
    """(directory, read) of the active store, for handing it to a worker process; None outside one."""
    store = _STORE.get()
    return None if store is None else (str(store.directory), store.read)


@functools.lru_cache(maxsize=None)
def source_fingerprint(package_dir: str) -> str:
    """sha256 (first 16 hex digits) over the names and contents of the ``*.py`` files in ``package_dir``."""
    digest = hashlib.sha256()
    for path in sorted(Path(package_dir).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _call_record(fn: Callable, args: tuple, kwargs: dict) -> dict:
    code = source_fingerprint(str(Path(inspect.getfile(fn)).resolve().parent))
    try:
        return json.loads(json.dumps({"function": f"{fn.__module__}.{fn.__qualname__}", "code": code,
                                      "args": list(args), "kwargs": kwargs}, sort_keys=True))
    except TypeError as err:
        raise TypeError(f"stored_run {fn.__qualname__}: arguments must be JSON values ({err})") from None


def logged_by_stored_run(directory: str | os.PathLike | None) -> Callable[[dict], bool]:
    """Whether a metric record was logged by a call whose result is stored in ``directory`` (None: no store, never).
    While the store is read such a call is not computed again, so its records are kept when a killed seed's or
    tuning phase's other records are dropped."""
    if directory is None:
        return lambda record: False
    directory = Path(directory)
    return lambda record: isinstance(record.get("run"), str) and (directory / record["run"]).is_file()


def stored_run(fn: Callable[..., Any] | None = None, *, save: Callable[[Any], Any] | None = None,
               load: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Decorate a deterministic function of JSON arguments returning a JSON value, or, with ``save`` and ``load``
    (both or neither), one returning anything ``save`` turns into tensors (see the module docstring)."""
    if (save is None) != (load is None):
        raise TypeError("stored_run needs both save and load, or neither")
    if fn is None:
        return functools.partial(stored_run, save=save, load=load)
    as_json = save is None

    def normalised(result, args, kwargs):
        if as_json:
            return json.loads(json.dumps(result))
        return load(save(result), *args, **kwargs)

    def read(path: Path, call: dict):
        try:
            if as_json:
                record = json.loads(path.read_text())
            else:
                import torch
                record = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - a missing or damaged file (any reader error) only costs its run
            return None
        if isinstance(record, dict) and record.get("call") == call and "result" in record:
            return record
        return None

    def write(path: Path, call: dict, result, written_by: dict) -> None:
        record = {"call": call, "result": result if as_json else save(result), "written_by": written_by}
        if as_json:
            # Keys in the result's own order: a caller that sums a dict's values gets the same float from a stored
            # result as from a fresh one (the call is compared as a dict, so its order does not matter).
            atomic_write_text(path, json.dumps(record) + "\n")
        else:
            import io

            import torch
            buffer = io.BytesIO()
            torch.save(record, buffer)
            atomic_write_bytes(path, buffer.getvalue())

    def located(store: _Store, args: tuple, kwargs: dict) -> tuple[Path, dict]:
        call = _call_record(fn, args, kwargs)
        digest = hashlib.sha256(json.dumps(call, sort_keys=True).encode()).hexdigest()[:24]
        return store.directory / f"{fn.__name__.lstrip('_')}-{digest}.{'json' if as_json else 'pt'}", call

    def is_stored(*args, **kwargs) -> bool:
        """Whether the active store holds this call's result, readable (False outside a store)."""
        store = _STORE.get()
        if store is None:
            return False
        return read(*located(store, args, kwargs)) is not None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        store = _STORE.get()
        if store is None:
            return normalised(fn(*args, **kwargs), args, kwargs)
        path, call = located(store, args, kwargs)
        record = read(path, call) if store.read else None  # None also for a missing or damaged file
        if record is not None:
            return record["result"] if as_json else load(record["result"], *args, **kwargs)
        with tagged(run=path.name):
            result = fn(*args, **kwargs)
        from .runner import code_version, cpu_model  # late: the runner imports this module

        # Another CPU kind gives other floats for the same training: the card names what each file came from.
        written_by = {**code_version(), "cpu_model": cpu_model()}
        store.directory.mkdir(parents=True, exist_ok=True)
        write(path, call, result, written_by)
        return normalised(result, args, kwargs)

    wrapper.is_stored = is_stored
    return wrapper


def run_ahead(fn: Callable[..., Any], calls: Iterable[tuple[tuple, dict]]) -> int:
    """Compute the calls ``fn(*args, **kwargs)`` of a :func:`stored_run` function that the active store lacks,
    several at once in the room's worker processes, before the caller needs them; returns how many ran.

    A tuning grid is a list of independent trainings, but it is scored one after another, and a room that pins its
    trainings to one torch thread (kromhc, salaad) then leaves the other cores idle. The same holds for a spec's
    seeds, which the runner hands to workers whole (``ExperimentSpec.ahead`` sends their trainings here instead).
    With ``--seed-jobs N`` the runner keeps N worker processes per room
    (:func:`icml26.harness.runner.room_seed_workers`); this sends the missing calls to them, each to the next free
    worker, waits for all, and the caller's own calls then read the results back from the store. Without workers,
    outside a store, or in a forced rerun (``read=False``: the caller would recompute anyway) it does nothing and
    the caller computes each call when it comes to it, as before. The workers compute under the run's
    ``--device`` and ``--precision``, as the caller's own call would.
    ``fn`` must be reachable as
    ``fn.__module__``.``fn.__name__`` (a module-level function), so a worker can import it."""
    from .runner import _PLACEMENT, _ROOM_SEED_WORKERS  # late: the runner imports this module

    store, workers = _STORE.get(), _ROOM_SEED_WORKERS.get()
    if store is None or not store.read or workers is None:
        return 0
    if not callable(getattr(fn, "is_stored", None)):
        raise TypeError(f"run_ahead needs a stored_run function, got {getattr(fn, '__qualname__', fn)!r}")
    missing, seen = [], set()
    for args, kwargs in calls:
        key = json.dumps([list(args), kwargs], sort_keys=True, default=repr)
        if key not in seen and not fn.is_stored(*args, **kwargs):
            seen.add(key)
            missing.append((tuple(args), dict(kwargs)))
    if not missing:
        return 0
    from concurrent.futures import FIRST_COMPLETED, wait

    pool, threads = workers
    placement = _PLACEMENT.get()  # the run's (--device, --precision), which the workers must compute under too
    logger = current_metric_log()
    queue, running = list(enumerate(missing)), {}
    # What a call logs (log_metrics) goes to its own part file beside the active metrics log, appended to that log
    # when the call is done: two trainings' lines never interleave, and an unfinished call's lines are dropped. (The
    # runner salvages the parts a killed run left before the spec starts, so a part here starts empty.)
    parts = ({i: logger.path.with_name(f"{logger.path.name}.ahead{i}.part") for i in range(len(missing))}
             if logger else {})

    def submit(worker) -> None:
        i, (args, kwargs) = queue.pop(0)
        log = (str(parts[i]), dict(logger.tags)) if logger else None
        running[worker.submit(_stored_call_in_worker, fn.__module__, fn.__name__, args, kwargs,
                              (str(store.directory), store.read), threads, log, placement)] = (worker, i)

    try:
        for worker in pool[:len(queue)]:
            submit(worker)
        while running:  # each worker takes the next call when it is free (trainings differ in cost)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                worker, i = running.pop(future)
                future.result()  # a failed call re-raises here; the running ones finish with the workers
                if i in parts:
                    logger.absorb(parts[i])
                if queue:
                    submit(worker)
    finally:  # after a failure: what the unfinished calls logged is dropped, the stored calls' records kept
        for part in parts.values():
            logger.absorb(part, keep=logged_by_stored_run(store.directory))
    return len(missing)


def _stored_call_in_worker(module: str, name: str, args: tuple, kwargs: dict, store: tuple[str, bool],
                           threads: int, log: tuple[str, dict] | None = None,
                           placement: tuple[str | None, str | None] = (None, None)) -> None:
    """Worker-process entry of :func:`run_ahead`: one call under the parent's ``placement`` (``(device,
    precision)``, as the runner's seed workers get them), its result written to the parent's store and what it logs
    to ``log`` (a part file and the parent logger's tags)."""
    import importlib

    import torch

    from .runner import _placed

    torch.set_num_threads(threads)
    # Imported before the device context, so that module-level tensors stay where a plain import puts them.
    fn = getattr(importlib.import_module(module), name)
    with run_store(store[0], read=store[1]), \
            (metric_log(log[0]) if log else contextlib.nullcontext()) as logger, _placed(*placement):
        if logger is not None:
            logger.tags = log[1]
        fn(*args, **kwargs)
