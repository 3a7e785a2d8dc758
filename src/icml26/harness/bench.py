"""Benchmarks that travel: the machine a number was measured on, and one runner for every benchmark script.

A speed ratio means little without the machine it came from, so every benchmark JSON carries
:func:`machine_info` (CPU model, cores, threads, torch and its BLAS, the commit, the load before and after), written
with :func:`write_bench_json`.

``icml26 bench [ROOM ...] [--threads 1 2] [--out DIR]`` runs every script in ``benchmarks/`` that declares a
module-level ``BENCH`` entry, once per thread count, each in its own process, and writes ``DIR/BENCH.md`` (one
table of ratios, the table cards quote) and ``DIR/bench.json`` (the same numbers with each run's machine). A
script's entry:

    BENCH = {
        "room": "kromhc",                      # the room whose card quotes it
        "args": ["--sizes", "full", "--rounds", "5"],   # quick arguments: the whole sweep fits in 15 minutes
        "ratios": {"KromHC / residual, d = 128": "sizes[size=full].rows[arm=kromhc].ratio_to_residual_median"},
        "threads_arg": "--threads",            # optional: how the script takes its thread count
        "out_arg": "--out",                    # optional (default "--out"): where it writes its JSON
        "seconds": 120,                        # optional: expected wall seconds of one run on an idle machine
    }

The runner adds ``OUT_ARG DIR/<script>_t<threads>.json`` and, when ``threads_arg`` is given, ``THREADS_ARG t``;
it always sets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (and ``ICML26_BENCH_THREADS``) to ``t`` in the child's
environment, so scripts without a thread option (and their subprocesses) run at ``t`` threads too. A ratio
path is dot-separated: a key (``rows``), an index (``rows[0]``) or the element of a list whose field equals a
value (``rows[arm=kromhc]``, or ``rows[part=timing,T=1024]`` for several fields; values are compared as text, and
the first matching element is taken).

The entry is read from the script's source with :mod:`ast` (a literal), so listing benchmarks imports nothing.
"""

from __future__ import annotations

import ast
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..core.io import atomic_write_json, atomic_write_text, read_json
from .runner import code_version, cpu_model

BENCH_BUDGET_S = 900.0
"""``icml26 bench`` over all scripts and both thread counts must fit in this (the issue's 15 minutes)."""

_REQUIRED = {"room": str, "args": list, "ratios": dict}
_OPTIONAL = {"threads_arg": str, "out_arg": str, "seconds": (int, float)}
DEFAULT_SECONDS = 60.0
"""Expected seconds of a run whose entry declares none (only used to share the budget out)."""


def blas_info() -> str:
    """The BLAS torch was built with, from ``torch.__config__.show()`` (``BLAS_INFO=mkl, ...``)."""
    import torch

    config = torch.__config__.show()
    match = re.search(r"BLAS_INFO=([^,\s]+)", config)
    return match.group(1) if match else "unknown"


def _loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """What a benchmark number must name: CPU model, cores, torch threads, torch, BLAS, CPU capability, commit.

    ``threads`` is the torch thread count the benchmark runs at (default: ``torch.get_num_threads()``).
    ``loadavg_start`` is read now; call :func:`finish_machine_info` (or :func:`write_bench_json`, which does) when
    the measurement ends to add ``loadavg_end``. On a shared machine the load says how contended the run was.
    """
    import torch

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": int(threads) if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "blas": blas_info(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        **code_version(),
        "loadavg_start": _loadavg(),
    }


def finish_machine_info(info: dict[str, Any]) -> dict[str, Any]:
    """Add ``loadavg_end`` (if absent) to a :func:`machine_info` dict and return it."""
    info.setdefault("loadavg_end", _loadavg())
    return info


def write_bench_json(path: str | os.PathLike, result: dict[str, Any], machine: dict[str, Any] | None = None,
                     *, threads: int | None = None) -> Path:
    """Write a benchmark's JSON atomically with a ``machine`` field (and the command line under ``command``).

    ``machine`` is the dict :func:`machine_info` gave at the start of the measurement (its end load is added
    now); without it one is taken now. The result's own fields are kept as they are.
    """
    if not isinstance(result, dict):
        raise TypeError(f"result must be a dict, got {type(result).__name__}")
    machine = finish_machine_info(dict(machine) if machine is not None else machine_info(threads))
    payload = {**result, "machine": machine}
    payload.setdefault("command", sys.argv)
    return atomic_write_json(path, payload)


