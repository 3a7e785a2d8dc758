"""FiX against FoX at laptop scale: byte-level LM validation loss, and the loss on long context beyond the training
length (FiX abstract: lower training loss and better long-context results than FoX).

Protocol (pre-registered in the README before the first run of this version):
1. Arms: ``fix`` (per-channel forget gates on the values + output RMSNorm) and ``fox`` (the official FoX layer,
   scalar gate per head). Same TinyLM otherwise, the same initialisation rule, the same parameter count (each
   arm's SwiGLU width is set so its total matches the plain softmax + RoPE TinyLM's as closely as a width step
   allows), the same steps and the same batches per seed.
2. Tuning, the same budget for both arms (harness ``tune_per_arm``, tuning seed 1000, score = validation loss):
   first the learning rate on ``LogGrid(3e-3, factor 3, size 3)`` with each arm's default options, then at that
   learning rate a ``ListGrid`` of three options per arm: FiX's reconstructed gate variants (``FIX_OPTIONS``) and
   FoX's official block variants (``FOX_OPTIONS``).
3. Validation loss: mean next-byte cross-entropy (nats) on fixed windows of T_train from the held-out tail.
4. Long-context loss: on fixed windows of T_eval = 4 T_train from the same tail, the mean loss of the targets in
   the last quarter of T_eval, each given its full prefix (3-4x longer than any context seen in training).

Statistics (paired per seed, FoX minus FiX, so > 0 means FiX is better; 0 when FiX is switched back to FoX):
``val_gain = L_FoX - L_FiX`` and ``long_gain = L^long_FoX - L^long_FiX``.
"""

from __future__ import annotations

import functools
import json
import math
import time
from typing import Any, Mapping

import torch

from ...core.seeding import seed_everything
from ...harness.run_store import stored_run
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import ListGrid, LogGrid, tune_per_arm
from ...models.tiny_lm import TinyLMConfig
from .layers import FiXAttention, build_tiny_lm

ARMS = ("fix", "fox")
# Candidate settings of each arm's uncertain or optional parts, tuned with the same budget (3 each).
FIX_OPTIONS: dict[str, dict[str, Any]] = {
    # The official-kernel benchmark's gates (the defaults of FixConfig): layer-0 gates from a token embedding,
    # W_up RMSNorm(W_down x) with rank ceil(d/16) and a dt bias, A ~ U(0, 16], one shared output-norm gain.
    "kernel_bench": {},
    # This room's first reconstruction: hidden-state gates everywhere, W_up W_down x with rank 16, A ~ U[1, 16],
    # per-head output-norm gains.
    "first_reconstruction": {"gate_rank": 16, "gate_bottleneck_norm": False, "gate_layer0_source": "hidden",
                             "a_init_range": (1.0, 16.0), "output_norm_shared": False},
    # Sigmoid gates at temperature 1 (f near 0.5 at init, FoX's starting point), kernel-benchmark layout otherwise.
    "sigmoid_f05": {"gate_form": "sigmoid", "gate_temperature": 1.0},
}
FOX_OPTIONS: dict[str, dict[str, Any]] = {
    "base": {},                                                  # official default: NoPE, full gate, no norms
    "rope": {"rope": True},                                      # FoX with RoPE (FoX paper, ablation)
    "pro": {"qk_norm": True, "fox_output_norm": True, "output_gate": True},   # FoX Pro block parts (QK-norm eps 1e-5)
}
OPTIONS = {"fix": FIX_OPTIONS, "fox": FOX_OPTIONS}
DEFAULT_OPTION = {"fix": "kernel_bench", "fox": "base"}
ATTENTION = {"fix": "fix", "fox": "fox", "softmax_rope": "softmax"}

CLAIM_LOSS = ("At equal parameters, steps and tuning budget, FiX (per-channel forget gates on the values) reaches a "
              "lower language-modelling loss than FoX (one scalar forget gate per head)")
