"""Annotations mitigate post-training mode collapse (arXiv 2605.09995): an annotation-anchored SFT trainer
(annotation loss masked, annotation sampled first at inference; ``use_annotations=False`` is plain SFT) and
diversity / mode-collapse metrics."""

from .config import AnnotationAnchoringConfig
from .metrics import (category_distribution, category_entropy, collapse, coverage, distinct_n, gap_closed,
                      kl_to_reference)
from .trainer import (ANNOTATION, PAD, PROMPT, RESPONSE, AnchoredSFTTrainer, AnnotatedExample, Batch, causal_logits,
                      collate, masked_lm_loss, trained_roles)

__all__ = ["ANNOTATION", "PAD", "PROMPT", "RESPONSE", "AnchoredSFTTrainer", "AnnotatedExample",
           "AnnotationAnchoringConfig", "Batch", "category_distribution", "category_entropy", "causal_logits",
           "collapse", "collate", "coverage", "distinct_n", "gap_closed", "kl_to_reference", "masked_lm_loss",
           "trained_roles"]
