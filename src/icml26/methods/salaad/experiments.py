"""SALAAD's deployment claim: one training run, truncated to any budget, beats post-hoc compression of a normal run.

Protocol (fixed before any quick-tier run):

1. Two training runs per seed with the same initialisation, batch order and optimizer (the official AdamW,
   lr 8e-3, betas (0.9, 0.95), no weight decay, linear warm-up then cosine to 0.1 lr, gradient clip 1):
   * ``vanilla``: plain training. It carries an *uncoupled* SALAAD hook (penalty exactly 0, so X trains exactly as
     plain training) whose tracked L + S gives the ablation arm ``salaad_uncoupled``;
   * ``salaad``: the coupled loss with the ADMM block every ``num_freq`` = 2 steps (official controller settings).
2. Every arm is compressed to each budget in ``budgets`` (fractions of the dense parameter count, one count for all
   arms: ``budget.block_cost``) and scored by validation loss (nats per byte) on fixed held-out batches:
   ``salaad`` and ``salaad_uncoupled`` by HPA (gamma 0.5); ``svd``, ``magnitude`` and ``rpca`` (IALM-RPCA + the same
   HPA truncation) from the vanilla model.
3. Equal tuning budget: every arm has exactly three settings (SALAAD: rho scale of the official per-layer rho; SVD and
   magnitude: how the budget is allocated across blocks; RPCA: lambda scale). On a separate tuning seed each arm
   keeps the setting with the lowest mean validation loss over budgets <= 30% (the claim's own metric).
4. Claim statistic per seed: ``low_budget_margin`` = min over svd, magnitude, rpca of
   (mean loss over budgets <= 30%) - (SALAAD's). Reproduced when it is > 0 (judge: mean and >= 2/3 of seeds).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from ...core.logging import log_metrics
from ...core.progress import progress
from ...core.seeding import seed_everything
from ...harness.spec import Comparator, ExperimentSpec
from .admm import SALAAD
from .baselines import magnitude_prune, rpca_components, svd_truncate
from .config import SALAADConfig, official_block_config
from .hpa import truncate_to_budget

TUNING_SEED = 10_000
LOW_BUDGET = 0.3
POST_HOC = ("svd", "magnitude", "rpca")
CLAIM = ("One SALAAD training run, truncated at deployment (HPA) to any parameter budget, gives lower loss than a "
         "normally trained model compressed afterwards by SVD truncation, magnitude pruning or RPCA")
COMPARATOR = Comparator(
    "low_budget_margin", ">", 0.0,
    "min over {svd, magnitude, rpca} of [mean validation loss over budgets <= 30%] minus SALAAD's is > 0: SALAAD's "
    "low-budget loss is below every post-hoc baseline's")


def _lm_config(config: Mapping[str, Any]):
    from ...models.tiny_lm import TinyLMConfig

    return TinyLMConfig(d_model=config["d_model"], n_layers=config["n_layers"], n_heads=config["n_heads"],
                        max_seq_len=config["seq_len"])


def _blocks(rho_scale: float) -> dict:
    """Every 2-D weight of the TinyLM: the tied embedding / LM head with the official embedding setting, the
    attention and MLP projections with the official linear setting."""
    return {r"tok_emb\.weight": official_block_config("embedding", rho_scale=rho_scale),
            r"blocks\..*\.weight": official_block_config("linear", rho_scale=rho_scale)}


def _val_batches(config: Mapping[str, Any]) -> list:
    from ...data.text import load_corpus, sample_batch

    gen = torch.Generator().manual_seed(12345)
    val = load_corpus(config["corpus"]).val
    return [sample_batch(val, config["val_batch_size"], config["seq_len"], gen) for _ in range(config["n_val_batches"])]


@torch.no_grad()
def val_loss(model: nn.Module, batches: list) -> float:
    model.eval()
    return sum(float(model(x, y)[1]) for x, y in batches) / len(batches)


def _lr_factor(step: int, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Official schedule shape: linear warm-up, then cosine from 1 to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress_frac = (step - warmup) / max(steps - warmup, 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_frac))


def train(config: Mapping[str, Any], seed: int, *, coupled: bool, rho_scale: float) -> tuple[nn.Module, SALAAD]:
    """One training run; ``coupled=False`` is plain training with a tracked (uncoupled) decomposition."""
    from ...data.text import load_corpus, sample_batch
    from ...models.tiny_lm import TinyLM

    seed_everything(seed)
    model = TinyLM(_lm_config(config))
    hook = SALAAD(model, _blocks(rho_scale), config=SALAADConfig(num_freq=config["num_freq"]), coupled=coupled)
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    steps, warmup = config["steps"], config["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, warmup))
    data, gen = load_corpus(config["corpus"]).train, torch.Generator().manual_seed(seed + 1)
    arm = "salaad" if coupled else "vanilla"
    model.train()
    for step in progress(range(steps), desc=f"train {arm} seed {seed} rho x{rho_scale:g}"):
        x, y = sample_batch(data, config["batch_size"], config["seq_len"], gen)
        _, loss = model(x, y)
        penalty = hook.penalty()
        opt.zero_grad(set_to_none=True)
        (loss + penalty).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        hook.step()
        if (step + 1) % config["log_every"] == 0:
            log_metrics(step + 1, arm=arm, seed=seed, rho_scale=rho_scale, loss=float(loss.detach()),
                        penalty=float(penalty.detach()))
    return model, hook


def _key(fraction: float) -> str:
    return f"b{round(fraction * 100):03d}"


def compress_curve(arm: str, setting: Any, model: nn.Module, hook: SALAAD, budgets: list[float],
                   batches: list) -> dict[float, tuple[float, int]]:
    """{budget: (validation loss, parameter count)} of one arm from its trained model."""
    blocks = list(hook.blocks)
    comps = rpca_components(model, blocks, lam_scale=float(setting)) if arm == "rpca" else hook
    out = {}
    for f in budgets:
        if arm in ("salaad", "salaad_uncoupled", "rpca"):
            small, report = truncate_to_budget(model, f, components=comps)
        elif arm == "svd":
            small, report = svd_truncate(model, f, blocks, allocation=setting)
        elif arm == "magnitude":
            small, report = magnitude_prune(model, f, blocks, allocation=setting)
        else:
            raise ValueError(f"unknown arm {arm!r}")
        out[f] = (val_loss(small, batches), report.params)
    return out


def _low(curve: Mapping[float, tuple[float, int]]) -> float:
    values = [loss for f, (loss, _) in curve.items() if f <= LOW_BUDGET + 1e-9]
    return sum(values) / len(values) if values else math.nan


def tune(config: Mapping[str, Any]) -> dict:
    """Three settings per arm on the tuning seed; keep the lowest mean loss over budgets <= 30%."""
    grids = config["grids"]
    if all(len(g) == 1 for g in grids.values()):
        return {"choices": {arm: g[0] for arm, g in grids.items()}, "scores": {}, "tuning_seed": TUNING_SEED,
                "on_grid_edge": []}
    batches, budgets = _val_batches(config), config["budgets"]
    scores: dict[str, dict[str, float]] = {arm: {} for arm in grids}
    vanilla, v_hook = train(config, TUNING_SEED, coupled=False, rho_scale=1.0)
    for arm in ("svd", "magnitude", "rpca"):
        for setting in grids[arm]:
            scores[arm][str(setting)] = _low(compress_curve(arm, setting, vanilla, v_hook, budgets, batches))
    for rho_scale in grids["salaad"]:
        model, hook = train(config, TUNING_SEED, coupled=True, rho_scale=rho_scale)
        scores["salaad"][str(rho_scale)] = _low(compress_curve("salaad", rho_scale, model, hook, budgets, batches))
    choices, edge = {}, []
    for arm, table in scores.items():
        best = min(table, key=lambda k: table[k] if math.isfinite(table[k]) else math.inf)
        choices[arm] = next(g for g in grids[arm] if str(g) == best)
        # Only the numeric grids (rho, lambda) have edges; a chosen edge value may mean the arm is under-tuned.
        if arm in ("salaad", "rpca") and best in (str(grids[arm][0]), str(grids[arm][-1])):
            edge.append(arm)
    return {"choices": choices, "scores": scores, "tuning_seed": TUNING_SEED, "on_grid_edge": edge}


def run_seed(config: Mapping[str, Any], seed: int, prepared: Mapping[str, Any]) -> dict:
    """Both training runs, every arm at every budget; the statistic compares low-budget losses."""
    choices = prepared["choices"]
    batches, budgets = _val_batches(config), config["budgets"]
    vanilla, v_hook = train(config, seed, coupled=False, rho_scale=1.0)
    model, hook = train(config, seed, coupled=True, rho_scale=float(choices["salaad"]))
    curves = {
        "salaad": compress_curve("salaad", choices["salaad"], model, hook, budgets, batches),
        "svd": compress_curve("svd", choices["svd"], vanilla, v_hook, budgets, batches),
        "magnitude": compress_curve("magnitude", choices["magnitude"], vanilla, v_hook, budgets, batches),
        "rpca": compress_curve("rpca", choices["rpca"], vanilla, v_hook, budgets, batches),
        "salaad_uncoupled": compress_curve("salaad_uncoupled", None, vanilla, v_hook, budgets, batches),
    }
    dense = {"salaad": val_loss(model, batches), "vanilla": val_loss(vanilla, batches)}
    arms = {}
    for arm, curve in curves.items():
        metrics = {f"loss_{_key(f)}": loss for f, (loss, _) in curve.items()}
        metrics.update({f"params_{_key(f)}": float(p) for f, (_, p) in curve.items()})
        metrics["low_budget_loss"] = _low(curve)
        metrics["dense_loss"] = dense["salaad" if arm == "salaad" else "vanilla"]
        arms[arm] = metrics
    margins = {b: arms[b]["low_budget_loss"] - arms["salaad"]["low_budget_loss"] for b in POST_HOC}
    stats = hook.stats()
    statistics = {
        "low_budget_margin": min(margins.values()),
        **{f"margin_vs_{b}": v for b, v in margins.items()},
        "coupling_gain": arms["salaad_uncoupled"]["low_budget_loss"] - arms["salaad"]["low_budget_loss"],
        "dense_gap_salaad_minus_vanilla": dense["salaad"] - dense["vanilla"],
        "salaad_rank_ratio": sum(s["rank_ratio"] for s in stats.values()) / len(stats),
        "salaad_density": sum(s["density"] for s in stats.values()) / len(stats),
        "salaad_residual": sum(s["residual"] for s in stats.values()) / len(stats),
    }
    n_dense = sum(p.numel() for p in model.parameters())
    by_fraction = {arm: [[p / n_dense, loss] for _, (loss, p) in sorted(curve.items())]
                   for arm, curve in curves.items()}
    by_fraction["dense"] = [[1.0, dense["vanilla"]], [1.0, dense["salaad"]]]
    return {"arms": arms, "statistics": statistics, "curves": by_fraction}


def plot_budget_curves(result: dict, ax) -> None:
    """Validation loss against the achieved parameter fraction, mean over seeds, one line per arm."""
    import numpy as np

    seeds = result["seed_results"]
    for arm in result["arms_order"]:
        runs = [r["curves"][arm] for r in seeds if arm in r.get("curves", {})]
        if not runs:
            continue
        frac = np.array([[p[0] for p in r] for r in runs], dtype=float).mean(0)
        loss = np.array([[p[1] for p in r] for r in runs], dtype=float).mean(0)
        ax.plot(frac, loss, marker="o", ms=3, label=arm)
    dense = np.mean([r["curves"]["dense"][0][1] for r in seeds])
    ax.axhline(float(dense), color="k", ls=":", lw=1, label="vanilla dense")
    ax.axvline(LOW_BUDGET, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("parameters kept (fraction of dense)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)


def _tier(steps: int, **kw: Any) -> dict:
    cfg = {"corpus": "python_stdlib", "d_model": 48, "n_layers": 2, "n_heads": 4, "seq_len": 64, "batch_size": 16,
           "steps": steps, "warmup_steps": max(steps // 10, 1), "lr": 8e-3, "num_freq": 2,
           "val_batch_size": 32, "n_val_batches": 8, "log_every": max(steps // 20, 1),
           "budgets": [round(0.1 * i, 1) for i in range(1, 11)],
           "grids": {"salaad": [1e3, 1e4, 1e5], "svd": ["uniform", "global", "energy"],
                     "magnitude": ["uniform", "global", "normalized"], "rpca": [0.5, 1.0, 2.0]}}
    cfg.update(kw)
    return cfg


SPECS = [
    ExperimentSpec(
        id="budget_curve", room="salaad", claim=CLAIM,
        paper_ref="arXiv 2602.00942, abstract and official README (HPA deployment)",
        metric="validation loss (nats/byte) of the compressed model at parameter budgets 10%..100%; claim statistic "
               "on budgets <= 30%",
        arms=("salaad", "svd", "magnitude", "rpca", "salaad_uncoupled"), baseline="svd", comparator=COMPARATOR,
        run=run_seed, prepare=tune, plot=plot_budget_curves,
        tiers={
            "smoke": _tier(16, d_model=32, batch_size=4, seq_len=32, n_val_batches=1, val_batch_size=8,
                           budgets=[0.1, 0.3, 1.0],
                           grids={"salaad": [1e4], "svd": ["uniform"], "magnitude": ["uniform"], "rpca": [1.0]}),
            "quick": _tier(400),
            "full": _tier(6000, d_model=128, n_layers=4, seq_len=128, batch_size=32,
                          grids={"salaad": [1e2, 1e3, 1e4], "svd": ["uniform", "global", "energy"],
                                 "magnitude": ["uniform", "global", "normalized"], "rpca": [0.5, 1.0, 2.0]}),
        },
        seeds={"smoke": 1, "quick": 3, "full": 3},
        notes="Byte-level TinyLM trained from scratch on Python stdlib source; every 2-D weight (tied embedding, "
              "attention and MLP projections) is a SALAAD block. The paper pretrains LLaMA 60M-1B on C4 for tens of "
              "thousands of steps; at this scale the density controller does not reach its 5% target within the run "
              "(see statistics salaad_density and salaad_residual). The rho grid is scaled up from the official 1e-6 "
              "because the dual variable must build up within a few hundred ADMM updates (quick) instead of tens of "
              "thousands.",
    ),
]
