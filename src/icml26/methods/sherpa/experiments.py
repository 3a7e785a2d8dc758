"""SHERPA's claims at laptop scale: guidance from a small fine-tuned segmenter, restricted by Fisher Ratio Separation
to task-relevant channels, (1) improves the large model's specialised-task Dice over the same LoRA fine-tuning
without guidance, and (2) keeps more of its general segmentation ability than full fine-tuning.

Protocol (pre-registered in README.md; per seed new task and suite data; the pretrained checkpoints are shared):
1. Pretrained small (d 32, 2 blocks) and large (d 64, 4 blocks) segmenters from ``pretrain.py`` (general shapes).
2. Task: ``n_train`` nuclei-like images with one prompted nucleus each; test ``n_test``; general suite: 5 variants
   (base, clutter, lowlight, small, textured) x ``n_suite`` images.
3. The small model is fully fine-tuned on the task (``steps``, lr ``small_lr``; its cost is reported, not an arm).
4. Arms, each ``steps`` AdamW steps at batch ``batch`` on the same task data: sherpa (LoRA + guidance on FRS
   channels), kd_full (LoRA + guidance on all channels: distillation from the small model without FRS), lora (LoRA,
   no guidance), full_ft (every weight, no guidance).
5. Tuning (tuning seed 1000, validation Dice of the task): lora and full_ft tune the learning rate (LogGrid, 3
   points, around 3e-3 and 1e-3); sherpa and kd_full tune lambda_g (ListGrid 0.1, 0.3, 1.0, 3 points) at lora's
   chosen learning rate: three evaluations per arm.
6. Metrics: task Dice on the test set; general retention = mean suite IoU after / before fine-tuning.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
import torch

from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import ListGrid, LogGrid, tune_per_arm
from .config import SherpaConfig
from .data import GENERAL_VARIANTS, Batch, general_batch, nuclei_batch
from .method import finetune, frs_channels
from .model import PromptableSegmenter, dice_iou
from .pretrain import pretrained

ARMS = ("sherpa", "kd_full", "lora", "full_ft")
# Reference points reported beside the trained arms, not trained under the tuning budget: the large model before
# fine-tuning and the small model fine-tuned on the task (the guide).
REFERENCE_ARMS = ("large_zero_shot", "small_ft")
TUNING_SEED = 1000
_CACHE: dict[str, Any] = {}


@torch.no_grad()
def evaluate(model: PromptableSegmenter, data: Batch, chunk: int = 128) -> tuple[float, float]:
    model.eval()
    logits = torch.cat([model(data.image[i:i + chunk], data.point[i:i + chunk]) for i in range(0, len(data), chunk)])
    return dice_iou(logits, data.mask)


def disk_iou(data: Batch, radius: float = 4.0) -> float:
    """IoU of the trivial prompt-centred disk (radius 4 px): the floor a segmenter has to beat."""
    yy, xx = torch.meshgrid(torch.arange(data.mask.shape[1]), torch.arange(data.mask.shape[2]), indexing="ij")
    disk = ((yy - data.point[:, 0, None, None]) ** 2 + (xx - data.point[:, 1, None, None]) ** 2) <= radius ** 2
    return dice_iou(disk.float() * 2 - 1, data.mask)[1]


def suite_iou(model: PromptableSegmenter, suite: dict[str, Batch]) -> dict[str, float]:
    return {v: evaluate(model, b)[1] for v, b in suite.items()}


def _data(config: Mapping[str, Any], seed: int) -> dict:
    return {"train": nuclei_batch(config["n_train"], seed * 10 + 1), "val": nuclei_batch(config["n_test"], seed * 10 + 2),
            "test": nuclei_batch(config["n_test"], seed * 10 + 3),
            "suite": {v: general_batch(config["n_suite"], seed * 10 + 4 + i, v) for i, v in enumerate(GENERAL_VARIANTS)}}


def _models(config: Mapping[str, Any]):
    steps = config["pretrain_steps"]
    return pretrained("small", steps=steps), pretrained("large", steps=steps)


def _arm_cfg(arm: str, config: Mapping[str, Any], lambda_g: float) -> SherpaConfig:
    if arm == "sherpa":
        return SherpaConfig(lambda_g=lambda_g, k_frac=config["k_frac"], m_samples=config["m_samples"],
                            frs_features=config.get("frs_features", "qk"), update=config.get("sherpa_update", "lora"))
    if arm == "kd_full":
        return SherpaConfig(lambda_g=lambda_g, k_frac=1.0, m_samples=config["m_samples"])
    return SherpaConfig(lambda_g=0.0, update="full" if arm == "full_ft" else "lora")


def _run_arm(arm, large, small_ft, data, config, lr, lambda_g, seed):
    cfg = _arm_cfg(arm, config, lambda_g)
    channels = frs_channels(large, data["train"], cfg, seed=seed)[0] if arm == "sherpa" else None
    return finetune(large, data["train"], steps=config["steps"], batch=config["batch"], lr=lr, seed=seed, cfg=cfg,
                    guide=small_ft if cfg.lambda_g > 0 else None, channels=channels, desc=f"sherpa arm {arm}")


def _small_ft(small, data, config, seed):
    return finetune(small, data["train"], steps=config["steps"], batch=config["batch"], lr=config["small_lr"],
                    seed=seed, cfg=SherpaConfig(lambda_g=0.0, update="full"), desc="small fine-tune")


def prepare(config: Mapping[str, Any]) -> dict:
    key = "prepare:" + json.dumps(config, sort_keys=True)
    if key in _CACHE:
        return _CACHE[key]
    torch.set_num_threads(1)
    small, large = _models(config)
    data = _data(config, TUNING_SEED)
    small_ft = _small_ft(small, data, config, TUNING_SEED)

    def lr_score(arm, lr, seed):
        return evaluate(_run_arm(arm, large, small_ft, data, config, lr, 0.0, seed), data["val"])[0]

    lr_t = tune_per_arm({"lora": LogGrid(center=config["lora_lr"], factor=3, size=3),
                         "full_ft": LogGrid(center=config["full_lr"], factor=3, size=3)}, lr_score, mode="max",
                        desc="sherpa lr")
    lora_lr = lr_t["chosen"]["lora"]

    def lam_score(arm, lam, seed):
        return evaluate(_run_arm(arm, large, small_ft, data, config, lora_lr, lam, seed), data["val"])[0]

    grid = ListGrid(tuple(config["lambda_grid"]))
    lam_t = tune_per_arm({"sherpa": grid, "kd_full": grid}, lam_score, mode="max", desc="sherpa lambda_g")
    out = {"tuning": {"lr": lr_t, "lambda_g": lam_t}}
    _CACHE[key] = out
    return out


def _choices(prepared, config) -> dict[str, tuple[float, float]]:
    if not prepared:
        return {a: (config["lora_lr"] if a != "full_ft" else config["full_lr"], config["lambda_grid"][0]) for a in ARMS}
    lr, lam = prepared["tuning"]["lr"]["chosen"], prepared["tuning"]["lambda_g"]["chosen"]
    return {"lora": (lr["lora"], 0.0), "full_ft": (lr["full_ft"], 0.0), "sherpa": (lr["lora"], lam["sherpa"]),
            "kd_full": (lr["lora"], lam["kd_full"])}


def run_seed(config: Mapping[str, Any], seed: int, prepared: Any = None) -> dict:
    key = f"run:{seed}:" + json.dumps(config, sort_keys=True) + json.dumps(prepared, sort_keys=True, default=str)
    if key in _CACHE:
        return _CACHE[key]
    torch.set_num_threads(1)
    small, large = _models(config)
    data = _data(config, seed)
    before = suite_iou(large, data["suite"])
    zero_dice = evaluate(large, data["test"])[0]
    small_ft = _small_ft(small, data, config, seed)
    small_dice = evaluate(small_ft, data["test"])[0]
    choices = _choices(prepared, config)
    arms = {}
    for arm in config["arms"]:
        lr, lam = choices[arm]
        model = _run_arm(arm, large, small_ft, data, config, lr, lam, seed)
        dice, iou = evaluate(model, data["test"])
        after = suite_iou(model, data["suite"])
        arms[arm] = {"task_dice": dice, "task_iou": iou, "general_iou": float(np.mean(list(after.values()))),
                     "retention": float(np.mean([after[v] / max(before[v], 1e-6) for v in after])), "lr": lr,
                     "lambda_g": lam, **{f"iou_{v}": after[v] for v in after}}
    arms["large_zero_shot"] = {"task_dice": zero_dice, "general_iou": float(np.mean(list(before.values()))),
                               "retention": 1.0}
    arms["small_ft"] = {"task_dice": small_dice}
    cfg = _arm_cfg("sherpa", config, 0.1)
    U, scores = frs_channels(large, data["train"], cfg, seed=seed)
    stats = {}
    if "sherpa" in arms and "lora" in arms:
        stats["dice_gain_vs_lora"] = arms["sherpa"]["task_dice"] - arms["lora"]["task_dice"]
        stats["retention_gap_vs_lora"] = arms["sherpa"]["retention"] - arms["lora"]["retention"]
    if "sherpa" in arms and "full_ft" in arms:
        stats["retention_gain_vs_full_ft"] = arms["sherpa"]["retention"] - arms["full_ft"]["retention"]
        stats["dice_gap_vs_full_ft"] = arms["sherpa"]["task_dice"] - arms["full_ft"]["task_dice"]
    if "sherpa" in arms and "kd_full" in arms:
        stats["dice_gain_vs_kd_full"] = arms["sherpa"]["task_dice"] - arms["kd_full"]["task_dice"]
        stats["retention_gain_vs_kd_full"] = arms["sherpa"]["retention"] - arms["kd_full"]["retention"]
    checks = {
        "guide_informative": small_dice - zero_dice,
        "frs_separates": float(scores[U].mean() / scores.mean()),
        "pretrained_vs_disk_iou": float(np.mean(list(before.values()))
                                        - np.mean([disk_iou(b) for b in data["suite"].values()])),
        "retention_gap_vs_lora": stats.get("retention_gap_vs_lora", float("nan")),
        "dice_gap_vs_full_ft": stats.get("dice_gap_vs_full_ft", float("nan")),
    }
    out = {"arms": arms, "statistics": stats, "checks": checks}
    _CACHE[key] = out
    return out


def _pareto(result: dict, ax) -> None:
    for arm in [a for a in result.get("arms_order", ARMS + REFERENCE_ARMS) if a in result["arms"]]:
        m = result["arms"].get(arm)
        if not m or "retention" not in m:
            continue
        ax.scatter(m["retention"]["per_seed"], m["task_dice"]["per_seed"], alpha=0.4)
        ax.scatter([m["retention"]["mean"]], [m["task_dice"]["mean"]], marker="s", label=arm)
    ax.set_xlabel("general retention (suite IoU after / before)")
    ax.set_ylabel("task Dice (nuclei)")
    ax.legend(fontsize=7)


_COMMON = {"pretrain_steps": 1000, "k_frac": 0.25, "m_samples": 64, "lora_lr": 3e-3, "full_lr": 1e-3,
           "small_lr": 1e-3, "lambda_grid": [0.1, 0.3, 1.0], "arms": list(ARMS)}
TIERS = {
    "smoke": {**_COMMON, "pretrain_steps": 20, "n_train": 16, "n_test": 16, "n_suite": 8, "steps": 2, "batch": 4,
              "m_samples": 8},
    "quick": {**_COMMON, "n_train": 256, "n_test": 192, "n_suite": 96, "steps": 120, "batch": 16},
    "full": {**_COMMON, "n_train": 512, "n_test": 512, "n_suite": 256, "steps": 600, "batch": 16},
}
_NOTES = ("Segmenters in SAM's shape trained from scratch here (32x32 grayscale, patch 4, d 32/64, 2/4 blocks) on "
          "generated shapes; nuclei-like generated task. FRS/GFE/loss are reconstructions (no code, no full paper).")

SPECS = [
    ExperimentSpec(
        id="task_dice_vs_lora",
        room="sherpa",
        claim="Guidance from a small SAM fine-tuned on the task, restricted to FRS-selected task-relevant channels, "
              "improves the large SAM's task performance (up to +2.2%) without losing general ability.",
        paper_ref="SHERPA, ICML 2026 abstract (up to +2.2% task performance, +11.1% generalisation retention)",
        metric="task Dice (held-out nuclei images), sherpa minus lora (same LoRA fine-tuning without guidance)",
        arms=ARMS + REFERENCE_ARMS, baseline="lora",
        comparator=Comparator("dice_gain_vs_lora", ">", 0.0, "sherpa's task Dice exceeds LoRA's (lower bound > 0)"),
        run=run_seed, prepare=prepare, tiers=TIERS, seeds={"smoke": 1, "quick": 5, "full": 5}, plot=_pareto,
        notes=_NOTES,
        checks=(
            MechanismCheck("guide_informative", ">", 0.0, "the fine-tuned small model beats the zero-shot large one "
                           "on the task (the guide knows something)"),
            MechanismCheck("frs_separates", ">=", 1.5, "FRS-selected channels have >= 1.5x the mean Fisher ratio"),
            MechanismCheck("pretrained_vs_disk_iou", ">=", 0.05, "the pretrained large model beats the prompt-"
                           "centred disk (radius 4) on the general suite by >= 0.05 IoU"),
            MechanismCheck("retention_gap_vs_lora", ">=", -0.02, "sherpa keeps general ability: retention at most "
                           "0.02 below lora's (seed mean)", reduce="mean"),
        ),
        null_value=0.0,
    ),
    ExperimentSpec(
        id="retention_vs_full_ft",
        room="sherpa",
        claim="SHERPA preserves the large SAM's general segmentation ability better than full fine-tuning "
              "(up to +11.1% generalisation retention) at comparable task performance.",
        paper_ref="SHERPA, ICML 2026 abstract",
        metric="general retention (suite IoU after / before), sherpa minus full fine-tuning",
        arms=ARMS + REFERENCE_ARMS, baseline="full_ft",
        comparator=Comparator("retention_gain_vs_full_ft", ">", 0.0, "sherpa's retention exceeds full "
                              "fine-tuning's (lower bound > 0)"),
        run=run_seed, prepare=prepare, tiers=TIERS, seeds={"smoke": 1, "quick": 5, "full": 5}, plot=_pareto,
        notes=_NOTES,
        checks=(
            MechanismCheck("guide_informative", ">", 0.0, "the fine-tuned small model beats the zero-shot large one "
                           "on the task"),
            MechanismCheck("pretrained_vs_disk_iou", ">=", 0.05, "the pretrained large model beats the prompt-"
                           "centred disk (radius 4) on the general suite by >= 0.05 IoU"),
            MechanismCheck("dice_gap_vs_full_ft", ">=", -0.05, "comparable task performance: sherpa's Dice at most "
                           "0.05 below full fine-tuning's (seed mean)", reduce="mean"),
        ),
        null_value=0.0,
    ),
]
