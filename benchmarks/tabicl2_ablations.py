"""TabICLv2 ablations as short classification pretrains, at an equal number of optimizer steps per arm (protocol v2,
pre-registered in src/icml26/methods/tabicl2/README.md, "Ablations"):

1. query scaling in the in-context blocks and ISAB step A: QASSMax vs SSMax vs plain softmax (all Muon), read by the
   length-generalisation gap CE(1,024 context rows) - CE(96 context rows) on held-out prior datasets (pretraining
   contexts are <= 128 rows);
2. Muon vs AdamW (QASSMax both), read by the in-distribution held-out CE and accuracy at 96 context rows.

Every arm gets the same lr tuning budget: a 3-point grid (factor 3) around its own natural lr, every grid point a
full run of ``--steps`` steps on the same data stream (the prior batches are generated once into a shared cache), the
lr chosen by CE on a tuning set of prior datasets; a choice on the grid's edge is extended once by a factor 3 in that
direction. The chosen run of each arm is evaluated on a separate held-out set; a second pretraining seed of
``qassmax_muon`` at its chosen lr gives the seed-noise yardstick. Wall-clock minutes and CPU seconds are reported,
not used as a budget.

Resumable: every pretrain resumes from its own ``state.pt``; the JSON is rewritten atomically after every run and
every evaluation; finished runs are skipped. Rerun the same command after a kill.

    nice -n 10 python benchmarks/tabicl2_ablations.py --steps 120 --eval-batches 4 \
        --out results/benchmarks/tabicl2_ablations_v2.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

MUON_GRID = (1e-3, 3e-3, 9e-3)     # centre 3e-3: Muon's update RMS is 0.2 * lr (0.2 sqrt(max(A, B)) scaling)
ADAMW_GRID = (3.3e-4, 1e-3, 3e-3)  # centre 1e-3: Adam's early update RMS is ~lr (sign-like), so a 3x lower lr
ARMS = {  # name -> (TabICLConfig overrides, optimizer, lr grid)
    "qassmax_muon": ({"ssmax": "qassmax"}, "muon", MUON_GRID),
    "ssmax_muon": ({"ssmax": "ssmax"}, "muon", MUON_GRID),
    "softmax_muon": ({"ssmax": "none"}, "muon", MUON_GRID),
    "qassmax_adamw": ({"ssmax": "qassmax"}, "adamw", ADAMW_GRID),
}
SHORT, LONG = 96, 1024          # context rows: inside the pretraining range (32-128 rows), and 8x its top
TUNE_SEED, EVAL_SEED = 8 * 10 ** 6, 7 * 10 ** 6  # pretraining batches use seeds < 1e6 (seed * 1e9 + step * 1e3)
LEVEL = 0.90                    # two-sided bootstrap interval


def tuning_set(batches: int = 4, n_features: int = 8) -> list:
    """Prior batches of 16 datasets, 96 training + 32 test rows (in the pretraining range), for choosing the lr."""
    import torch
    from icml26.methods.tabicl2.prior import sample_batch
    out = []
    for b in range(batches):
        X, y = sample_batch(TUNE_SEED + b, 16, SHORT + 32, n_features, SHORT)
        out.append((torch.from_numpy(X), torch.from_numpy(y), SHORT))
    return out


def eval_set(batches: int = 4, n_test: int = 128, n_features: int = 8) -> list:
    """Held-out prior batches of 16 datasets with LONG training rows followed by ``n_test`` test rows. The short
    context is the first SHORT training rows of the same dataset (rows are randomly permuted by the prior), so the
    two contexts are compared on the same datasets and the same test rows."""
    import torch
    from icml26.methods.tabicl2.prior import sample_batch
    out = []
    for b in range(batches):
        X, y = sample_batch(EVAL_SEED + b, 16, LONG + n_test, n_features, LONG)
        out.append((torch.from_numpy(X), torch.from_numpy(y)))
    return out


def per_dataset_metrics(model, batches: list, n_ctx: int, n_train: int) -> dict:
    """Per-dataset test CE and accuracy with the first ``n_ctx`` of the ``n_train`` training rows as context.

    batches: [(X (B, n, H), y (B, n))]; test rows are ``n_train:``. Logits of classes beyond the dataset's class
    count (from all ``n_train`` training rows, the same for both contexts) are masked, as in pretraining.
    Returns {"ce": (D,), "acc": (D,)} numpy arrays over the D datasets."""
    import torch
    import torch.nn.functional as F
    ce, acc = [], []
    model.eval()
    dev = next(model.parameters()).device
    with torch.no_grad():
        for X, y in batches:
            X, y = X.to(dev), y.to(dev)
            Xc = torch.cat([X[:, :n_ctx], X[:, n_train:]], 1)
            logits = model(Xc, y[:, :n_ctx])                       # (B, n_test, C)
            n_cls = y[:, :n_train].max(1).values + 1
            mask = torch.arange(logits.shape[-1], device=dev)[None, None] >= n_cls[:, None, None]
            logits = logits.masked_fill(mask, -1e9)
            y_te = y[:, n_train:]
            ce.append(F.cross_entropy(logits.transpose(1, 2), y_te, reduction="none").mean(1).cpu().numpy())
            acc.append((logits.argmax(-1) == y_te).float().mean(1).cpu().numpy())
    return {"ce": np.concatenate(ce), "acc": np.concatenate(acc)}


def length_eval(model, batches: list) -> dict:
    """CE and accuracy at SHORT and LONG context rows and the per-dataset gap CE(LONG) - CE(SHORT), all (D,)."""
    s = per_dataset_metrics(model, batches, SHORT, LONG)
    lo = per_dataset_metrics(model, batches, LONG, LONG)
    return {"ce_short": s["ce"], "acc_short": s["acc"], "ce_long": lo["ce"], "acc_long": lo["acc"],
            "gap": lo["ce"] - s["ce"]}


def paired_ci(a: np.ndarray, b: np.ndarray, level: float = LEVEL, n_boot: int = 4000, seed: int = 0) -> dict:
    """Mean of the per-dataset difference a - b with a percentile bootstrap interval over datasets (paired)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    if d.ndim != 1 or d.size < 2:
        raise ValueError(f"paired_ci needs two equal-length 1-D arrays of >= 2 datasets, got shape {d.shape}")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(d.mean()), "lo": float(lo), "hi": float(hi)}


