"""SHERPA's pre-claim mechanism check (issue 13): is the stand-in a test at all, before any claim runs?

On the tuning seed's data only (seed 1000; never a reported seed) it measures
* the pretrained small and large segmenters' general-suite IoU per variant against the prompt-centred disk
  (the "general ability" to keep must be there: large - disk >= 0.05 is the claims' stand-in check);
* the fine-tuned small model's task Dice against the zero-shot large model's (the guide must know something);
* FRS: mean Fisher ratio of the selected channels over the mean of all;
* that the guidance term can act: KL(G_S || A_L^U) on validation images after LoRA fine-tuning with lambda_g = 0.3
  against lambda_g = 0 (task Dice of these two runs is not computed: that is the claim's job).
Writes JSON atomically.

    python benchmarks/sherpa_mechanism.py --out results/benchmarks/sherpa_mechanism.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/benchmarks/sherpa_mechanism.json")
    ap.add_argument("--tier", default="quick")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from icml26.core.io import atomic_write_json
    from icml26.methods.sherpa import experiments as ex
    from icml26.methods.sherpa.method import attention_kl, frs_channels, restricted_attention

    t0 = time.perf_counter()
    config = ex.TIERS[args.tier]
    small, large = ex._models(config)
    data = ex._data(config, ex.TUNING_SEED)
    disk = {v: ex.disk_iou(b) for v, b in data["suite"].items()}
    suite = {"large": ex.suite_iou(large, data["suite"]), "small": ex.suite_iou(small, data["suite"]), "disk": disk}
    small_ft = ex._small_ft(small, data, config, ex.TUNING_SEED)
    cfg = ex._arm_cfg("sherpa", config, 0.3)
    U, scores = frs_channels(large, data["train"], cfg)
    lr = config["lr_centres"]["lora"]
    kls = {}
    for lam in (0.0, 0.3):
        model = ex._run_arm("sherpa", large, {"small": small_ft}, data, config, lr, lam, ex.TUNING_SEED)
        with torch.no_grad():
            small_ft.encode(data["val"].image)
            target = small_ft.blocks[-1].attention_map()
            model.encode(data["val"].image)
            blk = model.blocks[-1]
            kls[f"lambda_g={lam}"] = float(attention_kl(target, restricted_attention(blk.last_q, blk.last_k, U)))
    out = {
        "tier": args.tier, "seed": ex.TUNING_SEED,
        "suite_iou": suite,
        "suite_mean": {k: float(np.mean(list(v.values()))) for k, v in suite.items()},
        "pretrained_vs_disk_iou": float(np.mean(list(suite["large"].values())) - np.mean(list(disk.values()))),
        "task_dice": {"large_zero_shot": ex.evaluate(large, data["val"])[0],
                      "small_ft": ex.evaluate(small_ft, data["val"])[0]},
        "frs_separates": float(scores[U].mean() / scores.mean()),
        "guidance_kl_on_val": kls,
        "wall_s": time.perf_counter() - t0,
    }
    atomic_write_json(args.out, out)
    print(out)


if __name__ == "__main__":
    main()
