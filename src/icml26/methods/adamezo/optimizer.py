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

Memory: between steps the optimizer keeps only h seeds and h floats. During a step it holds scratch rows of at
most ``CHUNK`` elements (h z rows, m and v), whatever the model size: the delta in the paper's (1 + delta) P.

Speed: on CPU the step is bound by torch's Gaussian generator (mt19937, ~4 ns a sample on one core), so a step
draws as few samples as the algorithm allows, in place, and bit for bit the numbers the plain per-tensor code draws:
  * every draw goes into reusable scratch, one ``CHUNK``-sized piece of a tensor at a time (see ``_spans`` for why
    the stream is unchanged), so the moment arithmetic runs on cache-sized pieces and nothing is allocated;
  * restoring theta after the second forward pass shares its draw with the update (the current step is slot h-1
    of the window, and MeZO's update direction), so a step draws h + 2 (AdaMeZO) or 3 (MeZO) perturbations;
  * the h slots' generators are independent, so their pieces are drawn concurrently on ``torch.get_num_threads()``
    threads (torch releases the GIL inside ``normal_``); the arithmetic order per element is unchanged.
The reference with dense stored directions is in ``reference.py``; tests check the two agree, and that the
parameters are bit-identical to the plain per-tensor replay (``replay_moments``) on a fixed seed.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
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


# Elements per generator call on CPU. torch's CPU ``normal_`` turns uniforms into normals 16 at a time (Box-Muller on
# entries j, j + 8 of each group of 16) and, for a size not divisible by 16, redraws the last 16 entries; so drawing
# a tensor as 16-aligned pieces, the last at least 16 long, continues the generator exactly as one draw of the whole
# tensor does (``test_chunked_draws_continue_the_stream_bit_for_bit``). 2^20 keeps each scratch row at 4 MiB.
CHUNK = 1 << 20
# Below this many elements a piece is drawn on the calling thread (thread hand-off costs more than it saves).
PARALLEL_MIN = 1 << 15


def _spans(param: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) ranges of ``param``'s flat elements, one generator call each (see ``CHUNK``)."""
    n = param.numel()
    if n < CHUNK + 16:
        return [(0, n)]
    bounds = list(range(0, n, CHUNK)) + [n]
    if bounds[-1] - bounds[-2] < 16:  # a piece shorter than 16 takes torch's other (serial) sampler
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def _draw(param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A fresh N(0, I) tensor shaped like ``param`` from ``gen`` (the plain MeZO draw)."""
    return torch.normal(0.0, 1.0, size=param.shape, generator=gen, dtype=param.dtype, device=param.device)


def _sq_norm(x: torch.Tensor) -> float:
    """||x||^2 accumulated in float64 (4x faster than ``x.double().pow(2).sum()``, same to ~1e-13)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


class _Streams:
    """The perturbation streams z(s) of several seeds, drawn piece by piece in parameter order.

    Each seed owns one generator carried from tensor to tensor, so the pieces of tensor j are exactly the slice of
    z(s) that the plain code (one ``torch.normal`` per tensor) draws. On CPU, contiguous tensors are drawn into
    scratch rows of shape (n_seeds, <= CHUNK + 15) allocated once per step; anything else (other devices, whose
    samplers are not piece-invariant, and non-contiguous tensors) gets one fresh tensor per seed, as before.
    """

    def __init__(self, params: list[torch.Tensor], seeds: list[int], pool: ThreadPoolExecutor | None = None):
        device = params[0].device if params else torch.device("cpu")
        self.gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.pool = pool if len(seeds) > 1 else None
        self.width = min(max((p.numel() for p in params), default=0), CHUNK + 15)  # longest piece
        self.rows: dict[torch.dtype, list[torch.Tensor]] = {}

    def pieces(self, param: torch.Tensor) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Yields ``(theta_piece, [z_i piece for each seed])`` covering ``param`` in order; ``theta_piece`` is a
        view of ``param`` (flat on the scratch path), and the z pieces are valid until the next piece."""
        if param.device.type != "cpu" or not param.is_contiguous():
            yield param, [_draw(param, g) for g in self.gens]
            return
        if param.dtype not in self.rows:
            self.rows[param.dtype] = [torch.empty(self.width, dtype=param.dtype) for _ in self.gens]
        flat, rows, n = param.view(-1), self.rows[param.dtype], param.numel()
        spans = ((0, n),) if n < CHUNK + 16 else _spans(param)
        for start, stop in spans:
            # Tiny models spend their step on per-call overhead: skip the slices when they would be the whole row.
            zs = rows if stop - start == rows[0].numel() else [row[: stop - start] for row in rows]
            if self.pool is not None and stop - start >= PARALLEL_MIN:
                list(self.pool.map(lambda zg: zg[0].normal_(generator=zg[1]), zip(zs, self.gens)))
            else:
                for z, gen in zip(zs, self.gens):
                    z.normal_(generator=gen)
            yield (flat if len(spans) == 1 else flat[start:stop]), zs


def _moment_buffers(cache: dict, like: torch.Tensor, dtype: torch.dtype,
                    with_v: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scratch m and v (``dtype``, shaped like ``like``) for one piece: two rows reused across pieces."""
    n = like.numel()
    rows = cache.get(dtype)
    if rows is None or rows[0].numel() < n or rows[0].device != like.device:
        rows = cache[dtype] = [torch.empty(n, dtype=dtype, device=like.device) for _ in range(2)]
    if rows[0].numel() == n and like.dim() == 1:
        return rows[0], (rows[1] if with_v else None)
    return rows[0][:n].view(like.shape), (rows[1][:n].view(like.shape) if with_v else None)


def _accumulate_moments(zs: list[torch.Tensor], w1: list[float], w2: list[float], m: torch.Tensor,
                        v: torch.Tensor | None) -> None:
    """m = sum_i w1_i z_i and v = sum_i w2_i z_i^2 in place, slots in order (the plain code's exact operations)."""
    m.zero_()
    if v is not None:
        v.zero_()
    for z, a, b in zip(zs, w1, w2):
        z = z.to(m.dtype)
        m.add_(z, alpha=a)
        if v is not None:
            v.addcmul_(z, z, value=b)


def _window_weights(projections: list[float], betas: tuple[float, float]) -> tuple[list[float], list[float]]:
    """Per-slot weights beta1^(h-1-i) p_i and beta2^(h-1-i) p_i^2 (slot 0 is the oldest)."""
    h = len(projections)
    return ([betas[0] ** (h - 1 - i) * projections[i] for i in range(h)],
            [betas[1] ** (h - 1 - i) * projections[i] ** 2 for i in range(h)])


def _pool() -> ThreadPoolExecutor | None:
    """Threads for drawing independent streams concurrently: as many as torch may use, none when that is 1."""
    n = torch.get_num_threads()
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="adamezo-draw") if n > 1 else None


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
        return _draw(param, gen)

    def _perturb(self, seed: int, scale: float) -> None:
        """theta <- theta + scale * z(seed), piece by piece from one stream."""
        params = self._params()
        streams = _Streams(params, [seed])
        for param in params:
            for theta, (z,) in streams.pieces(param):
                theta.add_(z, alpha=scale)

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
        projected = float((loss_plus.double() - loss_minus.double()) / (2.0 * cfg.eps))
        if not math.isfinite(projected):
            self._perturb(seed, cfg.eps)
            raise FloatingPointError(f"step {t}: the closure returned non-finite losses ({float(loss_plus)}, "
                                     f"{float(loss_minus)}); parameters were restored and not updated")

        # The window includes the current step (it is stored before the update, as in the official trainer).
        # Both updates first restore theta (theta - eps z + eps z) with the draw of z_t they use anyway.
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
        """Restore theta, then theta <- theta - lr (p z + lambda theta), optionally rescaled to the cached step norm
        (ablation); one draw of z serves both."""
        rescale = 1.0
        if self.norm_schedule is not None:
            if t >= len(self.norm_schedule):
                raise IndexError(f"norm_schedule has {len(self.norm_schedule)} entries but step {t} needs one")
            # Whole-tensor draws and sums, as before: the rescale factor (hence the update) stays bit-identical.
            gen, sq = self._generator(seed), 0.0
            for group in self.param_groups:
                for param in group["params"]:
                    if param.requires_grad:
                        sq += float((group["lr"] * projected * _draw(param, gen)).double().pow(2).sum())
            rescale = self.norm_schedule[t] / max(math.sqrt(sq), 1e-5)
        streams, sq = _Streams(self._params(), [seed]), 0.0
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                for theta, (z,) in streams.pieces(param):
                    theta.add_(z, alpha=self.config.eps)
                    step = z.mul_(projected * rescale)
                    sq += lr * lr * _sq_norm(step)
                    if wd:
                        step.add_(theta, alpha=wd)
                    theta.sub_(step, alpha=lr)
        self.last_step_norm = math.sqrt(sq)

    def _adaptive_update(self, seeds: list[int], projections: list[float]) -> None:
        """Restore theta, then theta <- theta - lr (scale * m / (sqrt(v) + adam_eps) + lambda theta), piece by piece.

        Slot h-1 of the window is the current step, so its draw also restores theta. Per piece: h draws (on
        ``torch.get_num_threads()`` threads), m and v in place in scratch, the update in place on theta.
        """
        cfg, params = self.config, self._params()
        w1, w2 = _window_weights(projections, cfg.betas)
        sq = 0.0
        pool = _pool()
        with pool if pool is not None else contextlib.nullcontext():
            streams, acc_rows = _Streams(params, seeds, pool), {}
            for group in self.param_groups:
                lr, wd = group["lr"], group["weight_decay"]
                for param in group["params"]:
                    if not param.requires_grad:
                        continue
                    acc = torch.promote_types(param.dtype, torch.float32)
                    for theta, zs in streams.pieces(param):
                        theta.add_(zs[-1], alpha=cfg.eps)
                        m, v = _moment_buffers(acc_rows, theta, acc, cfg.betas[1] > 0)
                        _accumulate_moments(zs, w1, w2, m, v)
                        denom = v.sqrt_().add_(cfg.adam_eps) if v is not None else 1.0 + cfg.adam_eps
                        step = m.div_(denom).mul_(cfg.direction_scale)
                        sq += lr * lr * _sq_norm(step)
                        if wd:
                            step.add_(theta, alpha=wd)
                        theta.sub_(step.to(theta.dtype), alpha=lr)
        self.last_step_norm = math.sqrt(sq)


def replay_moments(params: list[torch.Tensor], seeds: list[int], projections: list[float],
                   betas: tuple[float, float]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Regenerate the window's moments tensor by tensor: yields ``(param, m, v)`` for each parameter in order.

    Slot i (0 = oldest of the h slots) owns one generator seeded once with s_i; its stream continues from tensor
    to tensor, so z_i restricted to a tensor is exactly the slice of the MeZO perturbation of step i. ``v`` is None
    when beta2 == 0 (the official code then uses v := 1). m, v are accumulated in at least float32 (the official
    code sums in the parameter dtype, fp16 there). The optimizer does the same arithmetic on scratch pieces
    without materialising whole-tensor m and v; this generator is for inspection and tests.
    """
    if len(seeds) != len(projections):
        raise ValueError(f"got {len(seeds)} seeds but {len(projections)} projected gradients")
    w1, w2 = _window_weights(projections, betas)
    streams = _Streams(params, seeds)
    for param in params:
        acc = torch.promote_types(param.dtype, torch.float32)
        m = torch.zeros(param.shape, dtype=acc, device=param.device)
        v = torch.zeros_like(m) if betas[1] > 0 else None
        flat_m, flat_v = m.view(-1), (v.view(-1) if v is not None else None)
        start = 0
        for theta, zs in streams.pieces(param):
            stop = start + theta.numel()
            piece_m = flat_m[start:stop].view(theta.shape)
            piece_v = flat_v[start:stop].view(theta.shape) if flat_v is not None else None
            _accumulate_moments(zs, w1, w2, piece_m, piece_v)
            start = stop
        yield param, m, v


class MeZO(AdaMeZO):
    """MeZO (Malladi et al., 2023): SPSA with the seed trick, ``theta <- theta - lr (p z + lambda theta)``.

    Identical to ``AdaMeZO(..., window=0)`` (a test checks this); ``norm_schedule`` is the norm_cache ablation.
    """

    def __init__(self, params: Iterable, lr: float = 1e-6, *, eps: float = 1e-3, weight_decay: float = 0.0,
                 seed: int = 0, norm_schedule: Sequence[float] | None = None):
        super().__init__(params, lr, eps=eps, window=0, weight_decay=weight_decay, seed=seed,
                         norm_schedule=norm_schedule)
