"""Janus-LoRA: continual LoRA with Online Estimation of protected subspaces, Gradient Rectification of the factor
updates and the Decoupled Margin Loss; baselines (sequential LoRA, LoRA-GPM, InfLoRA-style) are trainer switches."""

from .adapter import (JanusLoRALinear, OnlineSubspace, decoupled_margin_loss, project_off, rectify_min_norm)
from .config import ARMS, JanusLoRAConfig
from .reference import null_space_violation
from .trainer import JanusTrainer, PrototypeMemory, janus_make

# Row of the adapter contract matrix (tests/families/test_adapters_common.py): the layer is LoRA-shaped with its own
# prefix; the method lives in the trainer's step rule.
ADAPTER_CASES = [("janus_lora", janus_make())]

__all__ = ["ADAPTER_CASES", "ARMS", "JanusLoRAConfig", "JanusLoRALinear", "JanusTrainer", "OnlineSubspace",
           "PrototypeMemory", "decoupled_margin_loss", "janus_make", "null_space_violation", "project_off",
           "rectify_min_norm"]
