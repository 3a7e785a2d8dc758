"""The continual-learning trainer: one LoRA per task (folded into the base at the boundary), protected input
subspaces per layer, and the step rule that each arm switches (plain LoRA, LoRA-GPM, InfLoRA-style, GR)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ...core.adapters import adapter_layers
from .adapter import JanusLoRALinear, OnlineSubspace, decoupled_margin_loss, project_off, rectify_min_norm
from .config import JanusLoRAConfig
from .reference import null_space_violation


class PrototypeMemory:
    """Stored class-mean features (exemplar-free): NCM classification and the DML term against old classes."""

    def __init__(self) -> None:
        self.classes: list[int] = []
        self.means: list[torch.Tensor] = []

    def add(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Store the mean feature of every class in ``labels`` (n,) from ``features`` (n, D)."""
        if not isinstance(features, torch.Tensor) or not isinstance(labels, torch.Tensor):
            raise TypeError("features and labels must be tensors")
        if features.ndim != 2 or labels.ndim != 1 or len(features) != len(labels):
            raise ValueError(f"features must be (n, D) and labels (n,), got {tuple(features.shape)} and "
                             f"{tuple(labels.shape)}")
        if len(labels) == 0:
            raise ValueError("empty batch: no features to build prototypes from")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise TypeError(f"labels must be integer class ids, got dtype {labels.dtype}")
        if not bool(torch.isfinite(features).all()):
            raise ValueError("features contain NaN or inf: the class prototypes would be NaN")
        if self.means and features.shape[1] != self.means[0].shape[0]:
            raise ValueError(f"features have dimension {features.shape[1]}, the stored prototypes "
                             f"{self.means[0].shape[0]}")
        for c in labels.unique().tolist():
            self.classes.append(int(c))
            self.means.append(features[labels == c].mean(0).detach())

    def matrix(self) -> torch.Tensor:
        return torch.stack(self.means) if self.means else torch.zeros(0, 0)

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """Nearest class mean by cosine similarity; features (n, D) -> class ids (n,)."""
        if not self.means:
            raise ValueError("no prototypes stored yet: call add(features, labels) after a task first")
        if features.ndim != 2 or features.shape[1] != self.means[0].shape[0]:
            raise ValueError(f"features must be (n, {self.means[0].shape[0]}), got {tuple(features.shape)}")
        cos = nn.functional.normalize(features, dim=-1) @ nn.functional.normalize(self.matrix(), dim=-1).T
        return torch.tensor(self.classes, device=cos.device)[cos.argmax(1)]


