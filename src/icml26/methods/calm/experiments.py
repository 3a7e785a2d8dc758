"""CalM's forecasting claim at laptop scale (protocol v3, issue 14): after self-supervised pretraining on many
sessions of several animals, CalM fine-tuned on a held-out session forecasts its population calcium activity better
than every baseline given the same data.

Protocol (identical for every arm; per seed everything is re-simulated):
1. Data (``simulator.SimConfig()``: nonlinear latent dynamics shared within an animal, AR(2) GCaMP6s/6f kinetics,
   saturation, neuropil, drift, bleaching, behaviour-coupled neurons, dF/F): ``n_families`` pretraining animals x
   ``sessions_per_family`` sessions; targets = one new session of each of the first ``heldout_sessions`` animals
   (held-out sessions) plus one session of each of ``heldout_animals`` new animals. Every target has new neurons;
   its first ``target_train_frames`` frames are the only target data any arm fits on, the rest is the test part.
2. Tokenizer (``config["tokenizer"]``, default the VQ-VAE) fit once on the pretraining sessions; calm and scratch
   share it. calm: the dual-axis transformer pretrained with next-token CE for ``pretrain_steps`` (cosine schedule),
   then fine-tuned per target for ``finetune_steps``. calm_zeroshot: no fine-tuning. scratch: the same model from
   random init, trained on the target train part only for ``finetune_steps`` (the reduction: zero pretraining).
   Population/pooled baselines (nlinear, gru, poco) train once per seed on the pooled data calm sees (pretraining
   sessions + every target train part) for ``baseline_steps``; tsmixer (channel mixing ties it to one session's
   neurons) and ar_linear (per-neuron ridge AR) fit per target train part; copy_last scores 0 by definition.
3. Metric: POCO prediction score 1 - MSE/MSE(copy-last) on the test part (48 context + 16 horizon frames, stride
   16), per target, then averaged over targets.
4. Tuning (harness rule): every trained arm's learning rate is chosen by ``tune_per_arm`` on tuning seed 1000
   (never reported) from a log grid of 3 (factor 3) around its own natural scale, extended at an edge.
5. Mechanism checks: pretraining reached a plateau; pretraining learned more than the code frequencies; the
   data reward a learned forecaster over per-neuron ridge AR; every tuned rate is inside its grid (runner).
``config["null"] = True`` switches the method back to the baseline: the calm arm is trained from scratch.
Secondary (recorded, not judged): behaviour decoding R^2 from ridge on frozen pooled features vs raw dF/F.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ...core.adapters import AdapterConfig, LoRALinear, inject_adapters
from ...core.io import atomic_write_bytes
from ...core.logging import log_metrics
from ...core.progress import progress
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import LogGrid, tune_per_arm
from .baselines import build_baseline
from .config import CalMConfig
from .decoding import ContrastiveEncoder, DecodingHead, PatchGRU, PatchMLP
from .model import CalM, fit_tokenizer, patchify, poco_score, r2_score, ridge_fit, ridge_predict
from .simulator import Session, SimConfig, simulate_session

PLATEAU_MAX_REMAINING = 0.1
"""pretrain_plateau: CE drop over the last 20% of steps / total CE drop from ln K must stay below this."""
BEYOND_UNIGRAM_MIN = 0.25
"""pretraining_acted: nats by which the final CE must undercut the entropy of the code frequencies."""
LEARNED_OVER_AR_MIN = 0.02
"""data_reward_learning: best pooled learned baseline minus ridge AR (POCO score), seed mean."""
POOLED = ("nlinear", "gru", "poco")
PER_TARGET = ("tsmixer",)
ARMS = ("calm", "scratch", "ar_linear", "nlinear", "tsmixer", "gru", "poco", "calm_zeroshot", "copy_last")
BASELINES = ("scratch", "ar_linear", "nlinear", "tsmixer", "gru", "poco")


def _sim(config: Mapping[str, Any]) -> SimConfig:
    """The simulator a config names; ``sim_burn_in`` (decoding/probe v2) drops the latent start-up transient."""
    kw = {"burn_in": int(config.get("sim_burn_in", 0))}
    return SimConfig.legacy(**kw) if config.get("sim") == "legacy" else SimConfig(**kw)


def _sessions(config: Mapping[str, Any], seed: int) -> tuple[list[Session], list[Session]]:
    kw = {"n_neurons": config["n_neurons"], "sim": _sim(config)}
    nf = config["n_families"]
    pre = [simulate_session(f, seed * 1000 + k, n_frames=config["pretrain_frames"], **kw)
           for f in range(nf) for k in range(config["sessions_per_family"])]
    n_tgt = config["target_train_frames"] + config["target_test_frames"]
    fams = list(range(config["heldout_sessions"])) + list(range(nf, nf + config["heldout_animals"]))
    return pre, [simulate_session(f, seed * 1000 + 999, n_frames=n_tgt, **kw) for f in fams]


def _window(config: Mapping[str, Any]) -> int:
    return (config["ctx_patches"] + config["hor_patches"]) * config["patch_len"]


def _model_config(config: Mapping[str, Any]) -> CalMConfig:
    return CalMConfig(patch_len=config["patch_len"], codebook_size=config["codebook_size"],
                      tokenizer=config["tokenizer"], d_model=config["d_model"], n_blocks=config["n_blocks"],
                      n_heads=config["n_heads"], max_patches=config["max_patches"],
                      neural_axis=config.get("neural_axis", "bidirectional"), rvq_stages=config.get("rvq_stages", 2))


def _batch(traces: list[torch.Tensor], config: Mapping[str, Any], gen: torch.Generator) -> torch.Tensor:
    """(batch, train_neurons, W) windows from one random session; a random neuron subset per batch (the models
    are permutation invariant over neurons, so any subset is a valid population and training is cheaper)."""
    W = _window(config)
    x = traces[int(torch.randint(len(traces), (1,), generator=gen))]
    k = min(config["train_neurons"], x.shape[0])
    idx = torch.randperm(x.shape[0], generator=gen)[:k]
    starts = torch.randint(0, x.shape[1] - W + 1, (config["batch_size"],), generator=gen).tolist()
    return torch.stack([x[idx, s:s + W] for s in starts])


def _fit(model: torch.nn.Module, loss_fn, traces: list[torch.Tensor], steps: int, lr: float,
         config: Mapping[str, Any], gen: torch.Generator, desc: str, *, cosine: bool = False,
         ckpt: Path | None = None, every: int = 100) -> list[float]:
    """AdamW on random windows; ``cosine``: 5% linear warm-up then cosine decay to 10% of ``lr``.

    ``ckpt``: every ``every`` steps the model, optimizer, schedule, batch generator and losses are written there
    atomically; a later call with the same path resumes from it and ends bit-identical to an uninterrupted run."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)

    def factor(i: int) -> float:
        if not cosine:
            return 1.0
        if i < warm:
            return (i + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses: list[float] = []
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        losses = state["losses"]
    model.train()
    for step in progress(range(len(losses), steps), desc=desc, total=steps - len(losses)):
        loss = loss_fn(model, _batch(traces, config, gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if ckpt is not None and ((step + 1) % every == 0 or step + 1 == steps):
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "gen": gen.get_state(), "losses": losses}, buf)
            atomic_write_bytes(ckpt, buf.getvalue())
    model.eval()
    return losses


def _calm_loss(model: CalM, batch: torch.Tensor) -> torch.Tensor:
    return model.loss(batch)


def _forecast_loss(config: Mapping[str, Any]):
    ctx = config["ctx_patches"] * config["patch_len"]

    def loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[..., :ctx]), batch[..., ctx:])
    return loss


