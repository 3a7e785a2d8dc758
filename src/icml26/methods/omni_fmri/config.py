"""Omni-fMRI options. Defaults are the official code's pretraining setting (github.com/OneMore1/Omni-fMRI at
commit d27b2970af25ca780371d332c187f3594f0a8d56, ``configs/pretrain.yaml``: ViT-B, 40-frame chunks); the experiments
pass laptop sizes (``experiments.model_config``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

METHODS = ("std", "variance", "entropy", "laplacian", "random")
LOSS_NORMS = ("pooled", "per_scale")
COARSE_EMBEDS = ("dual_path", "downsample_only")


@dataclass
class OmniFMRIConfig:
    """Dynamic patching + dual-path multi-scale embedding + scale-aware MAE.

    Scale s in 0..K-1 has patches of ``patch_size * 2**s`` voxels per side. ``thresholds=(0.0,)`` is uniform
    base patching (every foreground base patch is a token; the paper's tau = 0); ``thresholds=(inf,)`` makes every
    foreground coarse patch one token (uniform coarse patching through the same embedding).
    """

    in_frames: int = field(default=40, metadata={
        "help": "T, frames per chunk, fed as input channels (SRC: 40 in the paper and pretrain.yaml)"})
    patch_size: int = field(default=4, metadata={"help": "base patch side in voxels (SRC: 4)"})
    num_scales: int = field(default=2, metadata={"help": "K, number of patch scales (SRC: 2)"})
    thresholds: tuple[float, ...] = field(default=(0.23,), metadata={
        "help": "tau per coarse scale s >= 1: a foreground patch of scale s with score < tau_s is one token "
                "(SRC: pretrain.yaml thresholds [0.23] with method 'std'; the paper's text says 0.25 on the variance)"})
    method: str = field(default="std", metadata={
        "help": "complexity score: 'std' (SRC default: sqrt of the within-patch variance averaged over frames), "
                "'variance', 'entropy', 'laplacian', 'random' (the ablations of the paper's Table on metrics)"})
    bg_threshold: float = field(default=1e-2, metadata={
        "help": "a patch is foreground when max |I| over its voxels and frames exceeds this (SRC: "
                "select_patches_by_threshold_3d default; the paper's text says mean intensity < 1e-3); a negative value "
                "keeps every patch (no background pruning: plain uniform patching)"})
    embed_dim: int = field(default=768, metadata={"help": "encoder width (SRC: ViT-B 768)"})
    depth: int = field(default=12, metadata={"help": "encoder blocks (SRC: 12)"})
    num_heads: int = field(default=12, metadata={"help": "encoder heads (SRC: 12)"})
    decoder_embed_dim: int = field(default=512, metadata={"help": "decoder width (SRC: 512)"})
    decoder_depth: int = field(default=8, metadata={"help": "decoder blocks (SRC: 8)"})
    decoder_num_heads: int = field(default=16, metadata={"help": "decoder heads (SRC: 16)"})
    mlp_ratio: float = field(default=4.0, metadata={"help": "MLP hidden / width (SRC: 4.0)"})
    mask_ratio: float = field(default=0.75, metadata={"help": "fraction of tokens masked (SRC: 0.75)"})
    patch_norm: bool = field(default=False, metadata={
        "help": "normalise each target patch to zero mean, unit variance (SRC: enable_patch_norm false; ablation)"})
    loss_norm: str = field(default="pooled", metadata={
        "help": "'pooled': sum over masked tokens of their voxel-mean squared error divided by the number of masked "
                "tokens of all scales (SRC: mae_model.forward_loss); 'per_scale': the paper's eq., each scale's sum "
                "divided by its own |M_s| V_s, summed over scales"})
    coarse_embed: str = field(default="dual_path", metadata={
        "help": "'dual_path': phi(P_down) + ZeroLinear(Conv(phi(P_grid))) + pos (SRC); 'downsample_only': no "
                "detail path (ablation)"})
    zero_init: bool = field(default=True, metadata={
        "help": "zero-initialise the detail path's last linear so training starts from the low-frequency "
                "embedding (SRC: zero_conv initialised to zeros)"})

    def __post_init__(self) -> None:
        for name in ("in_frames", "patch_size", "num_scales", "embed_dim", "depth", "num_heads",
                     "decoder_embed_dim", "decoder_depth", "decoder_num_heads"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.thresholds = tuple(float(t) for t in self.thresholds)
        if len(self.thresholds) != self.num_scales - 1:
            raise ValueError(f"thresholds needs one value per coarse scale (num_scales - 1 = {self.num_scales - 1}), "
                             f"got {len(self.thresholds)}: {self.thresholds}")
        if any(math.isnan(t) or t < 0 for t in self.thresholds):
            raise ValueError(f"thresholds must be >= 0 (0 = uniform base patches, inf = uniform coarse patches), "
                             f"got {self.thresholds}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not math.isfinite(self.bg_threshold):
            raise ValueError(f"bg_threshold must be a finite number (negative: no background pruning), got "
                             f"{self.bg_threshold!r}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        if self.decoder_embed_dim % self.decoder_num_heads:
            raise ValueError(f"decoder_embed_dim ({self.decoder_embed_dim}) must be divisible by decoder_num_heads "
                             f"({self.decoder_num_heads})")
        if not (0.0 <= self.mask_ratio < 1.0):
            raise ValueError(f"mask_ratio must be in [0, 1), got {self.mask_ratio!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio!r}")
        if self.loss_norm not in LOSS_NORMS:
            raise ValueError(f"loss_norm must be one of {LOSS_NORMS}, got {self.loss_norm!r}")
        if self.coarse_embed not in COARSE_EMBEDS:
            raise ValueError(f"coarse_embed must be one of {COARSE_EMBEDS}, got {self.coarse_embed!r}")

    @property
    def patch_sizes(self) -> tuple[int, ...]:
        """Side of a patch at each scale: ``patch_size * 2**s``."""
        return tuple(self.patch_size * 2 ** s for s in range(self.num_scales))

    @property
    def multiple(self) -> int:
        """Volumes must have sides divisible by the largest patch side."""
        return self.patch_sizes[-1]
