"""GRPO / Clip_B hyperparameters. Defaults follow the official Trinity-RFT code (ClipBAdvantageFn and
PPOPolicyLossFn default_args) and the paper's main setting (arXiv 2602.03392, Sec. 5: Qwen2.5-7B-Instruct,
16 rollouts per prompt, KL coefficient 0, response length 7168, rollout temperature 1.0)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def check_clip_b(clip_b, mu, clip_b_name: str = "clip_b", mu_name: str = "mu") -> None:
    """Validate the Clip_B switch and its mu (shared by EntropyRFTConfig and the TRL ClipBConfig); the error names
    the caller's field."""
    if not isinstance(clip_b, bool):
        raise ValueError(f"{clip_b_name} must be a bool, got {clip_b!r}")
    if not (_num(mu) and mu >= 0):
        raise ValueError(f"{mu_name} must be a number >= 0 (math.inf disables clipping), got {mu!r}")


@dataclass
class EntropyRFTConfig:
    """Hyperparameters of :class:`~icml26.methods.entropy_rft.GRPOTrainer`.

    ``clip_b=False`` (or ``mu=math.inf``) is plain GRPO. Every field is checked in ``__post_init__``; a bad
    value raises ValueError naming the field.
    """

    group_size: int = field(default=16, metadata={
        "help": "G, responses sampled per prompt (paper Sec. 5: 16 rollouts per prompt)"})
    adv_epsilon: float = field(default=1e-6, metadata={
        "help": "epsilon in (r - mean) / (std + epsilon), ClipBAdvantageFn default_args"})
    clip_b: bool = field(default=True, metadata={
        "help": "apply Clip_B entropy-discriminator token clipping (the paper's method); False -> plain GRPO"})
    mu: float = field(default=2.5, metadata={
        "help": "mu: drop negative-advantage tokens with S - E[S] < -mu * std(S) (ClipBAdvantageFn default 2.5); "
                "math.inf keeps every token"})
    clip_range_low: float = field(default=0.2, metadata={
        "help": "PPO ratio clip 1 - eps_low (Trinity PPOPolicyLossFn default clip_range 0.2)"})
    clip_range_high: float = field(default=0.2, metadata={
        "help": "PPO ratio clip 1 + eps_high (Trinity PPOPolicyLossFn default clip_range 0.2)"})
    clip_ratio_c: float = field(default=3.0, metadata={
        "help": "dual-clip bound c > 1 for negative advantages (Trinity PPOPolicyLossFn default 3.0)"})
    loss_agg_mode: str = field(default="token-mean", metadata={
        "help": "loss aggregation over valid tokens (Trinity default 'token-mean'); or 'seq-mean-token-mean'"})
    kl_coef: float = field(default=0.0, metadata={
        "help": "beta of the k3 KL penalty to a frozen reference policy (paper Sec. 5: 0, no KL)"})
    entropy_coef: float = field(default=0.0, metadata={
        "help": "coefficient of the entropy bonus (paper's main runs: none; the entropy-bonus baseline sets it)"})
    temperature: float = field(default=1.0, metadata={
        "help": "rollout sampling temperature, also applied to the training log-probs (paper: 1.0)"})
    max_new_tokens: int = field(default=7168, metadata={
        "help": "response length cap (paper Sec. 5: 7168; the laptop experiments use a few tokens)"})
    ppo_epochs: int = field(default=1, metadata={
        "help": "gradient steps per rollout batch; 1 is on-policy (ratio 1), > 1 makes the PPO clip active"})
    eos_token_id: int | None = field(default=None, metadata={
        "help": "token that ends a response; later tokens are padding and leave the mask (None: fixed length)"})
    pad_token_id: int = field(default=0, metadata={"help": "token written after eos_token_id (never trained on)"})

    def __post_init__(self) -> None:
        for name in ("group_size", "max_new_tokens", "ppo_epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (_num(self.adv_epsilon) and math.isfinite(self.adv_epsilon) and self.adv_epsilon >= 0):
            raise ValueError(f"adv_epsilon must be a finite number >= 0, got {self.adv_epsilon!r}")
        check_clip_b(self.clip_b, self.mu, "clip_b", "mu")
        for name in ("clip_range_low", "clip_range_high"):
            value = getattr(self, name)
            if not (_num(value) and 0 <= value < (1 if name == "clip_range_low" else math.inf)):
                raise ValueError(f"{name} must be a number in [0, 1) for low, >= 0 for high, got {value!r}")
        if not (_num(self.clip_ratio_c) and self.clip_ratio_c > 1):
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not (_num(value) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (_num(self.temperature) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        if self.eos_token_id is not None and (not isinstance(self.eos_token_id, int) or self.eos_token_id < 0):
            raise ValueError(f"eos_token_id must be None or a non-negative int, got {self.eos_token_id!r}")
        if not isinstance(self.pad_token_id, int) or isinstance(self.pad_token_id, bool) or self.pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative int, got {self.pad_token_id!r}")

    @property
    def clipping_active(self) -> bool:
        """False when Clip_B cannot drop a token (switch off or mu = inf): the trainer is then plain GRPO."""
        return self.clip_b and math.isfinite(self.mu)
