"""Token count and MAE pretraining step time of dynamic vs uniform patching (Omni-fMRI) on simulated MNI152 chunks.

Median wall time and process CPU time per forward+backward+AdamW step at batch 8, for each patching arm of the claim,
plus the ratios to uniform 4^3 measured in the same run. Writes one JSON file atomically.

    python benchmarks/omni_fmri_step_cost.py --steps 10 --out results/benchmarks/omni_fmri_step_cost.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--frames", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tier", default="quick", choices=["quick", "full"], help="model and grid of this tier")
    ap.add_argument("--out", default="results/benchmarks/omni_fmri_step_cost.json")
    args = ap.parse_args()

    import torch

    from icml26.core.io import atomic_write_json
    from icml26.methods.omni_fmri.experiments import PATCHING, TIERS, model_config
    from icml26.methods.omni_fmri.model import OmniMAE
    from icml26.methods.omni_fmri.simulate import SimSpec, simulate

    torch.set_num_threads(args.threads)
    config = {**TIERS[args.tier], "frames": args.frames}
    spec = SimSpec(shape=tuple(config["shape"]), voxel_mm=config["voxel_mm"], frames=args.frames)
    ds = simulate(2, max(1, args.batch // 2), 0, spec)
    x = ds.tensor()[:args.batch]
    rows = {}
    for arm in PATCHING:
        cfg = model_config(config, arm)
        torch.manual_seed(0)
        model = OmniMAE(cfg, x.shape[2:])
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        tokens = model.tokenize(x)
        walls, cpus = [], []
        for step in range(args.steps + 2):
            w, c = time.perf_counter(), time.process_time()
            out = model(x, tokens=tokens)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
            if step >= 2:  # two warm-up steps
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
        rows[arm] = {"tokens_per_chunk": float(tokens.count().float().mean()),
                     "coarse_tokens_per_chunk": float(tokens.count(1).float().mean()),
                     "step_wall_s_median": statistics.median(walls), "step_cpu_s_median": statistics.median(cpus)}
    for arm, r in rows.items():
        r["token_ratio_to_uniform4"] = r["tokens_per_chunk"] / rows["uniform4"]["tokens_per_chunk"]
        r["cpu_ratio_to_uniform4"] = r["step_cpu_s_median"] / rows["uniform4"]["step_cpu_s_median"]
    result = {"benchmark": "omni_fmri_step_cost", "args": vars(args), "platform": platform.platform(),
              "torch": torch.__version__, "arms": rows}
    atomic_write_json(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
