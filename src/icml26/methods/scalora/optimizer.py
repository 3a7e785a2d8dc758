"""ScaLoRA and ReLoRA as wrappers around any torch optimizer that trains the LoRA factors.

    opt = ScaLoRAOptimizer(model, torch.optim.AdamW(trainable, lr=1e-3))   # merge + optimal rescale every step
    opt = ReLoRAOptimizer(model, torch.optim.AdamW(trainable, lr=1e-3), every=100)
    loss.backward(); opt.step(); opt.zero_grad()

Both find every :class:`ScaLoRALinear` and :class:`~icml26.core.adapters.LoRALinear` in ``model``, and every
active adapter of a Hugging Face peft LoRA model (``get_peft_model(model, LoraConfig(...))``); both keep the
effective weight of each layer unchanged by their restarts, so the function the model computes only changes
through the inner optimizer's steps. A learning-rate scheduler attaches to the inner optimizer
(``wrapper.optimizer``). After training with either, the base weights have changed: ``save_adapters`` then also
writes the adapted layers' base weights; a peft model is saved whole with ``merge_and_unload().save_pretrained``
(peft's adapter-only ``save_pretrained`` would drop the merged updates).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from ...core.adapters import PeftLoRA
from .adapter import lora_factors, lora_layers, merge_reinit_, merge_rescale_
from .config import ReLoRAConfig, ScaLoRAConfig
from .scaling import adam_direction, gram_adam, gram_sgd, optimal_multipliers

ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)

# Optimizer-state entries that are running averages of the gradient (scale like it) or of its square.
FIRST_MOMENTS = ("exp_avg", "momentum_buffer")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")


class _OptimizerWrapper:
    """Delegates the torch.optim.Optimizer surface that training loops use to ``self.optimizer``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.layers = list(lora_layers(model))
        if not self.layers:
            raise ValueError("the model has no LoRALinear, ScaLoRALinear or peft LoRA layer: inject adapters first")
        if any(isinstance(layer, PeftLoRA) for _, layer in self.layers):
            warnings.warn(f"{type(self).__name__} folds updates into the base weights of this peft model, and peft's "
                          "save_pretrained writes only the LoRA factors: save the trained model with "
                          "model.merge_and_unload().save_pretrained(dir)", UserWarning, stacklevel=3)
        owner = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self._group: dict[int, dict] = {}
        for name, layer in self.layers:
            A, B, _ = lora_factors(layer)
            for p in (A, B):
                if id(p) not in owner:
                    raise ValueError(f"the optimizer does not train the factors of adapter {name!r}; pass every "
                                     "adapter parameter to it")
                self._group[id(p)] = owner[id(p)]
        self.num_steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _closure_loss(self, closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class ScaLoRAOptimizer(_OptimizerWrapper):
    """ScaLoRA (arXiv 2510.23818): before every K-th step, merge each adapter into its frozen weight and restart
    it with optimally column-scaled factors; gradients and optimizer moments follow the rescale.

    Per layer, with W = W0 + s B A (B (m, r), A (r, n)) and the factor gradients of this step:

    1. solve the 2r x 2r normal equations of ``scaling.py`` for multipliers u (columns of B) and v (rows of A)
       that bring the coming step closest to the full fine-tuning step (``proxy`` says which step is modelled),
       from A, B, dl/dA, dl/dB (and Adam's moments) only: O((m + n) r^2), the full gradient G is never formed;
    2. W0 <- W0 + s B (I - diag(u v)) A, B <- B diag(u), A <- diag(v) A (W unchanged);
    3. dl/dB <- dl/dB diag(v), dl/dA <- diag(u) dl/dA (the chain rule at the new point, exact);
    4. moments: first moments scale like the gradient, second moments by its square ("equivariant");

    then the inner optimizer steps. ``scale_bounds=(1, 1)`` fixes u = v = 1, which is exactly LoRA.

    Args:
        model: a module holding LoRALinear / ScaLoRALinear adapters, or a peft LoRA model.
        optimizer: a torch optimizer over (at least) every adapter factor. The 'adam' proxy needs Adam/AdamW;
            the default 'auto' uses it for them and the 'sgd' proxy for anything else.
        every, proxy, nonneg, target_scale, scale_bounds, moment_transfer, ridge: see :class:`ScaLoRAConfig`.

    Attributes:
        last_multipliers: adapter name -> (u, v) float64 tensors of the latest rescale (for diagnostics).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, every: int = 1, proxy: str = "auto",
                 nonneg: str = "nnls", target_scale: float = 1.0, scale_bounds: tuple[float, float] = (1e-2, 1e2),
                 moment_transfer: str = "equivariant", ridge: float = 1e-10):
        self.config = ScaLoRAConfig(every=every, proxy=proxy, nonneg=nonneg, target_scale=target_scale,
                                    scale_bounds=scale_bounds, moment_transfer=moment_transfer, ridge=ridge)
        super().__init__(model, optimizer)
        is_adam = isinstance(optimizer, ADAM_FAMILY)
        if proxy == "adam" and not is_adam:
            raise ValueError(f"proxy='adam' needs a torch.optim.Adam or AdamW inner optimizer, got "
                             f"{type(optimizer).__name__}; use proxy='sgd'")
        self.proxy = "adam" if proxy == "adam" or (proxy == "auto" and is_adam) else "sgd"
        self.num_rescales = 0
        self.last_multipliers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: ScaLoRAConfig) -> "ScaLoRAOptimizer":
        return cls(model, optimizer, every=config.every, proxy=config.proxy, nonneg=config.nonneg,
                   target_scale=config.target_scale, scale_bounds=config.scale_bounds,
                   moment_transfer=config.moment_transfer, ridge=config.ridge)

    def normal_equations(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K (2r, 2r), g (2r,)) of ``layer`` from its factors and their gradients (None without gradients)."""
        A, B, s = lora_factors(layer)
        if A.grad is None or B.grad is None:
            return None
        if self.proxy == "sgd":
            return gram_sgd(A, B, A.grad, B.grad, s, self.config.target_scale)
        PA = adam_direction(A.grad, self.optimizer.state.get(A, {}), self._group[id(A)])
        PB = adam_direction(B.grad, self.optimizer.state.get(B, {}), self._group[id(B)])
        return gram_adam(A, B, A.grad, B.grad, PA, PB, s)

    @torch.no_grad()
    def compute_multipliers(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Adapter name -> optimal (u (r,), v (r,)) for every adapter with gradients; one batched solve per rank."""
        systems: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        for name, layer in self.layers:
            found = self.normal_equations(layer)
            if found is not None:
                systems.setdefault(found[1].shape[0], []).append((name, *found))
        cfg, out = self.config, {}
        for rows in systems.values():
            u, v = optimal_multipliers(torch.stack([row[1] for row in rows]), torch.stack([row[2] for row in rows]),
                                       proxy=self.proxy, nonneg=cfg.nonneg, ridge=cfg.ridge,
                                       bounds=cfg.scale_bounds)
            out.update({row[0]: (u[i], v[i]) for i, row in enumerate(rows)})
        return out

    @torch.no_grad()
    def merge_rescale(self) -> None:
        """Steps 1-4 of the class docstring for every adapter that has gradients."""
        multipliers = self.compute_multipliers()
        for name, layer in self.layers:
            if name not in multipliers:
                continue
            u, v = multipliers[name]
            A, B, _ = lora_factors(layer)
            merge_rescale_(layer, u, v)
            u_col, v_row = u.to(A.dtype)[:, None], v.to(B.dtype)[None, :]
            A.grad.mul_(u_col)
            B.grad.mul_(v_row)
            self._transfer(A, u_col)
            self._transfer(B, v_row)
        self.last_multipliers = multipliers
        self.num_rescales += 1

    def _transfer(self, param: torch.Tensor, factor: torch.Tensor) -> None:
        """Carry the moments of ``param`` into the rescaled parameterization (``factor`` broadcasts to it)."""
        state = self.optimizer.state.get(param)
        mode = self.config.moment_transfer
        if not state or mode == "keep":
            return
        for key, value in state.items():
            if not (isinstance(value, torch.Tensor) and value.shape == param.shape):
                continue  # step counters and other scalars
            if mode == "reset":
                value.zero_()
            elif key in FIRST_MOMENTS:
                value.mul_(factor.to(value.dtype))
            elif key in SECOND_MOMENTS:
                value.mul_(factor.to(value.dtype) ** 2)
            else:
                raise ValueError(f"don't know how the optimizer state entry {key!r} transforms under a rescale; "
                                 "use moment_transfer='reset' or 'keep' with this optimizer")

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Merge-rescale when due (gradients must be populated), then the inner step; returns the closure's loss."""
        loss = self._closure_loss(closure)
        if self.num_steps % self.config.every == 0:
            self.merge_rescale()
        self.optimizer.step()
        self.num_steps += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps,
                "num_rescales": self.num_rescales}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps, self.num_rescales = int(state["num_steps"]), int(state["num_rescales"])


class ReLoRAOptimizer(_OptimizerWrapper):
    """ReLoRA (Lialin et al., 2023), the baseline: after every N steps, merge each adapter into its frozen
    weight, re-initialise it (A Kaiming-uniform, B = 0), magnitude-prune the factors' optimizer state and
    re-warm the learning rate linearly over ``rewarmup_steps`` steps.

    The re-warm-up multiplies the learning rate of every param group of the inner optimizer during its step
    and restores it afterwards, so it composes with a scheduler attached to the inner optimizer.

    Args:
        model: a module holding LoRALinear / ScaLoRALinear adapters.
        optimizer: a torch optimizer over (at least) every adapter factor.
        every, rewarmup_steps, prune_ratio, seed: see :class:`ReLoRAConfig`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, every: int = 100,
                 rewarmup_steps: int = 10, prune_ratio: float = 0.99, seed: int = 0):
        self.config = ReLoRAConfig(every=every, rewarmup_steps=rewarmup_steps, prune_ratio=prune_ratio, seed=seed)
        super().__init__(model, optimizer)
        self.generator = torch.Generator().manual_seed(seed)
        self.num_restarts = 0
        self.last_restart_step = 0

    def lr_factor(self) -> float:
        """The re-warm-up multiplier of the coming step (1 before the first restart)."""
        warm = self.config.rewarmup_steps
        if self.num_restarts == 0 or warm == 0:
            return 1.0
        return min(1.0, (self.num_steps - self.last_restart_step + 1) / warm)

    @torch.no_grad()
    def restart(self) -> None:
        """Merge, re-initialise and prune the optimizer state of every adapter (the effective weight is kept)."""
        for _, layer in self.layers:
            merge_reinit_(layer, self.generator)
            A, B, _ = lora_factors(layer)
            for p in (A, B):
                self._prune(p)
        self.num_restarts += 1
        self.last_restart_step = self.num_steps

    def _prune(self, param: torch.Tensor) -> None:
        ratio = self.config.prune_ratio
        for value in self.optimizer.state.get(param, {}).values():
            if not (isinstance(value, torch.Tensor) and value.shape == param.shape) or ratio == 0.0:
                continue
            k = int(round(ratio * value.numel()))
            if k >= value.numel():
                value.zero_()
            elif k > 0:
                threshold = value.abs().flatten().kthvalue(k).values
                value.masked_fill_(value.abs() <= threshold, 0.0)

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """The inner step at the re-warmed learning rate, then a restart when N steps have passed since the last."""
        loss = self._closure_loss(closure)
        factor = self.lr_factor()
        saved = [group["lr"] for group in self.optimizer.param_groups]
        try:
            if factor != 1.0:
                for group in self.optimizer.param_groups:
                    group["lr"] = group["lr"] * factor
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
        self.num_steps += 1
        if self.num_steps % self.config.every == 0:
            self.restart()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps,
                "num_restarts": self.num_restarts, "last_restart_step": self.last_restart_step,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps, self.num_restarts = int(state["num_steps"]), int(state["num_restarts"])
        self.last_restart_step = int(state["last_restart_step"])
        self.generator.set_state(state["generator"])
