"""Per-round curves of FedDTL vs FedLoRA from finished result files: client drift (mean pairwise cosine distance
of the clients' LoRA updates), RL-stage reward / signal / clip fraction, and base/novel test accuracy at the
evaluated rounds; mean over seeds. Reads RESULTS/feddtl/*.json, writes one PNG per spec and a JSON summary.

    .venv/bin/python benchmarks/feddtl_curves.py results/feddtl_regimes [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from icml26.core.io import atomic_write_json

KEYS = ("drift", "reward", "signal_fraction", "clip_fraction", "base_accuracy", "novel_accuracy")


def summarise(result: dict) -> dict:
    """``{arm: {"round": [...], key: mean-over-seeds list}}`` for the arms with curves (feddtl, fedlora)."""
    out: dict = {}
    for arm in ("feddtl", "fedlora"):
        curves = [r["curves"][arm] for r in result.get("seed_results", []) if arm in r.get("curves", {})]
        if not curves:
            continue
        rounds, every = curves[0]["round"], result["run_info"]["config"].get("eval_every", 0)
        evaluated = [t for t in rounds if every and (t % every == 0 or t == rounds[-1])]
        out[arm] = {"round": rounds, "evaluated_round": evaluated, "seeds": len(curves)}
        for key in KEYS:
            rows = [c[key] for c in curves if len(c[key]) == len(curves[0][key])]
            out[arm][key] = np.mean(rows, axis=0).tolist() if rows else []
    return out


def plot(summary: dict, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for i, (arm, c) in enumerate(summary.items()):
        rounds = c["round"]
        axes[0].plot(rounds, c["drift"], marker="o", color=f"C{i}", label=arm)
        evaluated = c["evaluated_round"]
        axes[1].plot(evaluated, c["base_accuracy"], marker="o", color=f"C{i}", label=f"{arm} base")
        axes[1].plot(evaluated, c["novel_accuracy"], marker="s", ls="--", color=f"C{i}", label=f"{arm} novel")
        if arm == "feddtl":
            axes[2].plot(rounds, c["reward"], marker="o", label="reward")
            axes[2].plot(rounds, c["signal_fraction"], marker="s", label="signal fraction")
            axes[2].plot(rounds, c["clip_fraction"], marker="^", label="clip fraction")
    for ax, name in zip(axes, ("client drift (1 - mean cos)", "test accuracy", "FedDTL RL stage")):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("round")
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results directory holding feddtl/*.json")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default RESULTS/feddtl)")
    args = parser.parse_args()
    files = sorted((args.results / "feddtl").glob("*.json"))
    if not files:
        raise SystemExit(f"no feddtl result files under {args.results / 'feddtl'}")
    out = args.out or args.results / "feddtl"
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for f in files:
        result = json.loads(f.read_text())
        if "spec" not in result:
            continue
        summary[result["spec"]] = s = summarise(result)
        if s:
            plot(s, f"{result['spec']} ({result['tier']}, {len(result.get('seed_results', []))} seeds)",
                 out / f"{result['spec']}_curves.png")
    atomic_write_json(out / "curves_summary.json", summary)
    for spec, s in summary.items():
        for arm, c in s.items():
            print(spec, arm, "drift", [round(v, 2) for v in c["drift"]], "base", [round(v, 3) for v in c["base_accuracy"]],
                  "novel", [round(v, 3) for v in c["novel_accuracy"]])


if __name__ == "__main__":
    main()
