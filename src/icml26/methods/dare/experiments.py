"""Laptop-scale check of DARE (arXiv 2511.03828) on the antmaze-like ``icml26/PointNavWall-v0``.

One seed: the host (TD3+BC at the quick tier; IQL or Cal-QL at the full tier) is pretrained offline on the
``medium`` nav dataset (made here, D4RL layout) and a behavior model is fitted on it; from that one pretrained
state every arm fine-tunes online for the same number of environment steps (UTD 1, mixing ratio 0.5), differing
only in which samples keep the host's offline constraint:

* ``dare``: by behavioral consistency (score -> posterior -> exchange), the method;
* ``origin``: offline-origin samples keep it, online ones not (the usual practice DARE argues against; baseline);
* ``keep_all``: every sample keeps it (the host continued; for the Cal-QL host this is CORL's Cal-QL recipe);
  ``drop_all``: nobody (TD3 / SAC-style online).

The constraint's strength (TD3+BC's alpha, IQL's beta, Cal-QL's online CQL weight) is what ``origin`` and
``keep_all`` are tuned over, around the host's CORL default; DARE is tuned over its reconstructed variants.

Statistic (pre-registered in the README): ``final_gain`` = normalised return of dare minus origin after the
online budget (mean of the last two evaluations, 20 episodes each), paired per seed.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import torch

from ...core.logging import log_metrics
from ...harness.run_store import run_ahead, stored_run
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import MAX_EXTENSIONS, ListGrid, LogGrid, tune_per_arm
from ...rl import NAV_ENV_ID, make_env
from ...rl.behavior import cached_dataset, generate
from ...rl.sac import cached_mujoco_dataset, random_dataset
from ...rl.buffers import OfflineBuffer
from ...rl.evaluation import evaluate_policy
from .config import DAREConfig, corl_defaults
from .hosts import make_agent
from .trainer import finetune

ARMS = ("dare", "origin", "keep_all", "drop_all")
CONSTRAINT = {"dare": "dare", "origin": "origin", "keep_all": "all", "drop_all": "none"}
DARE_VARIANTS = ("kl_mean/moments/threshold", "nll/moments/threshold", "kl_mean/moments/stochastic")
"""The reconstructed parts tuned as options (score / fit / exchange), 3 options = the baselines' grid size."""
STRENGTH = {"td3bc": "alpha", "iql": "iql_beta", "calql": "cql_alpha_online"}
"""Per host, the field that sets the offline constraint's strength (tuned for origin and keep_all)."""
_PRETRAINED: dict[str, dict] = {}


def _device() -> torch.device:
    return torch.empty(0).device  # the runner's default-device context, CPU otherwise


def base_config(config: Mapping[str, Any]) -> DAREConfig:
    host = config.get("host", "td3bc")
    return DAREConfig(**corl_defaults(host, antmaze=config.get("sparse", True)), hidden=config["hidden"],
                      layers=config["layers"], batch_size=config["batch_size"],
                      reward_scale=config.get("reward_scale", 1.0), reward_bias=config["reward_bias"],
                      bc_steps=config["bc_steps"], behavior=config.get("behavior", "gaussian"))


def arm_config(arm: str, value: Any, config: Mapping[str, Any]) -> DAREConfig:
    """The arm's config with its tuned value: DARE's variant string, the constraint strength (``STRENGTH``) for
    origin / keep_all, or the actor lr for drop_all."""
    cfg = replace(base_config(config), constraint=CONSTRAINT[arm])
    if arm == "dare":
        score, fit, exchange = value.split("/")
        return replace(cfg, score=score, fit=fit, exchange=exchange)
    if arm == "drop_all":
        return replace(cfg, actor_lr=float(value))
    return replace(cfg, **{STRENGTH[cfg.host]: float(value)})


def _env_id(config: Mapping[str, Any]) -> str:
    return config.get("env_id", NAV_ENV_ID)


