"""SHERPA's claims at laptop scale: guidance from a small fine-tuned segmenter, restricted by Fisher Ratio Separation
to task-relevant channels, (1) improves the large model's specialised-task Dice over the same LoRA fine-tuning
without guidance, and (2) keeps more of its general segmentation ability than full fine-tuning.

Protocol v2 (pre-registered in README.md; per seed new task and suite data; the pretrained checkpoints are shared):
1. Pretrained small (d 32, 2 blocks) and large (d 64, 4 blocks) segmenters from ``pretrain.py`` (committed weights,
   v2 recipe: the mixture of all general variants).
2. Task: ``n_train`` nuclei-like images with one prompted nucleus each; validation and test ``n_test`` each; general
   suite: 5 variants (base, clutter, lowlight, small, textured) x ``n_suite`` held-out images; the real stardist
   image (122 nuclei windows) as a held-out check when stardist is installed (recorded, not judged).
3. The small model is fully fine-tuned on the task (``steps``, lr ``small_lr``; its cost is reported, not an arm).
4. Arms, each ``steps`` AdamW steps at batch ``batch`` on the same task data (``config["arms"]``):
   sherpa (LoRA + guidance on FRS channels), kd_full (LoRA + guidance on all channels), lora, full_ft; full tier
   adds decoder_only, l2sp (full fine-tuning + L2-SP), kd_random (LoRA + guidance on random channels of FRS's size)
   and self_guide (LoRA + guidance from the large model's own LoRA-fine-tuned copy on FRS channels).
5. Tuning (tuning seed 1000, validation Dice of the task), three points per arm, extended at an edge: lora,
   full_ft and decoder_only tune the learning rate (LogGrid x3 around their natural scales); the guided arms tune
   lambda_g (LogGrid x3 around 0.3, hard floor 0.03) at lora's chosen rate; l2sp tunes lambda_sp (LogGrid x10
   around 1e-3) at full_ft's chosen rate.
6. Metrics: task Dice on the test set; general retention = mean over variants of suite IoU after / before.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
import torch

from ...core.assets import MissingAssetError
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import LogGrid, tune_per_arm
from .config import SherpaConfig
from .data import GENERAL_VARIANTS, Batch, general_batch, nuclei_batch, stardist_batch
from .method import finetune, frs_channels
from .model import PromptableSegmenter, dice_iou
from .pretrain import pretrained

CLAIM_ARMS = ("sherpa", "kd_full", "lora", "full_ft")
EXTRA_ARMS = ("decoder_only", "l2sp", "kd_random", "self_guide")
ARMS = CLAIM_ARMS + EXTRA_ARMS
GUIDED = ("sherpa", "kd_full", "kd_random", "self_guide")
LR_ARMS = ("lora", "full_ft", "decoder_only")
# Reference points reported beside the trained arms, not trained under the tuning budget: the large model before
# fine-tuning and the small model fine-tuned on the task (the guide).
REFERENCE_ARMS = ("large_zero_shot", "small_ft")
TUNING_SEED = 1000
LAMBDA_FLOOR = 0.03  # below it the guidance KL is under ~1% of the segmentation loss: the arm is plain LoRA
_CACHE: dict[str, Any] = {}


@torch.no_grad()
def predict(model: PromptableSegmenter, data: Batch, chunk: int = 128) -> torch.Tensor:
    model.eval()
    return torch.cat([model(data.image[i:i + chunk], data.point[i:i + chunk]) for i in range(0, len(data), chunk)])


def evaluate(model: PromptableSegmenter, data: Batch, chunk: int = 128) -> tuple[float, float]:
    """(mean Dice, mean IoU) of the model's thresholded masks on ``data``."""
    return dice_iou(predict(model, data, chunk), data.mask)


def disk_iou(data: Batch, radius: float = 4.0) -> float:
    """IoU of the trivial prompt-centred disk (radius 4 px): the floor a segmenter has to beat."""
    yy, xx = torch.meshgrid(torch.arange(data.mask.shape[1]), torch.arange(data.mask.shape[2]), indexing="ij")
    disk = ((yy - data.point[:, 0, None, None]) ** 2 + (xx - data.point[:, 1, None, None]) ** 2) <= radius ** 2
    return dice_iou(disk.float() * 2 - 1, data.mask)[1]


