"""Entropy dynamics in reinforcement fine-tuning (arXiv 2602.03392): a GRPO trainer with Clip_B
entropy-discriminator clipping, and the entropy-discriminator utilities (S_k, first-order Delta H).

``ClipBGRPOTrainer`` / ``ClipBConfig`` (Clip_B inside TRL's GRPOTrainer) load ``trl`` on first access only."""

from .config import EntropyRFTConfig
from .grpo import (check_rewards, clip_b_keep_mask, entropy_discriminator, group_normalized_advantages, grpo_loss,
                   logprobs_and_entropy, masked_aggregate, pass_at_k, predicted_entropy_change, vocab_discriminator)
from .trainer import GRPOTrainer, Rollout, causal_logits, response_logprobs, sample_responses

_TRL_EXPORTS = ("ClipBConfig", "ClipBGRPOTrainer")

__all__ = ["ClipBConfig", "ClipBGRPOTrainer", "EntropyRFTConfig", "GRPOTrainer", "Rollout", "causal_logits",
           "check_rewards", "clip_b_keep_mask", "entropy_discriminator", "group_normalized_advantages", "grpo_loss",
           "logprobs_and_entropy", "masked_aggregate", "pass_at_k", "predicted_entropy_change", "response_logprobs",
           "sample_responses", "vocab_discriminator"]


def __getattr__(name: str):
    # trl (the `rl` extra) is heavy and optional: import it only when a TRL class is asked for.
    if name in _TRL_EXPORTS:
        from . import trl_trainer

        return getattr(trl_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
