"""ScaLoRA's headline claim: accumulating optimally scaled low-rank increments converges faster than LoRA and
its variants (ReLoRA) and builds a high-rank update (abstract; Sec. 3; Figs. on convergence).

Protocol (the same for every task; the README's "Reproduction" is the pre-registration, issue 8):
1. Arms at equal trainable parameters (rank r on the same layers): ``scalora``, ``lora`` and ``relora`` (merge
   every N, 99% magnitude-pruned optimizer state, re-warm-up), all AdamW (no weight decay) at a constant rate on
   the same batch sequence.
2. Per-arm tuning (``harness.tuning.tune_per_arm``, tuning seed 1000, never reported): a 3-point log grid
   (factor 3) of the rate around each arm's natural rate, scored by final validation loss; then ScaLoRA's
   reconstructed step proxy is chosen from 3 options (``ListGrid``: the baselines' budget) at its chosen rate.
3. Per seed, paired: target = the baseline's final validation loss; S_arm = first evaluated step at or below
   it; ``step_reduction = 1 - S_ScaLoRA / S_baseline`` (censored at the budget). One spec per baseline: LoRA
   and ReLoRA. Mechanism checks: ScaLoRA's update rank accumulated (>= 2r), and, against LoRA, a generic
   rank-accumulating arm (ReLoRA) does not already pass the same comparator (else the task only tests rank
   accumulation, not ScaLoRA's scaling: not testable here).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ...core.adapters import AdapterConfig, LoRALinear, find_target_modules, inject_adapters
from ...core.logging import log_metrics
from ...core.seeding import seed_everything
from ...harness.plots import plot_mean_curves
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import ListGrid, LogGrid, tune_per_arm
from .adapter import ScaLoRALinear, effective_rank, effective_weight, lora_layers
from .optimizer import ReLoRAOptimizer, ScaLoRAOptimizer

CLAIM = ("ScaLoRA accumulates a high-rank update from optimally scaled low-rank increments and converges faster "
         "than LoRA and its variants (ReLoRA) at the same trainable-parameter budget")
COMPARATOR = Comparator(
    "step_reduction", ">=", 0.25,
    "1 - S_ScaLoRA/S_LoRA >= 0.25, where S is the number of steps to reach LoRA's final validation loss: ScaLoRA "
    "needs at most 3/4 of LoRA's steps (the paper reports faster convergence without one number; 0.25 is fixed "
    "here as 'clearly faster')")
COMPARATOR_RELORA = Comparator(
    "step_reduction_vs_relora", ">=", 0.25,
    "1 - S_ScaLoRA/S_ReLoRA >= 0.25, where S is the number of steps to reach ReLoRA's final validation loss "
    "(the same 'clearly faster' margin as against LoRA)")
ADAPTER_ARMS = ("scalora", "scalora_sgd_proxy", "lora", "relora")
PROXY_OPTIONS = {"adam": {"proxy": "adam"}, "sgd": {"proxy": "sgd"}, "sgd_clamp": {"proxy": "sgd", "nonneg": "clamp"}}
"""ScaLoRA's reconstructed step proxy, tuned as options: the Adam-step proxy (our default under AdamW), the
notes' gradient-step proxy with the exact non-negative solve, and the same with the notes' cheaper clamp."""
DEFAULT_PROXY = "adam"
"""What ``ScaLoRAOptimizer``'s default ``proxy='auto'`` picks under the AdamW every arm here trains with."""


