"""The frozen foundation policy of the PGT room: built by behavior cloning (``policy.pretrain``) and shipped with the
room (``checkpoints/foundation-<key>.safetensors``, ~200 kB each; packaged by pyproject's
``methods/*/checkpoints/*``) so that no tier spends minutes pretraining. A config whose key has no shipped file is built here, with an atomic checkpoint that resumes after a
kill, and cached in the user cache directory.

Rebuild a shipped file (deterministic given torch's CPU kernels):
    python -m icml26.methods.pgt.foundation --steps 2000
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from ...core.assets import cache_dir
from ...core.io import atomic_write_bytes
from .policy import GoalPolicy, pretrain

WORLD_VERSION = "procworld-v1"
SHIPPED = Path(__file__).parent / "checkpoints"
KEYS = ("horizon", "pretrain_steps", "z_dim", "hidden")


def key(config: Mapping[str, Any]) -> str:
    spec = {k: config[k] for k in KEYS} | {"world": WORLD_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def build(config: Mapping[str, Any], checkpoint: str | None = None) -> dict:
    """Pretrain from torch.manual_seed(0) and the BC generator seed 0; returns the state dict."""
    torch.manual_seed(0)
    fresh = GoalPolicy(z_dim=config["z_dim"], hidden=config["hidden"])
    pretrain(fresh, config["pretrain_steps"], horizon=config["horizon"], seed=0, checkpoint=checkpoint)
    return fresh.state_dict()


def load(config: Mapping[str, Any], *, use_cache: bool = True) -> GoalPolicy:
    """The foundation policy for ``config``: the shipped file, else the user cache, else built (and cached)."""
    from safetensors.torch import load_file, save

    policy = GoalPolicy(z_dim=config["z_dim"], hidden=config["hidden"])
    name = f"foundation-{key(config)}.safetensors"
    if not use_cache:
        policy.load_state_dict(build(config))
        return policy
    for path in (SHIPPED / name, cache_dir("pgt") / name):
        if path.exists():
            policy.load_state_dict(load_file(str(path)))
            return policy
    path = cache_dir("pgt") / name
    state = build(config, checkpoint=str(path.with_suffix(".ckpt")))
    atomic_write_bytes(path, save({k: v.contiguous() for k, v in state.items()}))
    policy.load_state_dict(state)
    return policy


def main(argv=None) -> None:
    from safetensors.torch import save

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--horizon", type=int, default=40)
    ap.add_argument("--z-dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--out", type=Path, default=SHIPPED)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = {"horizon": args.horizon, "pretrain_steps": args.steps, "z_dim": args.z_dim, "hidden": args.hidden}
    out = args.out / f"foundation-{key(cfg)}.safetensors"
    state = build(cfg, checkpoint=str(cache_dir("pgt") / f"foundation-{key(cfg)}.ckpt"))
    atomic_write_bytes(out, save({k: v.contiguous() for k, v in state.items()}))
    print(out)


if __name__ == "__main__":
    main()