def suite_iou(model: PromptableSegmenter, suite: dict[str, Batch]) -> dict[str, float]:
    return {v: evaluate(model, b)[1] for v, b in suite.items()}


def _stardist() -> Batch | None:
    if "stardist" not in _CACHE:
        try:
            _CACHE["stardist"] = stardist_batch()
        except MissingAssetError:
            _CACHE["stardist"] = None
    return _CACHE["stardist"]


def _data(config: Mapping[str, Any], seed: int) -> dict:
    return {"train": nuclei_batch(config["n_train"], seed * 10 + 1), "val": nuclei_batch(config["n_test"], seed * 10 + 2),
            "test": nuclei_batch(config["n_test"], seed * 10 + 3),
            "suite": {v: general_batch(config["n_suite"], seed * 10 + 4 + i, v) for i, v in enumerate(GENERAL_VARIANTS)}}


def _models(config: Mapping[str, Any]):
    over = {"steps": config["pretrain_steps"]} if config.get("pretrain_steps") else {}
    return pretrained("small", **over), pretrained("large", **over)


def _arm_cfg(arm: str, config: Mapping[str, Any], value: float) -> SherpaConfig:
    """``value`` is the arm's tuned weight: lambda_g for the guided arms, lambda_sp for l2sp, unused otherwise."""
    m = config["m_samples"]
    if arm in ("sherpa", "self_guide"):
        return SherpaConfig(lambda_g=value, k_frac=config["k_frac"], m_samples=m,
                            frs_features=config.get("frs_features", "qk"), update=config.get("sherpa_update", "lora"))
    if arm == "kd_random":
        return SherpaConfig(lambda_g=value, k_frac=config["k_frac"], m_samples=m, frs_features="random")
    if arm == "kd_full":
        return SherpaConfig(lambda_g=value, k_frac=1.0, m_samples=m)
    if arm == "l2sp":
        return SherpaConfig(lambda_g=0.0, lambda_sp=value, update="full")
    return SherpaConfig(lambda_g=0.0, update={"full_ft": "full", "decoder_only": "decoder"}.get(arm, "lora"))


def _run_arm(arm, large, guides, data, config, lr, value, seed):
    """Fine-tune the large model as ``arm``; ``guides`` maps 'small' (fine-tuned small model) and, for self_guide,
    'self' (the large model's own LoRA-fine-tuned copy)."""
    cfg = _arm_cfg(arm, config, value)
    channels = frs_channels(large, data["train"], cfg, seed=seed)[0] if arm in GUIDED and arm != "kd_full" else None
    guide = guides.get("self" if arm == "self_guide" else "small") if cfg.lambda_g > 0 else None
    return finetune(large, data["train"], steps=config["steps"], batch=config["batch"], lr=lr, seed=seed, cfg=cfg,
                    guide=guide, channels=channels, desc=f"sherpa arm {arm}")


def _small_ft(small, data, config, seed):
    return finetune(small, data["train"], steps=config["steps"], batch=config["batch"], lr=config["small_lr"],
                    seed=seed, cfg=SherpaConfig(lambda_g=0.0, update="full"), desc="small fine-tune")


def _self_guide(large, data, config, lora_lr, seed):
    return _run_arm("lora", large, {}, data, config, lora_lr, 0.0, seed)