def init_model(tokenizer, config: Mapping[str, Any], seed: int) -> CalM:
    torch.manual_seed(seed)
    return CalM(_model_config(config), tokenizer)


def adapt(pretrained: CalM | None, train: np.ndarray, config: Mapping[str, Any], lr: float, seed: int,
          tokenizer=None) -> CalM:
    """Fit a model to one target session's train part (N, T) for ``finetune_steps``.

    ``pretrained=None`` is the from-scratch arm: fresh init from ``seed`` on ``tokenizer`` (the pretraining
    sessions' tokenizer, shared with calm). Passing ``init_model(tokenizer, config, seed)`` gives the same weights.
    """
    if pretrained is None:
        model = init_model(tokenizer, config, seed)
    else:
        model = copy.deepcopy(pretrained)
    traces = [torch.as_tensor(train)]
    _fit(model, _calm_loss, traces, config["finetune_steps"], lr, {**config, "train_neurons": train.shape[0]},
         torch.Generator().manual_seed(seed), "adapt to target")
    return model


def _tokenizer(pre: list[Session], config: Mapping[str, Any], seed: int):
    P = config["patch_len"]
    patches = torch.cat([patchify(torch.as_tensor(s.dff), P).reshape(-1, P) for s in pre])
    if config["tokenizer"] == "continuous":
        return None
    return fit_tokenizer(config["tokenizer"], patches, config["codebook_size"], seed=seed,
                         steps=config["tokenizer_steps"], stages=config.get("rvq_stages", 2))


def _unigram_entropy(tok, pre: list[Session], config: Mapping[str, Any]) -> float:
    codes = torch.cat([tok.encode(patchify(torch.as_tensor(s.dff), config["patch_len"])).flatten() for s in pre])
    p = torch.bincount(codes, minlength=config["codebook_size"]).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def _pretrain(pre: list[Session], tok, config: Mapping[str, Any], seed: int) -> tuple[CalM, list[float]]:
    model = init_model(tok, config, seed)
    ckpt = None
    if config.get("checkpoint_dir"):  # keyed by the config, so a changed config never resumes a stale run
        key = hashlib.sha256(json.dumps({k: v for k, v in config.items() if k != "checkpoint_dir"}, sort_keys=True,
                                        default=str).encode()).hexdigest()[:12]
        ckpt = Path(config["checkpoint_dir"]).expanduser() / f"calm_pretrain_{key}_seed{seed}.pt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    losses = _fit(model, _calm_loss, [torch.as_tensor(s.dff) for s in pre], config["pretrain_steps"],
                  config["lr"], config, torch.Generator().manual_seed(seed), "CalM pretraining", cosine=True,
                  ckpt=ckpt, every=config.get("checkpoint_every", 100))
    return model, losses


def _train_baseline(name: str, traces: list[torch.Tensor], config: Mapping[str, Any], lr: float, seed: int,
                    steps: int) -> torch.nn.Module:
    ctx, hor = config["ctx_patches"] * config["patch_len"], config["hor_patches"] * config["patch_len"]
    torch.manual_seed(seed)
    n = traces[0].shape[0] if name in PER_TARGET else config["train_neurons"]
    model = build_baseline(name, ctx, hor, n)
    cfg = {**config, "train_neurons": n}
    _fit(model, _forecast_loss(config), traces, steps, lr, cfg, torch.Generator().manual_seed(seed), f"{name}")
    return model


def _test_windows(config: Mapping[str, Any], dff: np.ndarray) -> np.ndarray:
    W, stride = _window(config), config["hor_patches"] * config["patch_len"]
    test = dff[:, config["target_train_frames"]:]
    return np.stack([test[:, s:s + W] for s in range(0, test.shape[1] - W + 1, stride)])  # (M, N, W)


