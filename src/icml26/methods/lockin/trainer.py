"""StabilisedFineTuner: one Adam fine-tuning loop with the standard stabilisers and the curvature-aware escape.

Stabilisers (``LockInConfig.stabiliser``):

* ``plain``   Adam on the task loss.
* ``low_lr``  Adam with lr * ``low_lr_factor``.
* ``l2sp``    task loss + l2sp/2 * ||theta - theta_0||^2 (weight decay towards the start, Li et al. 2018).
* ``ewc``     task loss + ewc/2 * sum_i F_i (theta_i - theta_0,i)^2, F the diagonal empirical Fisher of the broad
              loss at theta_0 normalised to mean 1 (Kirkpatrick et al. 2017 form).
* ``freeze``  parameters whose names start with a prefix in ``freeze`` are not trained.
* ``project`` after every Adam step the update Delta is replaced by (I - U U^T) Delta, U (P, k) the top-k
              eigendirections of the broad loss's empirical Fisher (or Hessian), recomputed every
              ``refresh_every`` steps along the trajectory: updates are kept off the broad loss's sharp modes.

Each switch reduces to ``plain`` exactly at its neutral value (factor 1, lambda 0, k 0); tests check it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import LockInConfig
from .geometry import (LossFn, fisher_top_directions, flatten, hvp, lanczos_top_eigs, per_example_grads,
                       project_out, write_flat)


class StabilisedFineTuner:
    """Fine-tune ``model`` on ``task_loss`` under one stabiliser.

    Args:
        model: the pretrained model (theta_0 is snapshotted at construction).
        task_loss, broad_loss: ``loss(model, batch) -> scalar tensor``.
        config: :class:`LockInConfig`.
        broad_batch: a batch of broad-capability examples (tuple of tensors, leading dim N); required by ``ewc``
            and ``project`` (their Fisher/Hessian); the first ``fisher_examples`` examples are used.
    """

    def __init__(self, model: nn.Module, task_loss: LossFn, config: LockInConfig, *, broad_loss: LossFn | None = None,
                 broad_batch: Any = None):
        self.model, self.task_loss, self.config = model, task_loss, config
        self.broad_loss, self.broad_batch = broad_loss, broad_batch
        kind = config.stabiliser
        if kind in ("ewc", "project") and (broad_loss is None or broad_batch is None):
            raise ValueError(f"stabiliser={kind!r} needs broad_loss and broad_batch (it uses the broad loss's "
                             "curvature)")
        if kind == "freeze":
            names = [n for n, _ in model.named_parameters() if n.startswith(config.freeze)]
            if not names:
                raise ValueError(f"freeze prefixes {config.freeze} match no parameter name of the model")
            for n, p in model.named_parameters():
                if n.startswith(config.freeze):
                    p.requires_grad_(False)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.theta0 = [p.detach().clone() for p in self.params]
        lr = config.lr * (config.low_lr_factor if kind == "low_lr" else 1.0)
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.steps = 0
        self.fisher_diag: list[torch.Tensor] | None = None
        self.basis: torch.Tensor | None = None
        if kind == "ewc" and config.ewc > 0:
            grads = per_example_grads(model, broad_loss, self._broad_examples(), self.params)
            diag = grads.pow(2).mean(0)
            diag = diag / diag.mean().clamp_min(1e-30)
            self.fisher_diag = [d.view_as(p) for d, p in zip(diag.split([p.numel() for p in self.params]), self.params)]

    def _broad_examples(self):
        n = self.config.fisher_examples
        b = self.broad_batch
        return tuple(t[:n] for t in b) if isinstance(b, (tuple, list)) else b[:n]

    def curvature_basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k broad-loss curvature eigenpairs at the current parameters: ``(eigenvalues (k,), U (P, k))``."""
        cfg = self.config
        batch = self._broad_examples()
        if cfg.project_curvature == "fisher":
            grads = per_example_grads(self.model, self.broad_loss, batch, self.params)
            return fisher_top_directions(grads, cfg.project_k)
        dim = sum(p.numel() for p in self.params)
        gen = torch.Generator().manual_seed(self.steps)

        def matvec(v: torch.Tensor) -> torch.Tensor:
            return hvp(self.model, self.broad_loss, batch, self.params, v.to(self.params[0].dtype))[2]

        evals, u = lanczos_top_eigs(matvec, dim, cfg.project_k, iters=cfg.lanczos_iters, generator=gen)
        return evals.to(self.params[0].dtype), u.to(self.params[0].dtype)

    def penalty(self) -> torch.Tensor | None:
        """The stabiliser's regulariser at the current parameters (None for penalty-free stabilisers)."""
        cfg = self.config
        if cfg.stabiliser == "l2sp" and cfg.l2sp > 0:
            return 0.5 * cfg.l2sp * sum((p - p0).pow(2).sum() for p, p0 in zip(self.params, self.theta0))
        if cfg.stabiliser == "ewc" and self.fisher_diag is not None:
            return 0.5 * cfg.ewc * sum((f * (p - p0).pow(2)).sum()
                                       for p, p0, f in zip(self.params, self.theta0, self.fisher_diag))
        return None

    def step(self, batch: Any) -> float:
        """One optimisation step on a task batch; returns the task loss (without the penalty) before the step."""
        cfg = self.config
        project = cfg.stabiliser == "project" and cfg.project_k > 0
        if project and (self.basis is None or (cfg.refresh_every and self.steps % cfg.refresh_every == 0)):
            self.basis = self.curvature_basis()[1].detach()
        loss = self.task_loss(self.model, batch)
        penalty = self.penalty()
        total = loss if penalty is None else loss + penalty
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        before = flatten(self.params).clone() if project else None
        self.optimizer.step()
        if project:
            delta = flatten(self.params) - before
            write_flat(self.params, before + project_out(delta, self.basis))
        self.steps += 1
        return float(loss.detach())

    def drift(self) -> float:
        """||theta - theta_0|| over the trained parameters (frozen ones do not move)."""
        return float(torch.sqrt(sum((p.detach() - p0).pow(2).sum() for p, p0 in zip(self.params, self.theta0))))

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps,
                "theta0": [t.clone() for t in self.theta0],
                "fisher_diag": None if self.fisher_diag is None else [f.clone() for f in self.fisher_diag],
                "basis": None if self.basis is None else self.basis.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.theta0 = [t.clone() for t in state["theta0"]]
        self.fisher_diag = None if state["fisher_diag"] is None else [f.clone() for f in state["fisher_diag"]]
        self.basis = None if state["basis"] is None else state["basis"].clone()
