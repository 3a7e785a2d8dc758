"""StarEmbed: a light-curve embedding benchmark (classification, clustering, OOD) with a hand-crafted-feature
baseline, a zero-shot tiny Chronos-style TSFM and a random embedder; plug your own model in via ``Embedder``."""

from .base import CurveEmbedder, as_curves
from .benchmark import Embedder, classification_task, clustering_task, evaluate, hungarian_macro_f1, ood_task
from .config import ID_CLASSES, OOD_CLASSES, StarEmbedConfig
from .data import LightCurve, LightCurveDataset, build_dataset, load_ogle3
from .features import FEATURE_NAMES, HandCraftedEmbedder, best_period, extract, fourier_fit
from .tsfm import RandomEmbedder, TinyChronosEncoder, TSFMEmbedder, kernel_synth, tokenize


# The claims live in .experiments (SPECS), loaded by the harness as icml26.methods.starembed.experiments.
__all__ = ["CurveEmbedder", "Embedder", "FEATURE_NAMES", "HandCraftedEmbedder", "ID_CLASSES", "LightCurve",
           "LightCurveDataset", "OOD_CLASSES", "RandomEmbedder", "StarEmbedConfig", "TSFMEmbedder",
           "TinyChronosEncoder", "as_curves", "best_period", "build_dataset", "classification_task", "clustering_task",
           "evaluate", "extract", "fourier_fit", "hungarian_macro_f1", "kernel_synth", "load_ogle3", "ood_task",
           "tokenize"]
