"""Pretrain TabICLv2 on the synthetic prior: ``python -m icml26.methods.tabicl2.pretrain --out DIR ...``.

Recipe as released (stage 1 of ``scripts/train_v2_clf_stage1.sh`` in soda-inria/tabicl at 8f1aa20, scaled down):
cross-entropy on the test rows of prior datasets, Muon on all parameters (momentum 0.9 Nesterov, 5 NS steps,
lr * 0.2 sqrt(max(A, B)), decoupled wd 0.01), cosine schedule with warm-up down to 1e-7, gradient clipping 10,
train fraction U[0.3, 0.9]. Reduced here: rows <= 256 (official <= 1024), features <= 12 (official <= 100),
batch 16 (official 64), a few thousand steps (official 500k).

The schedule runs over ``--steps`` (deterministic) or over a wall-clock budget ``--minutes`` (the lr follows the
fraction of the budget used, so a slower machine sees fewer datasets but still completes its cosine). Every
``--ckpt-every`` steps the full state (model, optimizer, step, elapsed time) is written atomically to
``OUT/state.pt``; rerunning the same command resumes from it, losing at most one interval. ``OUT/log.jsonl`` holds
the loss curve and ``OUT/loss.png`` its plot; ``--export PATH`` writes the weights-only checkpoint
(``{"config", "state_dict", "meta"}``) that :class:`TabICLClassifier` loads.

``--task regression`` pretrains the v2 regressor instead (``scripts/train_v2_reg_stage1.sh`` in the release): the
network gets ``max_classes = 0`` (a linear target embedding and a head of ``num_quantiles`` quantiles), the prior
keeps the target continuous (standardised), and the loss is the pinball loss averaged over the quantile levels
linspace(0, 1, Q + 2)[1:-1]; the held-out metrics are the pinball loss and the R^2 of the predicted mean (the mean
of the sorted quantiles). :class:`TabICLRegressor` loads the exported checkpoint.

Under ``torchrun --nproc_per_node=K`` (gloo on CPU, NCCL on GPUs) each rank draws its own datasets and gradients
are averaged with all-reduce, so K processes train one model with K times the batch (``--steps`` mode only).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from icml26.core.io import atomic_write_bytes

from .config import TabICLConfig
from .muon import Muon
from .prior import sample_batch
from .reference import TabICL, pinball_loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/tabicl2/pretrain", help="run directory (state, log, plot)")
    p.add_argument("--export", default=None, help="write the weights-only checkpoint here at the end")
    p.add_argument("--steps", type=int, default=0, help="schedule length in steps (0: use --minutes)")
    p.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget for the schedule")
    p.add_argument("--batch", type=int, default=16, help="datasets per step (per rank)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--optimizer", choices=("muon", "muon_adamw", "adamw"), default="muon",
                   help="muon: Muon on every parameter (release); muon_adamw: AdamW for vectors; adamw: AdamW")
    p.add_argument("--warmup", type=float, default=0.02, help="warm-up fraction of the schedule")
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--min-rows", type=int, default=64)
    p.add_argument("--max-rows", type=int, default=256)
    p.add_argument("--max-features", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=4, help="held-out prior batches of 16 (256 rows, 8 features)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stop-at", type=int, default=0, help="leave after this step as if killed (tests resume)")
    p.add_argument("--task", choices=("classification", "regression"), default="classification",
                   help="regression: max_classes=0, quantile head, pinball loss, continuous prior targets")
    p.add_argument("--data-cache", default=None,
                   help="directory of per-step prior batches (safetensors), shared by runs with the same data stream "
                        "(seed, rows, features, batch, task): generated once, then read; the batches are identical "
                        "either way")
    p.add_argument("--model", default="{}", help="JSON overrides of TabICLConfig, e.g. '{\"ssmax\": \"none\"}'")
    return p.parse_args(argv)


def lr_factor(frac: float, warmup: float, floor: float = 5e-5) -> float:
    """Linear warm-up over ``warmup`` of the schedule, then cosine from 1 down to ``floor``."""
    if frac < warmup:
        return max(frac / warmup, 1e-3)
    t = min((frac - warmup) / max(1 - warmup, 1e-9), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def batch_shape(seed: int, step: int, args) -> tuple[int, int, int]:
    """(rows, features, n_train) of one step: rows log-uniform, features uniform, train fraction U[0.3, 0.9]."""
    rng = np.random.default_rng([seed, step, 7])
    rows = int(round(math.exp(rng.uniform(math.log(args.min_rows), math.log(args.max_rows)))))
    feats = int(rng.integers(1, args.max_features + 1))
    n_train = int(np.clip(round(rows * rng.uniform(0.3, 0.9)), 8, rows - 4))
    return rows, feats, n_train


def step_batch(args, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The prior batch of one step: X (batch, rows, features), y (batch, rows), n_train. Deterministic in
    (seed, step, rank, shape args); with ``--data-cache`` it is read from (or written once to) a safetensors file
    named by all of those, so ablation arms that share a data stream generate the prior once."""
    rows, feats, n_train = batch_shape(args.seed, step, args)
    seed = args.seed * 10 ** 9 + step * 1000 + rank

    def build() -> dict:
        X, y = sample_batch(seed, args.batch, rows, feats, n_train, task=args.task)
        return {"X": torch.from_numpy(X), "y": torch.from_numpy(y)}

    if not args.data_cache:
        b = build()
    else:
        from icml26.core.io import cached_tensors
        name = f"{args.task}_s{seed}_b{args.batch}_r{rows}_f{feats}_n{n_train}.safetensors"
        b = cached_tensors(Path(args.data_cache) / name, build)
    return b["X"], b["y"], n_train