# ----------------------------------------------------------------------------------------------------------------
# The runner


def default_bench_dir() -> Path:
    """``benchmarks/`` of the source checkout (next to ``src/``)."""
    return Path(__file__).resolve().parents[3] / "benchmarks"


def read_entry(script: str | os.PathLike) -> dict[str, Any] | None:
    """The script's module-level ``BENCH`` literal, checked; None when the script declares none."""
    script = Path(script)
    tree = ast.parse(script.read_text(), filename=str(script))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        if any(isinstance(t, ast.Name) and t.id == "BENCH" for t in targets):
            try:
                entry = ast.literal_eval(node.value)
            except ValueError as err:
                raise ValueError(f"{script.name}: BENCH must be a literal dict ({err})") from None
            return _check_entry(entry, script.name)
    return None


def _check_entry(entry: Any, name: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ValueError(f"{name}: BENCH must be a dict, got {type(entry).__name__}")
    unknown = set(entry) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise ValueError(f"{name}: BENCH has unknown keys {sorted(unknown)}")
    for key, kind in {**_REQUIRED, **_OPTIONAL}.items():
        if key in _REQUIRED and key not in entry:
            raise ValueError(f"{name}: BENCH needs {key!r}")
        if key in entry and (not isinstance(entry[key], kind) or isinstance(entry[key], bool)):
            kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ValueError(f"{name}: BENCH[{key!r}] must be a {kinds}, got {type(entry[key]).__name__}")
    if "seconds" in entry and not entry["seconds"] > 0:
        raise ValueError(f"{name}: BENCH['seconds'] must be positive, got {entry['seconds']}")
    if not all(isinstance(a, str) for a in entry["args"]):
        raise ValueError(f"{name}: BENCH['args'] must be a list of strings")
    if not entry["ratios"] or not all(isinstance(k, str) and isinstance(v, str) for k, v in entry["ratios"].items()):
        raise ValueError(f"{name}: BENCH['ratios'] must map labels to JSON paths (strings), at least one")
    return {"out_arg": "--out", **entry}


def discover(bench_dir: str | os.PathLike | None = None, rooms: list[str] | None = None) -> list[tuple[Path, dict]]:
    """(script, entry) for every ``*.py`` in ``bench_dir`` with a BENCH entry, optionally only these rooms."""
    bench_dir = Path(bench_dir) if bench_dir is not None else default_bench_dir()
    if not bench_dir.is_dir():
        raise FileNotFoundError(f"no benchmarks directory at {bench_dir}")
    found = []
    for script in sorted(bench_dir.glob("*.py")):
        entry = read_entry(script)
        if entry is not None and (not rooms or entry["room"] in rooms):
            found.append((script, entry))
    return found


_SEGMENT = re.compile(r"^([^\[\]]*)((?:\[[^\[\]]+\])*)$")


def json_path(obj: Any, path: str) -> Any:
    """Follow ``path`` (``a.b[2].c[arm=kromhc].d``) into a loaded JSON object; KeyError naming the failing step."""
    current = obj
    for part in path.split("."):
        match = _SEGMENT.match(part)
        if match is None:
            raise KeyError(f"{path}: cannot parse {part!r}")
        key, selectors = match.groups()
        if key:
            if not isinstance(current, dict) or key not in current:
                raise KeyError(f"{path}: no key {key!r}")
            current = current[key]
        for selector in re.findall(r"\[([^\[\]]+)\]", selectors):
            if not isinstance(current, list):
                raise KeyError(f"{path}: [{selector}] applied to a {type(current).__name__}, not a list")
            if "=" in selector:
                conditions = [c.split("=", 1) for c in selector.split(",")]
                if any(len(c) != 2 for c in conditions):
                    raise KeyError(f"{path}: cannot parse [{selector}]")
                hits = [item for item in current if isinstance(item, dict)
                        and all(str(item.get(field)) == value for field, value in conditions)]
                if not hits:
                    raise KeyError(f"{path}: no element with {' and '.join(f'{f} = {v}' for f, v in conditions)}")
                current = hits[0]
            else:
                index = int(selector)
                if not -len(current) <= index < len(current):
                    raise KeyError(f"{path}: index {index} out of range ({len(current)} elements)")
                current = current[index]
    return current


def run_script(script: Path, entry: dict[str, Any], threads: int, out_dir: Path, timeout_s: float,
               python: str = sys.executable) -> dict[str, Any]:
    """Run one script at ``threads`` threads; return its record (ratios read from its JSON, or the error)."""
    out_json = out_dir / f"{script.stem}_t{threads}.json"
    cmd = [python, str(script), *entry["args"], entry["out_arg"], str(out_json)]
    if "threads_arg" in entry:
        cmd += [entry["threads_arg"], str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "ICML26_BENCH_THREADS": str(threads), "ICML26_PROGRESS": "0"}
    record: dict[str, Any] = {"script": script.name, "room": entry["room"], "threads": threads,
                              "json": str(out_json), "command": cmd[1:], "machine": machine_info(threads)}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=script.parent.parent)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as err:
        status, tail = f"timeout after {timeout_s:.0f} s", str(err.stdout or "")[-2000:]
    record["wall_s"] = time.perf_counter() - start
    finish_machine_info(record["machine"])
    record["status"], record["output_tail"] = status, tail
    ratios: dict[str, Any] = {}
    if status == "ok":
        try:
            data = read_json(out_json)
        except (OSError, ValueError) as err:
            record["status"] = f"no readable JSON ({err})"
        else:
            for label, path in entry["ratios"].items():
                try:
                    value = json_path(data, path)
                    ratios[label] = float(value) if isinstance(value, (int, float)) else value
                except KeyError as err:
                    ratios[label] = f"missing: {err.args[0]}"
    record["ratios"] = ratios
    return record


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}×"
    return "—" if value is None else str(value)


