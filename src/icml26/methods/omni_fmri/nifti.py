"""NIfTI input and output for Omni-fMRI: the MNI152 brain mask and template from nilearn (offline), writing and
reading 4-D runs with nibabel, and a loader that prepares a user's own run the way the paper does.

Paper preprocessing (arXiv 2601.23090, Sec. 4.1; SwiFT's pipeline): MNI space, resampled with cubic B-splines,
padded or cropped to a fixed grid; runs whose TR is outside 0.7-0.8 s resampled in time to 0.72 s; global z-score
inside the brain mask; cut into chunks of T frames. Here the grid is whatever ``target`` says (the experiments use
6 mm voxels on a 32 x 40 x 32 grid instead of 2 mm on 96^3), and the temporal resampling is linear interpolation
(the paper does not name its method).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...core.assets import require

NEURO = "pip install 'icml26[neuro]'"
PAPER_TR = 0.72
KEEP_TR = (0.7, 0.8)
TR_RANGE = (0.2, 4.0)
"""TRs we resample from; outside this range linear interpolation to 0.72 s would invent or discard too much."""


def _nib():
    return require("nibabel", NEURO, purpose="reading and writing NIfTI files")


def grid_affine(shape: tuple[int, int, int], voxel_mm: float, centre_mm: tuple[float, float, float]) -> np.ndarray:
    """RAS affine of an isotropic grid of ``shape`` whose centre voxel sits at ``centre_mm`` (world mm)."""
    aff = np.diag([voxel_mm, voxel_mm, voxel_mm, 1.0])
    aff[:3, 3] = np.asarray(centre_mm, float) - voxel_mm * (np.asarray(shape, float) - 1) / 2
    return aff


MNI_BRAIN_CENTRE = (0.0, -18.0, 18.0)
"""Centre (mm) of the MNI152 brain mask's bounding box (x -90..90, y -126..90, z -72..108), rounded."""


@functools.lru_cache(maxsize=8)
def _mni(kind: str):
    datasets = require("nilearn.datasets", NEURO, purpose="the MNI152 templates")
    if kind == "mask":
        return datasets.load_mni152_brain_mask(resolution=2)
    return datasets.load_mni152_template(resolution=2)


