"""AnchoredSFTTrainer: supervised post-training with semantic annotations whose loss is masked, and two-stage
sampling (annotation first, then the response) — arXiv 2605.09995.

A training example is three token segments: ``prompt``, ``annotation`` (a short description of the response's
semantics: topic, entities, style) and ``response``. The sequence is ``prompt + annotation + response``
(``annotation + prompt + response`` with ``annotation_position="before_prompt"``); the loss
is the token-mean cross-entropy over the response tokens (plus the annotation tokens when
``mask_annotation_loss=False``, which with an empty prompt is the annotated pretraining step). With
``use_annotations=False`` the annotation segment is dropped and the trainer is plain SFT.

Works with any causal LM whose ``model(ids)`` returns logits (B, T, V), a tuple whose first item is the logits
(TinyLM) or an object with ``.logits`` (Hugging Face ``AutoModelForCausalLM``). Batches are right-padded; with
causal attention the pads never influence real positions, so no attention mask is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...models.outputs import causal_logits
from .config import AnnotationAnchoringConfig

PROMPT, ANNOTATION, RESPONSE, PAD = 0, 1, 2, -1
"""Role of each position in a :class:`Batch`."""


def _ids(x: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    # Token ids must be integers: .long() would silently truncate 1.5 to 1 (and True to 1).
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got a {x.dtype} tensor")
        t = x.long().reshape(-1)
    else:
        if isinstance(x, (str, bytes)):
            raise TypeError(f"{name} must be a sequence of token ids, got a {type(x).__name__}: tokenize it first")
        try:
            values = list(x)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of token ids, got {type(x).__name__}") from None
        bad = [v for v in values if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_))]
        if bad:
            raise TypeError(f"{name} must hold int token ids, got {bad[0]!r} ({type(bad[0]).__name__})")
        t = torch.tensor([int(v) for v in values], dtype=torch.long)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} holds a negative token id")
    return t


def _vocab_size(model: nn.Module) -> int | None:
    """The input vocabulary of ``model`` when it can be read without a forward pass (HF or first nn.Embedding)."""
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if isinstance(emb, nn.Embedding) else None


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@dataclass(frozen=True)
class AnnotatedExample:
    """One example: token ids of the prompt (may be empty), the annotation (may be empty) and the response."""

    prompt: Sequence[int] | torch.Tensor
    annotation: Sequence[int] | torch.Tensor
    response: Sequence[int] | torch.Tensor


@dataclass
class Batch:
    """``inputs`` (B, T-1) and ``targets`` (B, T-1) of the right-padded sequences, ``roles`` (B, T) of the full
    sequences (PROMPT / ANNOTATION / RESPONSE / PAD) and ``loss_mask`` (B, T-1): 1 where a target is trained."""

    inputs: torch.Tensor
    targets: torch.Tensor
    roles: torch.Tensor
    loss_mask: torch.Tensor


def trained_roles(config: AnnotationAnchoringConfig) -> tuple[int, ...]:
    """Roles whose tokens carry loss under ``config``."""
    roles = [RESPONSE]
    if config.use_annotations and not config.mask_annotation_loss:
        roles.append(ANNOTATION)
    if config.train_on_prompt:
        roles.append(PROMPT)
    return tuple(roles)


def collate(examples: Sequence[AnnotatedExample], config: AnnotationAnchoringConfig) -> Batch:
    """Build a right-padded :class:`Batch`; the annotation segment is left out when ``use_annotations=False``."""
    if isinstance(examples, AnnotatedExample):
        raise TypeError("examples must be a list of AnnotatedExample, got a single AnnotatedExample: wrap it in [...]")
    if not isinstance(config, AnnotationAnchoringConfig):
        raise TypeError(f"config must be an AnnotationAnchoringConfig, got {type(config).__name__}")
    if not examples:
        raise ValueError("examples must be non-empty")
    wrong = [i for i, ex in enumerate(examples) if not isinstance(ex, AnnotatedExample)]
    if wrong:
        raise TypeError(f"examples[{wrong[0]}] is a {type(examples[wrong[0]]).__name__}, not an AnnotatedExample")
    seqs, roles = [], []
    for ex in examples:
        parts = [(_ids(ex.prompt, "prompt"), PROMPT)]
        if config.use_annotations:
            annotation = (_ids(ex.annotation, "annotation"), ANNOTATION)
            parts.insert(0 if config.annotation_position == "before_prompt" else 1, annotation)
        parts.append((_ids(ex.response, "response"), RESPONSE))
        seqs.append(torch.cat([p for p, _ in parts]))
        roles.append(torch.cat([torch.full((len(p),), r, dtype=torch.long) for p, r in parts]))
    length = max(len(s) for s in seqs)
    if length < 2:
        raise ValueError("every batch needs a sequence of at least 2 tokens")
    ids = torch.full((len(seqs), length), config.pad_token_id, dtype=torch.long)
    role = torch.full((len(seqs), length), PAD, dtype=torch.long)
    for i, (s, r) in enumerate(zip(seqs, roles)):
        ids[i, :len(s)], role[i, :len(r)] = s, r
    trained = torch.zeros_like(role, dtype=torch.bool)
    for r in trained_roles(config):
        trained |= role == r
    return Batch(ids[:, :-1], ids[:, 1:], role, trained[:, 1:].float())


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy over the positions with ``loss_mask`` 1: logits (B, T, V), targets/mask (B, T)."""
    if logits.ndim != 3 or targets.shape != logits.shape[:2] or loss_mask.shape != targets.shape:
        raise ValueError(f"need logits (B, T, V) and targets, loss_mask (B, T); got {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(loss_mask.shape)}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= logits.shape[-1]):
        raise ValueError(f"target token ids must lie in [0, {logits.shape[-1]}) (the logits' vocabulary), got "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(loss_mask)
    return (ce * loss_mask).sum() / loss_mask.sum().clamp_min(1.0)


@torch.no_grad()
def _extend(model: nn.Module, ids: torch.Tensor, steps: int, temperature: float,
            generator: torch.Generator | None) -> torch.Tensor:
    """Sample ``steps`` tokens after ``ids`` (B, T) -> (B, T + steps); TinyLM's KV cache when it has one."""
    if steps == 0:
        return ids
    if hasattr(model, "new_cache") and hasattr(model, "generate"):
        return model.generate(ids, steps, temperature=temperature, generator=generator)
    for _ in range(steps):
        logits = causal_logits(model, ids)[:, -1].float() / temperature
        ids = torch.cat((ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)), 1)
    return ids


class AnchoredSFTTrainer:
    """Annotation-anchored SFT for a causal LM (``use_annotations=False``: plain SFT).

    Args:
        model: the causal LM (TinyLM, a Hugging Face causal LM, or any module returning logits).
        optimizer: a torch optimizer over its trainable parameters.
        config: :class:`AnnotationAnchoringConfig`.
        generator: torch.Generator for sampling.

    ``step(examples)`` takes one optimizer step on the masked loss and returns metrics; ``loss(batch)`` is the
    differentiable loss; ``sample(prompts, n)`` draws a ~ p(a | prompt) then y ~ p(y | prompt, a).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: AnnotationAnchoringConfig | None = None, *,
                 generator: torch.Generator | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module (a causal LM), got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        config = config if config is not None else AnnotationAnchoringConfig()
        if not isinstance(config, AnnotationAnchoringConfig):
            raise TypeError(f"config must be an AnnotationAnchoringConfig, got {type(config).__name__}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.model, self.optimizer, self.config, self.generator = model, optimizer, config, generator

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        vocab = _vocab_size(self.model)
        if vocab is not None and ids.numel() and int(ids.max()) >= vocab:
            raise ValueError(f"{what} hold token id {int(ids.max())}, outside the model's vocabulary of {vocab}")

    def loss(self, batch: Batch) -> torch.Tensor:
        """The masked loss of a :func:`collate` batch; the batch moves to the model's device."""
        device = _device(self.model)
        return masked_lm_loss(causal_logits(self.model, batch.inputs.to(device)), batch.targets.to(device),
                              batch.loss_mask.to(device))

    def step(self, examples: Sequence[AnnotatedExample]) -> dict[str, float]:
        """One optimizer step on the masked loss of ``examples``.

        Raises (before the optimizer steps, so the weights and its state are unchanged) when nothing in the batch is
        trained, a token id lies outside the vocabulary, or the loss or a gradient is NaN/inf."""
        batch = collate(examples, self.config)
        if not bool(batch.loss_mask.any()):
            raise ValueError("no trained token in this batch (every response is empty and nothing else is "
                             "trained): the step would only apply weight decay")
        self._check_ids(batch.inputs, "the examples")
        self._check_ids(batch.targets, "the examples")
        was_training = self.model.training
        self.model.train()
        try:
            loss = self.loss(batch)
            if not bool(torch.isfinite(loss.detach())):
                raise ValueError(f"the loss is not finite ({float(loss.detach())}): the model's logits hold "
                                 "NaN/inf; no step taken")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            bad = [n for n, p in self.model.named_parameters()
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            if bad:
                self.optimizer.zero_grad(set_to_none=True)  # no NaN gradient left behind for a later step
                raise ValueError(f"non-finite gradient in {bad[:5]}: no step taken")
        except Exception:
            self.model.train(was_training)  # a refused step leaves the model as it found it
            raise
        self.optimizer.step()
        return {"loss": loss.item(), "trained_tokens": float(batch.loss_mask.sum())}

    @torch.no_grad()
    def sample_annotations(self, prompts: torch.Tensor) -> list[torch.Tensor]:
        """a ~ p(a | prompt) (``after_prompt``) or a ~ p(a) (``before_prompt``): per row of ``prompts`` (B, Tp)
        the annotation tokens (start ids, sampled tokens up to and including ``annotation_end_id``), 1-D each."""
        cfg = self.config
        if cfg.annotation_position == "before_prompt":
            prompts = prompts[:, :0]
        start = torch.tensor(cfg.annotation_start_ids, dtype=torch.long, device=prompts.device).expand(len(prompts), -1)
        ids = torch.cat((prompts, start), 1)
        if ids.shape[1] == 0:
            raise ValueError("annotation_start_ids must be non-empty when nothing precedes the annotation")
        if cfg.annotation_end_id is None:
            ids = _extend(self.model, ids, cfg.max_annotation_tokens, cfg.annotation_temperature, self.generator)
            return list(ids[:, prompts.shape[1]:])
        done = torch.zeros(len(prompts), dtype=torch.bool, device=prompts.device)
        for _ in range(cfg.max_annotation_tokens):  # token by token: rows stop at their own end token
            ids = _extend(self.model, ids, 1, cfg.annotation_temperature, self.generator)
            done |= ids[:, -1] == cfg.annotation_end_id
            if bool(done.all()):
                break
        out = []
        for row in ids[:, prompts.shape[1]:]:
            sampled = row[len(cfg.annotation_start_ids):]
            hit = (sampled == cfg.annotation_end_id).nonzero()
            keep = int(hit[0]) + 1 if len(hit) else len(sampled)
            out.append(row[:len(cfg.annotation_start_ids) + keep])
        return out

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, n: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Two-stage sampling for each row of ``prompts`` (B, Tp), ``n`` samples each (row-major order).

        Returns (annotations, responses): lists of B * n 1-D tensors; annotations are empty when
        ``use_annotations=False``. Responses are cut after ``eos_token_id`` when it is set.
        """
        cfg = self.config
        if not isinstance(prompts, torch.Tensor):
            raise TypeError(f"prompts must be a (B, Tp) long tensor, got {type(prompts).__name__}")
        if prompts.ndim != 2 or prompts.dtype != torch.long:
            raise ValueError(f"prompts must be a (B, Tp) long tensor, got {tuple(prompts.shape)} {prompts.dtype}")
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n (samples per prompt) must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        if len(prompts) == 0:
            raise ValueError("prompts is an empty batch (B = 0)")
        device = _device(self.model)
        if prompts.device != device:
            raise ValueError(f"prompts are on {prompts.device} but the model is on {device}: move them with "
                             f".to({str(device)!r})")
        if prompts.numel() and int(prompts.min()) < 0:
            raise ValueError("prompts hold a negative token id")
        self._check_ids(prompts, "prompts")
        first = 0 if cfg.annotation_position == "before_prompt" else prompts.shape[1]
        if cfg.use_annotations and first + len(cfg.annotation_start_ids) == 0:
            raise ValueError("annotation_start_ids must be non-empty when nothing precedes the annotation")
        if not cfg.use_annotations and prompts.shape[1] == 0:
            raise ValueError("prompts are empty (Tp = 0) and there is no annotation: nothing to condition on")
        was_training = self.model.training
        self.model.eval()
        try:
            return self._sample(prompts, n)
        finally:
            self.model.train(was_training)

    def _sample(self, prompts: torch.Tensor, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cfg = self.config
        rep = prompts.repeat_interleave(n, 0)
        if cfg.use_annotations:
            annotations = self.sample_annotations(rep)
        else:
            annotations = [rep.new_zeros(0) for _ in range(len(rep))]
        responses: list[torch.Tensor | None] = [None] * len(rep)
        groups: dict[int, list[int]] = {}
        for i, a in enumerate(annotations):  # rows with equal annotation length decode together
            groups.setdefault(len(a), []).append(i)
        for rows in groups.values():
            ann = torch.stack([annotations[i] for i in rows])
            before = cfg.annotation_position == "before_prompt"
            prefix = torch.cat((ann, rep[rows]) if before else (rep[rows], ann), 1)
            out = _extend(self.model, prefix, cfg.max_new_tokens, cfg.temperature, self.generator)
            for i, y in zip(rows, out[:, prefix.shape[1]:]):
                responses[i] = y
        if cfg.eos_token_id is not None:
            cut = []
            for y in responses:
                hit = (y == cfg.eos_token_id).nonzero()
                cut.append(y[:int(hit[0]) + 1] if len(hit) else y)
            responses = cut
        return annotations, responses  # type: ignore[return-value]