def _score(predict, windows: np.ndarray, config: Mapping[str, Any]) -> float:
    ctx = config["ctx_patches"] * config["patch_len"]
    with torch.no_grad():
        pred = predict(torch.as_tensor(windows[:, :, :ctx])).cpu().numpy()
    return poco_score(pred, windows[:, :, ctx:], windows[:, :, ctx - 1])


def _calm_predictor(model: CalM, config: Mapping[str, Any]):
    return lambda ctx: model.forecast(ctx, config["hor_patches"])


def _ar_linear_score(windows: np.ndarray, train: np.ndarray, config: Mapping[str, Any]) -> float:
    ctx, W = config["ctx_patches"] * config["patch_len"], _window(config)
    pred = np.zeros_like(windows[:, :, ctx:])
    for n in range(train.shape[0]):
        seg = np.lib.stride_tricks.sliding_window_view(train[n], W)
        Wn = ridge_fit(seg[:, :ctx], seg[:, ctx:], config["ridge_alpha"])
        pred[:, n] = ridge_predict(Wn, windows[:, n, :ctx])
    return poco_score(pred, windows[:, :, ctx:], windows[:, :, ctx - 1])


def _decode_r2(feats_fn, sess: Session, config: Mapping[str, Any]) -> float:
    """Ridge from per-patch features to the patch-mean behaviour; fit on the train part, R^2 on the test part."""
    P, ntr = config["patch_len"], config["target_train_frames"] // config["patch_len"]
    seg = config["max_patches"] * P
    n_win = sess.dff.shape[1] // seg
    feats = torch.cat([feats_fn(torch.as_tensor(sess.dff[None, :, i * seg:(i + 1) * seg]))[0]
                       for i in range(n_win)]).numpy()
    y = patchify(torch.as_tensor(sess.behavior[:n_win * seg]), P).mean(-1).numpy()
    W = ridge_fit(feats[:ntr], y[:ntr, None], config["ridge_alpha"])
    return r2_score(ridge_predict(W, feats[ntr:]), y[ntr:, None])


def prepared_lr(prepared: Any, arm: str, config: Mapping[str, Any]) -> float:
    if prepared:
        return float(prepared["tuning"]["chosen"][arm])
    return float(config[f"{arm}_lr_center"])


TUNED = ("calm", "scratch", "nlinear", "tsmixer", "gru", "poco")


def tune_lrs(config: Mapping[str, Any]) -> dict:
    """Per-arm learning rate (harness rule): a log grid around each arm's own natural scale, scored by the mean
    POCO score over the tuning seed's targets after the arm's full training budget; the tuning seed's data,
    tokenizer and pretraining follow the same protocol as the reported seeds, and no reported seed enters."""
    torch.set_num_threads(1)
    cache: dict[int, Any] = {}

    def setup(seed: int):
        if seed not in cache:
            pre, tgt = _sessions(config, seed)
            tok = _tokenizer(pre, config, seed)
            cache[seed] = (pre, tgt, tok)
        return cache[seed]

    pretrained: dict[int, CalM] = {}

    def score(arm: str, lr: float, seed: int) -> float:
        pre, tgt, tok = setup(seed)
        return float(np.mean(list(_arm_scores(arm, lr, pre, tgt, tok, config, seed, pretrained).values())))

    arms = [a for a in TUNED if a in config["arms"]]
    grids = {a: LogGrid(center=config[f"{a}_lr_center"], factor=3.0, size=config["lr_grid_size"]) for a in arms}
    return {"tuning": tune_per_arm(grids, score, mode="max", desc="calm lr")}


def _arm_scores(arm: str, lr: float, pre, tgt, tok, config, seed, pretrained: dict) -> dict[int, float]:
    """POCO score per target of one trained arm at rate ``lr`` (the tuning objective and the reported run)."""
    trains = [s.dff[:, :config["target_train_frames"]] for s in tgt]
    if arm == "calm":
        if seed not in pretrained:
            pretrained[seed] = _pretrain(pre, tok, config, seed)[0]
        return {i: _score(_calm_predictor(adapt(pretrained[seed], tr, config, lr, seed * 100 + i), config),
                          _test_windows(config, s.dff), config) for i, (s, tr) in enumerate(zip(tgt, trains))}
    if arm == "scratch":
        return {i: _score(_calm_predictor(adapt(None, tr, config, lr, seed * 100 + i, tok), config),
                          _test_windows(config, s.dff), config) for i, (s, tr) in enumerate(zip(tgt, trains))}
    if arm in POOLED:
        pool = [torch.as_tensor(s.dff) for s in pre] + [torch.as_tensor(tr) for tr in trains]
        m = _train_baseline(arm, pool, config, lr, seed, config["baseline_steps"])
        return {i: _score(m, _test_windows(config, s.dff), config) for i, s in enumerate(tgt)}
    if arm in PER_TARGET:
        return {i: _score(_train_baseline(arm, [torch.as_tensor(tr)], config, lr, seed * 100 + i,
                                          config["finetune_steps"]), _test_windows(config, s.dff), config)
                for i, (s, tr) in enumerate(zip(tgt, trains))}
    raise ValueError(f"arm {arm!r} is not trained")


def plateau_remaining(losses: list[float], log_k: float) -> float:
    """(mean CE over steps [60%, 80%) - mean CE over the last 20%) / (ln K - mean CE over the last 20%): the
    share of the total drop from uniform that the last fifth of pretraining still achieved (0 = flat)."""
    n = len(losses)
    a, b = np.mean(losses[int(0.6 * n):int(0.8 * n)]), np.mean(losses[int(0.8 * n):])
    return float((a - b) / max(log_k - b, 1e-9))