class JanusTrainer:
    """Train the :class:`JanusLoRALinear` layers of ``model`` on a sequence of tasks.

    Per task: :meth:`begin_task` folds the previous adapter into the base and draws a fresh one (A in the
    complement of V for GR/InfLoRA), :meth:`step` applies one SGD-momentum step whose factor update is switched by
    ``config.projection``, and :meth:`end_task` measures the task's null-space violation and extends each layer's
    basis V (Online Estimation, or a GPM pass over ``data``). ``extra_params`` (e.g. a classifier head) get the same
    plain SGD-momentum step.
    """

    def __init__(self, model: nn.Module, config: JanusLoRAConfig, *, extra_params: Iterable[nn.Parameter] = ()):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(config, JanusLoRAConfig):
            raise TypeError(f"config must be a JanusLoRAConfig, got {type(config).__name__}")
        self.model, self.config = model, config
        self.layers: dict[str, JanusLoRALinear] = {n: m for n, m in adapter_layers(model)
                                                     if isinstance(m, JanusLoRALinear)}
        if not self.layers:
            raise ValueError("model has no JanusLoRALinear layers: inject them with inject_adapters(..., janus_make())")
        self.subspaces = {n: OnlineSubspace(m.in_features, config.energy_threshold) for n, m in self.layers.items()}
        self.extra_params = list(extra_params)
        self.buffers: dict[int, torch.Tensor] = {}
        self.task = -1
        self.nv_history: list[dict[str, float]] = []

    def basis(self, name: str) -> torch.Tensor:
        return self.subspaces[name].basis

    # -- task boundaries ---------------------------------------------------------------------------------------
    def begin_task(self) -> None:
        self.task += 1
        project_a = self.config.projection in ("gr", "inflora")
        for name, layer in self.layers.items():
            layer.fold_and_reset(self.basis(name) if project_a else None)
            layer.janus_A.requires_grad_(self.config.projection != "inflora")
            layer.input_cov.zero_()
            layer.input_count = 0
            layer.track_inputs = self.config.subspace == "online"
        self.buffers = {}

    @torch.no_grad()
    def end_task(self, data: Callable[[], Iterable[torch.Tensor]] | None = None) -> dict[str, float]:
        """Record NV of this task's update against the basis it had to respect, then extend the bases.

        ``data`` (needed for ``subspace="gpm"``) yields model inputs; the forward pass collects each layer's inputs.
        Returns {layer: NV}.
        """
        if self.config.subspace == "gpm" and data is None:
            raise ValueError("subspace='gpm' needs end_task(data=...) to collect the task's inputs")
        if data is not None and not callable(data):
            raise TypeError(f"data must be a function returning an iterable of model inputs, got "
                            f"{type(data).__name__}")
        if self.config.subspace == "online":
            # Checked before anything is recorded, so a poisoned covariance leaves every basis as it was.
            for name, layer in self.layers.items():
                self.subspaces[name].check_covariance(layer.input_cov, f"the input covariance of layer {name!r}")
        nv = {n: null_space_violation(layer.delta_weight().double(), self.basis(n)) for n, layer in self.layers.items()}
        self.nv_history.append(nv)
        if self.config.subspace == "gpm":
            for layer in self.layers.values():
                layer.input_cov.zero_()
                layer.track_inputs = True
            for x in data():
                self.model(x)
        for name, layer in self.layers.items():
            layer.track_inputs = False
            self.subspaces[name].update(layer.input_cov)
        return nv

    # -- one step ----------------------------------------------------------------------------------------------
    def _momentum(self, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(id(p))
        buf = grad.clone() if buf is None else buf.mul_(self.config.momentum).add_(grad)
        self.buffers[id(p)] = buf
        return -self.config.lr * buf

    @torch.no_grad()
    def _factor_steps(self, name: str, layer: JanusLoRALinear) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, V = self.config, self.basis(name)
        A, B = layer.janus_A, layer.janus_B
        gA = torch.zeros_like(A) if A.grad is None or cfg.projection == "inflora" else A.grad
        gB = torch.zeros_like(B) if B.grad is None else B.grad
        if cfg.projection == "gpm" or (cfg.projection == "gr" and cfg.gr_solver == "project_both"):
            gA = project_off(gA, V)
        dA, dB = self._momentum(A, gA), self._momentum(B, gB)
        if cfg.projection == "gr" and cfg.gr_solver == "min_norm":
            dA, dB = rectify_min_norm(A, B, V, dA, dB, rcond=cfg.rcond)
        return dA, dB

    def step(self, loss: torch.Tensor) -> dict[str, float]:
        """Backward ``loss``, update factors (switched by ``projection``) and extra params; returns per-layer NV of
        this step's first-order composite update B dA + dB A against V.

        Raises ValueError (before any factor, momentum buffer or extra parameter changes) when ``loss`` is not a
        finite scalar that depends on the parameters, or when a gradient comes out NaN/inf."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a scalar tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}: reduce it (e.g. .mean()) first")
        if not loss.requires_grad:
            raise ValueError("loss does not depend on any trainable parameter (no grad_fn): compute it from the "
                             "model's output")
        if not bool(torch.isfinite(loss.detach()).all()):
            raise ValueError(f"loss is not finite ({float(loss.detach())}): refusing a step that would make every "
                             "factor NaN")
        for p in self.parameters():
            p.grad = None
        loss.backward()
        self._check_gradients()
        nv: dict[str, float] = {}
        with torch.no_grad():
            for name, layer in self.layers.items():
                dA, dB = self._factor_steps(name, layer)
                nv[name] = null_space_violation(
                    (layer.janus_B @ dA + dB @ layer.janus_A).double(), self.basis(name))
                layer.janus_A += dA
                layer.janus_B += dB
            for p in self.extra_params:
                if p.grad is not None:
                    p += self._momentum(p, p.grad)
        return nv

    def _check_gradients(self) -> None:
        named = [(f"{n}.{k}", p) for n, layer in self.layers.items()
                 for k, p in (("janus_A", layer.janus_A), ("janus_B", layer.janus_B))]
        named += [(f"extra_params[{i}]", p) for i, p in enumerate(self.extra_params)]
        bad = [n for n, p in named if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if bad:
            raise ValueError(f"non-finite gradient in {bad}: no parameter was updated")

    def dml_loss(self, features: torch.Tensor, memory: PrototypeMemory) -> torch.Tensor:
        """lambda_DML * L_DML against the stored old-class prototypes (0 when switched off or on the first task)."""
        if self.config.dml_weight == 0.0 or not memory.means:
            return features.sum() * 0.0
        return self.config.dml_weight * decoupled_margin_loss(features, memory.matrix().to(features),
                                                              self.config.margin)

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers.values() for p in (layer.janus_A, layer.janus_B)] + self.extra_params

    # -- persistence -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"task": self.task, "bases": {n: s.basis.clone() for n, s in self.subspaces.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore the task counter and the bases; everything is checked before anything is set."""
        if not isinstance(state, dict) or set(state) != {"task", "bases"}:
            raise ValueError("state must be a dict with keys 'task' and 'bases' (from JanusTrainer.state_dict())")
        missing = set(self.subspaces) ^ set(state["bases"])
        if missing:
            raise ValueError(f"bases do not match this model's Janus layers: {sorted(missing)}")
        task = state["task"]
        if not isinstance(task, int) or isinstance(task, bool) or task < -1:
            raise ValueError(f"task must be an int >= -1, got {task!r}")
        for name, basis in state["bases"].items():
            dim = self.subspaces[name].dim
            if not isinstance(basis, torch.Tensor) or basis.ndim != 2:
                shape = tuple(basis.shape) if isinstance(basis, torch.Tensor) else type(basis).__name__
                raise ValueError(f"basis for {name!r} must be a 2-D tensor ({dim}, k), got {shape}")
            if basis.shape[0] != dim:
                raise ValueError(f"basis for {name!r} has {basis.shape[0]} rows, layer expects {dim}")
            b = basis.detach().double()
            if not bool(torch.isfinite(b).all()):
                raise ValueError(f"basis for {name!r} has NaN or inf entries")
            if basis.shape[1] > dim or not torch.allclose(b.T @ b, torch.eye(b.shape[1], dtype=b.dtype,
                                                                              device=b.device), atol=1e-6):
                raise ValueError(f"basis for {name!r} is not orthonormal (V^T V != I)")
        self.task = task
        for name, basis in state["bases"].items():
            self.subspaces[name].basis = basis.detach().clone().double().cpu()


def janus_make():
    """``make`` for :func:`~icml26.core.adapters.inject_adapters`: wraps each target Linear in JanusLoRALinear."""
    def make(linear: nn.Linear, r: int, alpha: float, name: str) -> JanusLoRALinear:
        return JanusLoRALinear(linear, r, alpha)
    return make