@dataclass
class Task:
    """A fine-tuning problem: a model whose ``targets`` Linear layers (full module names) get adapters, and
    three callables."""

    model: nn.Module
    targets: list[str]
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    val_loss: Callable[[nn.Module], float]


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads: these models are so small that a second thread only adds contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# -- tasks -----------------------------------------------------------------------------------------------------
def teacher_student_task(config: Mapping[str, Any], seed: int) -> Task:
    """Linear regression y = (W0 + Delta*) x + noise, fine-tuned from W0 (d x d); Delta* is full rank with
    singular values sigma_k proportional to k^(-decay), scaled so that ||Delta* x|| has variance ``delta_var``
    per output. Validation loss is the exact relative error ||W - W*||_F^2 / ||Delta*||_F^2 (1 at the start)."""
    d = config["dim"]
    gen = torch.Generator().manual_seed(seed)
    W0 = torch.randn(d, d, generator=gen) / math.sqrt(d)
    U, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    sigma = torch.arange(1, d + 1, dtype=torch.float32) ** -config["decay"]
    sigma = sigma * math.sqrt(config["delta_var"] * d) / sigma.norm()
    delta = U @ torch.diag(sigma) @ V.T
    W_star = W0 + delta
    seed_everything(seed)
    model = nn.Sequential(nn.Linear(d, d, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(W0)
    batch_gen = torch.Generator().manual_seed(seed + 1)
    scale = float(delta.pow(2).sum())

    def batch(step: int):
        x = torch.randn(config["batch_size"], d, generator=batch_gen)
        return x, x @ W_star.T + config["noise"] * torch.randn(config["batch_size"], d, generator=batch_gen)

    def loss(m: nn.Module, b) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    def val_loss(m: nn.Module) -> float:
        layer = m[0]
        weight = layer.weight if isinstance(layer, nn.Linear) else effective_weight(layer)
        return float((weight.detach() - W_star).pow(2).sum()) / scale

    return Task(model, ["0"], batch, loss, val_loss)


@functools.lru_cache(maxsize=2)
def _pretrained_mlp(hidden: int, steps: int) -> dict[str, torch.Tensor]:
    """An MLP 64 -> hidden -> hidden -> 10 trained with Adam on upright sklearn digits (seed 0, all images)."""
    from ...data.images import load_digits_dataset

    X, y = (torch.as_tensor(a) for a in load_digits_dataset())
    seed_everything(0)
    model = _mlp(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(X), (64,), generator=gen)
        loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mlp(hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10))


def mlp_digits_task(config: Mapping[str, Any], seed: int) -> Task:
    """Fine-tune an MLP pretrained on upright digits to digits rotated by 90 degrees (same labels).

    A rotation permutes the 64 input pixels, so the ideal first-layer update W0 P - W0 is full rank: the
    setting where a rank-r update should hurt. Train/validation split is fixed (500 validation images).
    """
    from ...data.images import load_digits_dataset

    X, y = (torch.as_tensor(a) for a in load_digits_dataset())
    X = torch.rot90(X.reshape(-1, 8, 8), 1, dims=(1, 2)).reshape(-1, 64).contiguous()
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    val_idx, train_idx = perm[:500], perm[500:]
    model = _mlp(config["hidden"])
    model.load_state_dict(_pretrained_mlp(config["hidden"], config["pretrain_steps"]))
    seed_everything(seed)
    batch_gen = torch.Generator().manual_seed(seed + 1)

    def batch(step: int):
        idx = train_idx[torch.randint(0, len(train_idx), (config["batch_size"],), generator=batch_gen)]
        return X[idx], y[idx]

    def loss(m: nn.Module, b) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b[0]), b[1])

    def val_loss(m: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(m(X[val_idx]), y[val_idx]))

    return Task(model, ["0", "2", "4"], batch, loss, val_loss)


def lm_text_task(config: Mapping[str, Any], seed: int) -> Task:
    """Causal-LM fine-tuning on real text (Shakespeare's First Folio, original spelling: a domain shift).

    ``model="smollm2"``: SmolLM2-135M-Instruct with its BPE tokenizer (full tier). ``model="random_llama"``: a
    randomly initialised 2-layer Llama on bytes, the same code path in seconds (smoke tier). The last 10% of
    the text is held out; validation uses ``n_val_batches`` fixed windows from it.
    """
    from ...data.text import ByteTokenizer, load_shakespeare

    text = load_shakespeare("folio")[: config["max_chars"]]
    seed_everything(seed)
    if config["model"] == "smollm2":
        from ...models.smollm2 import load_smollm2

        model, tok = load_smollm2()
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    elif config["model"] == "random_llama":
        from ...core.assets import require

        transformers = require("transformers", "pip install 'icml26[llm]'", purpose="a small Llama")
        seed_everything(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=config["seq_len"] + 1))
        ids = ByteTokenizer().encode(text)
        seed_everything(seed)
    else:
        raise ValueError(f"model must be 'smollm2' or 'random_llama', got {config['model']!r}")
    model.eval()  # no dropout: every arm sees the same deterministic function of its weights
    cut = int(0.9 * len(ids))
    train, val = ids[:cut], ids[cut:]
    length = config["seq_len"] + 1

    def windows(tokens: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(tokens) - length, (n,), generator=gen)
        return tokens[starts[:, None] + torch.arange(length)]

    val_batches = [windows(val, config["batch_size"], torch.Generator().manual_seed(12345))
                   for _ in range(config["n_val_batches"])]
    batch_gen = torch.Generator().manual_seed(seed + 1)

    def batch(step: int):
        return windows(train, config["batch_size"], batch_gen)

    def loss(m: nn.Module, b) -> torch.Tensor:
        return m(input_ids=b, labels=b).loss

    def val_loss(m: nn.Module) -> float:
        with torch.no_grad():
            return sum(loss(m, b).item() for b in val_batches) / len(val_batches)

    return Task(model, find_target_modules(model, list(config["target_modules"])), batch, loss, val_loss)