def run_seed(config: Mapping[str, Any], seed: int, prepared: Any = None) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    pre, tgt = _sessions(config, seed)
    tok = _tokenizer(pre, config, seed)
    null = bool(config.get("null"))
    pretrained, losses = _pretrain(pre, tok, config, seed)
    cache = {seed: pretrained}
    per_target: dict[str, dict[int, float]] = {}
    for arm in config["arms"]:
        if arm in TUNED:
            if arm == "calm" and null:  # the null switch: calm is trained from scratch at scratch's rate
                per_target[arm] = _arm_scores("scratch", prepared_lr(prepared, "scratch", config), pre, tgt, tok,
                                              config, seed, cache)
            else:
                per_target[arm] = _arm_scores(arm, prepared_lr(prepared, arm, config), pre, tgt, tok, config, seed,
                                              cache)
        elif arm == "calm_zeroshot":
            per_target[arm] = {i: _score(_calm_predictor(pretrained, config), _test_windows(config, s.dff), config)
                               for i, s in enumerate(tgt)}
        elif arm == "ar_linear":
            per_target[arm] = {i: _ar_linear_score(_test_windows(config, s.dff),
                                                   s.dff[:, :config["target_train_frames"]], config)
                               for i, s in enumerate(tgt)}
        elif arm == "copy_last":
            per_target[arm] = {i: 0.0 for i in range(len(tgt))}
    n_sess = config["heldout_sessions"]
    arms = {}
    for a, v in per_target.items():
        vals = [v[i] for i in range(len(tgt))]
        arms[a] = {"score": float(np.mean(vals)), "score_heldout_sessions": float(np.mean(vals[:n_sess])),
                   "score_heldout_animals": float(np.mean(vals[n_sess:])),
                   **{f"score_target{j}": float(s) for j, s in enumerate(vals)}}
    final_ce = float(np.mean(losses[-max(1, len(losses) // 10):])) if losses else float("nan")
    stats = {"pretrain_final_loss": final_ce, "wall_s": 0.0}
    if tok is not None:
        stats["code_unigram_entropy"] = _unigram_entropy(tok, pre, config)
        dec = [_decode_r2(pretrained.pooled_features, s, config) for s in tgt]
        raw = [_decode_r2(lambda x: patchify(x, config["patch_len"]).permute(0, 2, 1, 3).flatten(2), s, config)
               for s in tgt]
        stats["decode_r2_calm_zeroshot_features"], stats["decode_r2_ridge_raw"] = float(np.mean(dec)), float(
            np.mean(raw))
    base = [b for b in BASELINES if b in arms]
    if "calm" in arms and base:
        best = max(base, key=lambda b: arms[b]["score"])
        stats["forecast_gain"] = arms["calm"]["score"] - arms[best]["score"]
        stats["best_baseline_index"] = float(BASELINES.index(best))
        for part in ("heldout_sessions", "heldout_animals"):
            stats[f"gain_{part}"] = arms["calm"][f"score_{part}"] - max(arms[b][f"score_{part}"] for b in base)
        if "scratch" in arms:
            stats["gain_over_scratch"] = arms["calm"]["score"] - arms["scratch"]["score"]
    learned = [arms[b]["score"] for b in POOLED if b in arms]
    checks = {}
    if losses and tok is not None:
        log_k = float(np.log(config["codebook_size"]))
        checks["pretrain_plateau"] = plateau_remaining(losses, log_k)
        checks["pretraining_acted"] = stats["code_unigram_entropy"] - final_ce
    if learned and "ar_linear" in arms:
        checks["data_reward_learning"] = max(learned) - arms["ar_linear"]["score"]
    stats["wall_s"] = time.perf_counter() - start
    log_metrics(seed, **{f"{a}_score": v["score"] for a, v in arms.items()})
    return {"arms": arms, "statistics": stats, "curves": {"pretrain_ce": losses[::max(1, len(losses) // 100)]},
            "checks": checks}


def _cfg(**kw: Any) -> dict:
    base = {"sim": "v3", "n_families": 3, "sessions_per_family": 3, "heldout_sessions": 1, "heldout_animals": 1,
            "n_neurons": 32, "pretrain_frames": 2000, "target_train_frames": 480, "target_test_frames": 1200,
            "patch_len": 8, "ctx_patches": 6, "hor_patches": 2, "max_patches": 16, "codebook_size": 64,
            "tokenizer": "vqvae", "tokenizer_steps": 300, "d_model": 32, "n_blocks": 2, "n_heads": 4,
            "neural_axis": "bidirectional", "batch_size": 8, "train_neurons": 16, "lr": 3e-3,
            "pretrain_steps": 300, "finetune_steps": 60, "baseline_steps": 200, "ridge_alpha": 1.0,
            "calm_lr_center": 1e-3, "scratch_lr_center": 3e-3, "nlinear_lr_center": 3e-3,
            "tsmixer_lr_center": 1e-2, "gru_lr_center": 3e-3, "poco_lr_center": 1e-3, "lr_grid_size": 3,
            "arms": list(ARMS)}
    unknown = set(kw) - set(base) - {"null", "checkpoint_dir", "checkpoint_every"}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    return {**base, **kw}


# ------------------------------------------------------------------------------------------- decoding claim
DECODE_ARMS = ("calm_head", "calm_lora", "ridge_raw", "mlp", "gru_dec", "cebra")
DECODE_BASELINES = ("ridge_raw", "mlp", "gru_dec", "cebra")
DECODE_TUNED = {"calm_head": "lr", "calm_lora": "lr", "ridge_raw": "alpha", "mlp": "lr", "gru_dec": "lr",
                "cebra": "alpha"}
LABELS_INFORMATIVE_MIN = 0.2
"""labels_informative: ridge on raw dF/F with all labels must reach this R^2 (seed mean): the behaviour is decodable."""


def _decode_data(sess: Session, config: Mapping[str, Any], label_seed: int = 0) -> dict:
    """Per-patch inputs and targets of one target session: patch means (T, N), z-scored behaviour (T,), the raw
    windows for the backbone (n_win, N, W), the number of train patches and ``order``, the train patches in the
    order they receive labels (v2: a random permutation from ``label_seed``, so a label fraction is a random subset
    shared by every arm and nested across fractions; v1, ``label_order="first"``: the first patches in time)."""
    P, W = config["patch_len"], config["max_patches"] * config["patch_len"]
    if config["target_train_frames"] % W:
        raise ValueError(f"target_train_frames ({config['target_train_frames']}) must be a multiple of the backbone "
                         f"window max_patches * patch_len = {W} so train and test windows do not overlap")
    n_win = sess.dff.shape[1] // W
    dff = torch.as_tensor(sess.dff[:, :n_win * W])
    means = patchify(dff, P).mean(-1).T.contiguous()  # (T, N)
    y = patchify(torch.as_tensor(sess.behavior[:n_win * W]), P).mean(-1).float()
    n_train = config["target_train_frames"] // P
    y = (y - y[:n_train].mean()) / y[:n_train].std().clamp_min(1e-6)
    windows = dff.reshape(dff.shape[0], n_win, W).transpose(0, 1)  # (n_win, N, W)
    if config.get("label_order", "first") == "random":
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(label_seed))
    else:
        order = torch.arange(n_train)
    return {"x": means, "y": y, "windows": windows, "n_train": n_train, "order": order}


def _r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    return r2_score(pred.detach().cpu().numpy()[:, None], y.cpu().numpy()[:, None])


def _adam(params, steps: int, lr: float, loss_fn) -> None:
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _label_windows(lab: torch.Tensor, patches_per_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted labelled patch indices (L,) -> the backbone windows that hold one (W',) and each labelled patch's
    position in those windows' flattened outputs (L,): only those windows enter a head's loss."""
    wins = torch.unique(lab // patches_per_window)
    return wins, torch.searchsorted(wins, lab // patches_per_window) * patches_per_window + lab % patches_per_window


def _decode_arm(arm: str, value: float, d: dict, n_lab: int, backbone: CalM | None, config: Mapping[str, Any],
                seed: int) -> float:
    """Test R^2 of one decoder trained with the first ``n_lab`` train patches of ``d["order"]`` labelled (inputs of
    every train patch may be used, as a self-supervised learner would); ``value`` is its tuned rate or ridge
    penalty."""
    torch.manual_seed(seed)
    x, y, ntr, steps = d["x"], d["y"], d["n_train"], config["decode_steps"]
    lab = d["order"][:n_lab].sort().values
    if arm == "ridge_raw":
        W = ridge_fit(x[lab].numpy(), y[lab, None].numpy(), value)
        return r2_score(ridge_predict(W, x[ntr:].numpy()), y[ntr:, None].numpy())
    if arm == "mlp":
        m = PatchMLP(x.shape[1])
        _adam(m.parameters(), steps, value, lambda: nn_mse(m(x[lab]), y[lab]))
        return _r2(m(x[ntr:]), y[ntr:])
    if arm == "gru_dec":
        m = PatchGRU(x.shape[1])
        _adam(m.parameters(), steps, value, lambda: nn_mse(m(x[:ntr])[lab], y[lab]))
        return _r2(m(x)[ntr:], y[ntr:])
    if arm == "cebra":
        enc = ContrastiveEncoder(x.shape[1])
        gen = torch.Generator().manual_seed(seed)
        _adam(enc.parameters(), steps, 3e-3,
              lambda: enc.loss(x[:ntr], torch.randint(0, ntr - 1, (min(64, ntr - 1),), generator=gen)))
        with torch.no_grad():
            z = enc(x)
        W = ridge_fit(z[lab].numpy(), y[lab, None].numpy(), value)
        return r2_score(ridge_predict(W, z[ntr:].numpy()), y[ntr:, None].numpy())
    if arm in ("calm_head", "calm_lora"):
        model = copy.deepcopy(backbone)
        inputs = model.inputs_from_traces(d["windows"])  # (n_win, N, T_p)
        head = DecodingHead(config["d_model"], config["n_heads"])
        wins, pos = _label_windows(lab, config["max_patches"])
        if arm == "calm_head":
            with torch.no_grad():
                h = model.features(inputs[wins])
            params, feats = list(head.parameters()), lambda: h
        else:
            inject_adapters(model, AdapterConfig(r=4, alpha=8.0, target_modules=r".*mlp\.[02]"),
                            lambda lin, r, a, name: LoRALinear(lin, r, a))
            params = list(head.parameters()) + [p for p in model.parameters() if p.requires_grad]
            feats = lambda: model.features(inputs[wins])  # noqa: E731
        _adam(params, steps, value, lambda: nn_mse(head(feats()).flatten()[pos], y[lab]))
        with torch.no_grad():
            pred = head(model.features(inputs)).flatten()
        return _r2(pred[ntr:], y[ntr:])
    raise ValueError(f"unknown decoding arm {arm!r}")


def nn_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(a, b)


def _decode_setup(config: Mapping[str, Any], seed: int) -> tuple[CalM, list[dict], float]:
    pre, tgt = _sessions(config, seed)
    tok = _tokenizer(pre, config, seed)
    backbone, losses = _pretrain(pre, tok, config, seed)
    acted = _unigram_entropy(tok, pre, config) - float(np.mean(losses[-max(1, len(losses) // 10):]))
    return backbone, [_decode_data(s, config, seed * 100 + i) for i, s in enumerate(tgt)], acted


def _n_labels(d: dict, frac: float) -> int:
    return max(2, int(round(frac * d["n_train"])))


def _pct(frac: float) -> str:
    return f"{int(round(100 * frac))}pct"


def _decoder_value(prepared: Any, arm: str, frac: float, config: Mapping[str, Any]) -> float:
    """An arm's tuned rate or penalty at a label fraction: its per-fraction choice ("arm@5pct", v2.1) if tuned per
    fraction, else its single choice (v1/v2), else (no tuning) its grid centre."""
    if not prepared:
        return float(config[f"{arm}_center"])
    chosen = prepared["tuning"]["chosen"]
    return float(chosen[f"{arm}@{_pct(frac)}"] if f"{arm}@{_pct(frac)}" in chosen else chosen[arm])


def tune_decoders(config: Mapping[str, Any]) -> dict:
    """Per-arm rate (neural decoders) or ridge penalty (ridge_raw, cebra's readout) by the harness rule on tuning
    seed 1000: test R^2 over its targets and every label fraction, reduced by ``tune_reduce`` (v2: the median, so
    a few wild low-label fits cannot decide; v1: the mean). ``tune_per_fraction`` (v2.1): one choice per arm and
    label fraction ("arm@5pct"), each scored on that fraction only, since a penalty or rate that suits 8 labels
    need not suit 160."""
    reduce = np.median if config.get("tune_reduce", "mean") == "median" else np.mean
    per_fraction = bool(config.get("tune_per_fraction", False))
    torch.set_num_threads(1)
    cache: dict[int, Any] = {}

    def score(key: str, value: float, seed: int) -> float:
        if seed not in cache:
            cache[seed] = _decode_setup(config, seed)
        backbone, data, _ = cache[seed]
        arm, _, pct = key.partition("@")
        fracs = [f for f in config["label_fractions"] if not pct or _pct(f) == pct]
        return float(reduce([_decode_arm(arm, value, d, _n_labels(d, f), backbone, config, seed * 100 + i)
                             for i, d in enumerate(data) for f in fracs]))

    arms = [a for a in DECODE_ARMS if a in config["arms"]]
    keys = [(a, f"{a}@{_pct(f)}") for a in arms for f in config["label_fractions"]] if per_fraction else \
        [(a, a) for a in arms]
    grids = {k: LogGrid(center=config[f"{a}_center"], factor=3.0, size=config["lr_grid_size"],
                        upper=math.inf if DECODE_TUNED[a] == "alpha" else 1.0) for a, k in keys}
    return {"tuning": tune_per_arm(grids, score, mode="max", desc="calm decoders")}


def run_decode_seed(config: Mapping[str, Any], seed: int, prepared: Any = None) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    backbone, data, acted = _decode_setup(config, seed)
    arms: dict[str, dict] = {}
    for arm in config["arms"]:
        src = "ridge_raw" if (arm == "calm_head" and config.get("null")) else arm  # null: calm becomes ridge
        arms[arm] = {}
        for f in config["label_fractions"]:
            value = _decoder_value(prepared, src, f, config)
            r2s = [_decode_arm(src, value, d, _n_labels(d, f), backbone, config, seed * 100 + i)
                   for i, d in enumerate(data)]
            arms[arm][f"r2_{int(round(100 * f))}pct"] = float(np.mean(r2s))
    lo = f"r2_{int(round(100 * min(config['label_fractions'])))}pct"
    for a in arms:
        arms[a]["score"] = arms[a][lo]
    stats = {"wall_s": time.perf_counter() - start}
    base = [b for b in DECODE_BASELINES if b in arms]
    if "calm_head" in arms and base:
        for key in arms["calm_head"]:
            if key.startswith("r2_"):
                stats[f"gain_{key[3:]}"] = arms["calm_head"][key] - max(arms[b][key] for b in base)
        stats["decode_gain_low_label"] = stats[f"gain_{lo[3:]}"]
    hi = f"r2_{int(round(100 * max(config['label_fractions'])))}pct"
    checks = {"pretraining_acted": acted}
    if "ridge_raw" in arms:
        checks["labels_informative"] = arms["ridge_raw"][hi]
    log_metrics(seed, **{f"{a}_score": v["score"] for a, v in arms.items()})
    return {"arms": arms, "statistics": stats, "curves": {}, "checks": checks}


def _dcfg(**kw: Any) -> dict:
    base = {**_cfg(), "sim_burn_in": 100, "label_order": "random", "tune_reduce": "median", "tune_per_fraction": True,
            "target_train_frames": 1280, "target_test_frames": 1280, "label_fractions": [0.05, 0.2, 1.0],
            "decode_steps": 100, "calm_head_center": 3e-3, "calm_lora_center": 1e-3, "ridge_raw_center": 10.0,
            "mlp_center": 1e-3, "gru_dec_center": 3e-3, "cebra_center": 1.0, "arms": list(DECODE_ARMS)}
    for k in ("calm_lr_center", "scratch_lr_center", "nlinear_lr_center", "tsmixer_lr_center", "gru_lr_center",
              "poco_lr_center", "finetune_steps", "baseline_steps"):
        base.pop(k)
    unknown = set(kw) - set(base) - {"null", "checkpoint_dir", "checkpoint_every"}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    return {**base, **kw}


# ------------------------------------------------------------------------------------------- linear-probe claim
PROBE_ARMS = ("calm_probe", "random_probe", "raw_probe")


def _probe_features(arm: str, d: dict, backbone: CalM, random_backbone: CalM, pool: str = "concat") -> np.ndarray:
    """(T, F) per-patch features: hidden states of the pretrained or the random-init backbone, or the per-neuron
    patch means of dF/F. ``pool="concat"`` (v2): every neuron's state side by side, F = N d (the probe is fit per
    session, so it may weight neurons differently, as the latent's mixing does); ``"mean"`` (v1): the neuron
    average, F = d."""
    if arm == "raw_probe":
        return d["x"].numpy()
    model = backbone if arm == "calm_probe" else random_backbone
    with torch.no_grad():
        h = model.features(model.inputs_from_traces(d["windows"]))  # (n_win, N, T_p, d)
    if pool == "mean":
        return h.mean(1).reshape(-1, h.shape[-1]).numpy()
    return h.permute(0, 2, 1, 3).reshape(h.shape[0] * h.shape[2], -1).numpy()


def _probe_setup(config: Mapping[str, Any], seed: int) -> tuple[dict, list[dict], float]:
    pre, tgt = _sessions(config, seed)
    tok = _tokenizer(pre, config, seed)
    backbone, losses = _pretrain(pre, tok, config, seed)
    random_backbone = init_model(tok, config, seed)  # the same init the pretraining started from
    acted = _unigram_entropy(tok, pre, config) - float(np.mean(losses[-max(1, len(losses) // 10):]))
    data = []
    for s in tgt:
        d = _decode_data(s, config)  # the probe uses every train patch, so the label order plays no part
        P, T = config["patch_len"], d["x"].shape[0]
        lat = torch.as_tensor(s.latents[:T * P]).reshape(T, P, -1).mean(1).numpy()  # patch-mean latent (T, D)
        data.append({**d, "latents": lat,
                     "feats": {a: _probe_features(a, d, backbone, random_backbone, config["probe_features"])
                               for a in PROBE_ARMS}})
    return {"acted": acted}, data, acted


def _probe_r2(feats: np.ndarray, lat: np.ndarray, ntr: int, alpha: float) -> float:
    """Ridge from features to the simulator's latent state, fit on the train patches, R^2 on the rest."""
    mu, sd = feats[:ntr].mean(0), feats[:ntr].std(0) + 1e-6  # standardise so one penalty scale fits every arm
    f = (feats - mu) / sd
    W = ridge_fit(f[:ntr], lat[:ntr], alpha)
    return r2_score(ridge_predict(W, f[ntr:]), lat[ntr:])


def tune_probes(config: Mapping[str, Any]) -> dict:
    """Per-arm ridge penalty by the harness rule on tuning seed 1000 (mean probe R^2 over its targets)."""
    torch.set_num_threads(1)
    cache: dict[int, Any] = {}

    def score(arm: str, alpha: float, seed: int) -> float:
        if seed not in cache:
            cache[seed] = _probe_setup(config, seed)[1]
        return float(np.mean([_probe_r2(d["feats"][arm], d["latents"], d["n_train"], alpha) for d in cache[seed]]))

    grids = {a: LogGrid(center=config["probe_alpha_center"], factor=3.0, size=config["probe_grid_size"])
             for a in PROBE_ARMS if a in config["arms"]}
    return {"tuning": tune_per_arm(grids, score, mode="max", desc="calm probes")}


def run_probe_seed(config: Mapping[str, Any], seed: int, prepared: Any = None) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    _, data, acted = _probe_setup(config, seed)
    arms = {}
    for arm in config["arms"]:
        src = "random_probe" if (arm == "calm_probe" and config.get("null")) else arm
        alpha = float(prepared["tuning"]["chosen"][src]) if prepared else float(config["probe_alpha_center"])
        arms[arm] = {"score": float(np.mean([_probe_r2(d["feats"][src], d["latents"], d["n_train"], alpha)
                                             for d in data]))}
    stats = {"wall_s": time.perf_counter() - start}
    if "calm_probe" in arms and "random_probe" in arms:
        stats["probe_gain"] = arms["calm_probe"]["score"] - arms["random_probe"]["score"]
    if "calm_probe" in arms and "raw_probe" in arms:
        stats["probe_gain_over_raw"] = arms["calm_probe"]["score"] - arms["raw_probe"]["score"]
    checks = {"pretraining_acted": acted}
    if "raw_probe" in arms:
        checks["latent_decodable"] = arms["raw_probe"]["score"]
    log_metrics(seed, **{f"{a}_score": v["score"] for a, v in arms.items()})
    return {"arms": arms, "statistics": stats, "curves": {}, "checks": checks}


def _pcfg(**kw: Any) -> dict:
    base = {k: v for k, v in _dcfg().items() if not k.endswith("_center") and k not in ("label_fractions",
                                                                                      "decode_steps",
                                                                                      "tune_per_fraction")}
    base.update({"probe_alpha_center": 1000.0, "probe_features": "concat", "probe_grid_size": 5,
                 "arms": list(PROBE_ARMS)})
    unknown = set(kw) - set(base) - {"null", "checkpoint_dir", "checkpoint_every"}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    return {**base, **kw}


SPECS = [
    ExperimentSpec(
        id="forecast_transfer", room="calm",
        claim="After self-supervised pretraining on many sessions and animals, CalM forecasts population calcium "
              "dynamics on held-out sessions and animals better than specialised baselines",
        paper_ref="arXiv 2604.04958, abstract (forecasting task); notes rl-federated-science.md 5.3-5.5",
        metric="POCO prediction score 1 - MSE/MSE(copy-last) over a 16-frame horizon from 48 frames of context, "
               "mean over held-out targets (held-out sessions of pretraining animals and held-out animals)",
        arms=ARMS, baseline="scratch",
        comparator=Comparator("forecast_gain", ">", 0.0,
                              "score(calm) - max over baselines (scratch, ar_linear, nlinear, tsmixer, gru, poco) "
                              "> 0 per seed"),
        run=run_seed, prepare=tune_lrs, null_value=0.0,
        checks=(MechanismCheck("pretrain_plateau", "<=", PLATEAU_MAX_REMAINING,
                               "pretraining reached a plateau: the last 20% of steps achieved at most "
                               f"{PLATEAU_MAX_REMAINING:g} of the CE drop from ln K"),
                MechanismCheck("pretraining_acted", ">=", BEYOND_UNIGRAM_MIN,
                               f"pretraining CE is at least {BEYOND_UNIGRAM_MIN:g} nat below the entropy of the "
                               "code frequencies (it learned context, not just which codes are common)"),
                MechanismCheck("data_reward_learning", ">=", LEARNED_OVER_AR_MIN,
                               "the simulated data reward learning shared dynamics: the best pooled learned "
                               f"baseline beats per-neuron ridge AR by at least {LEARNED_OVER_AR_MIN:g}",
                               reduce="mean")),
        tiers={"smoke": _cfg(n_families=2, sessions_per_family=1, pretrain_frames=400, target_test_frames=200,
                             codebook_size=16, tokenizer_steps=20, pretrain_steps=10, finetune_steps=2,
                             baseline_steps=2, lr_grid_size=1),
               "quick": _cfg(),
               "full": _cfg(n_families=6, sessions_per_family=4, heldout_sessions=3, heldout_animals=2,
                            n_neurons=64, pretrain_frames=4000, tokenizer_steps=1500, pretrain_steps=4000,
                            finetune_steps=300, baseline_steps=2000, d_model=64, n_blocks=4, train_neurons=32,
                            checkpoint_dir="~/.cache/icml26/calm")},
        seeds={"smoke": 1, "quick": 3, "full": 3},
        notes="Simulated data (nonlinear shared latents -> Poisson -> AR(2) GCaMP -> fluorescence with nuisance -> "
              "dF/F); VQ-VAE tokenizer; 2 dual-axis blocks of width 32 at the quick tier. Everything but the "
              "abstract is reconstructed.",
    ),
    ExperimentSpec(
        id="decode_low_label", room="calm",
        claim="With a task head, the pretrained CalM backbone decodes behaviour better than supervised decoders, "
              "most of all when labels are scarce",
        paper_ref="arXiv 2604.04958, abstract (behaviour decoding with a task head); notes 5.5 (5%/20%/100% labels)",
        metric="test R^2 of patch-mean running speed on held-out targets, at 5%, 20% and 100% of the target's "
               "train-part labels; judged at 5%",
        arms=DECODE_ARMS, baseline="ridge_raw",
        comparator=Comparator("decode_gain_low_label", ">", 0.0,
                              "R^2(calm_head) - max over ridge_raw, mlp, gru_dec, cebra at 5% labels > 0 per seed"),
        run=run_decode_seed, prepare=tune_decoders, null_value=0.0,
        checks=(MechanismCheck("pretraining_acted", ">=", BEYOND_UNIGRAM_MIN,
                               f"pretraining CE at least {BEYOND_UNIGRAM_MIN:g} nat below the code-frequency entropy"),
                MechanismCheck("labels_informative", ">=", LABELS_INFORMATIVE_MIN,
                               f"ridge on raw dF/F with all labels reaches R^2 >= {LABELS_INFORMATIVE_MIN:g}: the "
                               "behaviour is decodable from this data", reduce="mean")),
        tiers={"smoke": _dcfg(n_families=2, sessions_per_family=1, pretrain_frames=400, target_train_frames=256,
                              target_test_frames=256, codebook_size=16, tokenizer_steps=20, pretrain_steps=10,
                              decode_steps=3, lr_grid_size=1),
               "full": _dcfg()},
        seeds={"smoke": 1, "full": 3},
        notes="Full tier only (the room's quick-tier budget goes to the forecasting claim). Same simulator, "
              "tokenizer and pretraining as forecast_transfer; head = attention pooling over neurons + linear.",
    ),
    ExperimentSpec(
        id="probe_latents", room="calm",
        claim="Linear analyses of CalM's pretrained representations reveal the population's functional structure: "
              "a linear probe recovers the latent state better from pretrained than from untrained features",
        paper_ref="arXiv 2604.04958, abstract (linear analyses of the representations); notes 5.4 (probes of latents)",
        metric="test R^2 of a ridge probe from the per-patch hidden states of all neurons (concatenated) to the "
               "simulator's latent state (patch mean), on held-out targets",
        arms=PROBE_ARMS, baseline="random_probe",
        comparator=Comparator("probe_gain", ">", 0.0,
                              "R^2(probe on pretrained features) - R^2(probe on the same backbone at its random "
                              "init) > 0 per seed"),
        run=run_probe_seed, prepare=tune_probes, null_value=0.0,
        checks=(MechanismCheck("pretraining_acted", ">=", BEYOND_UNIGRAM_MIN,
                               f"pretraining CE at least {BEYOND_UNIGRAM_MIN:g} nat below the code-frequency "
                               "entropy"),
                MechanismCheck("latent_decodable", ">=", LABELS_INFORMATIVE_MIN,
                               f"a ridge probe on raw dF/F patch means reaches R^2 >= {LABELS_INFORMATIVE_MIN:g}: "
                               "the latent state is linearly present in the data at all", reduce="mean")),
        tiers={"smoke": _pcfg(n_families=2, sessions_per_family=1, pretrain_frames=400, target_train_frames=256,
                              target_test_frames=256, codebook_size=16, tokenizer_steps=20, pretrain_steps=10,
                              lr_grid_size=1),
               "full": _pcfg()},
        seeds={"smoke": 1, "full": 3},
        notes="Full tier only (the room's quick-tier budget goes to the forecasting claim). Same simulator, "
              "tokenizer and pretraining as forecast_transfer; raw_probe (ridge on dF/F patch means) is recorded.",
    ),
]
