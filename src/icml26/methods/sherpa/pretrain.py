"""Pretrain the small and large promptable segmenters on the general distribution (the SA-1B analogue), once.

``python -m icml26.methods.sherpa.pretrain`` rebuilds both checkpoints into ``cache_dir("sherpa")`` (deterministic
given the seed); :func:`pretrained` loads them, building them on a miss.
"""

from __future__ import annotations

import math
import sys

import torch

from ...core.assets import cache_dir
from ...core.io import cached_tensors
from ...core.progress import progress
from .data import general_batch
from .model import LARGE, SMALL, PromptableSegmenter, SegmenterSize, seg_loss

PRETRAIN = {"steps": 1000, "batch": 32, "lr": 2e-3, "seed": 12345}
SIZES = {"small": SMALL, "large": LARGE}


def train_general(size: SegmenterSize, *, steps: int, batch: int, lr: float, seed: int) -> PromptableSegmenter:
    torch.manual_seed(seed)
    model = PromptableSegmenter(size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for step in progress(range(steps), desc=f"pretrain segmenter d={size.dim}"):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        b = general_batch(batch, seed * 100_003 + step)
        loss = seg_loss(model(b.image, b.point), b.mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def pretrained(name: str, **overrides) -> PromptableSegmenter:
    """The pretrained 'small' or 'large' segmenter (built and cached on first use: ~1-3 CPU minutes)."""
    size = SIZES[name]
    cfg = {**PRETRAIN, **overrides}
    key = f"{name}_d{size.dim}_L{size.depth}_s{cfg['steps']}_b{cfg['batch']}_seed{cfg['seed']}.safetensors"
    state = cached_tensors(cache_dir("sherpa") / key, lambda: train_general(size, **cfg).state_dict())
    model = PromptableSegmenter(size)
    model.load_state_dict(state)
    return model


if __name__ == "__main__":
    torch.set_num_threads(1)
    for n in ("small", "large"):
        pretrained(n)
        print(f"built {n}", file=sys.stderr)