def _ratio_rows(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[int, Any]]:
    """(room, script, ratio label) -> {threads: ratio, or the run's status when it failed}, in record order."""
    rows: dict[tuple[str, str, str], dict[int, Any]] = {}
    for rec in records:
        for label, value in (rec["ratios"] or {"(no ratios)": None}).items():
            rows.setdefault((rec["room"], rec["script"], label), {})[rec["threads"]] = (
                value if rec["status"] == "ok" else rec["status"])
    return rows


def bench_table(records: list[dict[str, Any]], threads: list[int]) -> str:
    """The markdown page: one row per (script, ratio), one column per thread count, then the machines."""
    rows = _ratio_rows(records)
    first = records[0]["machine"] if records else machine_info()
    lines = ["# Benchmark ratios (`icml26 bench`)", "",
             f"Machine: {first['cpu_model']}, {first['cpu_count']} cores, torch {first['torch']} ({first['blas']}, "
             f"{first['cpu_capability']}), commit `{first['git_sha'][:12]}`"
             + (" (dirty tree)" if first.get("git_dirty") else "") + ". Each ratio is the script's own "
             "(named in its JSON path); a JSON per script and thread count lies next to this page.", "",
             "| room | script | ratio | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in threads) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in threads) + " |"]
    for (room, script, label), by_thread in rows.items():
        lines.append(f"| {room} | `{script}` | {label} | "
                     + " | ".join(_fmt(by_thread.get(t)) for t in threads) + " |")
    lines += ["", "| script | threads | status | wall s | load average start → end |",
              "| --- | --- | --- | --- | --- |"]
    for rec in records:
        m = rec["machine"]
        load = (f"{m['loadavg_start'][0]:.1f} → {m['loadavg_end'][0]:.1f}"
                if m.get("loadavg_start") and m.get("loadavg_end") else "—")
        lines.append(f"| `{rec['script']}` | {rec['threads']} | {rec['status']} | {rec['wall_s']:.0f} | {load} |")
    return "\n".join(lines) + "\n"


CARD_BEGIN = "<!-- bench:begin (generated by `icml26 bench --cards`; edit the benchmark, not this table) -->"
CARD_END = "<!-- bench:end -->"


def room_table(records: list[dict[str, Any]], room: str, threads: list[int]) -> str:
    """One room's rows of :func:`bench_table` with the run that measured them (commit, CPU, load): the block a card
    quotes between ``CARD_BEGIN`` and ``CARD_END``."""
    mine = [r for r in records if r["room"] == room]
    if not mine:
        raise ValueError(f"the benchmark records hold no run of room {room!r}")
    m = mine[0]["machine"]
    loads = [r["machine"].get(k) for r in mine for k in ("loadavg_start", "loadavg_end")]
    loads = [x[0] for x in loads if x]
    lines = [f"`make bench` (`icml26 bench`) at commit `{m['git_sha'][:12]}`"
             + (" (dirty tree)" if m.get("git_dirty") else "")
             + f", {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}"
             + (f", load average {min(loads):.1f}–{max(loads):.1f}" if loads else "")
             + "; each ratio is its script's own, as its label says (JSONs in `results/benchmarks/`).", "",
             "| script | ratio | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in threads) + " |",
             "| --- | --- | " + " | ".join("---" for _ in threads) + " |"]
    for (_, script, label), by_thread in _ratio_rows(mine).items():
        lines.append(f"| `{script}` | {label} | " + " | ".join(_fmt(by_thread.get(t)) for t in threads) + " |")
    return "\n".join(lines) + "\n"


def update_cards(bench_json: str | os.PathLike, methods_dir: str | os.PathLike | None = None) -> list[Path]:
    """Rewrite, in every benchmarked room's card, the block between ``CARD_BEGIN`` and ``CARD_END`` with that
    room's rows of the recorded run ``bench_json`` (a ``bench.json`` written by :func:`run_benchmarks`).

    Every card is checked before any is written: a card without the two markers (each once, in order) is an error
    naming it. Returns the cards written.
    """
    data = read_json(bench_json)
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise ValueError(f"{bench_json}: not a bench.json with runs (write one with `icml26 bench`)")
    records, threads = data["runs"], list(data.get("threads") or sorted({r["threads"] for r in data["runs"]}))
    methods_dir = Path(methods_dir) if methods_dir else Path(__file__).resolve().parents[1] / "methods"
    new_text = {}
    for room in dict.fromkeys(r["room"] for r in records):
        card = methods_dir / room / "README.md"
        text = card.read_text() if card.exists() else ""
        if text.count(CARD_BEGIN) != 1 or text.count(CARD_END) != 1 or text.index(CARD_BEGIN) > text.index(CARD_END):
            raise ValueError(f"{card}: needs one {CARD_BEGIN!r} line followed by one {CARD_END!r} line")
        head, rest = text.split(CARD_BEGIN)
        new_text[card] = head + CARD_BEGIN + "\n" + room_table(records, room, threads) + CARD_END + rest.split(CARD_END, 1)[1]
    for card, text in new_text.items():
        atomic_write_text(card, text)
    return list(new_text)


def run_benchmarks(rooms: list[str] | None = None, threads: list[int] | tuple[int, ...] = (1, 2),
                   out_dir: str | os.PathLike = "results/benchmarks", bench_dir: str | os.PathLike | None = None,
                   budget_s: float = BENCH_BUDGET_S, python: str = sys.executable,
                   echo: bool = True) -> tuple[Path, list[dict[str, Any]]]:
    """Run every BENCH script (of ``rooms``) at each thread count; write ``bench.json`` and ``BENCH.md``.

    Each run's timeout is its share of what is left of ``budget_s``, in proportion to the entries' declared
    ``seconds`` (``DEFAULT_SECONDS`` when absent), so the sweep ends within the budget and time a quick run
    leaves over goes to the next ones. Returns the markdown page's path and the records.
    """
    threads = list(threads)
    if not threads or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in threads):
        raise ValueError(f"threads must be positive ints, got {threads}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    scripts = discover(bench_dir, rooms)
    if rooms:
        missing = sorted(set(rooms) - {e["room"] for _, e in scripts})
        if missing:
            raise ValueError(f"no benchmark script declares a BENCH entry for room(s) {missing}")
    if not scripts:
        raise ValueError("no benchmark script declares a BENCH entry")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(script, entry, t) for script, entry in scripts for t in threads]
    deadline = time.perf_counter() + budget_s
    records = []
    for i, (script, entry, t) in enumerate(runs):
        weights = [e.get("seconds", DEFAULT_SECONDS) for _, e, _ in runs[i:]]
        timeout = max(1.0, (deadline - time.perf_counter()) * weights[0] / sum(weights))
        if echo:
            print(f"[{i + 1}/{len(runs)}] {script.name} at {t} thread(s) (timeout {timeout:.0f} s) ...", flush=True)
        rec = run_script(script, entry, t, out_dir, timeout, python)
        records.append(rec)
        if echo:
            shown = ", ".join(f"{k} {_fmt(v)}" for k, v in rec["ratios"].items())
            print(f"    {rec['status']}, {rec['wall_s']:.0f} s: {shown}", flush=True)
    atomic_write_json(out_dir / "bench.json", {"threads": threads, "budget_s": budget_s, "runs": records})
    page = atomic_write_text(out_dir / "BENCH.md", bench_table(records, threads))
    return page, records