def _dims(config: Mapping[str, Any]) -> tuple[int, int]:
    env = make_env(_env_id(config))
    return env.observation_space.shape[0], env.action_space.shape[0]


def dataset(config: Mapping[str, Any]) -> dict:
    """The offline dataset: the nav task's (generated here on a cache miss), or a MuJoCo one recorded from our SAC
    (``python -m icml26.rl.sac``; a clear error with the commands when it is missing)."""
    if _env_id(config) != NAV_ENV_ID and config.get("smoke_random_data"):
        return random_dataset(_env_id(config), config["transitions"], config["data_seed"])
    if _env_id(config) != NAV_ENV_ID:
        return cached_mujoco_dataset(_env_id(config), config["level"], config["transitions"], config["data_seed"])[0]
    if config["cache_data"]:
        return cached_dataset(config["level"], config["transitions"], config["data_seed"])[0]
    return generate(config["level"], config["transitions"], config["data_seed"])


def pretrained(config: Mapping[str, Any], seed: int) -> dict:
    """The offline host + behavior model for this seed (shared by every arm; kept in memory for the process)."""
    key = json.dumps({**dict(config), "seed": seed}, sort_keys=True, default=str)
    if key not in _PRETRAINED:
        cfg = base_config(config)
        offline = OfflineBuffer(dataset(config), _device(), reward_scale=cfg.reward_scale, reward_bias=cfg.reward_bias,
                                mc_discount=cfg.discount if cfg.host == "calql" else None,
                                sparse_failure_reward=cfg.reward_bias if cfg.host == "calql" and
                                config.get("sparse", True) else None)
        agent = make_agent(*_dims(config), cfg, _device(), seed=seed)
        agent.pretrain(offline, config["offline_steps"])
        nll = agent.fit_behavior(offline)
        score = evaluate_policy(make_env(_env_id(config)), agent.act, config["eval_episodes"], 10_000 + seed)
        _PRETRAINED.clear()  # one seed at a time is enough; keeps memory flat
        _PRETRAINED[key] = {"state": agent.state_dict(), "offline": offline, "offline_score": score["normalized"],
                            "behavior_nll": nll}
    return _PRETRAINED[key]


def online_run(arm: str, value: Any, config: Mapping[str, Any], seed: int) -> dict:
    """One arm's online fine-tuning from the seed's offline state (``pretrained``), with its tuned ``value``.

    Returns ``final`` (mean of the last two evaluations), ``auc``, ``dip`` (worst drop in the first third), ``start``,
    the ``curve`` ([[step, normalised return], ...]), DARE's ``diag`` means and the seed's ``offline_score``. Under
    ``icml26 reproduce`` a finished run is kept in OUT/dare/runs/, so a killed full tier resumes run by run and
    ``--seed-jobs N`` computes a tuning grid N runs at a time (``run_ahead``)."""
    return _online_run(arm, value, dict(config), seed)


