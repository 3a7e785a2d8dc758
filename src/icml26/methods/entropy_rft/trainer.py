"""GRPOTrainer: group-sampled rollouts, verifiable rewards, group-normalised advantages, token-level clipped
policy loss, optional KL / entropy bonus, and Clip_B entropy-discriminator clipping (arXiv 2602.03392).

Works with any causal LM whose ``model(ids)`` returns logits (B, T, V), a tuple whose first item is the logits
(TinyLM), or an object with ``.logits`` (Hugging Face ``AutoModelForCausalLM``). Prompts are a (B, Tp) long
tensor of equal length (left-pad them yourself and make the model ignore the pad if they are not).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ...models.outputs import causal_logits
from .config import EntropyRFTConfig
from .grpo import (check_rewards, clip_b_keep_mask, entropy_discriminator, group_normalized_advantages, grpo_loss,
                   logprobs_and_entropy)

RewardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``reward_fn(prompts (N, Tp), responses (N, L), response_mask (N, L)) -> rewards (N,)`` float."""


@torch.no_grad()
def sample_responses(model: nn.Module, prompts: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                     generator: torch.Generator | None = None, eos_token_id: int | None = None,
                     pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one response per row of ``prompts`` (N, Tp) -> responses (N, L) and response mask (N, L).

    TinyLM uses its KV-cache ``generate``; other models are run on the whole prefix at every step. Tokens after
    the first ``eos_token_id`` become ``pad_token_id`` and leave the mask (the EOS itself stays in it).
    """
    if hasattr(model, "new_cache") and hasattr(model, "generate"):
        seqs = model.generate(prompts, max_new_tokens, temperature=temperature, generator=generator)
        responses = seqs[:, prompts.shape[1]:]
    else:
        seqs = prompts
        for _ in range(max_new_tokens):
            logits = causal_logits(model, seqs)[:, -1].float() / temperature
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            seqs = torch.cat((seqs, nxt), dim=1)
        responses = seqs[:, prompts.shape[1]:]
    mask = torch.ones_like(responses, dtype=torch.float32)
    if eos_token_id is not None:
        is_eos = (responses == eos_token_id).long()
        after = (is_eos.cumsum(1) - is_eos) > 0  # strictly after the first EOS
        mask = (~after).float()
        responses = responses.masked_fill(after, pad_token_id)
    return responses, mask


def response_logprobs(model: nn.Module, prompts: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs (N, L), entropies (N, L) and logits (N, L, V) of ``responses`` given ``prompts`` under ``model``."""
    ids = torch.cat((prompts, responses), dim=1)
    tp, length = prompts.shape[1], responses.shape[1]
    logits = causal_logits(model, ids)[:, tp - 1: tp - 1 + length].float() / temperature
    logp, entropy = logprobs_and_entropy(logits, responses)
    return logp, entropy, logits


@dataclass
class Rollout:
    """One GRPO batch. N = prompts x G rows; ``group`` says which prompt each row answers.

    ``mask`` is the response mask, ``keep`` the Clip_B keep mask (all ones when Clip_B is off), ``s`` the entropy
    discriminator S = exp(LP)(H + LP) and ``entropy`` H per token, both from the policy before the update.
    """

    prompts: torch.Tensor
    responses: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor
    entropy: torch.Tensor
    s: torch.Tensor
    keep: torch.Tensor
    ref_logp: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class GRPOTrainer:
    """GRPO with optional Clip_B for a causal LM.

    Args:
        model: the policy (TinyLM, a Hugging Face causal LM, or any module returning logits).
        optimizer: a torch optimizer over the policy's trainable parameters.
        reward_fn: verifiable reward, see :data:`RewardFn`.
        config: :class:`EntropyRFTConfig`; ``clip_b=False`` is plain GRPO.
        ref_model: frozen reference policy for the KL penalty; when ``kl_coef > 0`` and it is None, a frozen copy
            of ``model`` at construction is used.
        generator: torch.Generator for sampling (reproducible rollouts).

    ``step(prompts)`` samples G responses per prompt (B, Tp), scores them, and takes ``ppo_epochs`` gradient
    steps; it returns metrics and keeps the batch in ``last_rollout``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, reward_fn: RewardFn,
                 config: EntropyRFTConfig | None = None, *, ref_model: nn.Module | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.model, self.optimizer, self.reward_fn = model, optimizer, reward_fn
        self.config = config if config is not None else EntropyRFTConfig()
        self.generator = generator
        self.ref_model = ref_model
        if self.config.kl_coef > 0 and ref_model is None:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.last_rollout: Rollout | None = None

    @torch.no_grad()
    def rollout(self, prompts: torch.Tensor) -> Rollout:
        """Sample, score, compute advantages, S, H and the Clip_B keep mask (no parameter change)."""
        cfg = self.config
        if prompts.ndim != 2 or prompts.dtype != torch.long:
            raise ValueError(f"prompts must be a (B, Tp) long tensor, got {tuple(prompts.shape)} {prompts.dtype}")
        if prompts.shape[0] == 0 or prompts.shape[1] == 0:
            raise ValueError(f"prompts is empty, shape {tuple(prompts.shape)}: GRPO needs at least one prompt of at "
                             "least one token (a causal LM cannot sample from an empty context)")
        group = torch.arange(prompts.shape[0]).repeat_interleave(cfg.group_size)
        rep = prompts.repeat_interleave(cfg.group_size, dim=0)
        was_training = self.model.training
        self.model.eval()
        responses, mask = sample_responses(self.model, rep, cfg.max_new_tokens, temperature=cfg.temperature,
                                           generator=self.generator, eos_token_id=cfg.eos_token_id,
                                           pad_token_id=cfg.pad_token_id)
        rewards = torch.as_tensor(self.reward_fn(rep, responses, mask)).float()
        check_rewards(rewards, rep.shape[0], f"reward_fn {getattr(self.reward_fn, '__name__', repr(self.reward_fn))}")
        adv = group_normalized_advantages(rewards, group, cfg.adv_epsilon)[:, None] * mask
        # LP and H recomputed by the current policy (the official comments); equal to rollout values on-policy.
        old_logp, entropy, _ = response_logprobs(self.model, rep, responses, cfg.temperature)
        self.model.train(was_training)
        s = entropy_discriminator(old_logp, entropy)
        mean_entropy = float((entropy * mask).sum() / mask.sum().clamp_min(1))
        metrics = {"reward_mean": float(rewards.mean()), "entropy": mean_entropy}
        if cfg.clipping_active:
            keep, clip_metrics = clip_b_keep_mask(s, adv, mask, cfg.mu)
            metrics.update(clip_metrics)
        else:
            keep = torch.ones_like(mask)
            metrics["frac_clipped"] = 0.0
        ref_logp = None
        if self.ref_model is not None and cfg.kl_coef > 0:
            ref_logp = response_logprobs(self.ref_model, rep, responses, cfg.temperature)[0]
        return Rollout(rep, responses, mask, group, rewards, adv, old_logp, entropy, s, keep, ref_logp, metrics)

    def loss(self, batch: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped GRPO loss of the current policy on ``batch`` (differentiable)."""
        cfg = self.config
        logp, entropy, _ = response_logprobs(self.model, batch.prompts, batch.responses, cfg.temperature)
        return grpo_loss(logp, batch.old_logp, batch.advantages, batch.mask * batch.keep,
                         clip_range_low=cfg.clip_range_low, clip_range_high=cfg.clip_range_high,
                         clip_ratio_c=cfg.clip_ratio_c, entropy=entropy, entropy_coef=cfg.entropy_coef,
                         ref_logp=batch.ref_logp, kl_coef=cfg.kl_coef, loss_agg_mode=cfg.loss_agg_mode)

    def step(self, prompts: torch.Tensor) -> dict[str, float]:
        """One GRPO iteration on ``prompts`` (B, Tp): rollout, then ``ppo_epochs`` optimizer steps."""
        batch = self.rollout(prompts)
        metrics = dict(batch.metrics)
        for _ in range(self.config.ppo_epochs):
            loss, loss_metrics = self.loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            metrics.update(loss_metrics)
        self.last_rollout = batch
        return metrics
