"""Janus-LoRA's claims at laptop scale: class-incremental digits, 5 tasks of 2 classes.

Protocol (identical for every arm):
1. Backbone: an MLP 64-128-128-64 pre-trained (Adam, seed 0) by *rotation prediction* on MNIST-5k images
   downsampled to 8x8; no digit label is ever used, so the backbone is task-agnostic. Frozen afterwards.
2. Continual phase on sklearn digits (per seed: a random 70/30 split and a random class order, 5 tasks x 2
   classes). LoRA r=4 on all three Linear layers, one adapter per task folded into the base at the boundary.
   Training loss: cross-entropy of a per-task cosine head over the task's 2 classes (+ DML for the DML arms).
   Evaluation: nearest-class-mean (cosine) over the prototypes of every class seen so far, each prototype stored
   when its task ended (exemplar-free; identical head for all arms).
3. One learning-rate grid for every arm; on a separate tuning seed each arm keeps the rate with the best ACC.
   Same steps, batch size and data order for every arm.
Metrics: ACC (final average task accuracy), MAA (mean over the sequence of the average accuracy on seen tasks),
BWT (mean final-minus-just-learned accuracy of tasks 1..T-1), NV (mean over layers and tasks 2..T of
||dW_task V|| / ||dW_task||).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from ...core.adapters import AdapterConfig, inject_adapters
from ...core.logging import log_metrics
from ...core.progress import progress
from ...core.seeding import seed_everything
from ...harness.spec import Comparator, ExperimentSpec
from .config import ARMS, JanusLoRAConfig
from .trainer import JanusTrainer, PrototypeMemory, janus_make

TUNING_SEED = 10_000
BASELINES = ("lora", "lora_gpm", "inflora")


# -- data and backbone -----------------------------------------------------------------------------------------
def _backbone(hidden: int, feat: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, feat))


@functools.lru_cache(maxsize=2)
def _pretrained_state(hidden: int, feat: int, steps: int) -> dict:
    """Rotation prediction (0/90/180/270 degrees) on MNIST-5k pooled to 8x8 and scaled to digits' range."""
    from ...data.images import load_mnist5k

    X, _ = load_mnist5k()  # labels deliberately unused
    imgs = nn.functional.adaptive_avg_pool2d(torch.as_tensor(X).reshape(-1, 1, 28, 28), 8)[:, 0]
    imgs = imgs / imgs.amax(dim=(1, 2), keepdim=True).clamp_min(1e-6)
    seed_everything(0)
    net, rot_head = _backbone(hidden, feat), nn.Linear(feat, 4)
    opt = torch.optim.Adam([*net.parameters(), *rot_head.parameters()], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in progress(range(steps), desc="pretraining MLP by rotation prediction"):
        idx = torch.randint(0, len(imgs), (128,), generator=gen)
        k = torch.randint(0, 4, (128,), generator=gen)
        x = torch.stack([torch.rot90(img, int(r), dims=(0, 1)) for img, r in zip(imgs[idx], k)]).reshape(128, 64)
        loss = nn.functional.cross_entropy(rot_head(net(x)), k)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _tasks(config: Mapping[str, Any], seed: int) -> list[dict]:
    from ...data.images import load_digits_dataset

    X, y = load_digits_dataset()
    X, y = torch.as_tensor(X), torch.as_tensor(y)
    rng = np.random.default_rng(seed)
    order = rng.permutation(10)
    perm = torch.as_tensor(rng.permutation(len(X)))
    n_test = int(round(config["test_fraction"] * len(X)))
    test, train = perm[:n_test], perm[n_test:]
    tasks = []
    for t in range(config["n_tasks"]):
        classes = [int(c) for c in order[t * config["classes_per_task"]:(t + 1) * config["classes_per_task"]]]
        pick = lambda idx: idx[torch.isin(y[idx], torch.tensor(classes))]
        tr, te = pick(train), pick(test)
        tasks.append({"classes": classes, "Xtr": X[tr], "ytr": y[tr], "Xte": X[te], "yte": y[te]})
    return tasks


# -- one arm ---------------------------------------------------------------------------------------------------
def train_arm(arm: str, config: Mapping[str, Any], seed: int, lr: float) -> dict:
    torch.set_num_threads(1)
    tasks = _tasks(config, seed)
    model = _backbone(config["hidden"], config["feat"])
    model.load_state_dict(_pretrained_state(config["hidden"], config["feat"], config["pretrain_steps"]))
    seed_everything(seed)
    inject_adapters(model, AdapterConfig(r=config["r"], alpha=config["alpha"], target_modules=["0", "2", "4"]),
                    janus_make())
    cfg = JanusLoRAConfig(**{**ARMS[arm], "lr": lr, "margin": config["margin"],
                             "energy_threshold": config["energy_threshold"], "subspace": config["subspace"]})
    head = nn.Parameter(torch.zeros(config["classes_per_task"], config["feat"]))
    trainer = JanusTrainer(model, cfg, extra_params=[head])
    memory = PrototypeMemory()
    batch_gen = torch.Generator().manual_seed(seed + 1)
    acc = np.full((len(tasks), len(tasks)), np.nan)
    start = time.perf_counter()
    for t, task in enumerate(tasks):
        trainer.begin_task()
        with torch.no_grad():
            head.copy_(0.01 * torch.randn(head.shape, generator=batch_gen))
        local = {c: i for i, c in enumerate(task["classes"])}
        ytr_local = torch.tensor([local[int(c)] for c in task["ytr"]])
        for _ in range(config["steps_per_task"]):
            idx = torch.randint(0, len(task["Xtr"]), (config["batch_size"],), generator=batch_gen)
            f = model(task["Xtr"][idx])
            logits = config["temperature"] * nn.functional.normalize(f, dim=-1) @ \
                nn.functional.normalize(head, dim=-1).T
            loss = nn.functional.cross_entropy(logits, ytr_local[idx]) + trainer.dml_loss(f, memory)
            trainer.step(loss)
        trainer.end_task(data=lambda: [task["Xtr"]])
        with torch.no_grad():
            memory.add(model(task["Xtr"]), task["ytr"])
            for j in range(t + 1):
                pred = memory.predict(model(tasks[j]["Xte"]))
                acc[t, j] = float((pred == tasks[j]["yte"]).float().mean())
        log_metrics(t + 1, arm=arm, seed=seed, lr=lr, avg_acc=float(np.nanmean(acc[t, :t + 1])))
    T = len(tasks)
    seen = [float(np.mean(acc[t, :t + 1])) for t in range(T)]
    nv = [v for task_nv in trainer.nv_history[1:] for v in task_nv.values()]
    return {"acc": seen[-1], "maa": float(np.mean(seen)),
            "bwt": float(np.mean([acc[T - 1, j] - acc[j, j] for j in range(T - 1)])),
            "nv": float(np.mean(nv)) if nv else math.nan,
            "wall_s": time.perf_counter() - start, "lr": lr,
            "curve": [[t + 1, seen[t]] for t in range(T)]}


def tune_learning_rates(config: Mapping[str, Any]) -> dict:
    """Every arm gets the same grid and budget on the tuning seed; keep the rate with the highest ACC."""
    scores: dict[str, dict[str, float]] = {}
    for arm, lr in progress([(a, lr) for a in config["arms"] for lr in config["lr_grid"]], desc="lr grid"):
        scores.setdefault(arm, {})[repr(lr)] = train_arm(arm, config, TUNING_SEED, lr)["acc"]
    chosen = {arm: float(max(t, key=lambda k: t[k])) for arm, t in scores.items()}
    edge = [a for a, lr in chosen.items() if len(config["lr_grid"]) > 2 and lr in (config["lr_grid"][0],
                                                                                   config["lr_grid"][-1])]
    return {"lr": chosen, "grid_scores": scores, "tuning_seed": TUNING_SEED, "lr_on_grid_edge": edge}


def run_seed(config: Mapping[str, Any], seed: int, prepared: Mapping[str, Any]) -> dict:
    runs = {arm: train_arm(arm, config, seed, prepared["lr"][arm]) for arm in config["arms"]}
    arms = {a: {k: v for k, v in r.items() if k != "curve"} for a, r in runs.items()}
    stats: dict[str, float] = {}
    if "janus" in runs:
        stats["acc_gain"] = runs["janus"]["acc"] - max(runs[b]["acc"] for b in BASELINES if b in runs)
        stats["maa_gain"] = runs["janus"]["maa"] - max(runs[b]["maa"] for b in BASELINES if b in runs)
    if "gr_only" in runs and "lora_gpm" in runs:
        stats["bwt_gain_gr_over_gpm"] = runs["gr_only"]["bwt"] - runs["lora_gpm"]["bwt"]
        stats["acc_gain_gr_over_gpm"] = runs["gr_only"]["acc"] - runs["lora_gpm"]["acc"]
        stats["nv_gpm_minus_gr"] = runs["lora_gpm"]["nv"] - runs["gr_only"]["nv"]
    return {"arms": arms, "statistics": stats, "curves": {a: r["curve"] for a, r in runs.items()}}


def plot_curves(result: dict, ax) -> None:
    """Average accuracy on the seen tasks after each task, mean over seeds."""
    from ...harness.plots import plot_mean_curves

    plot_mean_curves(result, ax, xlabel="tasks learned", ylabel="avg accuracy on seen classes (NCM)")


def _cfg(**kw: Any) -> dict:
    base = {"n_tasks": 5, "classes_per_task": 2, "test_fraction": 0.3, "hidden": 128, "feat": 64,
            "pretrain_steps": 1500, "r": 4, "alpha": 8.0, "batch_size": 32, "steps_per_task": 100,
            "temperature": 10.0, "margin": 0.1, "energy_threshold": 0.97, "subspace": "online",
            "lr_grid": [0.003, 0.01, 0.03, 0.1, 0.3], "arms": list(ARMS)}
    unknown = set(kw) - set(base)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    return {**base, **kw}


SPECS = [
    ExperimentSpec(
        id="cil_digits", room="janus_lora",
        claim="Janus-LoRA (GR + OE + DML) reaches a higher final accuracy than LoRA-based continual baselines "
              "(sequential LoRA, LoRA-GPM, InfLoRA)",
        paper_ref="arXiv 2605.28495, abstract; ImageNet-R/CIFAR-100 tables (project page)",
        metric="ACC: final average task accuracy, class-incremental digits (5 x 2 classes), NCM over stored prototypes",
        arms=tuple(ARMS), baseline="inflora",
        comparator=Comparator("acc_gain", ">=", 0.0,
                              "ACC(janus) - max(ACC(lora), ACC(lora_gpm), ACC(inflora)) >= 0 per seed"),
        run=run_seed, prepare=tune_learning_rates, plot=plot_curves,
        tiers={"smoke": _cfg(pretrain_steps=30, steps_per_task=5, lr_grid=[0.1],
                             arms=["janus", "lora", "lora_gpm", "inflora"]),
               "quick": _cfg(),
               "full": _cfg(steps_per_task=300, lr_grid=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0])},
        seeds={"smoke": 1, "quick": 3, "full": 10},
        notes="MLP on 8x8 digits pre-trained by rotation prediction instead of a ViT on ImageNet-R; one adapter per "
              "task folded into the base; NCM evaluation for every arm. All non-LoRA details are reconstructed.",
    ),
    ExperimentSpec(
        id="gr_plugin", room="janus_lora",
        claim="Gradient Rectification plugged into LoRA-GPM removes the null-space violation of the composite update "
              "and improves backward transfer (+6.93 BWT on ImageNet-R)",
        paper_ref="arXiv 2605.28495, GR plug-in table (project page: +2.25 ACC, +6.93 BWT)",
        metric="BWT of GR (A in the complement of V + rectified steps) minus BWT of LoRA-GPM; NV of both",
        arms=("gr_only", "lora_gpm", "lora"), baseline="lora_gpm",
        comparator=Comparator("bwt_gain_gr_over_gpm", ">", 0.0, "BWT(gr_only) - BWT(lora_gpm) > 0 per seed"),
        run=run_seed, prepare=tune_learning_rates, plot=plot_curves,
        tiers={"smoke": _cfg(pretrain_steps=30, steps_per_task=5, lr_grid=[0.1], arms=["gr_only", "lora_gpm"]),
               "quick": _cfg(arms=["gr_only", "lora_gpm", "lora"]),
               "full": _cfg(steps_per_task=300, arms=["gr_only", "lora_gpm", "lora"],
                            lr_grid=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0])},
        seeds={"smoke": 1, "quick": 3, "full": 10},
        notes="Same protocol as cil_digits; no DML in either arm.",
    ),
]
