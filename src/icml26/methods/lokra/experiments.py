"""LoKRA's claims: at equal trainable parameters, LoKRA (and LoKRA+) fine-tune better than LoRA, and their learned
updates are more diverse (higher effective rank, lower coherence).

Protocol, the same for every task (the README's "Reproduction" is the pre-registration, issue 8):
1. Arms: ``lora`` (baseline), ``lokra`` (the same layer with the same initial factors plus the penalty) and
   ``lokra_plus`` (Khatri-Rao factors fitted into LoRA-r's budget). Trainable counts are recorded per arm.
2. Per-arm tuning through ``harness.tuning.tune_per_arm`` on tuning seed 1000 (never reported): every arm gets a
   3-point log grid (factor 3) around its own natural AdamW rate, scored by final validation loss; then the
   reconstructed penalty weight lambda of each LoKRA arm is chosen from a 3-option ``ListGrid`` (same budget)
   at that arm's chosen rate.
3. Per evaluation seed, every arm sees the same data split and batch sequence for the same number of AdamW steps.
4. Paired statistics per seed: ``acc_gain_*`` = accuracy(arm) - accuracy(LoRA), ``loss_gain_*`` = relative drop
   of the final validation loss against LoRA, ``erank_ratio_*`` = effective rank of dW over LoRA's (mean over
   layers), plus coherence drops (recorded). Each spec judges one of them with a comparator fixed here, and
   declares mechanism checks (the penalty acted, the task is learnable, the update claim is not implied by
   construction).

Runs are deterministic functions of (task config, arm, seed, lr), so the specs that share a task share their runs
through an in-process memo instead of training the same arm twice.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from ...core.adapters import AdapterConfig, LoRALinear, adapter_layers, count_trainable_parameters, inject_adapters
from ...core.assets import cache_dir
from ...core.io import cached_tensors
from ...core.logging import log_metrics
from ...core.progress import progress
from ...core.seeding import seed_everything
from ...harness.plots import plot_mean_curves
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import ListGrid, LogGrid, tune_per_arm
from .adapter import LoKRALinear, kruskal_penalty, lokra_make, lokra_plus_make, update_diagnostics
from .config import LoKRAConfig

ARMS = ("lokra", "lokra_plus", "lora")
PAPER_REF = "LoKRA (ICML 2026; AMD ROCm blog 'Low Kruskal-Rank Adaptation'), abstract and main results table"
CLAIM_LOKRA = ("LoKRA, LoRA plus a penalty promoting a high Kruskal rank of A and B^T, outperforms LoRA "
               "(+2.4 to +5.0 average accuracy on commonsense reasoning)")
CLAIM_PLUS = ("LoKRA+, which builds the update from a Khatri-Rao product with a tighter Kruskal-rank lower bound, "
              "outperforms LoRA (and LoKRA by a further +0.3 to +0.8)")
CLAIM_UPDATE = ("Kruskal-rank promotion makes the learned update more diverse than LoRA's: fewer redundant "
                "directions, i.e. a higher effective rank of dW")

ACC_RULE = ("mean accuracy gain over LoRA >= 0.005 (half a point; the paper's smallest gain is 2.4 points at LLM "
            "scale, the sign with a margin above noise is what a tiny model can test)")
LOSS_RULE = "final validation loss at least 0.5% below LoRA's (relative)"
ERANK_RULE = "effective rank of the learned dW at least 5% above LoRA's (mean over adapted layers)"


@dataclass
class Task:
    """A fine-tuning problem: a frozen base with adapters injected, batches, the training loss and an evaluation."""

    model: nn.Module
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]


def _is_lora(arm: str, config: Mapping[str, Any]) -> bool:
    """The arm trains plain LoRA: the baseline, or a method arm switched back to it (``as_baseline``, the tests'
    null arm)."""
    return arm == "lora" or arm in config.get("as_baseline", ())


def _adapter_make(arm: str, config: Mapping[str, Any], lam: float | None = None):
    lokra = LoKRAConfig(**{**config.get("lokra", {}), **({"lam": lam} if lam is not None else {})})
    if _is_lora(arm, config):
        return lambda linear, r, alpha, name: LoRALinear(linear, r, alpha)
    if arm == "lokra":
        return lokra_make(lokra)
    if arm == "lokra_plus":
        return lokra_plus_make(lokra)
    raise ValueError(f"unknown arm {arm!r}; arms are {ARMS}")


def _inject(model: nn.Module, arm: str, config: Mapping[str, Any], seed: int, lam: float | None = None) -> None:
    # Reseeding right before injection gives LoRA and LoKRA the very same initial A, so the two arms differ by
    # the penalty alone.
    seed_everything(seed)
    inject_adapters(model, AdapterConfig(r=config["r"], alpha=config["alpha"], target_modules=config["targets"]),
                    _adapter_make(arm, config, lam))


# -- digits: an MLP pretrained on MNIST (8x8), fine-tuned on sklearn's digits (same classes, another source) --------
def _cached(name: str, build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Load tensors from ``cache_dir('lokra')/name`` (safetensors), building and saving them on a miss."""
    return cached_tensors(cache_dir("lokra") / name, build)