@stored_run
def _online_run(arm: str, value: Any, config: dict, seed: int) -> dict:
    base = pretrained(config, seed)
    agent = make_agent(*_dims(config), arm_config(arm, value, config), _device(), seed=seed)
    agent.load_state_dict({**base["state"], "config": None})
    # a fresh actor optimiser when the arm's lr differs from pretraining (drop_all's tuned lr)
    for group in agent.actor_opt.param_groups:
        group["lr"] = agent.config.actor_lr
    out = finetune(agent, make_env(_env_id(config)), make_env(_env_id(config)), base["offline"], config["online_steps"],
                   eval_every=config["eval_every"], eval_episodes=config["eval_episodes"], seed=seed)
    curve = out["curve"]
    ys = [y for _, y in curve]
    early = [y for x, y in curve if 0 < x <= config["online_steps"] // 3] or ys[1:2]
    return {"final": float(np.mean(ys[-2:])), "auc": float(np.mean(ys[1:])), "dip": float(min(early) - ys[0]),
            "start": ys[0], "curve": curve, "diag": out["diag"], "offline_score": base["offline_score"]}


def prepare(config: Mapping[str, Any]) -> dict:
    """Per-arm tuning on tuning seed 1000 (never reported), score = final normalised return, same 3-point budget
    for dare (its reconstructed variants), origin and keep_all (the host's constraint strength), each grid extended
    at an edge up to ``tune_max_extensions`` times (tier key, default ``MAX_EXTENSIONS``, the same for every arm);
    drop_all runs untuned at CORL's lr."""
    torch.set_num_threads(1)
    center = getattr(base_config(config), STRENGTH[config.get("host", "td3bc")])
    grids = {"dare": ListGrid(DARE_VARIANTS), "origin": LogGrid(center=center), "keep_all": LogGrid(center=center)}

    tune_config = {**config, "online_steps": config["tune_online_steps"]}

    def score(arm: str, value: Any, seed: int) -> float:
        res = online_run(arm, value, tune_config, seed)
        log_metrics(0, arm=arm, value=str(value), final=res["final"])
        return res["final"]

    tuning = tune_per_arm(grids, score, mode="max", desc="dare tuning",
                          max_extensions=config.get("tune_max_extensions", MAX_EXTENSIONS),
                          # with --seed-jobs N the grid's online runs go N at a time to the room's workers
                          ahead=lambda points: run_ahead(_online_run, [((arm, value, tune_config, seed), {})
                                                                       for arm, value, seed in points]))
    # drop_all is a context arm at CORL's default actor lr: it collapsed to 0 at every lr tried on the tuning
    # seed, so a tie-broken grid edge would fail the tuning check for an arm the verdict does not use (README).
    tuning["chosen"]["drop_all"] = base_config(config).actor_lr
    return {"tuning": tuning}


def run_claim(config: Mapping[str, Any], seed: int, prepared: Mapping[str, Any]) -> dict:
    torch.set_num_threads(1)
    chosen = prepared["tuning"]["chosen"]
    runs = {arm: online_run(arm, chosen[arm], config, seed) for arm in ARMS}
    for arm, r in runs.items():
        log_metrics(config["online_steps"], arm=arm, final=r["final"], auc=r["auc"], dip=r["dip"])
    arms = {arm: {"final": r["final"], "auc": r["auc"], "dip": r["dip"], "start": r["start"]} for arm, r in runs.items()}
    d = runs["dare"]["diag"]
    # score separation d' under the origin labels (before the exchange) and under DARE's labels (after)
    arms["dare"].update({k: d.get(k, math.nan) for k in ("released", "kept_online", "sep_origin", "sep_exchange")})
    stats = {"final_gain": runs["dare"]["final"] - runs["origin"]["final"],
             "auc_gain": runs["dare"]["auc"] - runs["origin"]["auc"],
             "dip_gain": runs["dare"]["dip"] - runs["origin"]["dip"],
             "final_gain_vs_keep_all": runs["dare"]["final"] - runs["keep_all"]["final"],
             "final_gain_vs_drop_all": runs["dare"]["final"] - runs["drop_all"]["final"],
             "separation_gain": d.get("sep_exchange", math.nan) - d.get("sep_origin", math.nan)}
    exchanged = 0.5 * (d.get("released", math.nan) + d.get("kept_online", math.nan))
    checks = {"offline_score": runs["dare"]["offline_score"], "exchanged_fraction": exchanged,
              "exchanged_fraction_max": exchanged}
    return {"arms": arms, "statistics": stats, "checks": checks,
            "curves": {arm: r["curve"] for arm, r in runs.items()}}


def plot_curves(result: dict, ax) -> None:
    from ...harness.plots import plot_mean_curves

    episodes = result["run_info"]["config"]["eval_episodes"]  # 20 / 50 on the nav task, 5 on Hopper
    plot_mean_curves(result, ax, xlabel="online environment steps",
                     ylabel=f"normalised return ({episodes} episodes per evaluation)")


def _tier(offline_steps: int, online_steps: int, **kw: Any) -> dict:
    cfg = {"host": "td3bc", "level": "medium", "transitions": 20000, "data_seed": 0, "cache_data": True,
           "hidden": 64, "layers": 2,
           "batch_size": 256, "reward_bias": -1.0, "bc_steps": 1000, "offline_steps": offline_steps,
           "online_steps": online_steps, "tune_online_steps": online_steps, "eval_every": max(online_steps // 6, 1),
           "eval_episodes": 20}
    return {**cfg, **kw}


CALQL_REWARD = {"reward_scale": 10.0, "reward_bias": -5.0}
"""CORL's antmaze reward map for Cal-QL (configs/finetune/cal_ql/antmaze: reward_scale 10, reward_bias -5)."""

COMPARATOR = Comparator(
    "final_gain", ">", 0.0,
    "normalised return of DARE minus the origin split after the online budget (mean of the last two evaluations), "
    "paired per seed, > 0")



def _checks(host: str) -> tuple:
    return (MechanismCheck("offline_score", ">=", 10.0, f"offline {host} reaches a normalised score >= 10"),
            MechanismCheck("exchanged_fraction", ">=", 0.01, "DARE moves >= 1% of samples across the origin "
                           "split (mean of released-offline and kept-online fractions)"),
            MechanismCheck("exchanged_fraction_max", "<=", 0.9, "DARE does not move (almost) every sample"))


CLAIM = ("Sample-level constraint release by behavioral consistency fine-tunes offline-to-online better than "
         "releasing the constraint by data origin")
PAPER_REF = "arXiv 2511.03828, abstract and D4RL experiments (no number readable; ICLR-26 reviews)"
METRIC = "normalised return (100 = scripted expert, 0 = random) after the online budget"

SPECS = [
    ExperimentSpec(
        id="dare_vs_origin", room="dare", claim=CLAIM, paper_ref=PAPER_REF, metric=METRIC,
        arms=ARMS, baseline="origin", comparator=COMPARATOR, run=run_claim, prepare=prepare, plot=plot_curves,
        tiers={"smoke": _tier(20, 20, transitions=600, cache_data=False, bc_steps=10, eval_every=10,
                              eval_episodes=2, tune_online_steps=10, batch_size=32, hidden=16),
               "quick": _tier(4000, 1000, eval_every=200, tune_online_steps=500),
               "full": _tier(10000, 10000, hidden=256, eval_episodes=50)},
        seeds={"smoke": 1, "quick": 3, "full": 5},
        checks=_checks("TD3+BC"),
        null_value=0.0,
        notes="TD3+BC host; Gaussian BC behavior model; 2x64 MLPs at the quick tier; nav task instead of D4RL "
              "AntMaze; arms share one offline pretraining per seed (protocol v2, README).",
    ),
    ExperimentSpec(
        id="dare_vs_origin_iql", room="dare", claim=CLAIM, paper_ref=PAPER_REF, metric=METRIC,
        arms=ARMS, baseline="origin", comparator=COMPARATOR, run=run_claim, prepare=prepare, plot=plot_curves,
        tiers={"smoke": _tier(20, 20, host="iql", transitions=600, cache_data=False, bc_steps=10, eval_every=10,
                              eval_episodes=2, tune_online_steps=10, batch_size=32, hidden=16),
               "full": _tier(6000, 3000, host="iql", eval_every=500)},
        seeds={"smoke": 1, "full": 4},
        checks=_checks("IQL"),
        null_value=0.0,
        notes="IQL host (CORL antmaze tau 0.9, beta 10); relaxed objective on S_on [REC]; full tier only.",
    ),
    ExperimentSpec(
        id="dare_vs_origin_calql", room="dare", claim=CLAIM, paper_ref=PAPER_REF, metric=METRIC,
        arms=ARMS, baseline="origin", comparator=COMPARATOR, run=run_claim, prepare=prepare, plot=plot_curves,
        tiers={"smoke": _tier(20, 20, host="calql", transitions=600, cache_data=False, bc_steps=10, eval_every=10,
                              eval_episodes=2, tune_online_steps=10, batch_size=32, hidden=16, **CALQL_REWARD),
               "full": _tier(20000, 3000, host="calql", eval_every=500, tune_online_steps=1500, **CALQL_REWARD)},
        seeds={"smoke": 1, "full": 4},
        checks=_checks("Cal-QL"),
        null_value=0.0,
        notes="Cal-QL host at CORL's antmaze recipe (policy lr 1e-4, cql_alpha 5 with Lagrange gap 0.8, 5-layer Q, "
              "max target backup, orthogonal init, reward 10 r - 5, calibration offline only); keep_all is CORL's "
              "Cal-QL O2O recipe; full tier only (protocol v2, README).",
    ),
    ExperimentSpec(
        id="dare_vs_origin_hopper", room="dare", claim=CLAIM, paper_ref=PAPER_REF,
        metric="D4RL-style normalised return (100 = our SAC expert, 0 = uniform random) after the online budget",
        arms=ARMS, baseline="origin", comparator=COMPARATOR, run=run_claim, prepare=prepare, plot=plot_curves,
        tiers={"smoke": _tier(20, 20, env_id="Hopper-v5", level="random", transitions=600, sparse=False,
                              reward_bias=0.0, smoke_random_data=True, bc_steps=10, eval_every=10, eval_episodes=1,
                              tune_online_steps=10, batch_size=32, hidden=16),
               "full": _tier(20000, 20000, env_id="Hopper-v5", level="medium", transitions=100000, sparse=False,
                             reward_bias=0.0, hidden=256, eval_every=2000, eval_episodes=5,
                             tune_max_extensions=4)},
        seeds={"smoke": 1, "full": 3},
        checks=_checks("TD3+BC"),
        null_value=0.0,
        notes="Hopper-v5 medium recorded from our SAC (python -m icml26.rl.sac); TD3+BC host, CORL MuJoCo "
              "defaults, no state normalisation; up to 4 grid extensions per arm (v2, on data v3); README; full "
              "tier only.",
    ),
    ExperimentSpec(
        id="dare_vs_origin_iql_hopper", room="dare", claim=CLAIM, paper_ref=PAPER_REF,
        metric="D4RL-style normalised return (100 = our SAC expert, 0 = uniform random) after the online budget",
        arms=ARMS, baseline="origin", comparator=COMPARATOR, run=run_claim, prepare=prepare, plot=plot_curves,
        tiers={"smoke": _tier(20, 20, host="iql", env_id="Hopper-v5", level="random", transitions=600,
                              sparse=False, reward_bias=0.0, smoke_random_data=True, bc_steps=10, eval_every=10,
                              eval_episodes=1, tune_online_steps=10, batch_size=32, hidden=16),
               "full": _tier(20000, 1500, host="iql", env_id="Hopper-v5", level="medium", transitions=100000,
                             sparse=False, reward_bias=0.0, eval_every=250, eval_episodes=5,
                             tune_online_steps=750, tune_max_extensions=4)},
        seeds={"smoke": 1, "full": 10},
        checks=_checks("IQL"),
        null_value=0.0,
        notes="Hopper-v5 medium (100k transitions) recorded from our SAC (python -m icml26.rl.sac); IQL host, CORL "
              "MuJoCo defaults (tau 0.7, beta 3), 2x64 MLPs, 20k offline (v4) and 1.5k online steps, 10 seeds, up "
              "to 4 grid extensions per arm (v4); README, full-tier protocol v4; full tier only.",
    ),
]
