"""Clip_B and the entropy-change diagnostics inside TRL's ``GRPOTrainer`` (arXiv 2602.03392), for TRL users.

``ClipBGRPOTrainer`` is used exactly like ``trl.GRPOTrainer``, with a :class:`ClipBConfig` (a ``GRPOConfig`` plus
``clip_b``, ``clip_b_mu`` and ``log_entropy_change``). Requires ``trl>=0.28,<2`` (the ``rl`` extra).

Extension point: one override, ``_generate_and_score_completions``, which calls TRL's own version and then
post-processes the batch it returns. That method and its output keys (``prompt_ids``, ``prompt_mask``,
``completion_ids``, ``completion_mask``, ``advantages``, ``num_items_in_batch``, ``tool_mask``) are the contract
between TRL's rollout and its loss. Clip_B enters the loss through ``tool_mask``: TRL's loss multiplies
``completion_mask`` by it for the token loss, its normalisation, the entropy bonus and the logged means, but not for
the attention mask. ``completion_mask`` cannot carry Clip_B, because it also masks attention, so zeroing a
token there would change the logits of every later token. No TRL loss code is copied or re-implemented: TRL's
``loss_type`` (``dapo`` = the official token-mean over the whole generation batch), PPO clipping, KL and entropy bonus
all apply unchanged.

Per generation batch (B completions of length L, shapes below), with the policy that sampled the batch:
  LP, H (B, L) from one extra no-grad forward pass (full-vocabulary logits, needed for H and E_p[S]);
  S = exp(LP)(H + LP); keep (B, L) = ``clip_b_keep_mask`` over the valid tokens of the global batch;
  ``tool_mask`` *= keep, and ``num_items_in_batch`` is recounted over the clipped mask.
Logged through TRL's metrics (``trainer.state.log_history``, W&B, ...):
  ``clip_b/frac_clipped``, ``clip_b/frac_clipped_neg``, ``clip_b/frac_clipped_pos``, ``entropy_discriminator/mean``,
  ``entropy_discriminator/std``, and ``entropy_change/first_order`` and ``entropy_change/first_order_unclipped``:
  the token mean of the Theorem 3.3 change -A (S_k - E_p[S]) per unit logit step over the trained tokens (after
  Clip_B) and over all valid tokens (before). Clip_B removes negative-advantage tokens whose term lowers H.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import trl
from packaging.version import Version
from torch import nn
from trl import GRPOConfig, GRPOTrainer

from .config import check_clip_b
from .grpo import (check_rewards, clip_b_keep_mask, entropy_discriminator, logprobs_and_entropy,
                   predicted_entropy_change)

MIN_TRL = "0.28"
"""First TRL whose GRPO loss multiplies the loss mask by ``tool_mask`` (huggingface/trl a03c2fcda, PR #4895).
Before it, the mask is ignored and Clip_B would silently clip nothing (the gradient test fails on trl 0.27.2)."""


@dataclass
class ClipBConfig(GRPOConfig):
    """``trl.GRPOConfig`` plus Clip_B. ``clip_b=False`` or ``clip_b_mu=math.inf`` is plain ``GRPOTrainer``.

    For the official Clip_B loss (Trinity-RFT ``PPOPolicyLossFn``: token mean over the batch) set
    ``loss_type="dapo"``; TRL's other loss types work too and then aggregate over the clipped mask their own way.
    """

    clip_b: bool = field(default=True, metadata={
        "help": "Clip_B: drop negative-advantage tokens whose entropy discriminator S lies far below the batch mean "
                "(arXiv 2602.03392; the official ClipBAdvantageFn). False: plain GRPO."})
    clip_b_mu: float = field(default=2.5, metadata={
        "help": "mu: drop tokens with A < 0 and S - E[S] < -mu * std(S) (ClipBAdvantageFn default 2.5); "
                "math.inf keeps every token."})
    log_entropy_change: bool = field(default=True, metadata={
        "help": "log the entropy discriminator and the first-order entropy change (Theorem 3.3) of each generation "
                "batch; costs one extra no-grad forward pass per generation batch (the one Clip_B needs anyway)."})

    def __post_init__(self) -> None:
        # Checked before GRPOConfig's own __post_init__ so that a bad value fails before anything is derived.
        check_clip_b(self.clip_b, self.clip_b_mu, "clip_b", "clip_b_mu")
        if not isinstance(self.log_entropy_change, bool):
            raise ValueError(f"log_entropy_change must be a bool, got {self.log_entropy_change!r}")
        if self.clip_b_active and (getattr(self, "use_liger_loss", False) or getattr(self, "use_liger_kernel", False)):
            raise ValueError("clip_b with use_liger_loss / use_liger_kernel: the Liger GRPO loss ignores the token mask "
                             "that carries Clip_B; switch Liger off or set clip_b=False")
        super().__post_init__()

    @property
    def clip_b_active(self) -> bool:
        """False when Clip_B cannot drop a token (switched off or mu = inf): the trainer is then plain GRPO."""
        return self.clip_b and math.isfinite(self.clip_b_mu)


def _finite_reward_func(func: Callable, name: str) -> Callable:
    """Wrap a TRL reward function so that a NaN or infinite reward raises ValueError naming ``name``.

    ``None`` stays allowed: it is TRL's documented way to mark a completion the function does not score. TRL turns
    None into NaN itself, so a NaN the function returns could otherwise not be told apart from None and would
    silently zero the completion's advantage; an inf reward would zero the advantages of its whole group.
    """

    def check(out: Any) -> Any:
        values = [v for v in out if v is not None]
        if values:
            check_rewards(torch.as_tensor(values, dtype=torch.float64), len(values), f"reward function {name!r}")
        return out

    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None)):
        @functools.wraps(func)
        async def wrapped_async(*args, **kwargs):
            return check(await func(*args, **kwargs))
        return wrapped_async

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        return check(func(*args, **kwargs))
    return wrapped


def _finite_reward_model_hook(name: str) -> Callable:
    """Forward hook for a reward model (``nn.Module`` returning ``.logits``): non-finite scores raise ValueError."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        scores = output.logits[:, 0].detach().float()
        check_rewards(scores, scores.shape[0], f"reward model {name!r}")
    return hook


class ClipBGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with Clip_B and entropy-change metrics; same arguments, ``args`` a :class:`ClipBConfig`.

    Also refuses bad input before any parameter changes: an empty ``train_dataset`` or prompt batch, a prompt that
    tokenizes to nothing, and a NaN or infinite reward (ValueError naming the reward function).
    """

    def __init__(self, model, reward_funcs=None, args: ClipBConfig | None = None, train_dataset=None, *pos, **kwargs):
        if Version(trl.__version__) < Version(MIN_TRL):
            raise ImportError(f"ClipBGRPOTrainer needs trl>={MIN_TRL} (its GRPO loss must honour tool_mask), found "
                              f"trl {trl.__version__}; pip install 'icml26[rl]'")
        if args is None:
            model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = ClipBConfig(f"{model_name.split('/')[-1]}-GRPO")
        if not isinstance(args, ClipBConfig):
            raise TypeError(f"args must be a ClipBConfig (a GRPOConfig with the Clip_B fields), got "
                            f"{type(args).__name__}; use ClipBConfig(..., clip_b=False) for plain GRPO")
        if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
            raise ValueError("train_dataset is empty: GRPO needs at least one prompt (TRL would train 0 steps)")
        super().__init__(model, reward_funcs, args, train_dataset, *pos, **kwargs)
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            if isinstance(func, nn.Module):
                func.register_forward_hook(_finite_reward_model_hook(name))
            else:
                self.reward_funcs[i] = _finite_reward_func(func, name)

    def _check_prompts(self, inputs: list[dict]) -> None:
        if len(inputs) == 0:
            raise ValueError("empty prompt batch: GRPO needs at least one prompt per generation batch")
        blank = [i for i, x in enumerate(inputs) if isinstance(x.get("prompt"), str) and not x["prompt"].strip()]
        if blank:
            # Mirrors TRL's tokenization of plain-text prompts; only blank strings can tokenize to nothing.
            ids = self.processing_class(text=[inputs[i]["prompt"] for i in blank])["input_ids"]
            empty = [i for i, row in zip(blank, ids) if len(row) == 0]
            if empty:
                raise ValueError(f"prompts {empty[:5]} tokenize to no tokens (prompt {inputs[empty[0]]['prompt']!r}); "
                                 "a causal LM cannot sample from an empty context")

    @torch.no_grad()
    def _completion_stats(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LP, H (B, L) of the completions and the first-order entropy change -A (S_k - E_p[S]) (B, L), alpha = 1.

        Full-vocabulary logits, rows in chunks of ``per_device_train_batch_size`` to bound memory. Temperature and
        the attention mask as in TRL's own log-prob pass.
        """
        prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
        ids = torch.cat((prompt_ids, completion_ids), dim=1)
        attention = torch.cat((batch["prompt_mask"], batch["completion_mask"]), dim=1)
        length = completion_ids.shape[1]
        advantages = batch["advantages"]
        advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).float()
        chunk = max(int(self.args.per_device_train_batch_size), 1)
        logp, entropy, change = [], [], []
        for start in range(0, ids.shape[0], chunk):
            rows = slice(start, start + chunk)
            with self.accelerator.autocast():
                logits = self.model(input_ids=ids[rows], attention_mask=attention[rows]).logits
            logits = logits[:, -length - 1:-1].float() / self.args.temperature
            lp, h = logprobs_and_entropy(logits, completion_ids[rows])
            logp.append(lp)
            entropy.append(h)
            change.append(predicted_entropy_change(logits, completion_ids[rows],
                                                   advantages[rows].expand(-1, length), 1.0))
        return torch.cat(logp), torch.cat(entropy), torch.cat(change)

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict[str, Any]:
        self._check_prompts(inputs)
        batch = super()._generate_and_score_completions(inputs)
        args = self.args
        if not (args.clip_b_active or args.log_entropy_change):
            return batch
        logp, entropy, change = self._completion_stats(batch)
        loss_mask = batch["completion_mask"].float()
        if "tool_mask" in batch:
            loss_mask = loss_mask * batch["tool_mask"].float()
        advantages = batch["advantages"]
        adv = (advantages[:, None] if advantages.dim() == 1 else advantages).float() * loss_mask
        s = entropy_discriminator(logp, entropy)

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            return self.accelerator.reduce(t, reduction="sum")

        mu = args.clip_b_mu if args.clip_b_active else math.inf
        keep, metrics = clip_b_keep_mask(s, adv, loss_mask, mu, reduce_sum=reduce_sum)
        if args.clip_b_active:
            tool_mask = batch.get("tool_mask", torch.ones_like(batch["completion_mask"]))
            batch["tool_mask"] = tool_mask * keep.to(tool_mask.dtype)
            if "num_items_in_batch" in batch:  # the dapo/cispo normaliser: tokens the loss trains on, all processes
                batch["num_items_in_batch"] = reduce_sum((loss_mask * keep).sum())

        def token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
            sums = reduce_sum(torch.stack(((values * mask).sum(), mask.sum())))
            return float(sums[0] / sums[1].clamp_min(1.0))

        mode = "train" if self.model.training else "eval"
        logged = {"clip_b/frac_clipped": metrics["frac_clipped"],
                  "clip_b/frac_clipped_neg": metrics["frac_clipped_neg"],
                  "clip_b/frac_clipped_pos": metrics["frac_clipped_pos"]}
        if args.log_entropy_change:
            logged.update({"entropy_discriminator/mean": metrics["S_mean"],
                           "entropy_discriminator/std": math.sqrt(metrics["S_var"]),
                           "entropy_change/first_order": token_mean(change, loss_mask * keep),
                           "entropy_change/first_order_unclipped": token_mean(change, loss_mask)})
        for key, value in logged.items():
            self._metrics[mode][key].append(value)
        return batch
