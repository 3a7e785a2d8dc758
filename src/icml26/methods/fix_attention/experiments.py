"""FiX's claims at laptop scale: byte-level LM validation loss, and length extrapolation (train 256, test 1024).

Protocol (both specs share the trained models; a run trains each (seed, arm) once per process):
1. Arms: ``fix`` (this room's defaults), ``fox`` (official FoX defaults: NoPE, data-dependent scalar gate, no output
   norm) and ``softmax_rope`` (TinyLM's softmax + RoPE). Same TinyLM otherwise, the same initialisation rule.
2. Equal parameters: the SwiGLU width of each arm is reduced so its total parameter count matches softmax_rope's as
   closely as a width step allows (FoX-Pro pays for its gates the same way). The counts are reported.
3. Equal budget: one fixed recipe for every arm, not tuned for any (AdamW lr 3e-3, betas (0.9, 0.95), no weight
   decay, 10% linear warm-up then cosine to 10%, clip 1.0), the same steps and the same batches per seed.
4. Validation loss: mean next-byte cross-entropy (nats) on fixed windows of T_train from the corpus' held-out tail.
   Extrapolation: per-position loss on fixed windows of T_eval = 4 T_train from the same tail; "rise" is the mean
   loss over the last quarter of T_eval minus the mean over the last quarter of T_train.

Comparators (fixed before any run):
- ``val_loss_order``: ``order_margin = min(L_FoX - L_FiX, L_softmax - L_FoX) >= 0`` (both orderings hold).
- ``length_extrapolation``: ``extrapolation_margin = min(rise_softmax - 0.10, 0.05 - max(rise_FoX, rise_FiX)) >= 0``:
  softmax + RoPE rises by at least 0.10 nats while FoX and FiX rise by at most 0.05 (flat).
"""

from __future__ import annotations

import functools
import json
import math
import time
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ...core.seeding import seed_everything
from ...harness.spec import Comparator, ExperimentSpec
from ...models.tiny_lm import TinyLMConfig
from .layers import build_tiny_lm

ARMS = ("fix", "fox", "softmax_rope")
ATTENTION = {"fix": "fix", "fox": "fox", "softmax_rope": "softmax"}
RISE_MIN, FLAT_MAX = 0.10, 0.05

CLAIM_LOSS = ("At equal parameters and steps, FiX reaches a lower language-modelling loss than FoX, and FoX than "
              "softmax attention with RoPE (FiX abstract: lower training loss; FoX paper: FoX beats the Transformer)")
CLAIM_EXTRAPOLATION = ("Trained at T=256 and evaluated at T=1024, the loss by position stays flat past the training "
                       "length for FoX and FiX and rises for softmax attention with RoPE alone (FoX paper, length "
                       "extrapolation; FiX abstract, long context)")
COMPARATOR_LOSS = Comparator(
    "order_margin", ">=", 0.0,
    "min(L_FoX - L_FiX, L_softmax - L_FoX) >= 0: validation loss FiX <= FoX <= softmax+RoPE, both gaps at once")
COMPARATOR_EXTRAPOLATION = Comparator(
    "extrapolation_margin", ">=", 0.0,
    f"min(rise_softmax - {RISE_MIN}, {FLAT_MAX} - max(rise_FoX, rise_FiX)) >= 0: softmax+RoPE's loss over the last "
    f"quarter of T_eval exceeds its loss over the last quarter of T_train by >= {RISE_MIN} nats while FoX's and "
    f"FiX's rise by <= {FLAT_MAX}")

# The fields that define a trained model; both specs' tier configs carry the same values.
_TRAIN_KEYS = ("corpus", "d_model", "n_layers", "n_heads", "train_len", "eval_len", "batch_size", "steps", "lr",
               "n_val_batches", "n_extrapolation_seqs", "threads", "log_every")


def model_config(config: Mapping[str, Any], arm: str) -> TinyLMConfig:
    """The arm's TinyLMConfig, with the SwiGLU width chosen so its parameter count matches softmax_rope's."""
    base = TinyLMConfig(d_model=config["d_model"], n_layers=config["n_layers"], n_heads=config["n_heads"],
                        max_seq_len=config["eval_len"])
    if arm == "softmax_rope":
        return base
    target = build_tiny_lm(base, attention="softmax").num_parameters()
    extra = build_tiny_lm(base, attention=ATTENTION[arm]).num_parameters() - target
    # Each SwiGLU hidden unit costs 3 d_model parameters per layer.
    step = 3 * config["d_model"] * config["n_layers"]
    hidden = base.hidden_dim - round(extra / step)
    return TinyLMConfig(**{**base.__dict__, "mlp_hidden": hidden})


