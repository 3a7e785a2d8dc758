"""Fit+predict wall time of TabICLClassifier and TabICLRegressor (shipped checkpoints) on random tables, and how it
grows with rows and features. Writes one JSON file atomically.

    python benchmarks/tabicl2_speed.py --threads 2 --out results/benchmarks/tabicl2_speed.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np


def time_once(n_rows: int, n_features: int, n_estimators: int, repeats: int, task: str = "classification") -> dict:
    from icml26.methods.tabicl2.estimator import TabICLClassifier, TabICLRegressor
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n_rows, n_features))
    signal = X[:, 0] + 0.5 * rng.normal(size=n_rows)
    n_train = int(0.8 * n_rows)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if task == "classification":
            y = (signal > 0).astype(int)
            TabICLClassifier(n_estimators=n_estimators).fit(X[:n_train], y[:n_train]).predict_proba(X[n_train:])
        else:
            TabICLRegressor(n_estimators=n_estimators).fit(X[:n_train], signal[:n_train]).predict(X[n_train:])
        times.append(time.perf_counter() - t0)
    return {"task": task, "rows": n_rows, "features": n_features, "n_estimators": n_estimators,
            "median_seconds": statistics.median(times), "repeats": repeats}


def main() -> None:
    import torch
    from icml26.core.io import atomic_write_json
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default="results/benchmarks/tabicl2_speed.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [time_once(1000, 20, 8, args.repeats)]
    rows += [time_once(n, 20, 1, args.repeats) for n in (250, 500, 1000, 2000)]
    rows += [time_once(1000, h, 1, args.repeats) for h in (5, 10, 40)]
    rows += [time_once(1000, 20, 8, args.repeats, "regression")]
    rows += [time_once(n, 20, 1, args.repeats, "regression") for n in (250, 1000, 2000)]
    out = {"benchmark": "tabicl2 fit+predict (80% train / 20% test rows)", "threads": args.threads,
           "torch": torch.__version__, "machine": platform.machine(), "cpu_count": __import__("os").cpu_count(),
           "note": "shared machine: other jobs may have been running", "results": rows}
    atomic_write_json(args.out, out)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
