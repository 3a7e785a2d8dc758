"""LockInProbe: objective-agnostic geometric probes of a fine-tuning trajectory, called every k steps.

    probe = LockInProbe(model, task_loss, broad_loss, LockInConfig(q=4, window=5))
    for step in range(steps):
        ...                                    # any optimiser, any objective
        if step % k == 0:
            record = probe.observe(step, model, batch_task, batch_broad)

Per call, with theta_t the current flat parameters (P,), theta_0 those at construction and
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
from typing import Any

import torch
from torch import nn

from .config import LockInConfig
from .geometry import (LossFn, fisher_vp, flatten, hvp, per_example_grads, principal_angles, subspace_overlap,
                       top_subspace, write_flat)


class LockInProbe:
    """Callback-style trajectory probe; see the module docstring for the quantities.

    Args:
        model: the model being fine-tuned; the probe watches all its parameters (frozen ones add zero drift).
        task_loss, broad_loss: ``loss(model, batch) -> scalar tensor``; batches are tuples of tensors whose leading
            dimension indexes examples (needed only for ``curvature="fisher"``).
        config: a :class:`LockInConfig` (uses ``q``, ``window`` and ``curvature``).
    """

    def __init__(self, model: nn.Module, task_loss: LossFn, broad_loss: LossFn, config: LockInConfig | None = None):
        self.config = config or LockInConfig()
        self.task_loss, self.broad_loss = task_loss, broad_loss
        self.theta0 = flatten(model.parameters()).clone()
        self.prev: torch.Tensor | None = None
        self.updates: list[torch.Tensor] = []
        self.subspace: torch.Tensor | None = None
        self.history: list[dict[str, Any]] = []

    def _curvature_products(self, model: nn.Module, params, batch, vectors: torch.Tensor):
        if self.config.curvature == "hessian":
            return hvp(model, self.broad_loss, batch, params, vectors)
        grads = per_example_grads(model, self.broad_loss, batch, params)
        with torch.no_grad():
            loss = float(self.broad_loss(model, batch))
        return loss, grads.mean(0), fisher_vp(grads, vectors)

    def observe(self, step: int, model: nn.Module, batch_task: Any, batch_broad: Any) -> dict[str, Any]:
        """Measure the probes at ``step``; returns (and appends to ``history``) a dict of floats."""
        params = list(model.parameters())
        theta = flatten(params).clone()
        if theta.shape != self.theta0.shape:
            raise ValueError(f"model has {theta.numel()} parameters, the probe was built for {self.theta0.numel()}")
        with torch.no_grad():
            record: dict[str, Any] = {"step": int(step), "drift": float((theta - self.theta0).norm()),
                                      "task_loss": float(self.task_loss(model, batch_task)),
                                      "broad_loss": float(self.broad_loss(model, batch_broad))}
        if self.prev is not None:
            v = theta - self.prev
            record["update_norm"] = float(v.norm())
            try:
                write_flat(params, self.prev)  # the Taylor expansion of the last update is taken at theta_prev
                loss_prev, grad, cv = self._curvature_products(model, params, batch_broad, v)
            finally:
                write_flat(params, theta)
            vcv = float(torch.dot(v.double(), cv.double()))
            first = float(torch.dot(grad.double(), v.double()))
            record.update(harm_first_order=first, harm_second_order=0.5 * vcv,
                          harm_rayleigh=vcv / max(float(v.double().pow(2).sum()), 1e-300),
                          harm_ratio=abs(0.5 * vcv) / (abs(first) + 1e-12),
                          broad_change=record["broad_loss"] - loss_prev)
            self.updates.append(v)
            if len(self.updates) == self.config.window:
                self._close_window(model, params, batch_broad, record)
        self.prev = theta
        self.history.append(record)
        return record

    def _close_window(self, model: nn.Module, params, batch_broad, record: dict) -> None:
        u = top_subspace(torch.stack(self.updates, dim=1), self.config.q)
        self.updates = []
        _, _, cu = self._curvature_products(model, params, batch_broad, u.T.contiguous())
        record["subspace_curvature"] = float((cu * u.T).sum(1).mean())
        if self.subspace is not None:
            angles = principal_angles(self.subspace, u)
            record["overlap"] = subspace_overlap(self.subspace, u)
            record["max_angle_deg"] = float(angles.max()) * 180.0 / math.pi
        self.subspace = u

    def series(self, key: str) -> list[tuple[int, float]]:
        """``[(step, value)]`` of one recorded quantity, in call order."""
        return [(r["step"], r[key]) for r in self.history if key in r]

    def state_dict(self) -> dict[str, Any]:
        return {"theta0": self.theta0.clone(), "prev": None if self.prev is None else self.prev.clone(),
                "updates": [u.clone() for u in self.updates],
                "subspace": None if self.subspace is None else self.subspace.clone(),
                "history": [dict(r) for r in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta0 = state["theta0"].clone()
        self.prev = None if state["prev"] is None else state["prev"].clone()
        self.updates = [u.clone() for u in state["updates"]]
        self.subspace = None if state["subspace"] is None else state["subspace"].clone()
        self.history = [dict(r) for r in state["history"]]
