"""CalM: a calcium-imaging simulator (shared nonlinear latent dynamics -> spikes -> AR(2) indicator -> fluorescence
with nuisance -> dF/F), learned and k-means patch tokenizers, a dual-axis autoregressive transformer (both readings
of the neural axis) with forecasting and decoding heads, forecasting baselines (NLinear, TSMixer, GRU, POCO-lite),
and the forecasting benchmark (POCO score)."""

from .baselines import GRUForecaster, NLinear, POCOLite, TSMixer, build_baseline
from .config import CalMConfig
from .data import Recording, check_dff, load_session, load_sessions
from .experiments import ARMS, SPECS
from .model import (CalM, DualAxisBlock, LearnedTokenizer, PatchTokenizer, RasterReadout, fit_tokenizer, fsq_levels,
                    patchify, poco_score, r2_score, reconstruction_r2, ridge_fit, ridge_predict, scalar_quantize)
from .simulator import Session, SimConfig, family_dynamics, simulate_session

__all__ = ["ARMS", "CalM", "CalMConfig", "DualAxisBlock", "GRUForecaster", "LearnedTokenizer", "NLinear", "POCOLite",
           "PatchTokenizer", "RasterReadout", "Recording", "SPECS", "Session", "SimConfig", "TSMixer",
           "build_baseline", "check_dff", "family_dynamics", "fit_tokenizer", "fsq_levels", "load_session",
           "load_sessions", "patchify", "poco_score", "r2_score", "reconstruction_r2", "ridge_fit", "ridge_predict",
           "scalar_quantize", "simulate_session"]
