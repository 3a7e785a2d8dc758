"""PGT configuration: defaults from the official training script (repo preference-goal-tuning/PGT,
``train_pgt.py``) unless noted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PGTConfig:
    """Preference Goal Tuning: DPO on the latent goal z of a frozen goal-conditioned policy.

    Attributes:
        lr: Adam learning rate on z (script: 1e-2).
        beta: DPO temperature (script: 0.1).
        epochs: passes over the training pairs per round, one pair per step (script: 50).
        eval_fraction: share of the preference pairs held out (script: random 80/20 split).
        max_train_pairs, max_eval_pairs: caps on the pairs used (script: 20 and 10, "for fast testing"; None =
            all pairs).
        n_rollouts: rollouts per collect round with the current z (script: 50).
        rounds: collect -> tune rounds (the project page iterates; our default 2).
    """

    lr: float = 1e-2
    beta: float = 0.1
    epochs: int = 50
    eval_fraction: float = 0.2
    max_train_pairs: int | None = 20
    max_eval_pairs: int | None = 10
    n_rollouts: int = 50
    rounds: int = 2

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"PGTConfig.lr must be > 0, got {self.lr}")
        if not self.beta > 0:
            raise ValueError(f"PGTConfig.beta must be > 0, got {self.beta}")
        for name in ("epochs", "n_rollouts", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"PGTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"PGTConfig.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        for name in ("max_train_pairs", "max_eval_pairs"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"PGTConfig.{name} must be None or >= 1, got {v}")
