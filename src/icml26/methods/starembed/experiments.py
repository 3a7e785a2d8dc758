"""StarEmbed's headline comparison at laptop scale: a zero-shot generic TSFM vs hand-crafted features.

Protocol (identical for every arm, one seed = one freshly simulated benchmark + probe/cluster/forest seeds):
1. Benchmark: semi-synthetic OGLE-III light curves (data.py), 7 ID classes + 3 OOD classes, stratified 70/10/20
   split with seed 42; the stars, epochs and noise are drawn from the run seed.
2. Arms: "handcrafted" (the paper's domain baseline, 24 period/Fourier/statistics features), "tsfm" (a tiny
   Chronos-style encoder pretrained once, seed 0, on KernelSynth GPs, zero-shot, StarEmbed recipe), "random".
3. Tasks: RF (200 trees, depth 20: the paper's HPO best for hand-crafted, fixed for all arms, no tuning), kNN (5),
   balanced logistic; KMeans (k=7) ARI/NMI/Hungarian-F1 on test; per-class IsolationForest AUROC for OOD.
Pre-registered statistics (paired per seed, method minus baseline; protocol v2, issue 8): RF macro-F1 gap
(handcrafted - tsfm) > 0; KMeans ARI gap (tsfm - handcrafted) > 0; OOD AUROC gap (tsfm - handcrafted) > 0, each
judged by the harness's one-sided 90% Student t bound over 5 seeds.

Mechanism checks (v2): the claims are about Chronos-class TSFMs on observed light curves, neither of which is
available offline. A verdict is only given when the TSFM arm is a competent model (OOD AUROC at least 0.10 above
chance, RF macro-F1 at least 0.30 above the random-embedding arm) and, for classification, when the light curves are
observed rather than simulated from the catalogue features that define the hand-crafted arm. With the in-room stand-in
and the simulator these checks fail, so every spec is inconclusive: "not testable here".

``config["null"] = True`` swaps the tsfm arm for the hand-crafted embedder (the method switched back to the baseline):
every statistic is then exactly 0, and the tests show that no comparator accepts it.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Mapping

import numpy as np

from ...core.progress import progress
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from .benchmark import evaluate
from .config import StarEmbedConfig
from .data import build_dataset
from .features import HandCraftedEmbedder
from .tsfm import RandomEmbedder, TSFMEmbedder

ROOM = "starembed"
ARMS = ("tsfm", "handcrafted", "random")
_CFG_KEYS = ("n_stars", "n_ood", "max_points", "rf_trees", "iforest_trees", "context")


@functools.lru_cache(maxsize=8)
def _benchmark(config_json: str, seed: int) -> dict:
    """All arms on one seed's benchmark; cached so the three specs share one computation per (config, seed)."""
    import torch

    torch.set_num_threads(1)
    config = json.loads(config_json)
    cfg = StarEmbedConfig(**{k: config[k] for k in _CFG_KEYS})
    data = build_dataset(cfg, seed)
    tsfm = (HandCraftedEmbedder() if config.get("null") else
            TSFMEmbedder(cfg.context, config["pretrain_steps"], config["pretrain_series"]))
    embedders = {"tsfm": tsfm,
                 "handcrafted": HandCraftedEmbedder(),
                 "random": RandomEmbedder(seed=seed)}
    arms = {}
    for name in progress(ARMS, desc=f"starembed seed {seed}"):
        start = time.perf_counter()
        arms[name] = {**evaluate(embedders[name], data, cfg, seed), "seconds": time.perf_counter() - start}
    # The benchmark is simulated from OGLE-III catalogue rows (periods, amplitudes, Fourier parameters): the very
    # quantities the hand-crafted features estimate. No observed light curves are offline (offline-assets.md).
    return {"arms": arms, "hash": data.content_hash(), "observed_light_curves": 0.0}


def _run(statistic: str):
    def run(config: Mapping[str, Any], seed: int, prepared: Any) -> dict:
        out = _benchmark(json.dumps(dict(config), sort_keys=True), seed)
        arms, hc, fm = out["arms"], out["arms"]["handcrafted"], out["arms"]["tsfm"]
        stats = {"rf_f1_gap": hc["rf_macro_f1"] - fm["rf_macro_f1"],
                 "ari_gap": fm["kmeans_ari"] - hc["kmeans_ari"],
                 "auroc_gap": fm["ood_auroc"] - hc["ood_auroc"]}
        checks = {"tsfm_auroc_over_chance": fm["ood_auroc"] - 0.5,
                  "tsfm_f1_over_random": fm["rf_macro_f1"] - arms["random"]["rf_macro_f1"],
                  "observed_light_curves": out["observed_light_curves"]}
        return {"arms": arms, "statistics": {statistic: stats[statistic]}, "curves": {"dataset_hash": out["hash"]},
                "checks": checks}
    return run