def read(ci: dict, yardstick: float) -> str:
    """Reading of an advantage ``ci`` (positive = the first arm is better): 'better' when the interval excludes 0
    and the mean exceeds the seed-noise yardstick, 'worse' symmetrically, else 'no difference shown'."""
    if ci["lo"] > 0 and ci["mean"] > yardstick:
        return "better"
    if ci["hi"] < 0 and -ci["mean"] > yardstick:
        return "worse"
    return "no difference shown"


def next_lr(grid_scores: dict, base_grid: tuple) -> float | None:
    """The lr to add to an arm's grid, or None when the choice is final.

    grid_scores: {lr: tuning CE} of the runs done. The best lr on the edge of the base grid gets one extension by
    the grid factor beyond that edge; after it (or an interior best) the choice is final."""
    factor = base_grid[1] / base_grid[0]
    best = min(grid_scores, key=grid_scores.get)
    lo, hi = min(base_grid), max(base_grid)
    if math.isclose(best, lo) and not any(x < lo * 0.99 for x in grid_scores):
        return lo / factor
    if math.isclose(best, hi) and not any(x > hi * 1.01 for x in grid_scores):
        return hi * factor
    return None


def lr_key(lr: float) -> str:
    return f"{lr:.2e}"


def main(argv=None) -> dict:
    import torch
    from icml26.core.io import atomic_write_json
    from icml26.methods.tabicl2 import pretrain
    from icml26.methods.tabicl2.config import TabICLConfig
    from icml26.methods.tabicl2.estimator import load_model
    from icml26.methods.tabicl2.reference import TabICL
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (equal for every arm and lr)")
    p.add_argument("--arms", nargs="*", default=list(ARMS))
    p.add_argument("--dir", default="results/tabicl2/ablations_v2")
    p.add_argument("--out", default="results/benchmarks/tabicl2_ablations_v2.json")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--no-seed-replicate", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    torch.set_num_threads(1)
    root, out = Path(args.dir), Path(args.out)
    state = json.loads(out.read_text()) if out.exists() else {"runs": {}, "eval": {}}
    state.update({"benchmark": "tabicl2 ablations v2 (equal optimizer steps per arm)", "steps": args.steps,
                  "contexts": [SHORT, LONG], "pretrain_rows": [32, 128], "features": 8, "batch": 16,
                  "grids": {a: list(ARMS[a][2]) for a in args.arms}, "level": LEVEL})
    tune = tuning_set()

    def run(arm: str, lr: float, seed: int = 0) -> dict:
        key = f"{arm}/{lr_key(lr)}" + (f"/seed{seed}" if seed else "")
        if key in state["runs"]:
            return state["runs"][key]
        overrides, optimizer, _ = ARMS[arm]
        run_dir = root / key.replace("/", "_")
        t0, c0 = time.time(), time.process_time()
        result = pretrain.main(["--out", str(run_dir), "--steps", str(args.steps), "--min-rows", "32",
                                "--max-rows", "128", "--max-features", "8", "--batch", "16", "--lr", str(lr),
                                "--optimizer", optimizer, "--seed", str(seed), "--eval-every", str(10 ** 9),
                                "--val-batches", "1", "--ckpt-every", "25", "--data-cache", str(root / "cache"),
                                "--model", json.dumps(overrides), "--export", str(run_dir / "model.pt")])
        model = load_model(run_dir / "model.pt")
        tune_ce = float(np.mean([per_dataset_metrics(model, [(X, y)], SHORT, n)["ce"].mean() for X, y, n in tune]))
        rec = {"arm": arm, "lr": lr, "seed": seed, "steps": result["steps"], "datasets": result["datasets"],
               "schedule_minutes": result["minutes"], "wall_s_this_session": time.time() - t0,
               "cpu_s_this_session": time.process_time() - c0, "tune_ce": tune_ce,
               "checkpoint": str(run_dir / "model.pt")}
        state["runs"][key] = rec
        atomic_write_json(out, state)
        print(f"{key}: tune CE {tune_ce:.4f} ({result['minutes']:.1f} schedule min)", flush=True)
        return rec

    def arm_scores(arm: str) -> dict:
        return {r["lr"]: r["tune_ce"] for r in state["runs"].values() if r["arm"] == arm and r["seed"] == 0}

    # 1. every arm's base grid (interleaved by lr so machine load spreads over arms), then edge extensions
    for lr_i in range(3):
        for arm in args.arms:
            run(arm, ARMS[arm][2][lr_i])
    chosen = {}
    for arm in args.arms:
        grid = ARMS[arm][2]
        extra = next_lr(arm_scores(arm), grid)
        if extra is not None:  # the one extension beyond an edge choice
            run(arm, extra)
        scores = arm_scores(arm)
        best = min(scores, key=scores.get)
        edge = best == min(scores) or best == max(scores)
        chosen[arm] = {"lr": best, "on_grid_edge": bool(edge), "tune_ce": scores}
    state["chosen"] = {a: {"lr": c["lr"], "on_grid_edge": c["on_grid_edge"],
                           "tune_ce": {lr_key(k): v for k, v in c["tune_ce"].items()}} for a, c in chosen.items()}
    atomic_write_json(out, state)

    # 2. held-out evaluation of each arm's chosen run (and the untrained network, for the mechanism check)
    ev_batches = eval_set(args.eval_batches)
    per = {}

    def evaluate(name: str, model) -> dict:
        m = length_eval(model, ev_batches)
        per[name] = m
        if name not in state["eval"]:
            state["eval"][name] = {k: float(v.mean()) for k, v in m.items()}
            state["eval"][name]["per_dataset"] = {k: [round(float(x), 5) for x in v] for k, v in m.items()}
            atomic_write_json(out, state)
            print(name, {k: round(float(v.mean()), 4) for k, v in m.items()}, flush=True)
        return m

    def cached(name: str) -> dict | None:
        if name in state["eval"]:
            per[name] = {k: np.asarray(v) for k, v in state["eval"][name]["per_dataset"].items()}
            return per[name]
        return None

    if cached("untrained_qassmax") is None:
        torch.manual_seed(0)
        evaluate("untrained_qassmax", TabICL(TabICLConfig(ssmax="qassmax")))
    for arm in args.arms:
        if cached(arm) is None:
            evaluate(arm, load_model(state["runs"][f"{arm}/{lr_key(chosen[arm]['lr'])}"]["checkpoint"]))
    # 3. seed-noise yardstick: a second pretraining seed of qassmax_muon at its chosen lr
    if "qassmax_muon" in chosen and not args.no_seed_replicate:
        rec = run("qassmax_muon", chosen["qassmax_muon"]["lr"], seed=1)
        if cached("qassmax_muon_seed1") is None:
            evaluate("qassmax_muon_seed1", load_model(rec["checkpoint"]))
    # mechanism diagnostics: how much the learned query scale changes from SHORT to LONG keys
    diag = {}
    for arm in args.arms:
        model = load_model(state["runs"][f"{arm}/{lr_key(chosen[arm]['lr'])}"]["checkpoint"])
        ratios = []
        for mod in model.modules():  # (no_grad below: a diagnostic, not training)
            if hasattr(mod, "base_scale"):
                z = torch.zeros(1)
                with torch.no_grad():
                    ratios.append(float(mod.base_scale(LONG, z).abs().mean() / mod.base_scale(SHORT, z).abs().mean()))
            elif hasattr(mod, "scales"):
                ratios.append(math.log(LONG) / math.log(SHORT))
        diag[arm] = {"query_scale_ratio_long_over_short": float(np.mean(ratios)) if ratios else 1.0}
    state["diagnostics"] = diag

    # 4. comparisons (positive advantage = the first arm is better); yardstick = |seed 0 - seed 1| of qassmax_muon
    def yard(metric: str) -> float:
        if "qassmax_muon_seed1" not in per or "qassmax_muon" not in per:
            return 0.0
        return abs(float(per["qassmax_muon"][metric].mean() - per["qassmax_muon_seed1"][metric].mean()))

    comps = {}
    pairs = [("qassmax_muon", "ssmax_muon"), ("qassmax_muon", "softmax_muon"), ("ssmax_muon", "softmax_muon"),
             ("qassmax_muon", "qassmax_adamw")]
    for a, b in pairs:
        if a not in per or b not in per:
            continue
        c = {}
        for metric, sign in (("gap", -1), ("ce_long", -1), ("ce_short", -1), ("acc_short", 1), ("acc_long", 1)):
            ci = paired_ci(sign * per[a][metric], sign * per[b][metric])
            c[metric] = {**ci, "yardstick": yard(metric), "reading": read(ci, yard(metric))}
        comps[f"{a} vs {b}"] = c
    state["comparisons"] = comps
    un, checks = per.get("untrained_qassmax"), {}
    for arm in args.arms:
        if un is not None and arm in per:
            drop = float(un["ce_short"].mean() - per[arm]["ce_short"].mean())
            checks[arm] = {"trained_ce_drop": drop, "trained": drop >= 0.05,
                           "lr_interior": not chosen[arm]["on_grid_edge"]}
    state["mechanism_checks"] = checks
    atomic_write_json(out, state)
    print(json.dumps({"chosen": state["chosen"], "checks": checks, "diagnostics": diag,
                      "comparisons": {k: {m: (round(v["mean"], 4), round(v["lo"], 4), round(v["hi"], 4),
                                              v["reading"]) for m, v in c.items()} for k, c in comps.items()}},
                     indent=1), flush=True)
    return state


if __name__ == "__main__":
    main()
