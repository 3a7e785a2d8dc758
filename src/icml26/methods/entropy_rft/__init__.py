"""Entropy dynamics in reinforcement fine-tuning (arXiv 2602.03392): a GRPO trainer with Clip_B
entropy-discriminator clipping, and the entropy-discriminator utilities (S_k, first-order Delta H)."""

from .config import EntropyRFTConfig
from .grpo import (clip_b_keep_mask, entropy_discriminator, group_normalized_advantages, grpo_loss,
                   logprobs_and_entropy, masked_aggregate, pass_at_k, predicted_entropy_change, vocab_discriminator)
from .trainer import GRPOTrainer, Rollout, causal_logits, response_logprobs, sample_responses

__all__ = ["EntropyRFTConfig", "GRPOTrainer", "Rollout", "causal_logits", "clip_b_keep_mask", "entropy_discriminator",
           "group_normalized_advantages", "grpo_loss", "logprobs_and_entropy", "masked_aggregate", "pass_at_k",
           "predicted_entropy_change", "response_logprobs", "sample_responses", "vocab_discriminator"]
