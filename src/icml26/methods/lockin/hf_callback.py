"""LockInCallback: the trajectory lock-in probe inside Hugging Face ``transformers.Trainer`` training.

    callback = LockInCallback(task_batch, broad_batch, LockInConfig(q=2, window=3, curvature="fisher"), every=10)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    callback.history          # one record per observation: drift, losses, harm signal, overlap, ...

The callback owns a :class:`LockInProbe` built at ``on_train_begin`` (theta_0 = the parameters when training
starts, only those with ``requires_grad``: a peft LoRA model is followed through its adapter factors alone). It
observes at step 0 and after every ``every``-th optimizer step (``on_step_end``, so theta_t is the parameters after
update t and the update between two observations is ``every`` optimizer steps). Each observation runs with the model
in eval mode (dropout off; the training mode is restored after), on two fixed batches: HF dict batches such as a
data collator's output (``input_ids``, ``attention_mask``, ``labels``, each (N, T)), moved to the model's device.
The default loss is the model's own: ``model(**batch).loss``.

Records go to ``callback.history`` and, with ``log=True``, to ``trainer.state.log_history`` as ``lockin/<key>``
entries (so they are saved in every checkpoint's ``trainer_state.json``). At each checkpoint the probe's state is
written to ``checkpoint-<step>/lockin_probe.pt``; ``trainer.train(resume_from_checkpoint=...)`` restores it from
``<output_dir>/checkpoint-<step>`` and the records continue as without the interruption.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...core.assets import require
from .config import LockInConfig
from .geometry import LossFn
from .probe import LockInProbe, check_probe_batch

transformers = require("transformers", "pip install 'icml26[llm]'", purpose="LockInCallback (transformers' Trainer)")
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

PROBE_STATE_NAME = "lockin_probe.pt"


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face model computes itself, ``model(**batch).loss`` (the batch must hold ``labels``)."""
    loss = model(**batch).loss
    if loss is None:
        raise ValueError("the model returned no loss for the probe batch: include 'labels' in the batch, or pass "
                         "task_loss/broad_loss callables to LockInCallback")
    return loss


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class LockInCallback(transformers.TrainerCallback):
    """Record the lock-in probes (:class:`LockInProbe`) during ``transformers.Trainer`` training.

    Args:
        task_batch, broad_batch: fixed probe batches (dicts of (N, T) tensors; N >= 1) on which the task loss l_T
            and the broad loss l_B are measured; the Fisher curvature splits ``broad_batch`` into its N examples.
        config: :class:`LockInConfig` (``q``, ``window``, ``curvature``); defaults to ``LockInConfig()``.
        every: observe after every ``every``-th optimizer step (and at step 0).
        task_loss, broad_loss: ``loss(model, batch) -> scalar``; default :func:`model_loss`.
        log: also append each record to ``state.log_history`` under ``lockin/<key>``.

    Attributes:
        probe: the :class:`LockInProbe` (None before training starts); ``history`` is its list of records.
    """

    def __init__(self, task_batch: Any, broad_batch: Any, config: LockInConfig | None = None, *, every: int = 10,
                 task_loss: LossFn | None = None, broad_loss: LossFn | None = None, log: bool = True):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an int >= 1 (observe every that many optimizer steps), got {every!r}")
        if config is not None and not isinstance(config, LockInConfig):
            raise TypeError(f"config must be a LockInConfig, got {type(config).__name__}")
        for name, batch in (("task_batch", task_batch), ("broad_batch", broad_batch)):
            check_probe_batch(name, batch)
        self.task_batch, self.broad_batch = task_batch, broad_batch
        self.config = config or LockInConfig()
        self.every, self.log = every, log
        self.task_loss, self.broad_loss = task_loss or model_loss, broad_loss or model_loss
        self.probe: LockInProbe | None = None
        self._batches: tuple[Any, Any] | None = None

    @property
    def history(self) -> list[dict[str, Any]]:
        return [] if self.probe is None else self.probe.history

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("LockInCallback needs the model: the Trainer passes it to on_train_begin")
        self.probe = LockInProbe(model, self.task_loss, self.broad_loss, self.config)
        device = next(p for p in model.parameters() if p.requires_grad).device
        self._batches = (_to_device(self.task_batch, device), _to_device(self.broad_batch, device))
        if state.global_step > 0:  # resumed: the probe continues from the checkpoint's state
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", PROBE_STATE_NAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"resuming at step {state.global_step}, but {path} is missing: without it the "
                                        "probe would take theta_0 at the resumed step and report a wrong drift. Resume "
                                        "from a checkpoint of the same output_dir written with LockInCallback")
            self.probe.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        else:
            self._observe(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.probe is not None and state.global_step % self.every == 0:
            self._observe(state, model)

    def on_save(self, args, state, control, **kwargs):
        if self.probe is not None and state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            torch.save(self.probe.state_dict(), os.path.join(folder, PROBE_STATE_NAME))

    def _observe(self, state, model: nn.Module) -> None:
        was_training = model.training
        model.eval()
        try:
            record = self.probe.observe(state.global_step, model, *self._batches)
        finally:
            model.train(was_training)
        if self.log:
            state.log_history.append({**{f"lockin/{k}": v for k, v in record.items() if k != "step"},
                                      "step": state.global_step})