CLAIM_LONG = ("FiX gives better long-context results than FoX: trained at T_train, its loss on targets 3-4x T_train "
              "deep in a long context is lower than FoX's")
GATE_SPREAD = 0.1


def model_config(config: Mapping[str, Any], arm: str, option: str) -> TinyLMConfig:
    """The arm's TinyLMConfig, with the SwiGLU width chosen so its parameter count matches softmax + RoPE's."""
    base = TinyLMConfig(d_model=config["d_model"], n_layers=config["n_layers"], n_heads=config["n_heads"],
                        max_seq_len=config["eval_len"])
    target = build_tiny_lm(base, attention="softmax").num_parameters()
    extra = _build(base, arm, option).num_parameters() - target
    step = 3 * config["d_model"] * config["n_layers"]           # each SwiGLU hidden unit costs 3 d per layer
    return TinyLMConfig(**{**base.__dict__, "mlp_hidden": base.hidden_dim - round(extra / step)})


def _build(tiny: TinyLMConfig, arm: str, option: str):
    return build_tiny_lm(tiny, attention=ATTENTION[arm], **(OPTIONS.get(arm, {}).get(option, {})))


def _lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _windows(tokens: torch.Tensor, n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ...data.text import sample_batch

    return sample_batch(tokens, n, length, torch.Generator().manual_seed(seed))


@torch.no_grad()
def gate_channel_spread(model, x: torch.Tensor) -> float:
    """How fine-grained FiX's trained gates are: mean over layers, heads and tokens of the std of log f across a
    head's channels, divided by the mean |log f| (0 for head-tied gates). NaN when the model has no FiX layer."""
    layers = [m for m in model.modules() if isinstance(m, FiXAttention)]
    if not layers:
        return float("nan")
    captured = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args: captured.append((mod, args[0]))) for layer in layers]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    ratios = []
    for layer, inp in captured:
        log_f = layer.log_forget(inp)                             # (B, H, T, Dh or 1)
        ratios.append(float(log_f.std(dim=-1).mean() / log_f.abs().mean().clamp_min(1e-12)) if log_f.shape[-1] > 1
                      else 0.0)
    return sum(ratios) / len(ratios)


@functools.lru_cache(maxsize=128)  # shared by both specs in one process
@stored_run  # and, through OUT/fix_attention/runs/, across processes
def _train(config_json: str, seed: int, arm: str, option: str, lr: float, evaluate_long: bool) -> dict:
    """Train one arm (with ``option``) on one seed at peak ``lr``; returns its losses and diagnostics."""
    from ...data.text import load_corpus, sample_batch

    config = json.loads(config_json)
    threads = torch.get_num_threads()
    # One thread: on a shared 2-core machine, two intra-op threads per process mostly wait on each other.
    torch.set_num_threads(config["threads"])
    try:
        seed_everything(seed)
        model = _build(model_config(config, arm, option), arm, option)
        split = load_corpus(config["corpus"])
        batches = torch.Generator().manual_seed(1000 + seed)            # the same batches for every arm
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        curve = []
        start = time.perf_counter()
        model.train()
        for step in range(config["steps"]):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, config["steps"], lr)
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
        value = float(torch.stack(val).mean())
        result = {"val_loss": value if math.isfinite(value) else float("inf"), "curve": curve,
                  "n_params": model.num_parameters(), "mlp_hidden": model.config.hidden_dim, "train_wall_s": wall}
        if evaluate_long:
            x, y = _windows(split.val, config["context_windows"], config["eval_len"], 54321)
            start_pos = config["eval_len"] - config["eval_len"] // 4
            with torch.no_grad():
                logits, _ = model(x)
                losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (W, T)
            result["long_loss"] = float(losses[:, start_pos:].mean())
            result["loss_by_position"] = losses.mean(0).tolist()
            result["gate_spread"] = gate_channel_spread(model, x[:1, : config["train_len"]])
        return result
    finally:
        torch.set_num_threads(threads)


