"""Annotation anchoring bad input, through the public API: each refused call raises a ValueError/TypeError naming
the problem, with the weights, the optimizer state and the train/eval mode unchanged. Also runs the card's Usage
snippet verbatim."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from icml26.methods.annotation_anchoring import (AnchoredSFTTrainer, AnnotatedExample, AnnotationAnchoringConfig,
                                                 collate, masked_lm_loss)
from icml26.models.tiny_lm import TinyLM, TinyLMConfig

pytestmark = pytest.mark.usefixtures("one_thread")
README = Path(__file__).resolve().parents[2] / "src/icml26/methods/annotation_anchoring/README.md"
V = 16


class Table(nn.Module):
    """logits[t] = table[ids[t]], no nn.Embedding (the vocabulary is unknown before a forward pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(0)))
        self.poison, self.poison_grad = 0.0, False

    def forward(self, ids):
        logits = self.table[ids] * (1.0 + self.poison)
        if self.poison_grad:  # same value; the gradient of sqrt at 0 is inf, times 0 is NaN
            logits = logits + 0.0 * torch.sqrt(0.0 * logits.abs())
        return logits


def _trainer(model=None, **cfg):
    if model is None:
        torch.manual_seed(0)
        model = TinyLM(TinyLMConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))
    opt = torch.optim.AdamW(model.parameters(), 1e-2, weight_decay=0.1)
    config = AnnotationAnchoringConfig(annotation_start_ids=(10,), annotation_end_id=11, max_annotation_tokens=3,
                                       max_new_tokens=4, **cfg)
    trainer = AnchoredSFTTrainer(model, opt, config, generator=torch.Generator().manual_seed(0))
    trainer.step(_good())  # non-empty optimizer state
    return trainer


def _good():
    return [AnnotatedExample([1, 2], [10, 4, 11], [5, 6, 12]), AnnotatedExample([1], [10, 3, 11], [7, 12])]


def _snapshot(trainer):
    opt_state = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
                 for k, st in trainer.optimizer.state.items()}
    return [p.detach().clone() for p in trainer.model.parameters()], opt_state, trainer.model.training


def _assert_unchanged(trainer, snap) -> None:
    params, opt_state, training = snap
    assert all(torch.equal(a, p.detach()) for a, p in zip(params, trainer.model.parameters()))
    for k, st in trainer.optimizer.state.items():
        assert all(torch.equal(v, st[n]) if isinstance(v, torch.Tensor) else v == st[n]
                   for n, v in opt_state[k].items())
    assert trainer.model.training == training
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in trainer.model.parameters())


def test_constructor_refuses_wrong_types():
    model = Table()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    cases = [(lambda: AnchoredSFTTrainer("model", opt), "model must be an nn.Module"),
             (lambda: AnchoredSFTTrainer(model, "adam"), "optimizer must be a torch.optim.Optimizer"),
             (lambda: AnchoredSFTTrainer(model, opt, {"use_annotations": True}), "AnnotationAnchoringConfig"),
             (lambda: AnchoredSFTTrainer(model, opt, generator=0), "torch.Generator")]
    for call, match in cases:
        with pytest.raises(TypeError, match=match):
            call()


@pytest.mark.parametrize("examples, error, match", [
    (AnnotatedExample([1], [10, 11], [5, 12]), TypeError, "single AnnotatedExample"),
    ([([1], [10, 11], [5, 12])], TypeError, r"examples\[0\] is a tuple"),
    ([], ValueError, "non-empty"),
    ([AnnotatedExample([1.5], [10, 11], [5, 12])], TypeError, "prompt must hold int token ids, got 1.5"),
    ([AnnotatedExample([1], [True], [5, 12])], TypeError, "annotation must hold int token ids"),
    ([AnnotatedExample([1], [10], torch.tensor([5.0, 12.0]))], TypeError, "response must hold integer token ids"),
    ([AnnotatedExample("Q: hi", [10], [5, 12])], TypeError, "tokenize it first"),
    ([AnnotatedExample([1], [10], [5, -3])], ValueError, "response holds a negative token id"),
    ([AnnotatedExample([1], [10], [5, V])], ValueError, f"token id {V}, outside the model's vocabulary of {V}"),
    ([AnnotatedExample([1, 2], [10, 11], [])], ValueError, "no trained token in this batch"),
])
def test_bad_examples_leave_weights_optimizer_and_mode_unchanged(examples, error, match):
    trainer = _trainer()
    trainer.model.eval()
    snap = _snapshot(trainer)
    with pytest.raises(error, match=match):
        trainer.step(examples)
    _assert_unchanged(trainer, snap)