@functools.lru_cache(maxsize=4)
def mni_on_grid(shape: tuple[int, int, int] = (32, 40, 32), voxel_mm: float = 6.0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The real MNI152 (ICBM 2009a) brain mask and T1 template shipped with nilearn, resampled to a coarser grid.

    Returns ``(mask (D, H, W) bool, t1 (D, H, W) float32 in [0, 1], affine (4, 4))``. The template is smoothed to the
    target voxel size before sampling (so that the coarse grid is not aliased) and sampled trilinearly; the mask is
    the trilinear resampling of the binary mask thresholded at 0.5. The result is cached under ``cache_dir("omni_fmri")``
    (building it takes ~15 s, mostly nilearn's import and the smoothing).
    """
    import torch

    from ...core.assets import cache_dir
    from ...core.io import cached_tensors

    key = f"mni152_{'x'.join(map(str, shape))}_{voxel_mm:g}mm.safetensors"
    t = cached_tensors(cache_dir("omni_fmri") / key, lambda: {
        k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in zip(("mask", "t1", "affine"),
                                                                     _build_mni(tuple(shape), float(voxel_mm)))})
    return t["mask"].numpy().astype(bool), t["t1"].numpy(), t["affine"].numpy()


def _build_mni(shape: tuple[int, int, int], voxel_mm: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    nib = _nib()
    processing = require("nibabel.processing", NEURO, purpose="resampling")
    aff = grid_affine(shape, voxel_mm, MNI_BRAIN_CENTRE)
    mask_img, t1_img = _mni("mask"), _mni("t1")
    fwhm = max(voxel_mm ** 2 - 2.0 ** 2, 0.0) ** 0.5
    t1_s = processing.smooth_image(t1_img, fwhm) if fwhm > 0 else t1_img
    t1 = np.asarray(processing.resample_from_to(t1_s, (shape, aff), order=1).dataobj, dtype=np.float32)
    mask_f = nib.Nifti1Image(np.asarray(mask_img.dataobj, dtype=np.float32), mask_img.affine)
    mask = np.asarray(processing.resample_from_to(mask_f, (shape, aff), order=1).dataobj) > 0.5
    return mask.astype(np.uint8), np.clip(t1, 0, None), aff


def save_run(path: str | Path, data: np.ndarray, affine: np.ndarray, tr: float) -> Path:
    """Write a 4-D run (X, Y, Z, T) as NIfTI-1 with the affine, mm/s units and the TR in the 4th zoom."""
    nib = _nib()
    data = np.asarray(data)
    if data.ndim != 4:
        raise ValueError(f"save_run expects (X, Y, Z, T) data, got shape {data.shape}")
    img = nib.Nifti1Image(data.astype(np.float32), np.asarray(affine, float))
    img.header.set_xyzt_units("mm", "sec")
    zooms = np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(0))
    img.header.set_zooms((*zooms, float(tr)))
    img.set_qform(affine, code=4)  # 4 = MNI152
    img.set_sform(affine, code=4)
    path = Path(path)
    nib.save(img, str(path))
    return path


@dataclass
class FMRIRun:
    """A prepared run: ``data`` (T, D, H, W) float32, globally z-scored in ``mask`` and 0 outside, on ``affine``."""

    data: np.ndarray
    mask: np.ndarray
    affine: np.ndarray
    tr: float
    source_tr: float

    def chunks(self, frames: int, *, stride: int | None = None) -> np.ndarray:
        """(n, frames, D, H, W) consecutive windows (``stride`` defaults to ``frames``: no overlap)."""
        stride = stride or frames
        n = (self.data.shape[0] - frames) // stride + 1
        if n < 1:
            raise ValueError(f"the run has {self.data.shape[0]} frames after resampling, fewer than one chunk of "
                             f"{frames}")
        return np.stack([self.data[i * stride:i * stride + frames] for i in range(n)])


def _tr_from_header(img) -> float | None:
    zooms = img.header.get_zooms()
    if len(zooms) < 4 or not zooms[3] or zooms[3] <= 0:
        return None
    unit = img.header.get_xyzt_units()[1]
    return float(zooms[3]) / 1000.0 if unit == "msec" else float(zooms[3]) / 1e6 if unit == "usec" else float(zooms[3])


def pad_to_multiple(x: np.ndarray, multiple: int) -> np.ndarray:
    """Zero-pad the last three axes at their end to multiples of ``multiple``."""
    pads = [(0, 0)] * (x.ndim - 3) + [(0, (-s) % multiple) for s in x.shape[-3:]]
    return np.pad(x, pads)


def load_run(img_or_path, *, mask=None, tr: float | None = None, target: tuple | None = None,
             target_tr: float = PAPER_TR, multiple: int = 8, affine_atol: float = 1e-3) -> FMRIRun:
    """Load and prepare a 4-D fMRI run as Omni-fMRI does.

    Args:
        img_or_path: a nibabel image or a path to a NIfTI file, (X, Y, Z, T), in MNI space.
        mask: brain mask (image, path, or boolean array on the data's grid). ``None``: voxels whose time series is
            not constant zero.
        tr: repetition time in seconds; read from the header's 4th zoom when ``None``.
        target: ``(shape, affine)`` of the grid to resample to (cubic B-spline for the data, nearest for the mask),
            e.g. from :func:`mni_on_grid`; ``None`` keeps the data's grid.
        target_tr: TRs outside 0.7-0.8 s are resampled in time to this (linear interpolation).
        multiple: the grid is zero-padded to multiples of this (the largest patch side).
    Raises:
        ValueError: not 4-D, mask grid or affine differs from the data's (without ``target``), empty mask, TR
            unknown or outside 0.2-4 s, fewer than 2 frames.
    """
    nib = _nib()
    img = nib.load(str(img_or_path)) if isinstance(img_or_path, (str, Path)) else img_or_path
    name = str(img_or_path) if isinstance(img_or_path, (str, Path)) else "the image"
    if len(img.shape) != 4:
        raise ValueError(f"{name} has shape {img.shape}: Omni-fMRI needs a 4-D run (x, y, z, time); a 3-D file is a "
                         f"single volume")
    if img.shape[3] < 2:
        raise ValueError(f"{name} has {img.shape[3]} frame(s); a run needs at least 2")
    source_tr = tr if tr is not None else _tr_from_header(img)
    if source_tr is None:
        raise ValueError(f"{name} has no TR in its header (4th zoom is 0); pass tr= in seconds")
    if not (TR_RANGE[0] <= source_tr <= TR_RANGE[1]):
        raise ValueError(f"TR {source_tr:g} s is outside the range we resample from {TR_RANGE} s (check the header's "
                         f"time unit, or pass tr= in seconds)")

    if mask is not None:
        if isinstance(mask, (str, Path)):
            mask = nib.load(str(mask))
        if hasattr(mask, "affine"):
            if target is None and (mask.shape[:3] != img.shape[:3]
                                   or not np.allclose(mask.affine, img.affine, atol=affine_atol)):
                raise ValueError(f"the mask's grid {mask.shape[:3]} / affine\n{np.round(mask.affine, 3)}\ndiffers from "
                                 f"the data's {img.shape[:3]} /\n{np.round(img.affine, 3)}; pass target=(shape, affine) "
                                 f"to resample both, or resample the mask")
            mask_img = mask
        else:
            arr = np.asarray(mask)
            if arr.shape != img.shape[:3]:
                raise ValueError(f"mask array shape {arr.shape} differs from the data grid {img.shape[:3]}")
            mask_img = nib.Nifti1Image(arr.astype(np.uint8), img.affine)
    else:
        data0 = np.asarray(img.dataobj, dtype=np.float32)
        mask_img = nib.Nifti1Image((np.abs(data0).max(-1) > 0).astype(np.uint8), img.affine)

    if target is not None:
        processing = require("nibabel.processing", NEURO, purpose="resampling")
        shape, aff = tuple(target[0]), np.asarray(target[1], float)
        frames = [processing.resample_from_to(img.slicer[..., t], (shape, aff), order=3)
                  for t in range(img.shape[3])]
        data = np.stack([np.asarray(f.dataobj, dtype=np.float32) for f in frames], -1)
        m = np.asarray(processing.resample_from_to(mask_img, (shape, aff), order=0).dataobj) > 0
    else:
        data, aff = np.asarray(img.dataobj, dtype=np.float32), np.asarray(img.affine, float)
        m = np.asarray(mask_img.dataobj) > 0
    if not m.any():
        raise ValueError(f"the brain mask of {name} is empty on the target grid; check that mask and data overlap "
                         f"(same space) and that the mask is not all zeros")

    x = np.moveaxis(data, -1, 0)  # (T, X, Y, Z)
    tr_out = source_tr
    if not (KEEP_TR[0] <= source_tr <= KEEP_TR[1]):
        t_src = np.arange(x.shape[0]) * source_tr
        t_new = np.arange(0.0, t_src[-1] + 1e-9, target_tr)
        lo = np.clip(np.searchsorted(t_src, t_new, side="right") - 1, 0, x.shape[0] - 1)
        hi = np.clip(lo + 1, 0, x.shape[0] - 1)
        w = ((t_new - t_src[lo]) / source_tr).astype(np.float32)[:, None, None, None]
        x = (1 - w) * x[lo] + w * x[hi]
        tr_out = target_tr
    vals = x[:, m]
    sd = float(vals.std())
    x = np.where(m[None], (x - float(vals.mean())) / (sd if sd > 0 else 1.0), 0.0).astype(np.float32)
    return FMRIRun(data=pad_to_multiple(x, multiple), mask=pad_to_multiple(m, multiple), affine=aff, tr=tr_out,
                   source_tr=float(source_tr))
