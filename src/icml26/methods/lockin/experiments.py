"""Trajectory lock-in at laptop scale: a byte-level TinyLM pretrained on Shakespeare (broad capability) is
fine-tuned narrowly on Python stdlib source (the task) under five standard stabilisers and the curvature-aware
projection.

Protocol v2 (issue 8; fixed before any run; the same for every arm):
1. Pretrain once (seed 0, cached on disk): Adam on Shakespeare.
2. Per seed, every arm starts from the same theta_0, sees the same batch sequence and gets the same number of
   Adam steps at the same rate (the "fixed narrow fine-tuning conditions"). Every ``eval_every`` steps: task loss
   (Python validation tail), broad loss (Shakespeare validation tail), drift ||theta - theta_0|| and the
   LockInProbe quantities on small probe batches.
3. Tuning (``harness.tuning.tune_per_arm``, tuning seed 1000, never reported, no probes): each stabiliser's strength
   (low_lr factor, L2-SP lambda, EWC lambda: log grids of 3, factor 3, around 0.3 / 0.1 / 1; freeze: 3 prefix sets)
   and the reconstructed escape's option (project_k in {4, 16, 48}) get 3 candidates each; score = broad loss where
   the arm first reaches L* = 75% of plain's task-loss reduction (an arm that never gets there loses).

Statistics (per seed; the stabilisers are plain, low_lr, l2sp, ewc, freeze, at their tuned strengths):
* ``collapse_share`` = 1 - S_task / S_step: S_step = mean over evaluation steps of max - min broad loss across the
  stabilisers (how differently fast they degrade), S_task = mean over 20 matched task-loss levels (theta_0 down
  to the deepest level all reach) of max - min broad loss. 1: one curve traversed at different rates; 0 when the
  arms coincide (every arm switched back to plain).
* ``drift_spread`` = mean over 20 matched drift levels (the range every stabiliser covers) of max - min broad
  loss, over the mean broad-loss increase at the deepest common drift. Always defined (v1 returned NaN below a
  30% coverage floor); the coverage is a mechanism check instead.
* ``escape_gain``: at L*, B_stab = the lowest broad loss of any stabiliser, gain = (B_stab - B_project(L*)) /
  (B_stab - B_0): the share of the best stabiliser's damage that the projection avoids; 0 if project never
  reaches L*.
``config["null"] = True`` switches every arm back to plain: all three statistics are then exactly 0.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Mapping

import numpy as np
import torch

from ...core.assets import cache_dir
from ...core.io import cached_tensors
from ...core.logging import log_metrics
from ...core.progress import progress
from ...core.seeding import seed_everything
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import MAX_EXTENSIONS, ListGrid, LogGrid, tune_per_arm
from .config import LockInConfig
from .curves import fit_degradation_curve, matched_spread
from .probe import LockInProbe
from .trainer import StabilisedFineTuner

ROOM = "lockin"
ARMS = ("project", "plain", "low_lr", "l2sp", "ewc", "freeze")
STANDARD = ("plain", "low_lr", "l2sp", "ewc", "freeze")
PAPER_REF = "ICML 2026 abstract 'trajectory lock-in' (paper not found; no arXiv id)"

_TUNED = {"low_lr": "low_lr_factor", "l2sp": "l2sp", "ewc": "ewc", "freeze": "freeze", "project": "project_k"}
"""The strength each arm is tuned on (plain has none: its Adam rate is the fixed fine-tuning condition)."""
_BASE = dict(pretrain_corpus="shakespeare", finetune_corpus="python_stdlib", pretrain_lr=3e-3, pretrain_batch=32,
             lr=1e-3, low_lr_factor=0.3, l2sp=0.1, ewc=1.0, freeze=["tok_emb", "blocks.0"], project_curvature="fisher",
             freeze_grid=["tok_emb", "tok_emb,blocks.0", "tok_emb,blocks.0,blocks.1.attn"], grid_size=3,
             n_levels=20, target_fraction=0.75, threads=1)
TIERS = {
    "smoke": {**_BASE, "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 32, "pretrain_steps": 30,
              "steps": 12, "batch_size": 8, "eval_every": 3, "n_val_batches": 1, "probe_batch": 4,
              "fisher_examples": 8, "project_k": 4, "refresh_every": 6, "q": 1, "window": 2, "grid_size": 1,
              "project_k_grid": [4]},
    "quick": {**_BASE, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 64, "pretrain_steps": 600,
              "steps": 300, "batch_size": 16, "eval_every": 20, "n_val_batches": 4, "probe_batch": 8,
              "fisher_examples": 64, "project_k": 16, "refresh_every": 25, "q": 2, "window": 3,
              "project_k_grid": [4, 16, 48]},
    "full": {**_BASE, "d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 128, "pretrain_steps": 3000,
             "steps": 1500, "batch_size": 32, "eval_every": 50, "n_val_batches": 8, "probe_batch": 16,
             "fisher_examples": 128, "project_k": 32, "refresh_every": 100, "q": 4, "window": 5,
             "project_k_grid": [8, 32, 96], "max_extensions": 4},
}
SEEDS = {"smoke": 1, "quick": 5, "full": 3}


def lm_loss(model, batch) -> torch.Tensor:
    """Mean next-byte cross-entropy of a TinyLM on ``(x, y)``."""
    return model(batch[0], batch[1])[1]


def _lm_config(config: Mapping[str, Any]):
    from ...models.tiny_lm import TinyLMConfig

    return TinyLMConfig(d_model=config["d_model"], n_layers=config["n_layers"], n_heads=config["n_heads"],
                        max_seq_len=config["seq_len"])


@functools.lru_cache(maxsize=4)
def _pretrained(config_json: str) -> dict:
    """theta_0: Adam-pretrain on the broad corpus (seed 0), cached on disk as safetensors."""
    from ...data.text import load_corpus, sample_batch
    from ...models.tiny_lm import TinyLM

    c = json.loads(config_json)

    def pretrain() -> dict:
        seed_everything(0)
        model = TinyLM(_lm_config(c))
        opt = torch.optim.Adam(model.parameters(), lr=c["pretrain_lr"])
        data, gen = load_corpus(c["pretrain_corpus"]).train, torch.Generator().manual_seed(0)
        for _ in progress(range(c["pretrain_steps"]), desc=f"lockin: pretraining on {c['pretrain_corpus']}"):
            loss = lm_loss(model, sample_batch(data, c["pretrain_batch"], c["seq_len"], gen))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.state_dict()

    name = (f"tinylm-{c['pretrain_corpus']}-d{c['d_model']}-l{c['n_layers']}-h{c['n_heads']}-t{c['seq_len']}"
            f"-s{c['pretrain_steps']}-lr{c['pretrain_lr']}-b{c['pretrain_batch']}.safetensors")
    return cached_tensors(cache_dir(ROOM) / name, pretrain)


def _pretrain_key(config: Mapping[str, Any]) -> str:
    keys = ("pretrain_corpus", "d_model", "n_layers", "n_heads", "seq_len", "pretrain_steps", "pretrain_lr",
            "pretrain_batch")
    return json.dumps({k: config[k] for k in keys}, sort_keys=True)


def _val_batches(tokens: torch.Tensor, config: Mapping[str, Any]) -> list:
    from ...data.text import sample_batch

    gen = torch.Generator().manual_seed(12345)
    return [sample_batch(tokens, config["batch_size"], config["seq_len"], gen) for _ in range(config["n_val_batches"])]


def _mean_loss(model, batches) -> float:
    with torch.no_grad():
        return sum(float(lm_loss(model, b)) for b in batches) / len(batches)


def arm_options(arm: str, config: Mapping[str, Any], prepared: Any = None) -> dict:
    """The stabiliser strength of ``arm``: its tuned value when ``prepared`` holds a tuning, else the config's."""
    name = _TUNED.get(arm)
    if name is None:
        return {}
    if prepared and arm in prepared.get("tuning", {}).get("chosen", {}):
        value = prepared["tuning"]["chosen"][arm]
    else:
        value = config[name]
    if name == "freeze" and isinstance(value, str):
        value = value.split(",")
    return {name: value}