def masked_ce(logits: torch.Tensor, y_test: torch.Tensor, y_train: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on test rows; logits of classes beyond each dataset's count are masked out."""
    n_cls = y_train.max(1).values + 1  # (B,)
    mask = torch.arange(logits.shape[-1], device=logits.device)[None, None] >= n_cls[:, None, None]
    logits = logits.masked_fill(mask, -1e9)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_test.reshape(-1))


def task_loss(pred: torch.Tensor, y_test: torch.Tensor, y_train: torch.Tensor, regression: bool) -> torch.Tensor:
    """Pinball loss over the quantile levels (regression) or class-masked cross-entropy (classification)."""
    return pinball_loss(pred, y_test) if regression else masked_ce(pred, y_test, y_train)


def make_optimizer(model: torch.nn.Module, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    return Muon(model.parameters(), lr=lr, momentum=0.9, nesterov=True, ns_steps=5, weight_decay=0.01,
                adamw_for_vectors=(kind == "muon_adamw"))


@torch.no_grad()
def evaluate(model: TabICL, val: list, device) -> dict:
    """Mean CE and accuracy (classification) or pinball loss and R^2 of the mean (regression) on fixed held-out
    prior batches."""
    model.eval()
    if model.cfg.regression:
        pin, r2 = [], []
        for X, y, n_train in val:
            X, y = X.to(device), y.to(device)
            q = model(X, y[:, :n_train])
            pin.append(pinball_loss(q, y[:, n_train:]).item())
            y_te = y[:, n_train:]
            mean = q.sort(-1).values.mean(-1)
            # per-dataset R^2 against the training mean (the y of every prior dataset is standardised on train)
            ss_res = ((mean - y_te) ** 2).sum(1)
            ss_tot = ((y_te - y[:, :n_train].mean(1, keepdim=True)) ** 2).sum(1)
            r2.append((1 - ss_res / ss_tot.clamp_min(1e-12)).mean().item())
        model.train()
        return {"val_pinball": float(np.mean(pin)), "val_r2": float(np.mean(r2))}
    ce, acc = [], []
    for X, y, n_train in val:
        X, y = X.to(device), y.to(device)
        logits = model(X, y[:, :n_train])
        ce.append(masked_ce(logits, y[:, n_train:], y[:, :n_train]).item())
        n_cls = y[:, :n_train].max(1).values + 1
        masked = logits.masked_fill(torch.arange(logits.shape[-1], device=device)[None, None] >= n_cls[:, None, None],
                                    -1e9)
        acc.append((masked.argmax(-1) == y[:, n_train:]).float().mean().item())
    model.train()
    return {"val_ce": float(np.mean(ce)), "val_acc": float(np.mean(acc))}


def validation_set(seed: int = 10 ** 6, n_batches: int = 4, batch: int = 16, task: str = "classification") -> list:
    out = []
    for b in range(n_batches):
        X, y = sample_batch(seed + b, batch, 256, 8, 192, task=task)
        out.append((torch.from_numpy(X), torch.from_numpy(y), 192))
    return out


def export_checkpoint(model: TabICL, path: str | os.PathLike, meta: dict) -> Path:
    """Weights-only checkpoint ``{"config", "state_dict", "meta"}`` (fp32), written atomically."""
    buf = io.BytesIO()
    torch.save({"config": model.cfg.to_dict(), "state_dict": {k: v.detach().cpu().float().contiguous()
                                                               for k, v in model.state_dict().items()},
                "meta": meta}, buf)
    return atomic_write_bytes(path, buf.getvalue())


def plot_log(log_path: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    tr = [r for r in rows if "loss" in r]
    key, name = ("val_pinball", "pinball loss") if any("val_pinball" in r for r in rows) else ("val_ce",
                                                                                                "cross-entropy")
    ev = [r for r in rows if key in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if tr:
        w = 20
        loss = np.array([r["loss"] for r in tr])
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid") if len(loss) >= w else loss
        ax.plot([r["datasets"] for r in tr][len(tr) - len(smooth):], smooth, label=f"train {name} (20-step mean)")
    if ev:
        ax.plot([r["datasets"] for r in ev], [r[key] for r in ev], "o-", label=f"held-out prior {name}")
    ax.set_xlabel("synthetic datasets seen")
    ax.set_ylabel(name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def init_distributed() -> None:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU), in a way that :func:`close_distributed` can undo.

    The first ``torch.optim.Optimizer`` built imports ``torch._dynamo``, and that import, once a default group
    exists, keeps about ten references to it (torch 2.13). ``destroy_process_group`` then cannot free gloo: its
    threads outlive ``main`` and are torn down at interpreter exit, where a rank now and then dies with SIGABRT
    ("terminate called without an active exception"; 1 of about 100 two-rank runs under CPU load, and a CI run).
    Importing it before the group exists leaves nothing behind.
    """
    import torch._dynamo  # noqa: F401  (import order matters, see above)
    import torch.distributed as dist
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def close_distributed() -> None:
    """Leave the process group: a barrier first, so no rank tears its transport down while a peer still reads
    (without it, 6 of 14 two-rank runs under CPU load died with SIGABRT), then ``destroy_process_group``."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if (args.steps > 0) == (args.minutes > 0):
        raise SystemExit("give exactly one of --steps N or --minutes M")
    torch.set_num_threads(args.threads)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        if args.minutes > 0:
            raise SystemExit("distributed runs need --steps (a wall-clock schedule would desynchronise ranks)")
        init_distributed()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path, log_path = out / "state.pt", out / "log.jsonl"

    torch.manual_seed(args.seed)
    regression = args.task == "regression"
    overrides = json.loads(args.model)
    if regression:
        if overrides.get("max_classes", 0) != 0:
            raise SystemExit("--task regression needs max_classes 0 (the quantile head); drop it from --model")
        overrides["max_classes"] = 0
    cfg = TabICLConfig(**overrides)
    model = TabICL(cfg).to(device)
    opt = make_optimizer(model, args.optimizer, args.lr)
    step, elapsed, datasets = 0, 0.0, 0
    if state_path.exists():
        st = torch.load(state_path, map_location=device, weights_only=False)
        if st["config"] != cfg.to_dict():
            raise SystemExit(f"{state_path} was written for another model config; use another --out")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed, datasets = st["step"], st["elapsed"], st["datasets"]
        print(f"resumed from step {step} ({elapsed / 60:.1f} min, {datasets} datasets)", flush=True)
    elif rank == 0 and log_path.exists():
        log_path.unlink()
    for g in opt.param_groups:
        g.setdefault("initial_lr", args.lr)
    val = validation_set(n_batches=args.val_batches, task=args.task) if rank == 0 else None
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"TabICL {n_params} parameters, optimizer {args.optimizer}, lr {args.lr}, world {world}", flush=True)

    def frac() -> float:
        return step / args.steps if args.steps > 0 else elapsed / (60 * args.minutes)

    def save_state() -> None:
        if rank != 0:
            return
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "datasets": datasets, "config": cfg.to_dict(), "args": vars(args)}, buf)
        atomic_write_bytes(state_path, buf.getvalue())

    log = open(log_path, "a") if rank == 0 else None
    t_last = time.time()
    recent = []
    while frac() < 1.0:
        X, y, n_train = step_batch(args, step, rank)
        rows, feats = X.shape[1], X.shape[2]
        X, y = X.to(device), y.to(device)
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(frac(), args.warmup, 1e-7 / args.lr)
        pred = model(X, y[:, :n_train])
        loss = task_loss(pred, y[:, n_train:], y[:, :n_train], regression)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            import torch.distributed as dist
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        datasets += args.batch * world
        now = time.time()
        elapsed += now - t_last
        t_last = now
        recent.append(loss.item())
        if rank == 0:
            log.write(json.dumps({"step": step, "datasets": datasets, "minutes": elapsed / 60, "loss": loss.item(),
                                  "lr": opt.param_groups[0]["lr"], "grad_norm": float(gnorm), "rows": rows,
                                  "features": feats}) + "\n")
            if step % 10 == 0:
                print(f"step {step} | {frac() * 100:5.1f}% | {elapsed / 60:6.1f} min | datasets {datasets} | "
                      f"loss {np.mean(recent):.4f} | lr {opt.param_groups[0]['lr']:.2e}", flush=True)
                recent = []
            if step % args.eval_every == 0:
                ev = evaluate(model, val, device)
                log.write(json.dumps({"step": step, "datasets": datasets, "minutes": elapsed / 60, **ev}) + "\n")
                print(f"  eval {ev}", flush=True)
            log.flush()
        if step % args.ckpt_every == 0:
            save_state()
            t_last = time.time()  # checkpoint time is not schedule time
        if args.stop_at and step >= args.stop_at:
            if world > 1:
                close_distributed()
            return {"stopped_at": step}
    sync = {}
    if world > 1:
        import torch.distributed as dist
        # Every rank must hold the same weights: gather a checksum of each rank's parameters. This collective runs
        # before rank 0's evaluation and plotting, so no rank waits inside gloo while rank 0 works alone.
        flat = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        sums = [torch.zeros(2, dtype=torch.float64, device=flat.device) for _ in range(world)]
        dist.all_gather(sums, torch.stack([flat.sum(), flat.square().sum()]))
        sync = {"ranks_in_sync": all(torch.equal(sums[0], s) for s in sums), "world_size": world}
        close_distributed()
    result = {}
    if rank == 0:
        save_state()
        ev = evaluate(model, val, device)
        log.write(json.dumps({"step": step, "datasets": datasets, "minutes": elapsed / 60, **ev}) + "\n")
        log.close()
        plot_log(log_path, out / "loss.png")
        result = {"steps": step, "datasets": datasets, "minutes": elapsed / 60, "params": n_params,
                  "optimizer": args.optimizer, "lr": args.lr, "task": args.task, **ev}
        if args.export:
            export_checkpoint(model, args.export, {**result, "args": vars(args)})
        print(json.dumps(result), flush=True)
        if sync:
            result.update(sync)
            print(json.dumps(sync), flush=True)
    return result


if __name__ == "__main__":
    main()
