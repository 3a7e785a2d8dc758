"""SHERPA (reconstructed): fine-tuning a large promptable segmenter on a specialised task with attention guidance
from a small fine-tuned one, restricted to Fisher-ratio-selected task-relevant channels; SAM-shaped segmenters,
generated general and nuclei-like data."""

from .config import SherpaConfig
from .method import (attention_kl, finetune, fisher_ratio, frs_channels, l2sp_penalty, restricted_attention,
                     token_labels)
from .model import LARGE, SMALL, LoRALinear, PromptableSegmenter, SegmenterSize, add_lora, dice_iou, seg_loss

__all__ = ["LARGE", "LoRALinear", "PromptableSegmenter", "SMALL", "SegmenterSize", "SherpaConfig", "add_lora",
           "attention_kl", "dice_iou", "finetune", "fisher_ratio", "frs_channels", "l2sp_penalty", "restricted_attention",
           "seg_loss",
           "token_labels"]