def prepare(config: Mapping[str, Any]) -> dict:
    key = "prepare:" + json.dumps(config, sort_keys=True)
    if key in _CACHE:
        return _CACHE[key]
    torch.set_num_threads(1)
    arms = config["arms"]
    small, large = _models(config)
    data = _data(config, TUNING_SEED)
    guides = {"small": _small_ft(small, data, config, TUNING_SEED)}

    def score(arm, lr, value, seed):
        return evaluate(_run_arm(arm, large, guides, data, config, lr, value, seed), data["val"])[0]

    lr_arms = [a for a in LR_ARMS if a in arms or (a == "lora" and set(GUIDED) & set(arms))
               or (a == "full_ft" and "l2sp" in arms)]
    lr_t = tune_per_arm({a: LogGrid(center=config["lr_centres"][a], factor=3, size=3) for a in lr_arms},
                        lambda arm, lr, seed: score(arm, lr, 0.0, seed), mode="max", desc="sherpa lr")
    chosen = lr_t["chosen"]
    if "self_guide" in arms:
        guides["self"] = _self_guide(large, data, config, chosen["lora"], TUNING_SEED)
    grids = {a: LogGrid(center=config["lambda_centre"], factor=3, size=3, lower=LAMBDA_FLOOR)
             for a in GUIDED if a in arms}
    if "l2sp" in arms:
        grids["l2sp"] = LogGrid(center=config["lambda_sp_centre"], factor=10, size=3)
    lam_t = tune_per_arm(grids, lambda arm, v, seed: score(arm, chosen["full_ft" if arm == "l2sp" else "lora"], v,
                                                            seed), mode="max", desc="sherpa weights")
    out = {"tuning": {"lr": lr_t, "weight": lam_t}}
    _CACHE[key] = out
    return out


def _choices(prepared, config) -> dict[str, tuple[float, float]]:
    """arm -> (learning rate, tuned weight)."""
    if not prepared:
        lr = config["lr_centres"]
        return {a: (lr.get(a, lr["full_ft" if a == "l2sp" else "lora"]),
                    config["lambda_sp_centre"] if a == "l2sp" else config["lambda_centre"]) for a in ARMS}
    lr, w = prepared["tuning"]["lr"]["chosen"], prepared["tuning"]["weight"]["chosen"]
    out = {a: (lr[a], 0.0) for a in lr}
    for a, v in w.items():
        out[a] = (lr["full_ft" if a == "l2sp" else "lora"], v)
    return out


def _pack_image(img: torch.Tensor) -> str:
    """(S, S) image -> hex string of uint8 after min-max scaling (compact JSON for the example figure)."""
    a = img.float()
    a = ((a - a.min()) / (a.max() - a.min() + 1e-6) * 255).round().to(torch.uint8)
    return bytes(a.flatten().tolist()).hex()


def _pack_mask(mask: torch.Tensor) -> str:
    return "".join("1" if v else "0" for v in (mask > 0).flatten().tolist())


def _examples(data: dict, models: dict[str, PromptableSegmenter], n: int = 3) -> dict:
    """n task and n general ('base') test images with ground truth and every model's predicted mask."""
    rows = []
    for name, b in (("task", data["test"].subset(slice(0, n))), ("general", data["suite"]["base"].subset(slice(0, n)))):
        preds = {m: predict(model, b) for m, model in models.items()}
        for i in range(len(b)):
            rows.append({"set": name, "image": _pack_image(b.image[i, 0]), "mask": _pack_mask(b.mask[i]),
                         "point": b.point[i].tolist(), "pred": {m: _pack_mask(p[i] > 0) for m, p in preds.items()}})
    return {"size": int(data["test"].mask.shape[-1]), "rows": rows}


