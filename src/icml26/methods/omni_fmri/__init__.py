"""Omni-fMRI (arXiv 2601.23090): dynamic patching of voxel-level fMRI (background pruning + variance gate),
dual-path multi-scale embedding, scale-aware masked autoencoder; an MNI152-based fMRI simulator and NIfTI loader."""

from .config import OmniFMRIConfig
from .model import DualPathEmbed, OmniMAE
from .nifti import FMRIRun, load_run, mni_on_grid, save_run
from .patching import Tokens, complexity_maps, foreground_maps, layout, select_patches, tokenize
from .simulate import FMRIDataset, SimSpec, simulate

__all__ = ["DualPathEmbed", "FMRIDataset", "FMRIRun", "OmniFMRIConfig", "OmniMAE", "SimSpec", "Tokens",
           "complexity_maps", "foreground_maps", "layout", "load_run", "mni_on_grid", "save_run", "select_patches",
           "simulate", "tokenize"]
