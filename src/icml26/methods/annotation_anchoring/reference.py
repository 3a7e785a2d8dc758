"""Plain, slow versions: the ground truth of the tests. One example at a time, no padding, float64."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) else out.logits


def anchored_loss_reference(model: nn.Module, examples: Sequence, *, use_annotations: bool = True,
                            mask_annotation_loss: bool = True, train_on_prompt: bool = False,
                            annotation_position: str = "after_prompt") -> torch.Tensor:
    """Token-mean NLL: run every example's own unpadded sequence, add -log p of each trained token one by one."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ex in examples:
        segments = [(list(map(int, ex.prompt)), train_on_prompt)]
        if use_annotations:
            annotation = (list(map(int, ex.annotation)), not mask_annotation_loss)
            if annotation_position == "before_prompt":
                segments.insert(0, annotation)
            else:
                segments.append(annotation)
        segments.append((list(map(int, ex.response)), True))
        seq = [t for toks, _ in segments for t in toks]
        trained = [flag for toks, flag in segments for _ in toks]
        logits = _logits(model, torch.tensor([seq]))[0].double()
        for pos in range(1, len(seq)):
            if trained[pos]:
                total = total - torch.log_softmax(logits[pos - 1], -1)[seq[pos]]
                count += 1
    return total / max(count, 1)


def plain_sft_loss_reference(model: nn.Module, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
    """Ordinary SFT: mean NLL of the response tokens given the prompt, for (prompt, response) pairs."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for prompt, response in pairs:
        seq = list(map(int, prompt)) + list(map(int, response))
        logits = _logits(model, torch.tensor([seq]))[0].double()
        for pos in range(max(len(prompt), 1), len(seq)):  # a first token has no context to be predicted from
            total = total - torch.log_softmax(logits[pos - 1], -1)[seq[pos]]
            count += 1
    return total / max(count, 1)


def entropy_reference(labels: Sequence) -> float:
    """-sum p log p of the non-None labels, counting by hand."""
    kept = [x for x in labels if x is not None]
    if not kept:
        return math.nan
    out = 0.0
    for c in set(kept):
        p = kept.count(c) / len(kept)
        out -= p * math.log(p)
    return out


def distinct_n_reference(texts: Sequence[Sequence], n: int) -> float:
    seen, total = [], 0
    for t in texts:
        for i in range(len(t) - n + 1):
            total += 1
            if tuple(t[i:i + n]) not in seen:
                seen.append(tuple(t[i:i + n]))
    return len(seen) / total if total else math.nan