def run_seed(config: Mapping[str, Any], seed: int, prepared: Any = None) -> dict:
    key = f"run:{seed}:" + json.dumps(config, sort_keys=True) + json.dumps(prepared, sort_keys=True, default=str)
    if key in _CACHE:
        return _CACHE[key]
    torch.set_num_threads(1)
    small, large = _models(config)
    data = _data(config, seed)
    real = _stardist() if config.get("stardist", True) else None
    before = suite_iou(large, data["suite"])
    zero_dice = evaluate(large, data["test"])[0]
    guides = {"small": _small_ft(small, data, config, seed)}
    small_dice = evaluate(guides["small"], data["test"])[0]
    choices = _choices(prepared, config)
    arms, models = {}, {"large_zero_shot": large, "small_ft": guides["small"]}
    order = sorted(config["arms"], key=lambda a: a != "lora")  # lora first: self_guide's guide is its model
    for arm in order:
        lr, value = choices[arm]
        if arm == "self_guide":
            guides["self"] = models.get("lora") or _self_guide(large, data, config, choices["lora"][0], seed)
        model = _run_arm(arm, large, guides, data, config, lr, value, seed)
        models[arm] = model
        dice, iou = evaluate(model, data["test"])
        after = suite_iou(model, data["suite"])
        arms[arm] = {"task_dice": dice, "task_iou": iou, "general_iou": float(np.mean(list(after.values()))),
                     "retention": float(np.mean([after[v] / max(before[v], 1e-6) for v in after])), "lr": lr,
                     "weight": value, **{f"iou_{v}": after[v] for v in after}}
        if real is not None:
            arms[arm]["stardist_dice"] = evaluate(model, real)[0]
    arms["large_zero_shot"] = {"task_dice": zero_dice, "general_iou": float(np.mean(list(before.values()))),
                               "retention": 1.0, **{f"iou_{v}": before[v] for v in before}}
    arms["small_ft"] = {"task_dice": small_dice}
    if real is not None:
        arms["large_zero_shot"]["stardist_dice"] = evaluate(large, real)[0]
        arms["small_ft"]["stardist_dice"] = evaluate(guides["small"], real)[0]
    U, scores = frs_channels(large, data["train"], _arm_cfg("sherpa", config, 0.1), seed=seed)
    stats = {}
    pairs = {"lora": "vs_lora", "full_ft": "vs_full_ft", "kd_full": "vs_kd_full", "kd_random": "vs_kd_random",
             "self_guide": "vs_self_guide", "l2sp": "vs_l2sp", "decoder_only": "vs_decoder_only"}
    if "sherpa" in arms:
        for other, tag in pairs.items():
            if other in arms:
                stats[f"dice_gain_{tag}"] = arms["sherpa"]["task_dice"] - arms[other]["task_dice"]
                stats[f"retention_gain_{tag}"] = arms["sherpa"]["retention"] - arms[other]["retention"]
        stats["dice_gain_vs_lora"] = stats.get("dice_gain_vs_lora", float("nan"))
        stats["retention_gap_vs_lora"] = stats.get("retention_gain_vs_lora", float("nan"))
        stats["dice_gap_vs_full_ft"] = stats.get("dice_gain_vs_full_ft", float("nan"))
    suite_disk = float(np.mean([disk_iou(b) for b in data["suite"].values()]))
    checks = {
        "guide_informative": small_dice - zero_dice,
        "frs_separates": float(scores[U].mean() / scores.mean()),
        "pretrained_vs_disk_iou": float(np.mean(list(before.values()))) - suite_disk,
        "retention_gap_vs_lora": stats.get("retention_gap_vs_lora", float("nan")),
        "dice_gap_vs_full_ft": stats.get("dice_gap_vs_full_ft", float("nan")),
        "suite_disk_iou": suite_disk,
    }
    out = {"arms": arms, "statistics": stats, "checks": checks}
    if seed == 0 and config.get("examples", True):
        out["examples"] = _examples(data, {m: models[m] for m in ["large_zero_shot", "small_ft", *order]})
    _CACHE[key] = out
    return out


def _pareto(result: dict, ax) -> None:
    """Task Dice against general retention, per seed (faint) and mean (square), for every trained arm."""
    for arm in [a for a in result.get("arms_order", ARMS + REFERENCE_ARMS) if a in result["arms"]]:
        m = result["arms"].get(arm)
        if not m or "retention" not in m:
            continue
        dots = ax.scatter(m["retention"]["per_seed"], m["task_dice"]["per_seed"], alpha=0.35, s=12)
        ax.scatter([m["retention"]["mean"]], [m["task_dice"]["mean"]], marker="s", color=dots.get_facecolor()[0],
                   label=arm)
    ax.set_xlabel("general retention (suite IoU after / before)")
    ax.set_ylabel("task Dice (nuclei)")
    ax.legend(fontsize=7)