def _unit_max(X: torch.Tensor) -> torch.Tensor:
    # Each image scaled to peak 1: removes the trivial intensity gap (MNIST strokes thin out when area-downsampled,
    # digits are pixel counts 0..16) and leaves the real shift in writing style and rendering.
    return X / X.amax(1, keepdim=True).clamp_min(1e-6)


def _mlp(hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10))


@functools.lru_cache(maxsize=4)
def _digits_assets(hidden: int, pretrain_steps: int) -> dict[str, torch.Tensor]:
    """sklearn digits (X (1797, 64), y) and an MLP 64-h-h-10 trained with Adam on MNIST-5k area-downsampled to 8x8."""

    def data() -> dict[str, torch.Tensor]:
        from ...data.images import load_digits_dataset

        X, y = load_digits_dataset()
        return {"X": _unit_max(torch.as_tensor(X)), "y": torch.as_tensor(y)}

    def pretrained() -> dict[str, torch.Tensor]:
        from ...data.images import load_mnist5k

        X, y = load_mnist5k()
        X = F.interpolate(torch.as_tensor(X).view(-1, 1, 28, 28), size=(8, 8), mode="area").view(-1, 64)
        X, y = _unit_max(X), torch.as_tensor(y)
        seed_everything(0)
        model = _mlp(hidden)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in progress(range(pretrain_steps), desc="pretraining the MLP on MNIST 8x8"):
            idx = torch.randint(0, len(X), (128,), generator=gen)
            loss = F.cross_entropy(model(X[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.state_dict()

    return {**_cached("sklearn-digits-unitmax.safetensors", data),
            **{f"mlp.{k}": v for k, v in _cached(f"mnist8x8-mlp-h{hidden}-s{pretrain_steps}.safetensors",
                                                  pretrained).items()}}


def digits_task(config: Mapping[str, Any], seed: int, arm: str, lam: float | None = None) -> Task:
    """Few-shot domain shift: ``n_train`` sklearn digits for training, the rest for validation (split per seed)."""
    assets = _digits_assets(config["hidden"], config["pretrain_steps"])
    X, y = assets["X"], assets["y"]
    model = _mlp(config["hidden"])
    model.load_state_dict({k[4:]: v for k, v in assets.items() if k.startswith("mlp.")})
    _inject(model, arm, config, seed, lam)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
    train_idx, val_idx = perm[: config["n_train"]], perm[config["n_train"]:]
    batch_gen = torch.Generator().manual_seed(seed + 1)

    def batch(step: int):
        idx = train_idx[torch.randint(0, len(train_idx), (config["batch_size"],), generator=batch_gen)]
        return X[idx], y[idx]

    def loss(m: nn.Module, b) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    def evaluate(m: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            logits = m(X[val_idx])
        return {"val_loss": float(F.cross_entropy(logits, y[val_idx])),
                "val_acc": float((logits.argmax(-1) == y[val_idx]).float().mean())}

    return Task(model, batch, loss, evaluate)


# -- tiny LM: a byte LM pretrained on Shakespeare, adapted to Python source --------------------------------------
@functools.lru_cache(maxsize=4)
def _tiny_lm_state(d_model: int, n_layers: int, n_heads: int, seq_len: int, steps: int) -> dict[str, torch.Tensor]:
    from ...data.text import load_corpus, sample_batch
    from ...models.tiny_lm import TinyLM, TinyLMConfig

    def build() -> dict[str, torch.Tensor]:
        seed_everything(0)
        model = TinyLM(TinyLMConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads, max_seq_len=seq_len))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        data, gen = load_corpus("shakespeare").train, torch.Generator().manual_seed(0)
        for _ in progress(range(steps), desc="pretraining the tiny LM on Shakespeare"):
            x, y = sample_batch(data, 32, seq_len, gen)
            loss = model(x, y)[1]
            opt.zero_grad()
            loss.backward()
            opt.step()
        # Tied embeddings share storage, which safetensors refuses; load_state_dict re-ties them.
        return {k: v.clone() for k, v in model.state_dict().items()}

    return _cached(f"tinylm-shakespeare-d{d_model}-l{n_layers}-h{n_heads}-t{seq_len}-s{steps}.safetensors", build)


def tiny_lm_task(config: Mapping[str, Any], seed: int, arm: str, lam: float | None = None) -> Task:
    """Adapters on the attention projections of a Shakespeare byte LM, trained on Python source."""
    from ...data.text import lm_batches, load_corpus
    from ...models.tiny_lm import TinyLM, TinyLMConfig

    sizes = (config["d_model"], config["n_layers"], config["n_heads"], config["seq_len"])
    model = TinyLM(TinyLMConfig(d_model=sizes[0], n_layers=sizes[1], n_heads=sizes[2], max_seq_len=sizes[3]))
    model.load_state_dict(_tiny_lm_state(*sizes, config["pretrain_steps"]))
    _inject(model, arm, config, seed, lam)
    val, next_batch = lm_batches(load_corpus("python_stdlib"), config["batch_size"], config["seq_len"],
                                 config["n_val_batches"], seed)

    def batch(step: int):
        return next_batch()

    def loss(m: nn.Module, b) -> torch.Tensor:
        return m(b[0], b[1])[1]

    def evaluate(m: nn.Module) -> dict[str, float]:
        losses, hits, count = 0.0, 0, 0
        with torch.no_grad():
            for x, y in val:
                logits, value = m(x, y)
                losses += float(value)
                hits += int((logits.argmax(-1) == y).sum())
                count += y.numel()
        return {"val_loss": losses / len(val), "val_acc": hits / count}

    return Task(model, batch, loss, evaluate)


# -- SmolLM2-135M: comedy or tragedy? (real text, real labels; full tier) ---------------------------------------
@functools.lru_cache(maxsize=1)
def _smollm2_base():
    """SmolLM2 loaded once per process (seconds from disk); every arm adapts its own deep copy."""
    from ...models.smollm2 import load_smollm2

    return load_smollm2()


def smollm2_genre_task(config: Mapping[str, Any], seed: int, arm: str, lam: float | None = None) -> Task:
    """Prompt classification with SmolLM2-135M-Instruct: cross-entropy over the two label words' logits at the last
    prompt token (MeZO's ``train_as_classification``); adapters on q_proj and v_proj."""
    from ...models.smollm2 import GenrePrompts

    model, tok = _smollm2_base()
    model = copy.deepcopy(model)
    _inject(model, arm, config, seed, lam)
    prompts = GenrePrompts(tok, n_train=config["n_train"], n_val=config["n_val"], n_chars=config["n_chars"],
                           seed=seed)
    batch_gen = torch.Generator().manual_seed(seed + 1)

    def batch(step: int):
        return prompts.sample(config["batch_size"], batch_gen)

    def loss(m: nn.Module, b) -> torch.Tensor:
        return F.cross_entropy(prompts.label_logits(m, b), b[2])

    def evaluate(m: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            logits = prompts.label_logits(m, prompts.val)
        return {"val_loss": float(F.cross_entropy(logits, prompts.val[2])),
                "val_acc": float((logits.argmax(-1) == prompts.val[2]).float().mean())}

    return Task(model, batch, loss, evaluate)


TASKS: dict[str, Callable[..., Task]] = {
    "digits": digits_task, "tiny_lm": tiny_lm_task, "smollm2_genre": smollm2_genre_task}


# -- one arm -----------------------------------------------------------------------------------------------------
_RUNS: dict[str, dict] = {}


def train_arm(arm: str, config: Mapping[str, Any], seed: int, lr: float, lam: float | None = None) -> dict:
    """Train one arm for ``config['steps']`` AdamW steps; returns final metrics, the validation-loss curve, the
    per-layer update diagnostics (averaged) and the trainable count. ``lam`` overrides the penalty weight of the
    LoKRA arms. Memoised on (config, arm, seed, lr, lam)."""
    if _is_lora(arm, config):
        lam = None  # no penalty: any lam trains the same model
    elif lam is None:  # the default spelled out, so the lambda list's default value reuses the lr tuning's run
        lam = LoKRAConfig(**config.get("lokra", {})).lam
    key = json.dumps({"config": dict(config), "arm": arm, "seed": seed, "lr": lr, "lam": lam}, sort_keys=True,
                     default=str)
    if key in _RUNS:
        return _RUNS[key]
    task = TASKS[config["task"]](config, seed, arm, lam)
    model = task.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    penalised = not _is_lora(arm, config)
    final = task.evaluate(model)
    curve = [(0, final["val_loss"])]
    wall = 0.0
    for step in range(config["steps"]):
        b = task.batch(step)
        start = time.perf_counter()
        model.train()
        loss = task.loss(model, b)
        total = loss + kruskal_penalty(model) if penalised else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        model.eval()
        wall += time.perf_counter() - start
        if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
            final = task.evaluate(model)
            curve.append((step + 1, final["val_loss"]))
            log_metrics(step + 1, arm=arm, seed=seed, lr=lr, train_loss=float(loss.detach()), **final)
            if not math.isfinite(final["val_loss"]):
                break  # diverged: the rest of the budget cannot help
    layers = [layer for _, layer in adapter_layers(model)]
    diags = [update_diagnostics(layer) for layer in layers]
    diag = {k: sum(d[k] for d in diags) / len(diags) for k in diags[0]}
    frozen = _frozen_metrics(config, seed)
    result = {"final": final, "curve": curve, "diag": diag, "wall_s": wall, "frozen": frozen,
              "shapes": [(layer.out_features, layer.in_features) for layer in layers],
              "n_trainable": count_trainable_parameters(model),
              "penalty": float(kruskal_penalty(model).detach()) if penalised else 0.0}
    _RUNS[key] = result
    return result


@functools.lru_cache(maxsize=64)
def _frozen_cached(key: str) -> dict:
    config, seed = json.loads(key)
    task = TASKS[config["task"]](config, seed, "lora")  # LoRA's B = 0: the frozen base model's predictions
    return task.evaluate(task.model)


def _frozen_metrics(config: Mapping[str, Any], seed: int) -> dict:
    return _frozen_cached(json.dumps([dict(config), seed], sort_keys=True, default=str))


def construction_erank_ratio(method: str, config: Mapping[str, Any], shapes: list, seed: int) -> float:
    key = json.dumps([method, dict(config), [list(s) for s in shapes], seed], sort_keys=True, default=str)
    return _construction_cached(key)


@functools.lru_cache(maxsize=64)
def _construction_cached(key: str) -> float:
    method, config, shapes, seed = json.loads(key)
    return _construction_erank_ratio(method, config, shapes, seed)


def _construction_erank_ratio(method: str, config: Mapping[str, Any], shapes: list, seed: int) -> float:
    """The effective-rank ratio (method over LoRA) that the structure alone gives, with no data.

    For every adapted layer shape, a fresh LoRA layer and a fresh method layer get random N(0, 1) factors from the
    same seed (B, U no longer zero). LoKRA's factors then descend on its penalty alone (200 Adam steps, no task
    loss), which is what the penalty does by construction. If this data-free ratio already clears the update
    claim's threshold, the claim is implied by construction and says nothing about what training learned.
    """
    lokra = LoKRAConfig(**config.get("lokra", {}))
    ratios = []
    for d_out, d_in in shapes:
        eranks = {}
        for arm in ("lora", method):
            seed_everything(seed)
            layer = _adapter_make(arm, config)(nn.Linear(d_in, d_out), config["r"], config["alpha"], "probe")
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in layer.parameters():
                    if p.requires_grad:
                        p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            if isinstance(layer, LoKRALinear):  # not when the null arm builds LoKRA as LoRA
                params = [p for p in layer.parameters() if p.requires_grad]
                opt = torch.optim.Adam(params, lr=1e-2)
                for _ in range(200):
                    loss = lokra.lam * layer.penalty()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            eranks[arm] = update_diagnostics(layer)["erank"]
        ratios.append(eranks[method] / eranks["lora"])
    return sum(ratios) / len(ratios)


def tune(config: Mapping[str, Any]) -> dict:
    """Harness tuning rule: per-arm 3-point log grids (factor 3) of the AdamW rate around each arm's own natural
    rate, then lambda of each LoKRA arm from a 3-option ListGrid at its chosen rate (the reconstructed part,
    tuned with the baselines' budget). Score: final validation loss on tuning seed 1000."""
    def final_loss(arm: str, lr: float, lam: float | None, seed: int) -> float:
        value = train_arm(arm, config, seed, lr, lam)["final"]["val_loss"]
        return value if math.isfinite(value) else math.inf

    grids = {arm: LogGrid(center=config["lr_centers"][arm], factor=3.0, size=config["grid_size"]) for arm in ARMS}
    lr = tune_per_arm(grids, lambda arm, v, seed: final_loss(arm, v, None, seed), mode="min",
                      desc=f"lr grid [{config['task']}]")
    lam_grids = {arm: ListGrid(tuple(config["lam_options"])) for arm in ("lokra", "lokra_plus")}
    lam = tune_per_arm(lam_grids, lambda arm, v, seed: final_loss(arm, lr["chosen"][arm], v, seed), mode="min",
                       desc=f"lambda options [{config['task']}]")
    return {"tuning": {"lr": lr, "lam": lam}}


def run_seed(config: Mapping[str, Any], seed: int, prepared: Mapping[str, Any]) -> dict:
    """All three arms on one seed; every claim statistic of the task (each spec judges one of them)."""
    lrs, lams = prepared["tuning"]["lr"]["chosen"], prepared["tuning"]["lam"]["chosen"]
    runs = {arm: train_arm(arm, config, seed, lrs[arm], lams.get(arm)) for arm in ARMS}
    arms = {}
    for arm, run in runs.items():
        arms[arm] = {**run["final"], **run["diag"], "n_trainable": float(run["n_trainable"]),
                     "penalty": run["penalty"], "train_wall_s": run["wall_s"], "lr": lrs[arm],
                     "lam": lams.get(arm, 0.0)}
    lora = arms["lora"]
    frozen = runs["lora"]["frozen"]
    stats: dict[str, float] = {}
    checks: dict[str, float] = {
        "lora_acc_over_frozen": lora["val_acc"] - frozen["val_acc"],
        "lora_loss_drop_over_frozen": (frozen["val_loss"] - lora["val_loss"]) / frozen["val_loss"],
    }
    for arm in ("lokra", "lokra_plus"):
        a = arms[arm]
        stats[f"acc_gain_{arm}"] = a["val_acc"] - lora["val_acc"]
        stats[f"loss_gain_{arm}"] = (lora["val_loss"] - a["val_loss"]) / lora["val_loss"]
        stats[f"erank_ratio_{arm}"] = a["erank"] / lora["erank"] if lora["erank"] > 0 else math.nan
        stats[f"delta_mu_drop_{arm}"] = lora["delta_mu"] - a["delta_mu"]
        stats[f"factor_msc_drop_{arm}"] = lora["factor_msc"] - a["factor_msc"]
        stats[f"param_ratio_{arm}"] = a["n_trainable"] / lora["n_trainable"]
        checks[f"factor_msc_drop_{arm}"] = stats[f"factor_msc_drop_{arm}"]
        checks[f"erank_ratio_{arm}"] = stats[f"erank_ratio_{arm}"]
        # The structure alone does not depend on the data seed: one probe (seed 0) serves every seed.
        checks[f"construction_erank_ratio_{arm}"] = construction_erank_ratio(arm, config, runs[arm]["shapes"], 0)
    return {"arms": arms, "statistics": stats, "checks": checks,
            "curves": {arm: [list(p) for p in run["curve"]] for arm, run in runs.items()}}


def plot_curves(result: dict, ax) -> None:
    """Validation loss against steps, mean over seeds, one line per arm."""
    plot_mean_curves(result, ax, xlabel="fine-tuning step")


# -- tiers -------------------------------------------------------------------------------------------------------
_CENTERS = {"lora": 1e-2, "lokra": 1e-2, "lokra_plus": 1e-2}
"""Natural AdamW rates, fixed before any run: 1e-2 is the usual LoRA rate on models this small; LoKRA is LoRA's
layer; LoKRA+ has LoRA's budget and scale alpha / r (= KRAdapter's fixed 2 at alpha = 2r), so the same centre."""
_LAMS = (0.01, 0.1, 1.0)
"""Options for the reconstructed penalty weight lambda (unknown in the paper; notes: 1e-3..1e-1), around the
default 0.1 by a factor 10, the same count as the rate grids."""
def _digits(**kw: Any) -> dict:
    base = {"task": "digits", "hidden": 64, "pretrain_steps": 1500, "n_train": 500, "batch_size": 64, "steps": 200,
            "eval_every": 40, "r": 8, "alpha": 16.0, "targets": ["0", "2", "4"], "lokra": {},
            "lr_centers": dict(_CENTERS), "grid_size": 3, "lam_options": list(_LAMS)}
    return {**base, **kw}


def _tiny_lm(**kw: Any) -> dict:
    base = {"task": "tiny_lm", "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "pretrain_steps": 400,
            "batch_size": 8, "n_val_batches": 6, "steps": 100, "eval_every": 25, "r": 8, "alpha": 16.0,
            "targets": ["qkv_proj", "out_proj"], "lokra": {}, "lr_centers": dict(_CENTERS), "grid_size": 3,
            "lam_options": list(_LAMS)}
    return {**base, **kw}


def _smollm2(**kw: Any) -> dict:
    # r=24 is the smallest rank at which LoKRA+ fits LoRA's budget on SmolLM2's 576-wide q_proj (24 * 24 >= 576).
    base = {"task": "smollm2_genre", "n_train": 1000, "n_val": 128, "n_chars": 300, "batch_size": 8, "steps": 300,
            "eval_every": 50, "r": 24, "alpha": 48.0, "targets": ["q_proj", "v_proj"], "lokra": {},
            "lr_centers": {arm: 1e-3 for arm in ARMS}, "grid_size": 3, "lam_options": list(_LAMS)}
    return {**base, **kw}


_DIGITS = {"smoke": _digits(pretrain_steps=200, n_train=200, steps=10, eval_every=5, grid_size=1, lam_options=[0.1]),
           "quick": _digits(),
           "full": _digits(steps=1000, eval_every=100)}
_TINY = {"smoke": _tiny_lm(pretrain_steps=20, steps=4, eval_every=2, n_val_batches=1, batch_size=4, grid_size=1,
                           lam_options=[0.1]),
         "quick": _tiny_lm(),
         # r=12 is the smallest rank at which LoKRA+ fits LoRA's budget on both d=128 projections (amendment 1:
         # r=8 raised at the first launch); alpha keeps the quick tier's alpha / r = 2.
         "full": _tiny_lm(d_model=128, n_layers=4, pretrain_steps=2000, batch_size=16, steps=1000, eval_every=100,
                          r=12, alpha=24.0)}
_SMOL = {"smoke": _smollm2(n_train=4, n_val=2, n_chars=80, batch_size=1, steps=1, eval_every=1, grid_size=1,
                           lam_options=[0.1], targets=["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj"]),
         "full": _smollm2()}
_SEEDS = {"smoke": 1, "quick": 5, "full": 3}


def _checks(method: str, task: str, update_claim: bool) -> tuple[MechanismCheck, ...]:
    """Mechanism checks: the method's structure or penalty acted, LoRA learned the task, and (update claims) the
    statistic is not implied by the structure alone."""
    if method == "lokra":
        acted = MechanismCheck("factor_msc_drop_lokra", ">=", 0.01, "the penalty acted: the mean-squared coherence "
                               "of LoKRA's factor columns is at least 0.01 below LoRA's")
    else:
        acted = MechanismCheck("erank_ratio_lokra_plus", ">=", 1.05, "the Khatri-Rao structure acted: LoKRA+'s "
                               "update has at least 5% higher effective rank than LoRA's")
    learn = (MechanismCheck("lora_acc_over_frozen", ">=", 0.05, "the task is learnable: LoRA gains at least 5 "
                            "accuracy points over the frozen model") if task == "acc" else
             MechanismCheck("lora_loss_drop_over_frozen", ">=", 0.02, "the task is learnable: LoRA's validation loss "
                            "is at least 2% below the frozen model's"))
    if not update_claim:
        return (acted, learn)
    return (MechanismCheck(f"construction_erank_ratio_{method}", "<", 1.05, "not implied by construction: the "
                           "ratio that the structure or penalty alone gives with random factors and no data stays "
                           "below the claim's 1.05 (otherwise: not testable here)"), learn)


def _spec(id: str, claim: str, metric: str, stat: str, op: str, threshold: float, rule: str, method: str,
          tiers: dict, notes: str) -> ExperimentSpec:
    others = tuple(a for a in ("lora", "lokra", "lokra_plus") if a != method)
    update_claim = stat.startswith("erank")
    return ExperimentSpec(
        id=id, room="lokra", claim=claim, paper_ref=PAPER_REF, metric=metric, arms=(method, *others),
        baseline="lora", comparator=Comparator(stat, op, threshold, rule), run=run_seed,
        prepare=tune, plot=plot_curves, tiers=tiers, seeds={t: _SEEDS[t] for t in tiers}, notes=notes,
        checks=_checks(method, "acc" if stat.startswith("acc") else "loss" if stat.startswith("loss") else "acc",
                       update_claim),
        null_value=1.0 if update_claim else 0.0)


_DIGITS_NOTE = ("MLP 64-64-64-10 pretrained on MNIST-5k downsampled to 8x8, adapted (all 3 Linear layers, r=8) to "
                "500 sklearn digits; accuracy on the other 1297. Frozen accuracy is about 21%. The paper fine-tunes "
                "LLaMA/Qwen 7-13B on commonsense reasoning.")
_TINY_NOTE = ("Byte LM (d=64, 2 layers) pretrained on Shakespeare; adapters (r=8) on qkv_proj and out_proj trained "
              "on Python source; validation loss on held-out Python.")
_SMOL_NOTE = ("Full tier only (long on 2 CPU cores). SmolLM2-135M-Instruct, adapters r=24 on q_proj and v_proj, "
              "comedy-vs-tragedy prompts from held-out Shakespeare text.")

SPECS = [
    _spec("digits_lokra", CLAIM_LOKRA, "validation accuracy after fine-tuning (MNIST-8x8 MLP -> sklearn digits)",
          "acc_gain_lokra", ">=", 0.005, ACC_RULE, "lokra", _DIGITS, _DIGITS_NOTE),
    _spec("digits_lokra_plus", CLAIM_PLUS, "validation accuracy after fine-tuning (MNIST-8x8 MLP -> sklearn digits)",
          "acc_gain_lokra_plus", ">=", 0.005, ACC_RULE, "lokra_plus", _DIGITS, _DIGITS_NOTE),
    _spec("digits_update_lokra", CLAIM_UPDATE, "effective rank of the learned dW (digits task)",
          "erank_ratio_lokra", ">=", 1.05, ERANK_RULE, "lokra", _DIGITS, _DIGITS_NOTE),
    _spec("digits_update_lokra_plus", CLAIM_UPDATE, "effective rank of the learned dW (digits task)",
          "erank_ratio_lokra_plus", ">=", 1.05, ERANK_RULE, "lokra_plus", _DIGITS, _DIGITS_NOTE),
    _spec("tiny_lm_lokra", CLAIM_LOKRA, "validation loss after fine-tuning (Shakespeare byte LM -> Python)",
          "loss_gain_lokra", ">=", 0.005, LOSS_RULE, "lokra", _TINY, _TINY_NOTE),
    _spec("tiny_lm_lokra_plus", CLAIM_PLUS, "validation loss after fine-tuning (Shakespeare byte LM -> Python)",
          "loss_gain_lokra_plus", ">=", 0.005, LOSS_RULE, "lokra_plus", _TINY, _TINY_NOTE),
    _spec("smollm2_genre_lokra", CLAIM_LOKRA, "validation accuracy (SmolLM2-135M, comedy vs tragedy)",
          "acc_gain_lokra", ">=", 0.005, ACC_RULE, "lokra", _SMOL, _SMOL_NOTE),
    _spec("smollm2_genre_lokra_plus", CLAIM_PLUS, "validation accuracy (SmolLM2-135M, comedy vs tragedy)",
          "acc_gain_lokra_plus", ">=", 0.005, ACC_RULE, "lokra_plus", _SMOL, _SMOL_NOTE),
]