TASKS: dict[str, Callable[[Mapping[str, Any], int], Task]] = {
    "teacher_student": teacher_student_task, "mlp_digits": mlp_digits_task, "lm_text": lm_text_task}


# -- one arm ---------------------------------------------------------------------------------------------------
def _prepare_arm(arm: str, task: Task, config: Mapping[str, Any], lr: float, seed: int, proxy: str | None = None):
    """Inject the arm's adapters (or unfreeze the target layers for ``full``) and build its optimizer.
    ``config["as_baseline"]`` (tests only) maps an arm to the baseline it is built as: the null arm."""
    arm = config.get("as_baseline", {}).get(arm, arm)
    model = task.model
    if arm == "full":
        for p in model.parameters():
            p.requires_grad_(False)
        for name in task.targets:
            for p in model.get_submodule(name).parameters():
                p.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0), params
    layer_type = LoRALinear if arm in ("lora", "relora") else ScaLoRALinear
    inject_adapters(model, AdapterConfig(r=config["rank"], alpha=config["alpha"], target_modules=task.targets),
                    lambda linear, r, alpha, name: layer_type(linear, r, alpha))
    params = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if arm == "lora":
        return inner, params
    if arm == "relora":
        return ReLoRAOptimizer(model, inner, every=config["relora_every"], rewarmup_steps=config["relora_warmup"],
                               prune_ratio=0.99, seed=seed), params
    if arm == "scalora":
        return ScaLoRAOptimizer(model, inner, **PROXY_OPTIONS[proxy or DEFAULT_PROXY]), params
    if arm == "scalora_sgd_proxy":
        return ScaLoRAOptimizer(model, inner, proxy="sgd"), params
    raise ValueError(f"unknown arm {arm!r}")


_RUNS: dict[str, dict] = {}


def train_arm(arm: str, config: Mapping[str, Any], seed: int, lr: float, proxy: str | None = None) -> dict:
    """Train one arm for ``config['steps']`` steps; returns its validation curve [(step, val_loss)], the
    effective ranks of the accumulated updates, its trainable-parameter count and wall time. ``proxy`` picks one
    of ``PROXY_OPTIONS`` for ScaLoRA. Memoised on (config, arm, seed, lr, proxy): the two specs of a task share
    their runs."""
    if config.get("as_baseline", {}).get(arm, arm) != "scalora":
        proxy = None  # only ScaLoRA has a step proxy: any value trains the same model
    elif proxy is None:  # the default spelled out, so the proxy list's "adam" reuses the lr tuning's run
        proxy = DEFAULT_PROXY
    key = json.dumps({"config": dict(config), "arm": arm, "seed": seed, "lr": lr, "proxy": proxy}, sort_keys=True,
                     default=str)
    if key not in _RUNS:
        _RUNS[key] = _train_arm(arm, config, seed, lr, proxy)
    return _RUNS[key]