def _lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _windows(tokens: torch.Tensor, n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ...data.text import sample_batch

    return sample_batch(tokens, n, length, torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=64)
def _train(config_json: str, seed: int, arm: str) -> dict:
    """Train one arm on one seed; returns losses, the per-position loss at T_eval, parameter count and wall time."""
    from ...data.text import load_corpus, sample_batch

    config = json.loads(config_json)
    threads = torch.get_num_threads()
    # One thread: on a shared 2-core machine, two intra-op threads per process mostly wait on each other.
    torch.set_num_threads(config["threads"])
    try:
        seed_everything(seed)
        model = build_tiny_lm(model_config(config, arm), attention=ATTENTION[arm])
        split = load_corpus(config["corpus"])
        batches = torch.Generator().manual_seed(1000 + seed)            # the same batches for every arm
        opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, 0.95), weight_decay=0.0)
        curve = []
        start = time.perf_counter()
        model.train()
        for step in range(config["steps"]):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, config["steps"], config["lr"])
            x, y = sample_batch(split.train, config["batch_size"], config["train_len"], batches)
            loss = model(x, y)[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if (step + 1) % config["log_every"] == 0 or step + 1 == config["steps"]:
                curve.append([step + 1, loss.item()])
        wall = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            val = [model(*_windows(split.val, config["batch_size"], config["train_len"], 12345 + i))[1]
                   for i in range(config["n_val_batches"])]
            x, y = _windows(split.val, config["n_extrapolation_seqs"], config["eval_len"], 54321)
            per_position = torch.zeros(config["eval_len"])
            for row in range(x.shape[0]):         # one sequence at a time keeps T_eval x T_eval scores small
                logits, _ = model(x[row:row + 1])
                per_position += F.cross_entropy(logits[0], y[row], reduction="none")
            per_position /= x.shape[0]
        return {"val_loss": float(torch.stack(val).mean()), "per_position": per_position.tolist(), "curve": curve,
                "n_params": model.num_parameters(), "mlp_hidden": model.config.hidden_dim, "train_wall_s": wall}
    finally:
        torch.set_num_threads(threads)


def _train_all(config: Mapping[str, Any], seed: int) -> dict[str, dict]:
    key = json.dumps({k: config[k] for k in _TRAIN_KEYS}, sort_keys=True)
    return {arm: _train(key, seed, arm) for arm in ARMS}


def _rise(per_position: list[float], train_len: int, eval_len: int) -> tuple[float, float, float]:
    """(mean loss over the last quarter of T_train, over the last quarter of T_eval, their difference)."""
    inside = per_position[train_len - train_len // 4: train_len]
    beyond = per_position[eval_len - eval_len // 4:]
    a, b = sum(inside) / len(inside), sum(beyond) / len(beyond)
    return a, b, b - a


def run_val_loss(config: Mapping[str, Any], seed: int, prepared: Any) -> dict:
    """Validation loss of every arm at equal parameters and steps; statistic ``order_margin``."""
    runs = _train_all(config, seed)
    arms = {arm: {"val_loss": r["val_loss"], "final_train_loss": r["curve"][-1][1], "n_params": float(r["n_params"]),
                  "mlp_hidden": float(r["mlp_hidden"]), "train_wall_s": r["train_wall_s"]} for arm, r in runs.items()}
    fix, fox, soft = (runs[a]["val_loss"] for a in ARMS)
    statistics = {"order_margin": min(fox - fix, soft - fox), "fix_minus_fox": fix - fox,
                  "fox_minus_softmax": fox - soft}
    return {"arms": arms, "statistics": statistics, "curves": {arm: r["curve"] for arm, r in runs.items()}}


def run_extrapolation(config: Mapping[str, Any], seed: int, prepared: Any) -> dict:
    """Per-position loss at T_eval of models trained at T_train; statistic ``extrapolation_margin``."""
    runs = _train_all(config, seed)
    arms, rises = {}, {}
    for arm, r in runs.items():
        inside, beyond, rise = _rise(r["per_position"], config["train_len"], config["eval_len"])
        rises[arm] = rise
        arms[arm] = {"rise": rise, "loss_last_quarter_train_len": inside, "loss_last_quarter_eval_len": beyond,
                     "loss_eval_len_mean": sum(r["per_position"]) / len(r["per_position"])}
    margin = min(rises["softmax_rope"] - RISE_MIN, FLAT_MAX - max(rises["fox"], rises["fix"]))
    return {"arms": arms, "statistics": {"extrapolation_margin": margin},
            "curves": {arm: r["per_position"] for arm, r in runs.items()}}


def plot_training(result: dict, ax) -> None:
    """Training loss against steps, mean over seeds."""
    import numpy as np

    for arm in result["arms_order"]:
        runs = [r["curves"][arm] for r in result["seed_results"] if arm in r.get("curves", {})]
        if runs:
            steps = [p[0] for p in runs[0]]
            ax.plot(steps, np.mean([[p[1] for p in r] for r in runs], axis=0), label=arm)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.legend(fontsize=8)


def plot_per_position(result: dict, ax) -> None:
    """Loss by position at T_eval (mean over seeds, smoothed over 32 positions); the line marks T_train."""
    import numpy as np

    for arm in result["arms_order"]:
        runs = [r["curves"][arm] for r in result["seed_results"] if arm in r.get("curves", {})]
        if runs:
            mean = np.mean(runs, axis=0)
            width = max(1, min(32, len(mean) // 16))
            smooth = np.convolve(mean, np.ones(width) / width, mode="valid")
            ax.plot(np.arange(len(smooth)) + width // 2, smooth, label=arm)
    ax.axvline(result["run_info"]["config"]["train_len"], color="k", ls=":", lw=1, label="T_train")
    ax.set_xlabel("position")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend(fontsize=8)


def _tier(**overrides: Any) -> dict:
    base = {"corpus": "shakespeare", "d_model": 64, "n_layers": 2, "n_heads": 4, "train_len": 256, "eval_len": 1024,
            "batch_size": 8, "steps": 150, "lr": 3e-3, "n_val_batches": 4, "n_extrapolation_seqs": 4, "threads": 1,
            "log_every": 10}
    return {**base, **overrides}


_SMOKE = _tier(d_model=32, n_layers=1, train_len=32, eval_len=128, batch_size=2, steps=6, n_val_batches=1,
               n_extrapolation_seqs=1, log_every=2)
_QUICK = _tier()
_FULL = _tier(d_model=128, n_layers=4, batch_size=16, steps=2000, n_val_batches=16, n_extrapolation_seqs=16,
              threads=2, log_every=50)

SPECS = [
    ExperimentSpec(
        id="val_loss_order", room="fix_attention", claim=CLAIM_LOSS,
        paper_ref="FiX, ICML 2026 (abstract; icml.cc/virtual/2026/poster/63473); FoX, arXiv 2503.02130, Sec. 4",
        metric="validation loss (nats/byte) of a byte-level LM on Shakespeare, equal parameters and steps",
        arms=ARMS, baseline="softmax_rope", comparator=COMPARATOR_LOSS, run=run_val_loss, plot=plot_training,
        tiers={"smoke": _SMOKE, "quick": _QUICK, "full": _FULL}, seeds={"smoke": 1, "quick": 3, "full": 3},
        notes="Quick tier: 0.1M-parameter 2-layer LM, 150 steps of 8 x 256 bytes (0.3M bytes). The papers train "
              "125M-760M models on billions of tokens; FiX's own numbers are not public.",
    ),
    ExperimentSpec(
        id="length_extrapolation", room="fix_attention", claim=CLAIM_EXTRAPOLATION,
        paper_ref="FoX, arXiv 2503.02130, Fig. 2 (per-position loss); FiX abstract (long-context results)",
        metric="rise of the per-position loss from the last quarter of T_train=256 to the last quarter of T_eval=1024",
        arms=ARMS, baseline="softmax_rope", comparator=COMPARATOR_EXTRAPOLATION, run=run_extrapolation,
        plot=plot_per_position, tiers={"smoke": _SMOKE, "quick": _QUICK, "full": _FULL},
        seeds={"smoke": 1, "quick": 3, "full": 3},
        notes="Same models as val_loss_order (trained once per process). RoPE base 10000 for every arm that uses "
              "RoPE; FoX is NoPE as in its official default.",
    ),
]
