"""SHERPA's extra baselines and ablations at quick-tier scale (issue 13), recorded, not judged.

Runs the quick tier of ``task_dice_vs_lora`` with every arm (decoder_only, l2sp, kd_random and self_guide beside
sherpa, kd_full, lora, full_ft) under the same tuning rule, through the harness (per-seed resume after a kill,
atomic result file). The claims' verdicts come from ``icml26 reproduce sherpa --tier quick``; this run only adds the
arms that do not fit that budget (the full tier runs them at 300 steps and 5 seeds).

    python benchmarks/sherpa_ablations.py --out results/benchmarks/sherpa_ablations
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/benchmarks/sherpa_ablations")
    ap.add_argument("--seeds", type=int, default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from icml26.harness.runner import run_spec
    from icml26.methods.sherpa import experiments as ex

    res = run_spec(ex.SPECS[0], "quick", Path(args.out), n_seeds=args.seeds, overrides={"arms": list(ex.ARMS)})
    arms = res["arms"]
    for arm in ex.ARMS + ex.REFERENCE_ARMS:
        m = arms.get(arm, {})
        print(arm, {k: round(m[k]["mean"], 4) for k in ("task_dice", "retention", "stardist_dice") if k in m})
    print({k: (round(v["mean"], 4), round(v.get("std", float("nan")), 4)) for k, v in res["statistics"].items()})
    print("tuning", res["prepared"]["tuning"]["lr"]["chosen"], res["prepared"]["tuning"]["weight"]["chosen"])


if __name__ == "__main__":
    main()
