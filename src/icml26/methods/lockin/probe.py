"""LockInProbe: objective-agnostic geometric probes of a fine-tuning trajectory, called every k steps.

    probe = LockInProbe(model, task_loss, broad_loss, LockInConfig(q=4, window=5))
    for step in range(steps):
        ...                                    # any optimiser, any objective
        if step % k == 0:
            record = probe.observe(step, model, batch_task, batch_broad)

Per call, with theta_t the current flat trainable parameters (P,), theta_0 those at construction and
v = theta_t - theta_prev the update since the previous call:

* drift ||theta_t - theta_0||, task loss and broad loss on the given batches;
* online harm signal on the broad loss l_b, evaluated at theta_prev on ``batch_broad``:
  first-order term g_b^T v, second-order term 1/2 v^T C v, the Rayleigh quotient v^T C v / ||v||^2 and the
  actual change l_b(theta_t) - l_b(theta_prev) on the same batch (C = Hessian via double backward, or the
  empirical Fisher from per-example gradients);
* effective update subspace: every ``window`` calls the K stacked updates (P, K) give the top-q left singular
  subspace U_t; its overlap ||U_prev^T U_t||_F^2 / q and principal angles with the previous window's subspace
  (lock-in: overlap -> 1), and the mean broad curvature u^T C u of its basis vectors (softer modes: smaller).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .config import LockInConfig
from .geometry import (LossFn, batch_size, fisher_vp, flatten, hvp, per_example_grads, principal_angles,
                       subspace_overlap, top_subspace, write_flat)


def check_probe_batch(name: str, batch: Any) -> None:
    """A clear ValueError for a missing or empty probe batch (0 examples, or an empty tuple or dict)."""
    empty_container = isinstance(batch, (tuple, list, Mapping)) and len(batch) == 0
    if batch is None or empty_container or batch_size(batch) == 0:
        raise ValueError(f"{name} is empty: the probe needs a batch with at least one example")


class LockInProbe:
    """Callback-style trajectory probe; see the module docstring for the quantities.

    Args:
        model: the model being fine-tuned. The probe follows its *trainable* parameters (``requires_grad`` at
            construction, in ``named_parameters`` order): P is their total size, and every stored vector
            (theta_0, theta_prev, the window's updates, the subspace U (P, q)) has P entries, so a LoRA-only model
            costs the probe only its adapter factors. Frozen parameters never move, so leaving them out changes
            no probe value.
        task_loss, broad_loss: ``loss(model, batch) -> scalar tensor``. Batches are tensors, tuples of tensors or
            dicts of tensors (Hugging Face batches) whose leading dimension indexes examples (needed only for
            ``curvature="fisher"``, which splits them into single examples).
        config: a :class:`LockInConfig` (uses ``q``, ``window`` and ``curvature``).

    Bad input raises before the probe's state changes: a model without trainable parameters (at construction), an
    empty batch, and a non-finite loss, parameter, gradient or curvature product (at ``observe``).
    """

    def __init__(self, model: nn.Module, task_loss: LossFn, broad_loss: LossFn, config: LockInConfig | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, fn in (("task_loss", task_loss), ("broad_loss", broad_loss)):
            if not callable(fn):
                raise TypeError(f"{name} must be a callable loss(model, batch) -> scalar tensor, got {fn!r}")
        self.config = config or LockInConfig()
        self.task_loss, self.broad_loss = task_loss, broad_loss
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.names:
            raise ValueError("the model has no trainable parameters (none has requires_grad=True): the probe "
                             "follows the trainable ones, so unfreeze what is fine-tuned before building it")
        params = self._params(model)
        self._check_finite("parameters", flatten(params), "at construction")
        self.theta0 = flatten(params).clone()
        self.prev: torch.Tensor | None = None
        self.updates: list[torch.Tensor] = []
        self.subspace: torch.Tensor | None = None
        self.history: list[dict[str, Any]] = []

    @property
    def num_parameters(self) -> int:
        """P, the number of (trainable) parameter entries the probe follows."""
        return int(self.theta0.numel())

    def _params(self, model: nn.Module) -> list[torch.Tensor]:
        """The followed parameters of ``model``, by name, in construction order."""
        named = dict(model.named_parameters())
        missing = [n for n in self.names if n not in named]
        if missing:
            raise ValueError(f"the model lacks {len(missing)} parameter(s) the probe was built for, e.g. "
                             f"{missing[:3]}: observe the model the probe was constructed with")
        return [named[n] for n in self.names]

    @staticmethod
    def _check_finite(what: str, value, where: str) -> None:
        finite = math.isfinite(value) if isinstance(value, float) else bool(torch.isfinite(value).all())
        if not finite:
            raise ValueError(f"LockInProbe {where}: the {what} {'is' if isinstance(value, float) else 'are'} not "
                             "finite (NaN or inf); the probe's state is unchanged")

    def _curvature_products(self, model: nn.Module, params, batch, vectors: torch.Tensor):
        if self.config.curvature == "hessian":
            return hvp(model, self.broad_loss, batch, params, vectors)
        grads = per_example_grads(model, self.broad_loss, batch, params)
        with torch.no_grad():
            loss = float(self.broad_loss(model, batch))
        return loss, grads.mean(0), fisher_vp(grads, vectors)

    def observe(self, step: int, model: nn.Module, batch_task: Any, batch_broad: Any) -> dict[str, Any]:
        """Measure the probes at ``step``; returns (and appends to ``history``) a dict of floats.

        Everything is computed first and committed last, so an error (empty batch, NaN loss) leaves the probe as
        it was and the model's parameters at theta_t."""
        check_probe_batch("batch_task", batch_task)
        check_probe_batch("batch_broad", batch_broad)
        params = self._params(model)
        theta = flatten(params).clone()
        if theta.shape != self.theta0.shape:
            raise ValueError(f"the followed parameters have {theta.numel()} entries, the probe was built for "
                             f"{self.theta0.numel()}")
        self._check_finite("parameters", theta, f"at step {step}")
        with torch.no_grad():
            record: dict[str, Any] = {"step": int(step), "drift": float((theta - self.theta0).norm()),
                                      "task_loss": float(self.task_loss(model, batch_task)),
                                      "broad_loss": float(self.broad_loss(model, batch_broad))}
        self._check_finite("task loss", record["task_loss"], f"at step {step}")
        self._check_finite("broad loss", record["broad_loss"], f"at step {step}")
        updates, subspace = self.updates, self.subspace
        if self.prev is not None:
            v = theta - self.prev
            record["update_norm"] = float(v.norm())
            try:
                write_flat(params, self.prev)  # the Taylor expansion of the last update is taken at theta_prev
                loss_prev, grad, cv = self._curvature_products(model, params, batch_broad, v)
            finally:
                write_flat(params, theta)
            self._check_finite("broad loss at theta_prev", loss_prev, f"at step {step}")
            self._check_finite("broad-loss gradient entries", grad, f"at step {step}")
            self._check_finite("curvature-vector products", cv, f"at step {step}")
            vcv = float(torch.dot(v.double(), cv.double()))
            first = float(torch.dot(grad.double(), v.double()))
            record.update(harm_first_order=first, harm_second_order=0.5 * vcv,
                          harm_rayleigh=vcv / max(float(v.double().pow(2).sum()), 1e-300),
                          harm_ratio=abs(0.5 * vcv) / (abs(first) + 1e-12),
                          broad_change=record["broad_loss"] - loss_prev)
            updates = updates + [v]
            if len(updates) == self.config.window:
                subspace = self._close_window(model, params, batch_broad, updates, record, step)
                updates = []
        self.updates, self.subspace, self.prev = updates, subspace, theta
        self.history.append(record)
        return record

    def _close_window(self, model: nn.Module, params, batch_broad, updates: list[torch.Tensor], record: dict,
                      step: int) -> torch.Tensor:
        """Fill the window-end entries of ``record``; returns the window's subspace U (P, q)."""
        u = top_subspace(torch.stack(updates, dim=1), self.config.q)
        _, _, cu = self._curvature_products(model, params, batch_broad, u.T.contiguous())
        self._check_finite("subspace curvature products", cu, f"at step {step}")
        record["subspace_curvature"] = float((cu * u.T).sum(1).mean())
        if self.subspace is not None:
            angles = principal_angles(self.subspace, u)
            record["overlap"] = subspace_overlap(self.subspace, u)
            record["max_angle_deg"] = float(angles.max()) * 180.0 / math.pi
        return u

    def series(self, key: str) -> list[tuple[int, float]]:
        """``[(step, value)]`` of one recorded quantity, in call order."""
        return [(r["step"], r[key]) for r in self.history if key in r]

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "theta0": self.theta0.clone(),
                "prev": None if self.prev is None else self.prev.clone(),
                "updates": [u.clone() for u in self.updates],
                "subspace": None if self.subspace is None else self.subspace.clone(),
                "history": [dict(r) for r in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = list(state.get("names", self.names))
        if names != self.names or state["theta0"].shape != self.theta0.shape:
            raise ValueError(f"this state follows {len(names)} parameter tensors ({state['theta0'].numel()} entries); "
                             f"the probe follows {len(self.names)} ({self.theta0.numel()} entries)")
        self.theta0 = state["theta0"].clone()
        self.prev = None if state["prev"] is None else state["prev"].clone()
        self.updates = [u.clone() for u in state["updates"]]
        self.subspace = None if state["subspace"] is None else state["subspace"].clone()
        self.history = [dict(r) for r in state["history"]]
