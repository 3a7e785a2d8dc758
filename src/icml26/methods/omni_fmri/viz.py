"""Pictures people check by eye: the dynamic patch layout over a brain slice, and MAE reconstructions.

``python -m icml26.methods.omni_fmri.viz RUN.nii.gz --out layout.png`` renders the layout for your own 4-D run
(resampled to the 6 mm MNI grid unless ``--native``); ``--simulated`` draws a simulated chunk instead.
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


def render_layout_png(chunk: torch.Tensor, cfg: OmniFMRIConfig, out: str | Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 4.4))
    try:
        counts = draw_layout(ax, chunk, cfg)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=130)
        atomic_write_bytes(out, buf.getvalue())
    finally:
        plt.close(fig)
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nifti", nargs="?", help="4-D NIfTI run in MNI space")
    ap.add_argument("--out", default="omni_fmri_layout.png")
    ap.add_argument("--frames", type=int, default=10, help="frames per chunk (paper: 40)")
    ap.add_argument("--tau", type=float, default=0.23)
    ap.add_argument("--native", action="store_true", help="keep the file's grid instead of the 6 mm MNI grid")
    ap.add_argument("--simulated", action="store_true", help="draw a simulated chunk (no file needed)")
    args = ap.parse_args(argv)
    cfg = OmniFMRIConfig(in_frames=args.frames, thresholds=(args.tau,))
    if args.simulated or not args.nifti:
        from .simulate import SimSpec, simulate

        chunk = simulate(1, 1, 0, SimSpec(frames=args.frames)).tensor()[0]
    else:
        from .nifti import load_run, mni_on_grid

        target = None if args.native else ((32, 40, 32), mni_on_grid()[2])
        run = load_run(args.nifti, target=target, multiple=cfg.multiple)
        chunk = torch.from_numpy(np.ascontiguousarray(run.chunks(args.frames)[0]))
    counts = render_layout_png(chunk, cfg, args.out)
    print(f"wrote {args.out}: tokens per scale {counts}")


if __name__ == "__main__":
    main()