def test_numpy_and_tensor_ids_are_accepted_like_lists():
    trainer = _trainer()
    as_numpy = [AnnotatedExample(np.array(ex.prompt), np.array(ex.annotation, dtype=np.int32), list(ex.response))
                for ex in _good()]
    as_tensor = [AnnotatedExample(torch.tensor(ex.prompt), torch.tensor(ex.annotation), torch.tensor(ex.response))
                 for ex in _good()]
    ref = collate(_good(), trainer.config)
    for examples in (as_numpy, as_tensor):
        batch = collate(examples, trainer.config)
        assert torch.equal(batch.inputs, ref.inputs) and torch.equal(batch.loss_mask, ref.loss_mask)
    with pytest.raises(TypeError, match="int token ids"):
        collate([AnnotatedExample(np.array([1.0, 2.0]), [10], [5, 12])], trainer.config)


def test_non_finite_loss_or_gradient_takes_no_step():
    trainer = _trainer(Table())
    snap = _snapshot(trainer)
    trainer.model.poison = math.nan
    with pytest.raises(ValueError, match=r"the loss is not finite \(nan\)"):
        trainer.step(_good())
    _assert_unchanged(trainer, snap)
    trainer.model.poison, trainer.model.poison_grad = 0.0, True
    with pytest.raises(ValueError, match=r"non-finite gradient in \['table'\]: no step taken"):
        trainer.step(_good())
    _assert_unchanged(trainer, snap)
    assert trainer.model.table.grad is None


def test_targets_outside_the_logits_vocabulary_raise_in_the_loss():
    # Table has no nn.Embedding: the vocabulary is only known from the logits
    trainer = _trainer(Table())
    trainer.model.eval()
    with pytest.raises(ValueError, match=r"target token ids must lie in \[0, 16\)"):
        trainer.step([AnnotatedExample([1], [10], [5, V + 3])])  # only a target: the forward pass works
    assert not trainer.model.training
    logits = torch.randn(2, 3, V)
    with pytest.raises(ValueError, match=r"target token ids must lie in \[0, 16\)"):
        masked_lm_loss(logits, torch.full((2, 3), V), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"need logits \(B, T, V\)"):
        masked_lm_loss(logits, torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(TypeError, match="AnnotationAnchoringConfig"):
        collate(_good(), {"use_annotations": True})


@pytest.mark.parametrize("prompts, n, kwargs, error, match", [
    ([[1, 2]], 1, {}, TypeError, "long tensor, got list"),
    (torch.tensor([1, 2]), 1, {}, ValueError, r"\(B, Tp\) long tensor, got \(2,\)"),
    (torch.tensor([[1.0, 2.0]]), 1, {}, ValueError, "long tensor"),
    (torch.zeros(0, 2, dtype=torch.long), 1, {}, ValueError, "empty batch"),
    (torch.tensor([[1, -2]]), 1, {}, ValueError, "negative token id"),
    (torch.tensor([[1, V + 1]]), 1, {}, ValueError, "outside the model's vocabulary"),
    (torch.tensor([[1, 2]]), 0, {}, ValueError, "n must be >= 1"),
    (torch.tensor([[1, 2]]), 2.0, {}, TypeError, "n .* must be an int"),
    (torch.tensor([[1, 2]]), 1, {"prompts_device": "meta"}, ValueError, "prompts are on meta but the model is on"),
    (torch.zeros(1, 0, dtype=torch.long), 1, {"use_annotations": False}, ValueError, "nothing to condition on"),
])
def test_bad_sampling_requests_raise_and_keep_the_mode(prompts, n, kwargs, error, match):
    device = kwargs.pop("prompts_device", None)
    trainer = _trainer(**kwargs)
    if device is not None:
        prompts = prompts.to(device)
    snap = _snapshot(trainer)
    with pytest.raises(error, match=match):
        trainer.sample(prompts, n)
    _assert_unchanged(trainer, snap)


def test_empty_start_ids_with_nothing_before_the_annotation_raise_before_eval():
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))
    trainer = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), 0.1),
                                 AnnotationAnchoringConfig(annotation_position="before_prompt", max_new_tokens=2))
    assert model.training
    with pytest.raises(ValueError, match="annotation_start_ids must be non-empty"):
        trainer.sample(torch.tensor([[1, 2]]), 1)
    assert model.training


def test_readme_usage_snippet_runs(run_card_snippet):
    """Executes the card's Usage block verbatim."""
    scope = run_card_snippet(README, "## Usage\n")
    annotations, responses = scope["annotations"], scope["responses"]
    assert len(annotations) == len(responses) == 4
    assert all(a[0].item() == ord("<") and len(a) <= 9 for a in annotations)
    assert all(1 <= len(y) <= 16 for y in responses)
