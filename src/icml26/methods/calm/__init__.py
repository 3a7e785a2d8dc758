"""CalM: a calcium-imaging simulator (switching latent dynamics -> spikes -> AR(1) calcium -> dF/F), a shared patch
tokenizer, a dual-axis autoregressive transformer with forecasting and decoding heads, and the forecasting benchmark
(POCO score) against from-scratch and linear-AR baselines."""

from .config import CalMConfig
from .experiments import ARMS, SPECS
from .model import CalM, DualAxisBlock, PatchTokenizer, patchify, poco_score, r2_score, ridge_fit, ridge_predict
from .simulator import Session, family_dynamics, simulate_session

__all__ = ["ARMS", "CalM", "CalMConfig", "DualAxisBlock", "PatchTokenizer", "SPECS", "Session", "family_dynamics",
           "patchify", "poco_score", "r2_score", "ridge_fit", "ridge_predict", "simulate_session"]