def _key(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


def prepare(config: Mapping[str, Any]) -> dict:
    """Equal tuning budget per arm: 3 learning rates (default options), then 3 options at the chosen rate."""
    key = _key(config)
    lr_grid = {arm: LogGrid(center=config["lr_center"], factor=3.0, size=3) for arm in ARMS}
    lr = tune_per_arm(lr_grid, lambda arm, value, seed: _train(key, seed, arm, DEFAULT_OPTION[arm], value, False)
                      ["val_loss"], mode="min", desc="fix_attention lr")
    option_grid = {arm: ListGrid(tuple(OPTIONS[arm])) for arm in ARMS}
    options = tune_per_arm(option_grid, lambda arm, value, seed: _train(key, seed, arm, value, lr["chosen"][arm],
                                                                        False)["val_loss"],
                           mode="min", desc="fix_attention options")
    return {"tuning": {"lr": lr, "options": options}}


def _choice(prepared: Mapping, arm: str) -> tuple[str, float]:
    tuning = prepared["tuning"]
    return tuning["options"]["chosen"][arm], tuning["lr"]["chosen"][arm]


def seed_runs(config: Mapping[str, Any], seed: int, prepared: Mapping, method_as: str = "fix") -> dict[str, dict]:
    """Both arms on one reported seed. ``method_as="fox"`` is the null arm: the FiX slot trains FoX (its tuned
    option and learning rate), i.e. the method switched back to the baseline."""
    key = _key(config)
    runs = {}
    for arm in ARMS:
        source = method_as if arm == "fix" else arm
        option, lr = _choice(prepared, source)
        runs[arm] = {**_train(key, seed, source, option, lr, True), "option": option, "lr": lr}
    return runs


def _arms(runs: dict[str, dict]) -> dict:
    return {arm: {"val_loss": r["val_loss"], "long_context_loss": r["long_loss"], "final_train_loss": r["curve"][-1][1],
                  "n_params": float(r["n_params"]), "mlp_hidden": float(r["mlp_hidden"]), "lr": r["lr"],
                  "train_wall_s": r["train_wall_s"]} for arm, r in runs.items()}


def _checks(runs: dict[str, dict]) -> dict:
    spread = runs["fix"]["gate_spread"]
    return {"fix_gate_channel_spread": spread if math.isfinite(spread) else 0.0,
            "param_gap": abs(runs["fix"]["n_params"] - runs["fox"]["n_params"]) / runs["fox"]["n_params"]}


def run_val_loss(config: Mapping[str, Any], seed: int, prepared: Any, method_as: str = "fix") -> dict:
    """Validation loss of both arms; statistic ``val_gain = L_FoX - L_FiX``."""
    runs = seed_runs(config, seed, prepared, method_as)
    gain = runs["fox"]["val_loss"] - runs["fix"]["val_loss"]
    return {"arms": _arms(runs), "statistics": {"val_gain": gain}, "checks": _checks(runs),
            "curves": {arm: r["curve"] for arm, r in runs.items()}}


def run_long_context(config: Mapping[str, Any], seed: int, prepared: Any, method_as: str = "fix") -> dict:
    """Loss deep in a 4x-longer context; statistic ``long_gain = L^long_FoX - L^long_FiX``."""
    runs = seed_runs(config, seed, prepared, method_as)
    gain = runs["fox"]["long_loss"] - runs["fix"]["long_loss"]
    curves = {arm: [list(range(len(r["loss_by_position"]))), r["loss_by_position"]] for arm, r in runs.items()}
    return {"arms": _arms(runs), "statistics": {"long_gain": gain, "val_gain": runs["fox"]["val_loss"] -
                                                runs["fix"]["val_loss"]},
            "checks": _checks(runs), "curves": curves}


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


def plot_by_position(result: dict, ax) -> None:
    """Loss by target position on the long windows (mean over seeds, smoothed over 16 positions)."""
    import numpy as np

    config = result["run_info"]["config"]
    for arm in result["arms_order"]:
        runs = [r["curves"][arm] for r in result["seed_results"] if arm in r.get("curves", {})]
        if runs:
            mean = np.mean([r[1] for r in runs], axis=0)
            smooth = np.convolve(mean, np.ones(16) / 16, mode="valid")
            ax.plot(np.arange(len(smooth)) + 8, smooth, label=arm)
    ax.axvline(config["train_len"], color="k", ls=":", lw=1, label="T_train")
    ax.axvline(config["eval_len"] - config["eval_len"] // 4, color="k", ls="--", lw=1, label="scored from here")
    ax.set_xlabel("target position")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend(fontsize=8)


def _tier(**overrides: Any) -> dict:
    base = {"corpus": "shakespeare", "d_model": 64, "n_layers": 2, "n_heads": 4, "train_len": 128, "eval_len": 512,
            "batch_size": 8, "steps": 120, "lr_center": 3e-3, "n_val_batches": 4, "context_windows": 8,
            "threads": 1, "log_every": 10}
    return {**base, **overrides}


_SMOKE = _tier(d_model=32, n_layers=1, train_len=32, eval_len=128, batch_size=2, steps=4, n_val_batches=1,
               context_windows=1, log_every=2)
_QUICK = _tier()
_FULL = _tier(d_model=128, n_layers=4, train_len=256, eval_len=1024, batch_size=16, steps=2000, n_val_batches=16,
              context_windows=16, threads=2, log_every=50)
TIERS = {"smoke": _SMOKE, "quick": _QUICK, "full": _FULL}

CHECKS = (
    MechanismCheck("fix_gate_channel_spread", ">=", GATE_SPREAD,
                   f"FiX's trained gates are fine-grained: the std of log f across a head's channels is >= "
                   f"{GATE_SPREAD:g} of its mean magnitude (0 would be FoX-like head-tied gates)"),
    MechanismCheck("param_gap", "<=", 0.01, "FiX and FoX have the same parameter count to within 1%"),
)
PAPER_REF = "FiX, ICML 2026 (abstract; icml.cc/virtual/2026/poster/63473); FoX, arXiv 2503.02130, Sec. 4"

SPECS = [
    ExperimentSpec(
        id="val_loss_fix_vs_fox", room="fix_attention", claim=CLAIM_LOSS, paper_ref=PAPER_REF,
        metric="paired per seed: validation loss of FoX minus FiX (nats/byte), byte-level LM on Shakespeare, equal "
               "parameters, steps and tuning budget",
        arms=ARMS, baseline="fox",
        comparator=Comparator("val_gain", ">", 0.0, "L_FoX - L_FiX > 0: FiX reaches a lower validation loss"),
        run=run_val_loss, prepare=prepare, plot=plot_training, tiers=TIERS,
        seeds={"smoke": 1, "quick": 5, "full": 3}, checks=CHECKS, null_value=0.0,
        notes="Quick tier: 0.1M-parameter 2-layer LM, 120 steps of 8 x 128 bytes. The papers train 125M-760M models "
              "on billions of tokens; FiX's own numbers are not public.",
    ),
    ExperimentSpec(
        id="long_context_fix_vs_fox", room="fix_attention", claim=CLAIM_LONG,
        paper_ref="FiX abstract (long-context results); FoX, arXiv 2503.02130, Fig. 2 (per-position loss)",
        metric="paired per seed: FoX minus FiX mean loss of targets at positions 3/4 T_eval .. T_eval (T_eval = "
               "4 T_train) given the full prefix",
        arms=ARMS, baseline="fox",
        comparator=Comparator("long_gain", ">", 0.0,
                              "L^long_FoX - L^long_FiX > 0: FiX predicts better deep in a context 4x the trained one"),
        run=run_long_context, prepare=prepare, plot=plot_by_position, tiers=TIERS,
        seeds={"smoke": 1, "quick": 5, "full": 3}, checks=CHECKS, null_value=0.0,
        notes="Same models and tuning as val_loss_fix_vs_fox (trained once per process).",
    ),
]