def _plot(metric: str):
    def plot(result: dict, ax) -> None:
        for i, arm in enumerate(result["arms_order"]):
            vals = result["arms"][arm][metric]["per_seed"]
            ax.bar(i, np.mean(vals), color="C%d" % i, alpha=0.6)
            ax.scatter([i] * len(vals), vals, color="k", s=10)
        ax.set_xticks(range(len(result["arms_order"])), result["arms_order"])
        ax.set_ylabel(metric)
    return plot


TIERS = {
    "smoke": {"n_stars": 70, "n_ood": 15, "max_points": 60, "rf_trees": 20, "iforest_trees": 20, "context": 200,
              "pretrain_steps": 3,
              "pretrain_series": 16},
    "quick": {"n_stars": 600, "n_ood": 90, "max_points": 250, "rf_trees": 200, "iforest_trees": 200, "context": 200,
              "pretrain_steps": 200,
              "pretrain_series": 512},
    "full": {"n_stars": 4000, "n_ood": 450, "max_points": 250, "rf_trees": 200, "iforest_trees": 200, "context": 200,
             "pretrain_steps": 1500,
             "pretrain_series": 2048},
}
SEEDS = {"smoke": 1, "quick": 5, "full": 5}
# A competent TSFM: the bars are far below what the paper reports for Chronos-T5-tiny (RF macro-F1 0.640 against
# 0.807 hand-crafted; a 7-class random embedding scores ~0.08), so a Chronos-class model would pass them easily.
_TSFM_CHECKS = (
    MechanismCheck("tsfm_auroc_over_chance", ">=", 0.10,
                   "the TSFM arm's OOD AUROC is at least 0.10 above chance (0.5): a stand-in near chance says nothing "
                   "about Chronos"),
    MechanismCheck("tsfm_f1_over_random", ">=", 0.30,
                   "the TSFM arm's RF macro-F1 is at least 0.30 above the random-embedding arm's"),
)
_DATA_CHECK = MechanismCheck(
    "observed_light_curves", ">=", 1.0,
    "the light curves are observed (1), not simulated (0) from the catalogue periods and Fourier parameters that the "
    "hand-crafted features measure, which makes classification easy for them by construction")
_NOTES = ("Semi-synthetic OGLE-III light curves (catalogue-driven shapes, simulated ZTF-like cadence and noise), one "
          "band; the TSFM is a tiny Chronos-style encoder pretrained in the room on KernelSynth GPs, not Chronos. "
          "NOT TESTABLE HERE: Chronos weights and observed ZTF light curves are not offline, so the mechanism checks "
          "(a competent TSFM; observed light curves for classification) make the verdict inconclusive rather than "
          "a verdict about the stand-in.")

SPECS = [
    ExperimentSpec(
        id="classification", room=ROOM,
        claim="No TSFM surpasses the long-established hand-crafted baseline in light-curve classification.",
        paper_ref="arXiv 2510.06200, abstract; repo RF results (hand-crafted macro-F1 0.807 vs Chronos-T5 0.640)",
        metric="test macro-F1 of a random forest (200 trees, depth 20) on each embedding",
        arms=ARMS, baseline="handcrafted",
        comparator=Comparator("rf_f1_gap", ">", 0.0, "RF macro-F1(handcrafted) - macro-F1(tsfm) > 0"),
        run=_run("rf_f1_gap"), tiers=TIERS, seeds=SEEDS, plot=_plot("rf_macro_f1"), notes=_NOTES,
        checks=(*_TSFM_CHECKS, _DATA_CHECK), null_value=0.0),
    ExperimentSpec(
        id="clustering", room=ROOM,
        claim="Chronos-family embeddings, pretrained on regularly sampled non-astronomical data, cluster light curves "
              "better than hand-crafted features.",
        paper_ref="arXiv 2510.06200, abstract; repo KMeans ARI (Chronos-T5 0.154 vs hand-crafted 0.065)",
        metric="adjusted Rand index of KMeans (k = 7) on the standardised test embeddings",
        arms=ARMS, baseline="handcrafted",
        comparator=Comparator("ari_gap", ">", 0.0, "KMeans ARI(tsfm) - ARI(handcrafted) > 0"),
        run=_run("ari_gap"), tiers=TIERS, seeds=SEEDS, plot=_plot("kmeans_ari"), notes=_NOTES,
        checks=_TSFM_CHECKS, null_value=0.0),
    ExperimentSpec(
        id="ood", room=ROOM,
        claim="Chronos-family embeddings give better out-of-distribution source detection than hand-crafted features.",
        paper_ref="arXiv 2510.06200, abstract (OOD); summary metric reconstructed as AUROC",
        metric="AUROC of OOD (DSCT, T2Cep, aCep) vs ID test curves, per-class IsolationForest max-normality score",
        arms=ARMS, baseline="handcrafted",
        comparator=Comparator("auroc_gap", ">", 0.0, "OOD AUROC(tsfm) - AUROC(handcrafted) > 0"),
        run=_run("auroc_gap"), tiers=TIERS, seeds=SEEDS, plot=_plot("ood_auroc"), notes=_NOTES,
        checks=_TSFM_CHECKS, null_value=0.0),
]
