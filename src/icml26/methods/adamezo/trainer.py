"""``ZOTrainer``: transformers' Trainer driven by a zeroth-order optimizer (MeZO, AdaMeZO).

The official MeZO code ships a Trainer subclass for the same reason (princeton-nlp/MeZO, ``large_models/
trainer.py``): Trainer's loop does ``loss.backward()`` then ``optimizer.step()`` with no closure, while an SPSA
optimizer needs the loss as a function it can evaluate twice at perturbed parameters. Here ``training_step`` runs
the whole ZO step (two forward passes under ``no_grad``, in eval mode as the official ``zo_forward`` does, so
dropout cannot differ between the two passes) and the loop's own closure-less ``optimizer.step()`` becomes a
no-op. Everything else is Trainer's: evaluation, logging, learning-rate schedules (they set ``param_groups``'
``lr``), checkpoints and ``resume_from_checkpoint`` (the optimizer state is the step count and the window of
(seed, projected gradient) pairs, so a resumed run continues the same perturbation stream exactly).

Usage::

    trainer = ZOTrainer(model=model, args=TrainingArguments(..., learning_rate=1e-6), train_dataset=ds,
                        zo_optimizer="adamezo", zo_kwargs={"eps": 1e-3, "window": 10})
    trainer.train()

or pass your own instance: ``ZOTrainer(..., optimizers=(AdaMeZO(params, lr=1e-6), None))``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from .optimizer import AdaMeZO, MeZO, zo_param_groups

_OPTIMIZERS = {"adamezo": AdaMeZO, "mezo": MeZO}


def _closure_step_only(optimizer: AdaMeZO) -> None:
    """Make ``optimizer.step()`` without a closure a no-op on this instance (the ZO step already ran inside
    ``training_step``); a call with a closure still performs a step."""
    if getattr(optimizer, "_zo_trainer_armed", False):
        return
    real_step = optimizer.step

    def step(closure=None):
        return None if closure is None else real_step(closure)

    optimizer.step = step
    optimizer._zo_trainer_armed = True


class ZOTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is MeZO or AdaMeZO.

    Args (beyond Trainer's):
        zo_optimizer: "adamezo" or "mezo", used when no optimizer instance is passed through ``optimizers``.
            It is built on :func:`zo_param_groups` (no decay on biases and norms, as the official trainer) with
            ``args.learning_rate`` and ``args.weight_decay``.
        zo_kwargs: further keyword arguments of that optimizer (``eps``, ``betas``, ``window``, ``seed``).
    """

    def __init__(self, *args: Any, zo_optimizer: str = "adamezo", zo_kwargs: dict | None = None, **kwargs: Any):
        if zo_optimizer not in _OPTIMIZERS:
            raise ValueError(f"zo_optimizer must be one of {sorted(_OPTIMIZERS)}, got {zo_optimizer!r}")
        given = kwargs.get("optimizers", (None, None))[0]
        if given is not None and not isinstance(given, AdaMeZO):
            raise TypeError(f"ZOTrainer needs a MeZO or AdaMeZO optimizer, got {type(given).__name__}; use "
                            f"transformers.Trainer for gradient-based optimizers")
        self.zo_optimizer, self.zo_kwargs = zo_optimizer, dict(zo_kwargs or {})
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError("ZOTrainer needs gradient_accumulation_steps=1: a zeroth-order step has no gradient "
                             f"to accumulate (got {self.args.gradient_accumulation_steps}); use a larger batch")

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            groups = zo_param_groups(model if model is not None else self.model, self.args.weight_decay)
            self.optimizer = _OPTIMIZERS[self.zo_optimizer](groups, lr=self.args.learning_rate, **self.zo_kwargs)
        return self.optimizer

    def _zo(self) -> AdaMeZO:
        """The ZO optimizer under accelerate's wrapper."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        _closure_step_only(optimizer)
        return optimizer

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """One ZO step on ``inputs``; returns the loss at theta + eps z (what the official trainer logs)."""
        inputs = self._prepare_inputs(inputs)
        model.eval()

        def closure() -> torch.Tensor:
            with self.compute_loss_context_manager():
                return self.compute_loss(model, inputs)

        loss = self._zo().step(closure)
        return loss.detach().to(self.args.device)

    # No gradients exist: nothing to clip, and no gradient norm to log (Trainer would log 0).
    def _clip_grad_norm(self, model):
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        return None
