"""The SALAAD ADMM hook: X = L + S for selected weight blocks, coupled to any model and any optimizer.

Per selected block X (m, n) the problem is  min l(X) + alpha ||L||_* + beta ||S||_1  s.t.  X = L + S.

* Primal step on X: the user's optimizer on the coupled loss l(X) + sum_blocks rho/2 ||X - L - S + Y/rho||_F^2
  (:meth:`SALAAD.penalty`).
* Every ``num_freq`` optimizer steps (:meth:`SALAAD.step`), the ADMM block, in the order of the official
  training loop (``trainer_salad.py``, ``train``):

  1. L <- U soft_{alpha/rho}(Sigma) V^T  with  U Sigma V^T = svd(X - S + Y/rho)   (singular value thresholding)
  2. alpha <- controller(rank ratio of L, rho)
  3. S <- soft_{beta/rho}(X - L + Y/rho)                                           (elementwise shrinkage)
  4. beta <- controller(density of S, rho)
  5. rho <- schedule(ADMM update index)
  6. Y <- Y + rho (X - L - S)

The rank ratio is the number of thresholded singular values that carry ``energy`` (0.999) of their squared sum,
over min(m, n); the density is nnz(S) / (m n).

Blocks of equal shape share one batched SVD (the fast path); ``reference.ReferenceBlock`` is the plain per-block
version it is tested against.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .config import BlockConfig, ControllerConfig, RhoConfig, SALAADConfig, official_block_config

DEFAULT_BLOCK_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"(.*\.)?(embed_tokens|tok_emb|wte|word_embeddings)\.weight", "embedding"),
    (r"(.*\.)?lm_head\.weight", "lm_head"),
    (r".*\.weight", "linear"),
)
"""Official per-kind settings keyed by parameter-name regex (first full match wins; only 2-D weights are used)."""


def soft_threshold(x: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """sign(x) max(|x| - tau, 0), elementwise; ``tau`` broadcasts. A negative tau enlarges |x| (official behaviour)."""
    return torch.sign(x) * torch.clamp_min(x.abs() - tau, 0.0)


def svt(matrix: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular value thresholding: (U soft_tau(Sigma) V^T, soft_tau(Sigma)) for ``matrix`` (m, n)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    s = soft_threshold(s, tau)
    return (u * s) @ vh, s


def energy_rank(s: torch.Tensor, quantile: float, *, squared: bool) -> int:
    """How many leading singular values of ``s`` (descending, (k,)) reach ``quantile`` of the total energy.

    ``squared=True`` sums s^2 (training: ``utils.get_energy_quantile``); ``squared=False`` sums s (deployment:
    ``uia.py``). A zero spectrum has rank 0.
    """
    weights = s * s if squared else s
    total = weights.sum()
    if not total > 0:
        return 0
    frac = torch.cumsum(weights, 0) / total
    return min(int((frac < quantile).sum()) + 1, s.numel())


class ThresholdController:
    """The adaptive threshold alpha or beta of one block (official ``PARAM``); see :class:`ControllerConfig`."""

    def __init__(self, config: ControllerConfig, target_rate: float):
        self.config = config
        self.target_rate = float(target_rate)
        self.value = 0.0 if config.mode == "hard_cut" else float(config.init)
        self.dvalue = 0.0
        self.updates = 0
        self.previous_rate = 0.0

    def update(self, rate: float, rho: float) -> None:
        """One controller step after the matching ADMM variable was updated (``rate``: rank ratio or density)."""
        self.updates += 1
        if self.config.mode != "adaptive":
            return
        # Integral action on the threshold: it keeps growing while the rate is above target.
        d = rho * (rate - self.target_rate) * self.config.k_p
        if self.updates >= self.config.switch_after:
            d = d + rho * max(0.0, rate - self.previous_rate) * self.config.k_d
        self.dvalue = d
        self.value = self.value + d
        self.previous_rate = rate

    def cut(self, matrix: torch.Tensor, rho: float) -> None:
        """hard_cut mode: value = rho * (the |.| of ``matrix`` at rank int(numel * target) in descending order)."""
        values = torch.sort(matrix.abs().flatten(), descending=True).values
        index = min(int(values.numel() * self.target_rate), values.numel() - 1)
        self.value = float(values[index]) * rho

    def state_dict(self) -> dict:
        return {"value": self.value, "dvalue": self.dvalue, "updates": self.updates,
                "previous_rate": self.previous_rate}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value, self.dvalue = float(state["value"]), float(state["dvalue"])
        self.updates, self.previous_rate = int(state["updates"]), float(state["previous_rate"])


def initial_rho(config: RhoConfig, shape: tuple[int, int], n_blocks: int) -> float:
    """rho before the first ADMM update (official ``RHO.initialization``)."""
    if config.mode == "shape_dependent":
        return 1.0 / (n_blocks * math.sqrt(shape[0] * shape[1]))
    return config.rho


def rho_at(config: RhoConfig, epoch: int, rho0: float) -> float:
    """rho after ADMM update number ``epoch`` (1-based; official ``RHO.get_rho``)."""
    if epoch < config.start_epoch or config.mode != "adaptive":
        return rho0
    t = epoch - 1
    k = 2.944439 / config.ramp_width
    return rho0 + (config.ramp_factor * rho0 - rho0) * 0.5 * (1.0 + math.tanh(k * (t - config.ramp_mid)))


def select_blocks(model: nn.Module, patterns: Sequence[tuple[str, Any]] | Mapping[str, Any]) -> dict[str, Any]:
    """{parameter name: value} for every 2-D parameter whose name fully matches a pattern (first match wins).

    Tied parameters appear once, under their first name. Each pattern must select at least one 2-D parameter.
    """
    items = list(patterns.items()) if isinstance(patterns, Mapping) else list(patterns)
    compiled = []
    for pattern, value in items:
        try:
            compiled.append((re.compile(pattern), value, pattern))
        except (re.error, TypeError) as err:
            raise ValueError(f"block pattern {pattern!r} is not a valid regular expression: {err}") from None
    chosen: dict[str, Any] = {}
    used = set()
    for name, param in model.named_parameters():
        if param.ndim != 2:
            continue
        for regex, value, raw in compiled:
            if regex.fullmatch(name):
                chosen[name] = value
                used.add(raw)
                break
    missing = [raw for _, _, raw in compiled if raw not in used]
    if missing:
        raise ValueError(f"block pattern(s) {missing} match no 2-D parameter; names look like "
                         f"{[n for n, p in model.named_parameters() if p.ndim == 2][:4]}")
    return chosen


def _default_patterns(model: nn.Module) -> list[tuple[str, BlockConfig]]:
    names = [n for n, p in model.named_parameters() if p.ndim == 2]
    out = []
    for pattern, kind in DEFAULT_BLOCK_PATTERNS:
        if any(re.fullmatch(pattern, n) for n in names):
            out.append((pattern, official_block_config(kind)))
    return out


def _check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    bad = [name for name, t in tensors.items() if not bool(torch.isfinite(t.detach()).all())]
    if bad:
        raise ValueError(f"{what} of block(s) {bad} has NaN or inf entries (a diverged step?): nothing was updated")


class _Block:
    """ADMM state of one weight block X (m, n): L, S, Y (m, n) in ``dtype``, the two controllers and rho."""

    def __init__(self, name: str, param: nn.Parameter, config: BlockConfig, n_blocks: int, dtype: torch.dtype):
        self.name, self.param, self.config = name, param, config
        x = param.detach().to(dtype)
        self.shape = tuple(x.shape)
        self.numel = x.numel()
        self.rho0 = initial_rho(config.rho, self.shape, n_blocks)
        self.rho = self.rho0
        self.epoch = 0
        self.alpha = ThresholdController(config.alpha, config.rate_rank)
        self.beta = ThresholdController(config.beta, config.rate_sparsity)
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        self.total_rank = s.numel()
        if config.is_init:
            k = math.ceil(self.total_rank * config.rate_rank) - 1
            self.alpha.value = float(s[k] * self.rho)
        if config.init_energy <= 0:
            self.L = torch.zeros_like(x)
        else:
            k = int(self.total_rank * config.rate_rank)
            self.L = (u[:, :k] * s[:k]) @ vh[:k]
        self.S = torch.zeros_like(x)
        self.Y = torch.zeros_like(x)
        self.nr_rank = 0

    def x(self) -> torch.Tensor:
        return self.param.detach().to(self.L.dtype)

    def state_dict(self) -> dict:
        return {"L": self.L.clone(), "S": self.S.clone(), "Y": self.Y.clone(), "rho": self.rho, "rho0": self.rho0,
                "epoch": self.epoch, "nr_rank": self.nr_rank, "alpha": self.alpha.state_dict(),
                "beta": self.beta.state_dict()}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError unless ``state`` is a complete, finite block state of this block's shape."""
        missing = [k for k in ("L", "S", "Y", "rho", "rho0", "epoch", "nr_rank", "alpha", "beta") if k not in state]
        if missing:
            raise ValueError(f"block {self.name}: checkpoint lacks {missing}")
        for key in ("L", "S", "Y"):
            value = state[key]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"block {self.name}: {key} must be a tensor, got {type(value).__name__}")
            if tuple(value.shape) != self.shape:
                raise ValueError(f"block {self.name}: {key} has shape {tuple(value.shape)}, expected {self.shape}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"block {self.name}: {key} has NaN or inf entries")
        for key in ("rho", "rho0"):
            if not (isinstance(state[key], (int, float)) and math.isfinite(state[key]) and state[key] > 0):
                raise ValueError(f"block {self.name}: {key} must be a positive finite number, got {state[key]!r}")
        for key in ("alpha", "beta"):
            sub = state[key]
            if not isinstance(sub, Mapping) or not all(k in sub for k in ("value", "dvalue", "updates",
                                                                          "previous_rate")):
                raise ValueError(f"block {self.name}: {key} must be a controller state_dict()")
            if not all(math.isfinite(float(sub[k])) for k in ("value", "dvalue", "previous_rate")):
                raise ValueError(f"block {self.name}: the {key} controller state is not finite: {dict(sub)}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        for key in ("L", "S", "Y"):
            setattr(self, key, state[key].detach().to(self.L).clone())
        self.rho, self.rho0, self.epoch = float(state["rho"]), float(state["rho0"]), int(state["epoch"])
        self.nr_rank = int(state["nr_rank"])
        self.alpha.load_state_dict(state["alpha"])
        self.beta.load_state_dict(state["beta"])


class SALAAD:
    """ADMM hook that keeps selected weights X close to a low-rank plus sparse surrogate L + S during training.

    Args:
        model: any ``nn.Module``; its 2-D parameters whose names match ``blocks`` become X blocks.
        blocks: ``{regex: BlockConfig or kind}`` or a list of pairs (first full match wins; kind is "linear",
            "embedding" or "lm_head" for the official setting). ``None``: embeddings, LM head and every other 2-D
            ``*.weight`` with the official per-kind settings.
        config: :class:`SALAADConfig` (``num_freq``, ``truncate_init``, HPA knobs).
        coupled: add the coupling term to :meth:`penalty`. ``False`` makes the penalty exactly zero, so X trains as
            in plain training while L and S still track it (the official "vanilla" mode plus a tracked
            decomposition).
        dtype: dtype of L, S, Y and of the ADMM arithmetic (official: float32).

    Usage::

        salaad = SALAAD(model)
        loss = task_loss + salaad.penalty()      # rho/2 ||X - L - S + Y/rho||^2 summed over blocks
        loss.backward(); optimizer.step()
        salaad.step()                            # ADMM block every num_freq calls

    Shapes: each block's X, L, S, Y are (m, n) as the parameter is stored (an embedding is (V, D)).
    """

    def __init__(self, model: nn.Module, blocks: Sequence[tuple[str, Any]] | Mapping[str, Any] | None = None, *,
                 config: SALAADConfig | None = None, coupled: bool = True, dtype: torch.dtype = torch.float32):
        self.config = config or SALAADConfig()
        if not isinstance(self.config, SALAADConfig):
            raise ValueError(f"config must be a SALAADConfig, got {type(self.config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype (of L, S, Y) must be a floating torch.dtype such as torch.float32, got {dtype!r}")
        self.model, self.coupled = model, bool(coupled)
        patterns = _default_patterns(model) if blocks is None else blocks
        chosen = select_blocks(model, patterns)
        if not chosen:
            raise ValueError("no 2-D parameter selected: pass blocks={regex: BlockConfig} naming the weights")
        params = dict(model.named_parameters())
        configs = {}
        for name, value in chosen.items():
            cfg = official_block_config(value) if isinstance(value, str) else value
            if not isinstance(cfg, BlockConfig):
                raise ValueError(f"blocks[{name!r}] must be a BlockConfig or a kind name, got {type(value).__name__}")
            configs[name] = cfg
        # Checked before truncate_init rewrites any weight: an SVD of a NaN block fails (or poisons L) anyway.
        _check_finite({name: params[name] for name in configs}, "weight")
        if self.config.truncate_init:
            with torch.no_grad():
                for name, cfg in configs.items():
                    w = params[name]
                    u, s, vh = torch.linalg.svd(w.detach().float(), full_matrices=False)
                    k = int(s.numel() * cfg.rate_rank)
                    w.copy_(((u[:, :k] * s[:k]) @ vh[:k]).to(w.dtype))
        self.blocks = {name: _Block(name, params[name], cfg, len(configs), dtype) for name, cfg in configs.items()}
        self.num_steps = 0
        self.num_updates = 0

    # -- training-time API ---------------------------------------------------------------------------------------
    def penalty(self) -> torch.Tensor:
        """Coupling term sum_blocks rho/2 ||X - L - S + Y/rho||_F^2 (differentiable in X; 0 when uncoupled)."""
        first = next(iter(self.blocks.values())).param
        total = torch.zeros((), dtype=first.dtype, device=first.device)
        if not self.coupled:
            return total
        for b in self.blocks.values():
            diff = b.param - (b.L + b.S - b.Y / b.rho).to(b.param.dtype)
            total = total + b.rho / 2 * diff.pow(2).sum()
        return total

    def step(self) -> bool:
        """Count one optimizer step; run the ADMM block when the count is a multiple of ``num_freq``.

        The count moves only when the ADMM block (if due) succeeded, so a refused update can be retried."""
        if (self.num_steps + 1) % self.config.num_freq:
            self.num_steps += 1
            return False
        self.admm_update()
        self.num_steps += 1
        return True

    @torch.no_grad()
    def admm_update(self) -> None:
        """One ADMM block (L, alpha, S, beta, rho, Y) on every block; equal shapes share a batched SVD.

        Raises ValueError naming the blocks whose weight X is NaN/inf (a diverged step), before any block changes."""
        _check_finite({name: b.param for name, b in self.blocks.items()}, "weight X")
        groups: dict[tuple[int, int], list[_Block]] = {}
        for b in self.blocks.values():
            groups.setdefault(b.shape, []).append(b)
        for group in groups.values():
            self._update_group(group)
        self.num_updates += 1

    def _update_group(self, group: list[_Block]) -> None:
        x = torch.stack([b.x() for b in group])
        s_old = torch.stack([b.S for b in group])
        y = torch.stack([b.Y for b in group])
        dtype = x.dtype
        rho = torch.tensor([b.rho for b in group], dtype=dtype, device=x.device).view(-1, 1, 1)
        # L step: SVT of X - S + Y/rho with each block's own alpha/rho.
        u, sv, vh = torch.linalg.svd(x - s_old + y / rho, full_matrices=False)
        tau_l = torch.tensor([b.alpha.value / b.rho for b in group], dtype=dtype, device=x.device).view(-1, 1)
        sv = soft_threshold(sv, tau_l)
        low = (u * sv.unsqueeze(-2)) @ vh
        for i, b in enumerate(group):
            b.L = low[i]
            b.nr_rank = energy_rank(sv[i], b.config.energy, squared=True)
            b.alpha.update(b.nr_rank / b.total_rank, b.rho)
        # S step with the new L.
        t = x - low + y / rho
        for i, b in enumerate(group):
            if b.beta.config.mode == "hard_cut":
                b.beta.cut(t[i], b.rho)
        tau_s = torch.tensor([b.beta.value / b.rho for b in group], dtype=dtype, device=x.device).view(-1, 1, 1)
        sparse = soft_threshold(t, tau_s)
        for i, b in enumerate(group):
            b.S = sparse[i]
            b.beta.update(int(torch.count_nonzero(sparse[i])) / b.numel, b.rho)
            b.epoch += 1
            b.rho = rho_at(b.config.rho, b.epoch, b.rho0)
        # Dual ascent with the updated rho.
        rho_new = torch.tensor([b.rho for b in group], dtype=dtype, device=x.device).view(-1, 1, 1)
        y = y + rho_new * (x - low - sparse)
        for i, b in enumerate(group):
            b.Y = y[i]

    # -- inspection, deployment, checkpoints ---------------------------------------------------------------------
    def components(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{block name: (L, S)}, the input of :func:`icml26.methods.salaad.hpa.truncate_to_budget`."""
        return {name: (b.L, b.S) for name, b in self.blocks.items()}

    @torch.no_grad()
    def stats(self) -> dict[str, dict[str, float]]:
        """Per block: rank ratio of L (training definition), density of S, alpha, beta, rho and
        ||X - L - S||_F / ||X||_F."""
        out = {}
        for name, b in self.blocks.items():
            x = b.x()
            out[name] = {"rank_ratio": b.nr_rank / b.total_rank,
                         "density": int(torch.count_nonzero(b.S)) / b.numel,
                         "alpha": b.alpha.value, "beta": b.beta.value, "rho": b.rho,
                         "residual": float(torch.linalg.norm(x - b.L - b.S) / torch.linalg.norm(x).clamp_min(1e-30))}
        return out

    def state_dict(self) -> dict:
        """Everything needed to resume: step counters and each block's L, S, Y, rho and controller states."""
        return {"num_steps": self.num_steps, "num_updates": self.num_updates,
                "blocks": {name: b.state_dict() for name, b in self.blocks.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; every block is checked before any is loaded."""
        if not isinstance(state, Mapping) or not all(k in state for k in ("blocks", "num_steps", "num_updates")):
            raise ValueError("state must be a SALAAD.state_dict() with 'blocks', 'num_steps' and 'num_updates'")
        names = set(state["blocks"])
        if names != set(self.blocks):
            raise ValueError(f"checkpoint blocks {sorted(names)} differ from this hook's {sorted(self.blocks)}")
        for key in ("num_steps", "num_updates"):
            if not isinstance(state[key], int) or isinstance(state[key], bool) or state[key] < 0:
                raise ValueError(f"{key} must be an int >= 0, got {state[key]!r}")
        for name, b in self.blocks.items():
            b.check_state(state["blocks"][name])
        for name, b in self.blocks.items():
            b.load_state_dict(state["blocks"][name])
        self.num_steps, self.num_updates = int(state["num_steps"]), int(state["num_updates"])