def _example_figure(result: dict, ax) -> None:
    """Seed 0's example segmentations: the image with its prompt, then each model's mask against the ground truth
    (yellow: correct foreground, red: false positive, green: missed)."""
    ex = next((r["examples"] for r in result.get("seed_results", []) if "examples" in r), None)
    if ex is None:
        ax.text(0.5, 0.5, "no examples recorded", ha="center")
        return
    S = ex["size"]
    models = list(ex["rows"][0]["pred"])
    tiles = []
    for row in ex["rows"]:
        img = np.frombuffer(bytes.fromhex(row["image"]), np.uint8).reshape(S, S) / 255.0
        gt = np.array([c == "1" for c in row["mask"]]).reshape(S, S)
        first = np.stack([img] * 3, -1)
        r, c = (int(v) for v in row["point"])
        first[r, c] = (0.0, 0.6, 1.0)
        line = [first]
        for m in models:
            pred = np.array([c == "1" for c in row["pred"][m]]).reshape(S, S)
            line.append(np.stack([pred, gt, np.zeros_like(gt)], -1).astype(float))
        tiles.append(np.concatenate([np.pad(t, ((1, 1), (1, 1), (0, 0)), constant_values=1.0) for t in line], 1))
    ax.imshow(np.concatenate(tiles, 0), interpolation="nearest")
    ax.set_xticks([(S + 2) * (i + 0.5) for i in range(len(models) + 1)])
    ax.set_xticklabels(["image"] + models, rotation=30, fontsize=6)
    ax.set_yticks([(S + 2) * (i + 0.5) for i in range(len(ex["rows"]))])
    ax.set_yticklabels([row["set"] for row in ex["rows"]], fontsize=6)


_COMMON = {"pretrain_steps": None, "k_frac": 0.25, "m_samples": 64, "small_lr": 1e-3, "lambda_centre": 0.3,
           "lambda_sp_centre": 1e-3, "lr_centres": {"lora": 1e-2, "full_ft": 1e-3, "decoder_only": 3e-3},
           "stardist": True, "examples": True}
TIERS = {
    "smoke": {**_COMMON, "pretrain_steps": 20, "n_train": 16, "n_test": 16, "n_suite": 8, "steps": 2, "batch": 4,
              "m_samples": 8, "arms": list(CLAIM_ARMS), "stardist": False},
    "quick": {**_COMMON, "n_train": 256, "n_test": 128, "n_suite": 64, "steps": 100, "batch": 16,
              "arms": list(CLAIM_ARMS)},
    "full": {**_COMMON, "n_train": 512, "n_test": 256, "n_suite": 128, "steps": 300, "batch": 16, "arms": list(ARMS)},
}
SEEDS = {"smoke": 1, "quick": 3, "full": 5}
_NOTES = ("Segmenters in SAM's shape trained from scratch here (32x32 grayscale, patch 4, d 32/64, 2/4 blocks) on "
          "generated shapes (protocol v2: pretrained on the mixture of the suite's variants); nuclei-like generated "
          "task; the real stardist image is a recorded held-out check. FRS/GFE/loss are reconstructions (no code, "
          "no full paper).")
_STANDIN = MechanismCheck("pretrained_vs_disk_iou", ">=", 0.05, "the pretrained large model beats the prompt-centred "
                          "disk (radius 4) on the general suite by >= 0.05 IoU")
_GUIDE = MechanismCheck("guide_informative", ">", 0.0, "the fine-tuned small model beats the zero-shot large one on "
                        "the task (the guide knows something)")

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
        run=run_seed, prepare=prepare, tiers=TIERS, seeds=SEEDS, plot=_pareto,
        notes=_NOTES,
        checks=(
            _GUIDE,
            MechanismCheck("frs_separates", ">=", 1.5, "FRS-selected channels have >= 1.5x the mean Fisher ratio"),
            _STANDIN,
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
        run=run_seed, prepare=prepare, tiers=TIERS, seeds=SEEDS, plot=_example_figure,
        notes=_NOTES,
        checks=(
            _GUIDE,
            _STANDIN,
            MechanismCheck("dice_gap_vs_full_ft", ">=", -0.05, "comparable task performance: sherpa's Dice at most "
                           "0.05 below full fine-tuning's (seed mean)", reduce="mean"),
        ),
        null_value=0.0,
    ),
]