def train_arm(arm: str, config: Mapping[str, Any], seed: int, options: Mapping[str, Any] | None = None,
              probes: bool = True) -> dict:
    """Fine-tune one arm; returns its curve [(task, broad, drift, step)] and probe summaries.

    ``options`` override the arm's strength (``low_lr_factor``, ``l2sp``, ``ewc``, ``freeze``, ``project_k``);
    ``probes=False`` (tuning) skips the curvature probes and records only losses and drift."""
    config = {**config, **(options or {})}
    from ...data.text import load_corpus, sample_batch
    from ...models.tiny_lm import TinyLM

    broad, task = load_corpus(config["pretrain_corpus"]), load_corpus(config["finetune_corpus"])
    model = TinyLM(_lm_config(config))
    model.load_state_dict(_pretrained(_pretrain_key(config)))
    seed_everything(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    probe_gen = torch.Generator().manual_seed(seed + 2)
    broad_fisher = sample_batch(broad.train, config["fisher_examples"], config["seq_len"], probe_gen)
    task_probe = sample_batch(task.val, config["probe_batch"], config["seq_len"], probe_gen)
    broad_probe = sample_batch(broad.val, config["probe_batch"], config["seq_len"], probe_gen)
    task_val, broad_val = _val_batches(task.val, config), _val_batches(broad.val, config)
    cfg = LockInConfig(q=config["q"], window=config["window"], curvature="hessian", stabiliser=arm, lr=config["lr"],
                       low_lr_factor=config["low_lr_factor"], l2sp=config["l2sp"], ewc=config["ewc"],
                       freeze=tuple(config["freeze"]), project_k=config["project_k"],
                       project_curvature=config["project_curvature"], refresh_every=config["refresh_every"],
                       fisher_examples=config["fisher_examples"])
    probe = LockInProbe(model, lm_loss, lm_loss, cfg)
    trainer = StabilisedFineTuner(model, lm_loss, cfg, broad_loss=lm_loss, broad_batch=broad_fisher)
    curve, records = [], []
    theta0 = [q.detach().clone() for q in model.parameters()]
    for step in range(config["steps"] + 1):
        if step % config["eval_every"] == 0 or step == config["steps"]:
            if probes:
                rec = probe.observe(step, model, task_probe, broad_probe)
            else:
                with torch.no_grad():
                    drift = float(sum(((q - q0) ** 2).sum() for q, q0 in zip(model.parameters(), theta0)) ** 0.5)
                rec = {"step": step, "drift": drift}
            t_loss, b_loss = _mean_loss(model, task_val), _mean_loss(model, broad_val)
            curve.append([t_loss, b_loss, rec["drift"], step])
            records.append(rec)
            log_metrics(step, arm=arm, seed=seed, task_loss=t_loss, broad_loss=b_loss, drift=rec["drift"],
                        **{k: v for k, v in rec.items() if k not in ("step", "drift", "task_loss", "broad_loss")})
        if step < config["steps"]:
            trainer.step(sample_batch(task.train, config["batch_size"], config["seq_len"], data_gen))
    return {"curve": curve, "records": records}


def _corr(a: list[float], b: list[float]) -> float:
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def _arm_metrics(out: dict) -> dict:
    recs = [r for r in out["records"] if "harm_first_order" in r]
    overlaps = [r["overlap"] for r in out["records"] if "overlap" in r]
    sub_curv = [r["subspace_curvature"] for r in out["records"] if "subspace_curvature" in r]
    final = out["curve"][-1]
    return {
        "final_task_loss": final[0], "final_broad_loss": final[1], "final_drift": final[2],
        "broad_increase": final[1] - out["curve"][0][1], "task_decrease": out["curve"][0][0] - final[0],
        "mean_overlap": float(np.mean(overlaps)) if overlaps else math.nan,
        "last_overlap": overlaps[-1] if overlaps else math.nan,
        "mean_subspace_curvature": float(np.mean(sub_curv)) if sub_curv else math.nan,
        "mean_harm_rayleigh": float(np.mean([r["harm_rayleigh"] for r in recs])) if recs else math.nan,
        "second_order_share": float(np.mean([abs(r["harm_second_order"]) /
                                             (abs(r["harm_first_order"]) + abs(r["harm_second_order"]) + 1e-12)
                                             for r in recs])) if recs else math.nan,
        "taylor_corr": _corr([r["harm_first_order"] + r["harm_second_order"] for r in recs],
                             [r["broad_change"] for r in recs]),
    }


def target_level(curve: list, config: Mapping[str, Any]) -> float:
    """L*: the task loss at ``target_fraction`` of plain's task-loss reduction (its start minus its best)."""
    xs = [p[0] for p in curve]
    return xs[0] - config["target_fraction"] * (xs[0] - min(xs))


def broad_at(curve: list, level: float) -> float:
    """Broad loss where the curve first reaches task loss ``level`` (NaN if it never does)."""
    from .curves import first_crossing

    return first_crossing([p[0] for p in curve], [p[1] for p in curve], level, decreasing=True)


def _step_spread(curves: Mapping[str, list]) -> float:
    """Mean over evaluation steps (after step 0) of max - min broad loss across the arms: the rate differences."""
    n = min(len(c) for c in curves.values())
    spreads = [max(c[i][1] for c in curves.values()) - min(c[i][1] for c in curves.values()) for i in range(1, n)]
    return float(np.mean(spreads)) if spreads else 0.0


def claim_statistics(curves: Mapping[str, list], config: Mapping[str, Any]) -> dict:
    """The three pre-registered statistics of protocol v2 (module docstring), their checks and descriptive extras."""
    n = config["n_levels"]
    task_curves = {a: ([p[0] for p in curves[a]], [p[1] for p in curves[a]]) for a in STANDARD}
    drift_curves = {a: ([p[2] for p in curves[a]], [p[1] for p in curves[a]]) for a in STANDARD}
    by_task = matched_spread(task_curves, decreasing=True, n_levels=n, reference="plain", min_coverage=0.0)
    by_drift = matched_spread(drift_curves, decreasing=False, n_levels=n, reference="plain", min_coverage=0.0)
    pooled = [(x, y) for xs, ys in task_curves.values() for x, y in zip(xs, ys)]
    # collapse: the share of the stabilisers' broad-loss differences at matched step that matching on task loss
    # removes (0 when the arms do not differ at all, e.g. every arm switched back to plain)
    spread_step = _step_spread({a: curves[a] for a in STANDARD})
    spread_task = float(np.mean(by_task["spread"])) if by_task["spread"] else math.nan
    collapse = 1.0 - spread_task / spread_step if spread_step > 0 else 0.0
    # drift paradox: broad-loss spread at matched drift over the drift range every stabiliser covers, relative to
    # the mean broad-loss increase at the deepest common drift (0 when the arms coincide)
    if by_drift["spread"] and by_drift["delta"] > 0:
        drift_spread = float(np.mean(by_drift["spread"])) / by_drift["delta"]
    else:
        drift_spread = 0.0
    # escape at the matched task loss L*
    y0 = by_task["y0"]
    level = target_level(curves["plain"], config)
    b_proj = broad_at(curves["project"], level)
    b_stab = {a: broad_at(curves[a], level) for a in STANDARD}
    b_best = min(b for b in b_stab.values() if math.isfinite(b))
    reached = math.isfinite(b_proj)
    if not reached:
        gain = 0.0  # no matched task performance, no escape
    elif b_best - y0 <= 0:
        gain = 0.0 if b_proj == b_best else math.nan
    else:
        gain = (b_best - b_proj) / (b_best - y0)
    return {"collapse_share": collapse, "drift_spread": drift_spread, "escape_gain": gain,
            "spread_at_matched_step": spread_step, "spread_at_matched_task": spread_task,
            "collapse_score_v1": by_task["score"] if by_task["coverage"] >= 0.3 else math.nan,
            "collapse_coverage": by_task["coverage"], "drift_coverage": by_drift["coverage"],
            "pooled_quadratic_r2": fit_degradation_curve(pooled, 2)["r2"], "escape_reached": float(reached),
            "escape_matched_task_loss": level, "escape_broad": b_proj, "best_stabiliser_broad": b_best,
            "best_stabiliser": min((a for a in STANDARD if math.isfinite(b_stab[a])), key=lambda a: b_stab[a])}


def tune(config: Mapping[str, Any]) -> dict:
    """:func:`tune_strengths`, memoised per process: the three specs share one tuning (same config, same rule)."""
    return json.loads(_tune_cached(json.dumps(dict(config), sort_keys=True)))


@functools.lru_cache(maxsize=4)
def _tune_cached(config_json: str) -> str:
    return json.dumps(tune_strengths(json.loads(config_json)))


def tune_strengths(config: Mapping[str, Any]) -> dict:
    """Each stabiliser's strength and the escape's reconstructed option (harness rule, tuning seed 1000, no probes).

    Score: the broad loss where the arm first reaches L* (75% of plain's task-loss reduction on the tuning seed);
    an arm that never reaches L* loses. Every arm gets 3 candidate values (log grids extend at an edge)."""
    torch.set_num_threads(config["threads"])
    plains: dict[int, float] = {}

    def score(arm: str, value, seed: int) -> float:
        if seed not in plains:
            plains[seed] = target_level(train_arm("plain", config, seed, probes=False)["curve"], config)
        name = _TUNED[arm]
        opt = {name: value.split(",") if name == "freeze" else value}
        return broad_at(train_arm(arm, config, seed, opt, probes=False)["curve"], plains[seed])

    size = config["grid_size"]
    # Where no strength reaches L*, the side nearer plain (which does reach it) is searched: a weaker penalty,
    # a rate factor nearer 1 (full-tier amendment 2; it changes nothing where some value scores).
    grids = {"low_lr": LogGrid(center=config["low_lr_factor"], factor=3.0, size=size, upper=1.0, unscored_toward=1),
             "l2sp": LogGrid(center=config["l2sp"], factor=3.0, size=size, unscored_toward=-1),
             "ewc": LogGrid(center=config["ewc"], factor=3.0, size=size, unscored_toward=-1),
             "freeze": ListGrid(tuple(config["freeze_grid"][:size])),
             "project": ListGrid(tuple(config["project_k_grid"][:size]))}
    return {"tuning": tune_per_arm(grids, score, mode="min", desc="lockin strengths",
                                   max_extensions=config.get("max_extensions", MAX_EXTENSIONS))}


@functools.lru_cache(maxsize=16)  # must hold every seed of a tier, else each spec retrains every seed
def _run_all(config_json: str, seed: int) -> str:
    """All arms for one seed (shared by the three specs, so each (config, seed) trains once per process)."""
    config = json.loads(config_json)
    threads = torch.get_num_threads()
    # One thread: on a shared 2-core machine, two intra-op threads per process mostly wait on each other.
    torch.set_num_threads(config["threads"])
    prepared = config.pop("__prepared__", None)
    try:
        if config.get("null"):  # every stabiliser and the escape switched back to plain: one run serves all
            plain = train_arm("plain", config, seed)
            outs = {arm: plain for arm in ARMS}
        else:
            outs = {arm: train_arm(arm, config, seed, arm_options(arm, config, prepared))
                    for arm in progress(ARMS, desc=f"lockin seed {seed} arms")}
    finally:
        torch.set_num_threads(threads)
    curves = {a: o["curve"] for a, o in outs.items()}
    stats = claim_statistics(curves, config)
    checks = {"spread_at_matched_step": stats["spread_at_matched_step"], "collapse_coverage": stats["collapse_coverage"],
              "drift_coverage": stats["drift_coverage"]}
    arms = {a: {**_arm_metrics(o), **{k: v for k, v in arm_options(a, config, prepared).items() if k != "freeze"}}
            for a, o in outs.items()}
    return json.dumps({"arms": arms, "statistics": {k: v for k, v in stats.items() if k != "best_stabiliser"},
                       "curves": curves, "checks": checks, "best_stabiliser_at_target": stats["best_stabiliser"]})


def run(config: Mapping[str, Any], seed: int, prepared: Any = None) -> dict:
    return json.loads(_run_all(json.dumps({**config, "__prepared__": prepared}, sort_keys=True), seed))


def _plot_trajectories(xi: int, xlabel: str):
    def plot(result: dict, ax) -> None:
        colors = {a: f"C{i}" for i, a in enumerate(result["arms_order"])}
        for arm in result["arms_order"]:
            for k, res in enumerate(result["seed_results"]):
                pts = res["curves"][arm]
                ax.plot([p[xi] for p in pts], [p[1] for p in pts], color=colors[arm], lw=1.8 if arm == "project" else 1,
                        alpha=0.8, label=arm if k == 0 else None, marker="." if arm == "project" else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("broad loss (Shakespeare val)")
        if xi == 0:
            ax.invert_xaxis()
        ax.legend(fontsize=7)
    return plot


_NOTES = ("Reconstructed: the paper and its code were not found. TinyLM (quick: d=32, 2 layers, 35k parameters) "
          "pretrained 600 Adam steps on Shakespeare, fine-tuned 300 Adam steps (lr 1e-3) on Python stdlib; all arms "
          "share theta_0, batches and budget. Protocol v2: each stabiliser's strength and the escape's k tuned on "
          "seed 1000 (3 values each) for the lowest broad loss at L* = 75% of plain's task-loss reduction.")
_COVERAGE = MechanismCheck("collapse_coverage", ">=", 0.5, "the task-loss range every stabiliser reaches covers at "
                           "least half of plain's task-loss reduction")
SPECS = [
    ExperimentSpec(
        id="collapse", room=ROOM,
        claim="Under fixed conditions the (task loss, broad loss) trajectories of standard stabilisers collapse onto "
              "one degradation curve: stabilisers change the rate along it, not the curve",
        paper_ref=PAPER_REF,
        metric="share of the stabilisers' broad-loss spread at matched step that vanishes at matched task loss",
        arms=ARMS, baseline="plain",
        comparator=Comparator("collapse_share", ">=", 0.5,
                              "1 - (mean broad-loss spread across plain, low_lr, l2sp, ewc, freeze at matched task "
                              "loss) / (their mean spread at matched step) >= 0.5, per seed"),
        run=run, prepare=tune, tiers=TIERS, seeds=SEEDS, null_value=0.0,
        checks=(MechanismCheck("spread_at_matched_step", ">=", 0.05, "the tuned stabilisers do move at different "
                               "rates: their broad losses at matched step differ by at least 0.05 nats on average"),
                _COVERAGE),
        plot=_plot_trajectories(0, "task loss (Python val), decreasing"), notes=_NOTES),
    ExperimentSpec(
        id="drift_paradox", room=ROOM,
        claim="Comparable Euclidean displacement ||theta - theta_0|| can correspond to divergent broad-capability "
              "outcomes (drift paradox)",
        paper_ref=PAPER_REF, metric="broad-loss spread at matched drift / broad-loss increase (5 stabilisers)",
        arms=ARMS, baseline="plain",
        comparator=Comparator("drift_spread", ">=", 0.5,
                              "mean over matched drift levels (the range every stabiliser covers) of (max - min) "
                              "broad loss across the 5 stabilisers is at least 50% of the mean broad-loss increase at "
                              "the deepest common drift"),
        run=run, prepare=tune, tiers=TIERS, seeds=SEEDS, null_value=0.0,
        checks=(MechanismCheck("drift_coverage", ">=", 0.3, "the drift range every stabiliser covers is at least 30% "
                               "of plain's drift"),),
        plot=_plot_trajectories(2, "drift ||theta - theta_0||"), notes=_NOTES),
    ExperimentSpec(
        id="escape", room=ROOM,
        claim="Escaping lock-in needs a reorientation towards softer curvature modes: the curvature-aware projection "
              "keeps matched task performance with lower broad loss than the stabilisers",
        paper_ref=PAPER_REF, metric="share of the best stabiliser's broad-loss increase avoided at matched task loss",
        arms=ARMS, baseline="plain",
        comparator=Comparator("escape_gain", ">=", 0.2,
                              "at L* (75% of plain's task-loss reduction) project's broad-loss increase is at least "
                              "20% below the lowest of the 5 tuned stabilisers' (0 if project never reaches L*)"),
        run=run, prepare=tune, tiers=TIERS, seeds=SEEDS, null_value=0.0, checks=(_COVERAGE,),
        plot=_plot_trajectories(0, "task loss (Python val), decreasing"), notes=_NOTES),
]
