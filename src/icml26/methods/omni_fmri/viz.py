"""Pictures people check by eye: the dynamic patch layout over a brain slice, and MAE reconstructions.

``python -m icml26.methods.omni_fmri.viz RUN.nii.gz --out layout.png`` renders the layout for your own 4-D run
(resampled to the 6 mm MNI grid unless ``--native``); ``--simulated`` draws a simulated chunk instead.
``--reconstruct`` adds input / masked / reconstruction panels: from ``--weights MODEL.pt`` (a ``state_dict`` of an
:class:`OmniMAE` built with the same ``--frames``, ``--tau``, ``--width``, ``--depth`` and grid), or else from a small
MAE pretrained here for ``--steps`` steps on the run's own chunks (enough to see the mechanics, not a foundation
model; the paper's weights are on the HF hub and not used here).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import torch

from ...core.io import atomic_write_bytes
from .config import OmniFMRIConfig
from .patching import tokenize


def draw_layout(ax, chunk: torch.Tensor, cfg: OmniFMRIConfig, *, axis_index: int | None = None) -> dict:
    """Frame-mean axial slice of one chunk (T, D, H, W) with the outline of every token crossing it (base scale
    thin white, coarser scales thick orange). Returns the token counts per scale of the whole chunk."""
    from matplotlib.patches import Rectangle

    tokens = tokenize(chunk[None], cfg)
    D = chunk.shape[-1]
    z = D // 2 if axis_index is None else axis_index
    ax.imshow(chunk.mean(0)[:, :, z].T.numpy(), cmap="gray", origin="lower")
    for s, c, ok in zip(tokens.scale[0].tolist(), tokens.coords[0].tolist(), tokens.valid[0].tolist()):
        p = cfg.patch_sizes[s]
        if ok and c[2] <= z < c[2] + p:
            ax.add_patch(Rectangle((c[0] - 0.5, c[1] - 0.5), p, p, fill=False, lw=0.4 if s == 0 else 1.6,
                                   ec="white" if s == 0 else "orange"))
    counts = {f"scale{s}": int(tokens.count(s)[0]) for s in range(cfg.num_scales)}
    ax.set_title(f"slice {z}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), fontsize=8)
    ax.set_axis_off()
    return counts


def draw_reconstruction(axes, model, chunk: torch.Tensor, *, frame: int = 0, seed: int = 0) -> None:
    """Three panels: input, masked input, reconstruction (masked tokens predicted) at one frame, middle slice."""
    recon, vox = model.reconstruct(chunk[None], generator=torch.Generator().manual_seed(seed))
    z = chunk.shape[-1] // 2
    masked = chunk.clone()
    masked[vox[0]] = float("nan")
    for ax, img, title in zip(axes, (chunk, masked, recon[0]), ("input", "masked", "reconstruction")):
        ax.imshow(img[frame, :, :, z].T.numpy(), cmap="gray", origin="lower", vmin=-2, vmax=2)
        ax.set_title(title, fontsize=8)
        ax.set_axis_off()


def _save(fig, out: str | Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130)
    atomic_write_bytes(out, buf.getvalue())


def render_layout_png(chunk: torch.Tensor, cfg: OmniFMRIConfig, out: str | Path, *, model=None,
                      seed: int = 0) -> dict:
    """Write a PNG of the layout of ``chunk`` (T, D, H, W); with ``model`` (an :class:`OmniMAE` on ``cfg``) also its
    input / masked / reconstruction panels. Returns the token counts per scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4 if model is not None else 1, figsize=(13, 3.6) if model is not None else (4, 4.4),
                             squeeze=False)
    try:
        counts = draw_layout(axes[0, 0], chunk, cfg)
        if model is not None:
            draw_reconstruction(axes[0, 1:], model, chunk, seed=seed)
        _save(fig, out)
    finally:
        plt.close(fig)
    return counts


def fit_small_mae(chunks: torch.Tensor, cfg: OmniFMRIConfig, *, steps: int, lr: float = 3e-3, batch: int = 4,
                  seed: int = 0):
    """A small :class:`OmniMAE` pretrained for ``steps`` steps on ``chunks`` (n, T, D, H, W), for the pictures."""
    from .model import OmniMAE
    from .train import TokenCache, pretrain

    if steps < 1:
        raise ValueError(f"steps must be >= 1 to pretrain a model for the reconstruction panels, got {steps}")
    torch.manual_seed(seed)
    model = OmniMAE(cfg, tuple(chunks.shape[2:]))
    cache = TokenCache(lambda idx: chunks[torch.as_tensor(idx)], len(chunks), cfg)
    pretrain(model, lambda idx: chunks[torch.as_tensor(idx)], len(chunks), cache, steps=steps,
             batch=min(batch, len(chunks)), lr=lr, seed=seed, desc="omni_fmri viz MAE")
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nifti", nargs="?", help="4-D NIfTI run in MNI space")
    ap.add_argument("--out", default="omni_fmri_layout.png")
    ap.add_argument("--frames", type=int, default=10, help="frames per chunk (paper: 40)")
    ap.add_argument("--tau", type=float, default=0.23)
    ap.add_argument("--native", action="store_true", help="keep the file's grid instead of the 6 mm MNI grid")
    ap.add_argument("--simulated", action="store_true", help="draw a simulated chunk (no file needed)")
    ap.add_argument("--reconstruct", action="store_true", help="add MAE reconstruction panels")
    ap.add_argument("--weights", help="state_dict of an OmniMAE with the same options (else one is pretrained here)")
    ap.add_argument("--steps", type=int, default=60, help="pretraining steps when no --weights are given")
    ap.add_argument("--width", type=int, default=48)
    ap.add_argument("--depth", type=int, default=2)
    args = ap.parse_args(argv)
    if args.weights and not args.reconstruct:
        ap.error("--weights is only used with --reconstruct")
    if args.reconstruct and not args.weights and args.steps < 1:
        raise ValueError(f"--steps must be >= 1 to pretrain a model for the reconstruction panels, got {args.steps}")
    cfg = OmniFMRIConfig(in_frames=args.frames, thresholds=(args.tau,), embed_dim=args.width, depth=args.depth,
                         num_heads=4, decoder_embed_dim=args.width, decoder_depth=1, decoder_num_heads=4)
    if args.simulated or not args.nifti:
        from .simulate import SimSpec, simulate

        chunks = simulate(2, 2, 0, SimSpec(frames=args.frames)).tensor()
    else:
        from .nifti import load_run, mni_on_grid

        target = None if args.native else ((32, 40, 32), mni_on_grid()[2])
        run = load_run(args.nifti, target=target, multiple=cfg.multiple)
        chunks = torch.from_numpy(np.ascontiguousarray(run.chunks(args.frames)))
    model = None
    if args.reconstruct:
        from .model import OmniMAE

        if args.weights:
            model = OmniMAE(cfg, tuple(chunks.shape[2:]))
            try:
                model.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
            except RuntimeError as err:  # shapes differ: say which options must match
                raise ValueError(f"{args.weights} does not fit an OmniMAE with --frames {args.frames} --width "
                                 f"{args.width} --depth {args.depth} on the grid {tuple(chunks.shape[2:])}: "
                                 f"{str(err).splitlines()[0]}") from err
        else:
            model = fit_small_mae(chunks, cfg, steps=args.steps)
    counts = render_layout_png(chunks[0], cfg, args.out, model=model)
    print(f"wrote {args.out}: tokens per scale {counts}")


if __name__ == "__main__":
    main()