def _train_arm(arm: str, config: Mapping[str, Any], seed: int, lr: float, proxy: str | None) -> dict:
    with _threads(config["threads"]):
        task = TASKS[config["task"]](config, seed)
        targets = {name: task.model.get_submodule(name).weight.detach().clone() for name in task.targets}
        opt, params = _prepare_arm(arm, task, config, lr, seed, proxy)
        model = task.model
        curve = [(0, task.val_loss(model))]
        wall, steps, every = 0.0, config["steps"], config["eval_every"]
        for step in range(steps):
            b = task.batch(step)
            start = time.perf_counter()
            loss = task.loss(model, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            wall += time.perf_counter() - start
            if (step + 1) % every == 0 or step + 1 == steps:
                value = task.val_loss(model)
                curve.append((step + 1, value))
                log_metrics(step + 1, arm=arm, seed=seed, lr=lr, val_loss=value, wall_s=wall)
                if not math.isfinite(value):
                    curve.append((steps, math.inf))
                    break  # diverged: the rest of the budget cannot help
        ranks = []
        for name, w0 in targets.items():
            layer = model.get_submodule(name)
            weight = layer.weight if isinstance(layer, nn.Linear) else effective_weight(layer)
            update = weight.detach() - w0
            ranks.append(effective_rank(update) if bool(torch.isfinite(update).all()) else math.nan)
        adapters = sum(1 for _ in lora_layers(model))
    return {"curve": curve, "erank_mean": sum(ranks) / len(ranks), "erank_min": min(ranks),
            "trainable_params": sum(p.numel() for p in params), "wall_s": wall, "steps_run": curve[-1][0],
            "n_adapters": adapters}


def _final(curve: list) -> float:
    value = curve[-1][1]
    return value if math.isfinite(value) else math.inf


def tune(config: Mapping[str, Any]) -> dict:
    """Harness tuning rule: per-arm 3-point log grids of the rate (factor 3) around each arm's natural rate, then
    ScaLoRA's step proxy from the 3 ``PROXY_OPTIONS`` at its chosen rate. Score: final validation loss on tuning
    seed 1000."""
    grids = {arm: LogGrid(center=config["lr_centers"][arm], factor=3.0, size=config["grid_size"])
             for arm in config["arms"]}
    lr = tune_per_arm(grids, lambda arm, v, seed: _final(train_arm(arm, config, seed, v)["curve"]), mode="min",
                      desc=f"lr grid [{config['task']}]")
    proxy = tune_per_arm({"scalora": ListGrid(tuple(config["proxy_options"]))},
                         lambda arm, v, seed: _final(train_arm(arm, config, seed, lr["chosen"][arm], v)["curve"]),
                         mode="min", desc=f"proxy options [{config['task']}]")
    return {"tuning": {"lr": lr, "proxy": proxy}}


def _steps_to(curve: list, target: float) -> int | None:
    for step, value in curve:
        if value <= target:
            return step
    return None


def run_seed(config: Mapping[str, Any], seed: int, prepared: Mapping[str, Any]) -> dict:
    """All arms on one seed; the claim statistic compares steps to LoRA's final validation loss."""
    lr = prepared["tuning"]["lr"]["chosen"]
    proxy = prepared["tuning"]["proxy"]["chosen"]["scalora"]
    runs = {arm: train_arm(arm, config, seed, lr[arm], proxy if arm == "scalora" else None) for arm in config["arms"]}
    target = _final(runs["lora"]["curve"])
    relora_target = _final(runs["relora"]["curve"]) if "relora" in runs else math.nan
    arms, curves = {}, {}
    for arm, run in runs.items():
        hit = _steps_to(run["curve"], target)
        hit_relora = _steps_to(run["curve"], relora_target)
        arms[arm] = {
            "final_val_loss": _final(run["curve"]), "steps_to_lora_final": float(hit) if hit is not None else math.nan,
            "reached_lora_final": float(hit is not None),
            "steps_to_relora_final": float(hit_relora) if hit_relora is not None else math.nan,
            "best_val_loss": min(v for _, v in run["curve"]), "erank_mean": run["erank_mean"],
            "erank_min": run["erank_min"], "trainable_params": float(run["trainable_params"]),
            "ms_per_step": 1e3 * run["wall_s"] / max(run["steps_run"], 1), "lr": lr[arm],
        }
        curves[arm] = [[s, v] for s, v in run["curve"]]
    budget = config["steps"]

    def reduction(reference: str, key: str, method: str = "scalora") -> float:
        ref = arms[reference][key]
        if not (math.isfinite(ref) and ref > 0):
            return math.nan  # the reference never improved on its start: no race to run
        own = arms[method][key]
        return 1.0 - (own if math.isfinite(own) else budget) / ref

    r = config["rank"]
    statistics = {
        "step_reduction": reduction("lora", "steps_to_lora_final"),
        "lora_final_val_loss": target,
        "erank_scalora_over_r": arms["scalora"]["erank_mean"] / r,
        "erank_lora_over_r": arms["lora"]["erank_mean"] / r,
        "rank_claim_holds": float(arms["scalora"]["erank_mean"] >= 2 * r and arms["lora"]["erank_mean"] <= r + 1e-6),
    }
    checks = {"erank_scalora_over_r": statistics["erank_scalora_over_r"]}
    if "relora" in arms:
        statistics["step_reduction_vs_relora"] = reduction("relora", "steps_to_relora_final")
        statistics["erank_relora_over_r"] = arms["relora"]["erank_mean"] / r
        # The same race against LoRA run by a generic rank accumulator: if ReLoRA also wins it by the margin,
        # beating LoRA here says nothing about ScaLoRA's optimal scaling.
        statistics["step_reduction_relora_vs_lora"] = reduction("lora", "steps_to_lora_final", method="relora")
        checks["step_reduction_relora_vs_lora"] = statistics["step_reduction_relora_vs_lora"]
    return {"arms": arms, "statistics": statistics, "curves": curves, "checks": checks}


def plot_curves(result: dict, ax) -> None:
    """Validation loss against steps, mean over seeds, with LoRA's final loss as the target line."""
    plot_mean_curves(result, ax, xlabel="optimizer step", target="lora_final_val_loss",
                     target_label="target (LoRA final)", log_y=True)


# -- tiers -----------------------------------------------------------------------------------------------------
_CENTERS = {"scalora": 3e-3, "lora": 3e-3, "relora": 3e-3}
"""Natural AdamW rates, fixed before any run: every arm trains rank-r factors with AdamW, so they share the
usual small-model LoRA rate; each arm's grid still extends on its own if its best rate is at an edge."""
_QUICK_ARMS = ["scalora", "lora", "relora"]
_PROXIES = list(PROXY_OPTIONS)


def _teacher_student(steps: int, **kw: Any) -> dict:
    return {"task": "teacher_student", "dim": 64, "decay": 0.5, "delta_var": 0.25, "noise": 0.1, "batch_size": 64,
            "rank": 4, "alpha": 8.0, "steps": steps, "eval_every": max(steps // 60, 1), "relora_every": 100,
            "relora_warmup": 10, "lr_centers": dict(_CENTERS), "grid_size": 3, "proxy_options": _PROXIES,
            "arms": _QUICK_ARMS, "threads": 1, **kw}


def _mlp_digits(steps: int, **kw: Any) -> dict:
    return {"task": "mlp_digits", "hidden": 128, "pretrain_steps": 400, "batch_size": 64, "rank": 4, "alpha": 8.0,
            "steps": steps, "eval_every": max(steps // 40, 1), "relora_every": 100, "relora_warmup": 10,
            "lr_centers": dict(_CENTERS), "grid_size": 3, "proxy_options": _PROXIES, "arms": _QUICK_ARMS,
            "threads": 1, **kw}


def _lm_text(steps: int, **kw: Any) -> dict:
    return {"task": "lm_text", "model": "smollm2", "max_chars": 2_000_000, "seq_len": 128, "batch_size": 8,
            "n_val_batches": 8, "target_modules": ["q_proj", "v_proj"], "rank": 8, "alpha": 16.0, "steps": steps,
            "eval_every": max(steps // 25, 1), "relora_every": 100, "relora_warmup": 10,
            "lr_centers": {arm: 1e-3 for arm in _QUICK_ARMS}, "grid_size": 3, "proxy_options": _PROXIES,
            "arms": ["scalora", "lora", "relora"], "threads": 2, **kw}


RANK_CHECK = MechanismCheck("erank_scalora_over_r", ">=", 2.0, "the mechanism acted: ScaLoRA's accumulated update "
                            "W_T - W_0 has effective rank at least 2r (mean over adapted layers)")
DISCRIMINATES = MechanismCheck(
    "step_reduction_relora_vs_lora", "<", 0.25, "the race against LoRA tests ScaLoRA's scaling, not rank "
    "accumulation alone: ReLoRA (a generic rank accumulator) does not itself reach LoRA's final loss 25% sooner "
    "(otherwise not testable here)")
_TS_NOTE = ("Full-rank target update with singular values ~ k^-0.5; validation loss is the exact relative weight "
            "error. The paper fine-tunes DeBERTaV3, LLaMA2/3 and Gemma3; this isolates the rank mechanism.")
_MLP_NOTE = ("A 64-128-128-10 MLP pretrained on upright sklearn digits, fine-tuned (r=4 on all three layers) to "
             "digits rotated by 90 degrees, a pixel permutation whose ideal first-layer update is full rank.")
_TS = {"smoke": _teacher_student(30, eval_every=10, relora_every=10, relora_warmup=2, grid_size=1,
                                 proxy_options=["adam"]),
       "quick": _teacher_student(1200),
       "full": _teacher_student(5000, dim=256, rank=8, alpha=16.0)}
_MLP = {"smoke": _mlp_digits(20, eval_every=10, pretrain_steps=20, relora_every=10, relora_warmup=2, grid_size=1,
                             proxy_options=["adam"]),
        "quick": _mlp_digits(500),
        "full": _mlp_digits(3000)}
_SEEDS = {"smoke": 1, "quick": 5, "full": 5}


def _spec(id: str, baseline: str, metric: str, tiers: dict, notes: str, paper_ref: str) -> ExperimentSpec:
    vs_lora = baseline == "lora"
    return ExperimentSpec(
        id=id, room="scalora", claim=CLAIM, paper_ref=paper_ref, metric=metric,
        arms=("scalora", "lora", "relora") if vs_lora else ("scalora", "relora", "lora"), baseline=baseline,
        comparator=COMPARATOR if vs_lora else COMPARATOR_RELORA, run=run_seed, prepare=tune, plot=plot_curves,
        tiers=tiers, seeds={t: _SEEDS[t] for t in tiers}, notes=notes,
        checks=(RANK_CHECK, DISCRIMINATES) if vs_lora else (RANK_CHECK,), null_value=0.0)


SPECS = [
    _spec("teacher_student", "lora", "steps to reach LoRA's final loss (64x64 linear teacher-student, r=4)",
          _TS, _TS_NOTE, "arXiv 2510.23818, abstract; Sec. 3"),
    _spec("teacher_student_vs_relora", "relora", "steps to reach ReLoRA's final loss (64x64 linear "
          "teacher-student, r=4)", _TS, _TS_NOTE, "arXiv 2510.23818, abstract; Sec. 3"),
    _spec("mlp_digits_rotated", "lora", "steps to reach LoRA's final validation cross-entropy (digits MLP -> "
          "rotated digits)", _MLP, _MLP_NOTE, "arXiv 2510.23818, abstract; Sec. 3"),
    _spec("mlp_digits_rotated_vs_relora", "relora", "steps to reach ReLoRA's final validation cross-entropy "
          "(digits MLP -> rotated digits)", _MLP, _MLP_NOTE, "arXiv 2510.23818, abstract; Sec. 3"),
    _spec("smollm2_folio", "lora", "steps to reach LoRA's final validation loss (SmolLM2-135M on First Folio text)",
          {"smoke": _lm_text(4, model="random_llama", max_chars=200_000, seq_len=32, batch_size=2, n_val_batches=1,
                             eval_every=2, relora_every=2, relora_warmup=1, threads=1, grid_size=1,
                             proxy_options=["adam"]),
           "full": _lm_text(600)},
          "Full tier only (~60 core-hours on CPU). SmolLM2-135M-Instruct, r=8 on q_proj and v_proj, causal LM loss "
          "on Shakespeare's First Folio (original spelling); the paper uses LLaMA2-7B/LLaMA3-8B/Gemma3-12B.",
          "arXiv 2510.23818, abstract; Tables 2-4"),
]
