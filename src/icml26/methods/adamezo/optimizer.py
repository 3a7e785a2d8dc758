"""MeZO and AdaMeZO as ``torch.optim.Optimizer`` subclasses (memory-lean, block-wise replay).

Notation (paper / official code -> here):
    theta          parameters, processed one tensor ("block") at a time in param-group order
    epsilon        ``eps``, the SPSA perturbation scale
    s_t, z_t       perturbation seed of step t, and z_t ~ N(0, I) drawn from a generator seeded with s_t,
                   one continuous stream across all blocks (exactly the MeZO perturbation)
    p_t            projected gradient (L(theta + eps z_t) - L(theta - eps z_t)) / (2 eps), a Python float
    h              ``window`` (HESS_WINDOW), number of (s_k, p_k) pairs kept; the newest is the current step
    beta1, beta2   window decays; slot i (0 = oldest) gets weight beta^(h-1-i)
    m, v           m = sum_i beta1^(h-1-i) p_i z_i,  v = sum_i beta2^(h-1-i) p_i^2 z_i^2  (block temporaries)
    update         theta <- theta - lr * (100 * m / (sqrt(v) + 1e-5) + lambda * theta)

Memory: between steps the optimizer keeps only h seeds and h floats. During the update it holds, per block,
m, v and one z buffer (the delta in the paper's (1 + delta) P). The reference with dense stored directions is in
``reference.py``; tests check the two agree.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from .config import AdaMeZOConfig

# The official code never decays these (substring match on the parameter name; trainer.py, MeZO upstream).
NO_DECAY_SUBSTRINGS = ("bias", "layer_norm", "layernorm")


def zo_param_groups(model: nn.Module, weight_decay: float, *,
                    no_decay: Sequence[str] = NO_DECAY_SUBSTRINGS) -> list[dict]:
    """Split a model's trainable parameters into a decayed and a non-decayed group, by name substring.

    Same rule as the official trainer: a parameter whose name contains any of ``no_decay`` gets no weight decay.
    Parameter order (``named_parameters`` order) is kept, which fixes the random stream layout.
    """
    decay, skip = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (skip if any(s in name for s in no_decay) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": skip, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def perturbation_seed(base_seed: int, step: int) -> int:
    """Seed s_t for step t, a pure function of (base seed, t) so no generator state must be saved.

    The official code draws ``np.random.randint(1e9)`` from NumPy's global state; any independent integer
    stream is equivalent for the algorithm.
    """
    return int(np.random.SeedSequence([base_seed, step]).generate_state(1)[0]) % 1_000_000_000


class AdaMeZO(torch.optim.Optimizer):
    """Zeroth-order Adam-style optimizer whose moments are replayed from seeds (AdaMeZO, arXiv 2605.00650).

    ``step(closure)`` evaluates ``closure()`` twice under ``torch.no_grad`` (at theta + eps z and theta - eps z),
    restores theta, then updates it. The first ``window + 1`` steps, and every step when ``window < 2``, are
    plain MeZO steps ``theta <- theta - lr (p z + lambda theta)`` as in the official code; afterwards the
    Adam-style replayed update is used.

    Args:
        params: parameters or param groups (groups may set ``lr`` and ``weight_decay``; see
            :func:`zo_param_groups` for the official no-decay rule).
        lr: learning rate eta.
        eps: perturbation scale epsilon.
        betas: (beta1, beta2) window decays.
        window: h, the number of replayed steps; 0 or 1 gives MeZO.
        weight_decay: lambda.
        direction_scale: the official constant 100 in front of m / (sqrt(v) + adam_eps).
        adam_eps: the official 1e-5 added outside the square root.
        seed: base seed of the perturbation stream.
        norm_schedule: ablation ``norm_cache``: for MeZO steps, rescale the step so that its global norm
            ||lr p z|| equals ``norm_schedule[t]`` (e.g. the ``last_step_norm`` values of an AdaMeZO run), which
            isolates the effect of AdaMeZO's direction from that of its step length.

    Attributes:
        forward_passes: closure evaluations so far (2 per step).
        last_step_norm: global norm of the last update ``lr * g`` (weight decay excluded), for the ablation.
    """

    def __init__(self, params: Iterable, lr: float = 1e-7, *, eps: float = 1e-3,
                 betas: tuple[float, float] = (0.7, 0.9), window: int = 10, weight_decay: float = 0.0,
                 direction_scale: float = 100.0, adam_eps: float = 1e-5, seed: int = 0,
                 norm_schedule: Sequence[float] | None = None):
        self.config = AdaMeZOConfig(lr=lr, eps=eps, betas=betas, window=window, weight_decay=weight_decay,
                                    direction_scale=direction_scale, adam_eps=adam_eps, seed=seed)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:
            AdaMeZOConfig(lr=group["lr"], weight_decay=group["weight_decay"])  # validate per-group overrides
        devices = {p.device for p in self._params()}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device (one random stream), got {sorted(map(str, devices))}")
        self.norm_schedule = list(norm_schedule) if norm_schedule is not None else None
        # The only state carried between steps: step count and the last h (seed, projected gradient) pairs.
        self.state["zo"] = {"step": 0, "seeds": [], "projections": []}
        self.last_step_norm = float("nan")

    # -- helpers ---------------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _generator(self, seed: int) -> torch.Generator:
        device = self.param_groups[0]["params"][0].device
        return torch.Generator(device=device).manual_seed(seed)

    @staticmethod
    def _draw(param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return torch.normal(0.0, 1.0, size=param.shape, generator=gen, dtype=param.dtype, device=param.device)

    def _perturb(self, seed: int, scale: float) -> None:
        """theta <- theta + scale * z(seed), block by block from one stream."""
        gen = self._generator(seed)
        for param in self._params():
            param.add_(self._draw(param, gen), alpha=scale)

    @property
    def forward_passes(self) -> int:
        return 2 * self.state["zo"]["step"]

    # -- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor | float]) -> torch.Tensor:  # type: ignore[override]
        """One SPSA estimate (two closure calls) and one update. Returns the loss at theta + eps z."""
        if closure is None:
            raise ValueError("AdaMeZO.step needs a closure that returns the loss (it is called twice, under no_grad)")
        zo, cfg = self.state["zo"], self.config
        t = zo["step"]
        seed = perturbation_seed(cfg.seed, t)

        self._perturb(seed, cfg.eps)
        loss_plus = torch.as_tensor(closure()).detach()
        self._perturb(seed, -2.0 * cfg.eps)
        loss_minus = torch.as_tensor(closure()).detach()
        self._perturb(seed, cfg.eps)
        projected = float((loss_plus.double() - loss_minus.double()) / (2.0 * cfg.eps))
        if not math.isfinite(projected):
            raise FloatingPointError(f"step {t}: the closure returned non-finite losses ({float(loss_plus)}, "
                                     f"{float(loss_minus)}); parameters were restored and not updated")

        # The window includes the current step (it is stored before the update, as in the official trainer).
        keep = max(cfg.window, 1)
        zo["seeds"] = (zo["seeds"] + [seed])[-keep:]
        zo["projections"] = (zo["projections"] + [projected])[-keep:]
        if not cfg.adaptive or t <= cfg.window:
            self._mezo_update(seed, projected, t)
        else:
            self._adaptive_update(zo["seeds"], zo["projections"])
        zo["step"] = t + 1
        return loss_plus

    def _mezo_update(self, seed: int, projected: float, t: int) -> None:
        """theta <- theta - lr (p z + lambda theta), optionally rescaled to the cached step norm (ablation)."""
        rescale = 1.0
        if self.norm_schedule is not None:
            if t >= len(self.norm_schedule):
                raise IndexError(f"norm_schedule has {len(self.norm_schedule)} entries but step {t} needs one")
            gen, sq = self._generator(seed), 0.0
            for group in self.param_groups:
                for param in group["params"]:
                    if param.requires_grad:
                        sq += float((group["lr"] * projected * self._draw(param, gen)).double().pow(2).sum())
            rescale = self.norm_schedule[t] / max(math.sqrt(sq), 1e-5)
        gen, sq = self._generator(seed), 0.0
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                step = self._draw(param, gen).mul_(projected * rescale)
                sq += float((lr * step).double().pow(2).sum())
                if wd:
                    step.add_(param, alpha=wd)
                param.sub_(step, alpha=lr)
        self.last_step_norm = math.sqrt(sq)

    def _adaptive_update(self, seeds: list[int], projections: list[float]) -> None:
        """theta <- theta - lr (scale * m / (sqrt(v) + adam_eps) + lambda theta), one block at a time."""
        cfg = self.config
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        sq = 0.0
        for param, m, v in replay_moments(self._params(), seeds, projections, cfg.betas):
            lr, wd = group_of[id(param)]["lr"], group_of[id(param)]["weight_decay"]
            denom = v.sqrt_().add_(cfg.adam_eps) if v is not None else 1.0 + cfg.adam_eps
            step = m.div_(denom).mul_(cfg.direction_scale)
            sq += float((lr * step).double().pow(2).sum())
            if wd:
                step.add_(param, alpha=wd)
            param.sub_(step.to(param.dtype), alpha=lr)
        self.last_step_norm = math.sqrt(sq)


def replay_moments(params: list[torch.Tensor], seeds: list[int], projections: list[float],
                   betas: tuple[float, float]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Regenerate the window's moments block by block: yields ``(param, m, v)`` for each parameter in order.

    Slot i (0 = oldest of the h slots) owns one generator seeded once with s_i; its stream continues from block
    to block, so z_i restricted to a block is exactly the slice of the MeZO perturbation of step i. Only one block's
    m, v and one z are alive at a time. ``v`` is None when beta2 == 0 (the official code then uses v := 1).
    m, v are accumulated in at least float32 (the official code sums in the parameter dtype, fp16 there).
    """
    if len(seeds) != len(projections):
        raise ValueError(f"got {len(seeds)} seeds but {len(projections)} projected gradients")
    h = len(seeds)
    beta1, beta2 = betas
    device = params[0].device if params else torch.device("cpu")
    slot_gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    w1 = [beta1 ** (h - 1 - i) * projections[i] for i in range(h)]
    w2 = [beta2 ** (h - 1 - i) * projections[i] ** 2 for i in range(h)]
    for param in params:
        acc = torch.promote_types(param.dtype, torch.float32)
        m = torch.zeros(param.shape, dtype=acc, device=param.device)
        v = torch.zeros_like(m) if beta2 > 0 else None
        for i, gen in enumerate(slot_gens):
            z = AdaMeZO._draw(param, gen).to(acc)
            m.add_(z, alpha=w1[i])
            if v is not None:
                v.addcmul_(z, z, value=w2[i])
        yield param, m, v


class MeZO(AdaMeZO):
    """MeZO (Malladi et al., 2023): SPSA with the seed trick, ``theta <- theta - lr (p z + lambda theta)``.

    Identical to ``AdaMeZO(..., window=0)`` (a test checks this); ``norm_schedule`` is the norm_cache ablation.
    """

    def __init__(self, params: Iterable, lr: float = 1e-6, *, eps: float = 1e-3, weight_decay: float = 0.0,
                 seed: int = 0, norm_schedule: Sequence[float] | None = None):
        super().__init__(params, lr, eps=eps, window=0, weight_decay=weight_decay, seed=seed,
                         norm_schedule=norm_schedule)
