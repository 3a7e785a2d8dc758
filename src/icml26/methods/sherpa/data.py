"""Generated promptable-segmentation data (32 x 32 grayscale): a broad "general" distribution for pretraining (the
SA-1B analogue), held-out general variants to measure what fine-tuning destroys, and a microscopy-like nuclei task
(the specialised fine-tuning task: touching blobs, low contrast, Poisson noise, vignetting).

Every sample is (image (1, S, S) float32, target mask (S, S) bool, prompt point (2,) in pixel (row, col), box (4,)
(r0, c0, r1, c1)). The prompt point lies inside the target, the box is the target's bounding box.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SIZE = 32
GENERAL_VARIANTS = ("base", "clutter", "lowlight", "small", "textured")


@dataclass
class Batch:
    image: torch.Tensor  # (B, 1, S, S)
    mask: torch.Tensor  # (B, S, S) float {0, 1}
    point: torch.Tensor  # (B, 2) pixel coordinates (row, col)
    box: torch.Tensor  # (B, 4) (r0, c0, r1, c1)

    def __len__(self) -> int:
        return self.image.shape[0]

    def subset(self, idx) -> "Batch":
        return Batch(self.image[idx], self.mask[idx], self.point[idx], self.box[idx])


_YY, _XX = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)


def _shape_mask(rng: np.random.Generator, kind: str, scale: float) -> np.ndarray:
    cy, cx = rng.uniform(4, SIZE - 4, size=2)
    r = rng.uniform(3, 8) * scale
    ang = rng.uniform(0, np.pi)
    dy, dx = _YY - cy, _XX - cx
    u = dy * np.cos(ang) + dx * np.sin(ang)
    v = -dy * np.sin(ang) + dx * np.cos(ang)
    if kind == "ellipse":
        return (u / r) ** 2 + (v / (r * rng.uniform(0.4, 1.0))) ** 2 <= 1
    if kind == "rect":
        return (np.abs(u) <= r) & (np.abs(v) <= r * rng.uniform(0.3, 1.0))
    if kind == "triangle":
        return (v >= -r) & (u <= r - (v + r) * 0.5 + 0.0) & (u >= -r + (v + r) * 0.5)
    if kind == "ring":
        d = np.sqrt(u ** 2 + v ** 2)
        return (d <= r) & (d >= r * rng.uniform(0.4, 0.7))
    # star: radius modulated by angle
    theta = np.arctan2(v, u)
    rr = r * (0.6 + 0.4 * np.cos(rng.integers(3, 6) * theta))
    return np.sqrt(u ** 2 + v ** 2) <= rr


def _texture(rng: np.random.Generator, strength: float) -> np.ndarray:
    kind = rng.integers(3)
    if kind == 0:
        f, a = rng.uniform(0.3, 1.5), rng.uniform(0, np.pi)
        return strength * np.sin(f * (_YY * np.cos(a) + _XX * np.sin(a)))
    if kind == 1:
        return strength * rng.normal(size=(SIZE, SIZE)).astype(np.float32)
    return strength * ((_YY // 4 + _XX // 4) % 2 - 0.5).astype(np.float32) * 2


def _finish(rng, img, target) -> tuple:
    ys, xs = np.nonzero(target)
    i = rng.integers(len(ys))
    point = np.array([ys[i], xs[i]], np.float32)
    box = np.array([ys.min(), xs.min(), ys.max(), xs.max()], np.float32)
    return img.astype(np.float32), target, point, box


def general_sample(rng: np.random.Generator, variant: str = "base") -> tuple:
    """One general scene: textured background, 1-4 objects (ellipse, rectangle, triangle, ring, star) with their own
    intensity and texture, later objects occluding earlier ones; the target is one object's visible part.

    ``variant`` is one of ``GENERAL_VARIANTS`` or ``"mix"`` (a variant drawn uniformly per image: the pretraining
    distribution, so that every suite variant is general ability the pretrained model has)."""
    if variant == "mix":
        variant = GENERAL_VARIANTS[rng.integers(len(GENERAL_VARIANTS))]
    elif variant not in GENERAL_VARIANTS:
        raise ValueError(f"variant must be one of {GENERAL_VARIANTS} or 'mix', got {variant!r}")
    n_obj = {"clutter": rng.integers(5, 8), "small": rng.integers(2, 5)}.get(variant, rng.integers(1, 5))
    scale = 0.5 if variant == "small" else 1.0
    contrast = 0.15 if variant == "lowlight" else 1.0
    tex = 0.45 if variant == "textured" else 0.15
    img = rng.uniform(0.2, 0.8) + _texture(rng, tex)
    label = np.full((SIZE, SIZE), -1)
    kinds = ("ellipse", "rect", "triangle", "ring", "star")
    for j in range(n_obj):
        m = _shape_mask(rng, kinds[rng.integers(len(kinds))], scale)
        if m.sum() < 4:
            continue
        level = rng.uniform(0.0, 1.0)
        img = np.where(m, contrast * level + (1 - contrast) * img.mean() + _texture(rng, tex), img)
        label[m] = j
    if variant == "lowlight":
        img = img + rng.normal(0, 0.08, size=img.shape)
    ids = [j for j in np.unique(label) if j >= 0 and (label == j).sum() >= 4]
    if not ids:
        return general_sample(rng, variant)
    target = label == ids[rng.integers(len(ids))]
    return _finish(rng, img, target)


def nuclei_sample(rng: np.random.Generator) -> tuple:
    """Microscopy-like nuclei: 4-10 irregular blobs of similar brightness, often touching, on a dark vignetted
    background, low contrast, blur-free Poisson noise; the target is one nucleus (instance mask)."""
    label = np.full((SIZE, SIZE), -1)
    bright = np.zeros((SIZE, SIZE), np.float32)
    n = rng.integers(4, 11)
    for j in range(n):
        cy, cx = rng.uniform(3, SIZE - 3, size=2)
        r = rng.uniform(3.0, 5.5)
        theta = np.arctan2(_YY - cy, _XX - cx)
        wobble = 1 + 0.15 * np.sin(rng.integers(2, 5) * theta + rng.uniform(0, 6.3))
        m = np.sqrt((_YY - cy) ** 2 + (_XX - cx) ** 2) <= r * wobble
        label[m] = j
        bright = np.where(m, rng.uniform(0.25, 0.4) * (1 + 0.3 * rng.normal(size=(SIZE, SIZE)) * 0.3), bright)
    vignette = 1 - 0.5 * (((_YY - SIZE / 2) ** 2 + (_XX - SIZE / 2) ** 2) / (SIZE / 2) ** 2)
    lam = 40 * (0.1 + bright) * vignette
    img = rng.poisson(lam).astype(np.float32) / 40.0
    ids = [j for j in np.unique(label) if j >= 0 and (label == j).sum() >= 6]
    if not ids:
        return nuclei_sample(rng)
    return _finish(rng, img, label == ids[rng.integers(len(ids))])


def make_batch(samples: list[tuple]) -> Batch:
    img = np.stack([s[0] for s in samples])[:, None]
    img = (img - img.mean(axis=(1, 2, 3), keepdims=True)) / (img.std(axis=(1, 2, 3), keepdims=True) + 1e-6)
    return Batch(torch.from_numpy(img.astype(np.float32)), torch.from_numpy(np.stack([s[1] for s in samples])).float(),
                 torch.from_numpy(np.stack([s[2] for s in samples])), torch.from_numpy(np.stack([s[3] for s in samples])))


def general_batch(n: int, seed: int, variant: str = "base") -> Batch:
    rng = np.random.default_rng(seed)
    return make_batch([general_sample(rng, variant) for _ in range(n)])


def nuclei_batch(n: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    return make_batch([nuclei_sample(rng) for _ in range(n)])


STARDIST_INSTALL = "pip install --no-deps stardist==0.9.2"


def stardist_batch(*, downsample: int = 3, min_area: int = 6) -> Batch:
    """The real stardist nuclei image (``img2d.tif``, 512 x 512 fluorescence, 125 annotated nuclei in ``mask2d.tif``)
    as a held-out check of the nuclei task: area-averaged by ``downsample`` (3: nuclei become ~7 px across, the size
    of the generated ones), then one 32 x 32 window per nucleus of at least ``min_area`` pixels, centred on it where
    the border allows; the prompt is the nucleus pixel nearest its centroid, the target its instance mask.

    Needs the stardist wheel for its data files only (``pip install --no-deps stardist``; no TensorFlow); the TIFFs
    are read with Pillow."""
    import importlib.util
    from pathlib import Path

    from PIL import Image

    from ...core.assets import MissingAssetError

    if not (isinstance(downsample, int) and downsample >= 1):
        raise ValueError(f"downsample must be a positive integer, got {downsample!r}")
    # find the package without importing it: importing stardist pulls in scikit-image and TensorFlow-era code
    spec = importlib.util.find_spec("stardist")
    folder = Path(spec.origin).parent / "data" / "images" if spec is not None and spec.origin else None
    if folder is None or not (folder / "img2d.tif").exists():
        raise MissingAssetError("the stardist sample image (img2d.tif) is not installed (needed for the real nuclei "
                                f"image of the sherpa held-out check). Install it with: {STARDIST_INSTALL}")
    img = np.asarray(Image.open(folder / "img2d.tif"), dtype=np.float32)
    lab = np.asarray(Image.open(folder / "mask2d.tif")).astype(np.int64)
    h = (img.shape[0] // downsample) * downsample
    w = (img.shape[1] // downsample) * downsample

    def pool(a):
        return a[:h, :w].reshape(h // downsample, downsample, w // downsample, downsample).mean((1, 3))

    small = pool(img)
    samples = []
    for j in np.unique(lab):
        if j == 0:
            continue
        m = pool((lab == j).astype(np.float32)) > 0.5
        if m.sum() < min_area:
            continue
        ys, xs = np.nonzero(m)
        cy, cx = ys.mean(), xs.mean()
        r0 = int(np.clip(round(cy) - SIZE // 2, 0, small.shape[0] - SIZE))
        c0 = int(np.clip(round(cx) - SIZE // 2, 0, small.shape[1] - SIZE))
        win, target = small[r0:r0 + SIZE, c0:c0 + SIZE], m[r0:r0 + SIZE, c0:c0 + SIZE]
        if target.sum() < min_area:
            continue
        ty, tx = np.nonzero(target)
        k = int(np.argmin((ty - (cy - r0)) ** 2 + (tx - (cx - c0)) ** 2))
        point = np.array([ty[k], tx[k]], np.float32)
        box = np.array([ty.min(), tx.min(), ty.max(), tx.max()], np.float32)
        samples.append((win, target, point, box))
    return make_batch(samples)
