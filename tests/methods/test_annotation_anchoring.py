"""annotation_anchoring: use_annotations=False is plain SFT (loss and weights), annotation tokens carry no loss and
no gradient when masked (and p(a | prompt) of a bigram LM is then exactly unchanged by SFT), batched loss ==
per-example reference (values and gradients), two-stage sampling, the diversity metrics on hand-made examples,
the experiment's classifier, and config validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from icml26.core.testing import assert_close
from icml26.methods.annotation_anchoring import (ANNOTATION, PROMPT, RESPONSE, AnchoredSFTTrainer, AnnotatedExample,
                                                 AnnotationAnchoringConfig, category_entropy, collapse, collate,
                                                 coverage, distinct_n, gap_closed, kl_to_reference, trained_roles)
from icml26.methods.annotation_anchoring.experiments import DOC_WORDS, TopicCorpus
from icml26.methods.annotation_anchoring.reference import (anchored_loss_reference, distinct_n_reference,
                                                           entropy_reference, plain_sft_loss_reference)
from icml26.models.tiny_lm import TinyLM, TinyLMConfig

pytestmark = pytest.mark.usefixtures("one_thread")

V = 13


class Bigram(nn.Module):
    """logits[t] = table[ids[t]]: each context token owns its own row, so a row moves only if its next token is
    trained. Returns a plain tensor (the non-TinyLM code path)."""

    def __init__(self, vocab: int = V, seed: int = 0) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def _tiny(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))


def _examples() -> list[AnnotatedExample]:
    # odd, unequal lengths; an empty prompt (pretraining-style) and an empty annotation
    return [AnnotatedExample([1, 2, 3], [10, 4, 11], [5, 6, 7, 8, 12]),
            AnnotatedExample([1], [10, 9, 9, 11], [6, 12]),
            AnnotatedExample([], [10, 3, 11], [7, 7, 8, 2, 2, 12]),
            AnnotatedExample([1, 4], [], [9, 12])]


def test_collate_roles_and_loss_mask():
    ex = _examples()
    batch = collate(ex, AnnotationAnchoringConfig(pad_token_id=0))
    assert batch.roles[0].tolist() == [PROMPT] * 3 + [ANNOTATION] * 3 + [RESPONSE] * 5  # the longest row
    assert batch.loss_mask[0].tolist() == [0.0] * 5 + [1.0] * 5  # targets = positions 1..
    assert batch.roles[3].tolist() == [PROMPT] * 2 + [RESPONSE] * 2 + [-1] * 7 and batch.loss_mask[3].sum() == 2
    assert batch.inputs[2, :3].tolist() == [10, 3, 11] and batch.targets[1, -1].item() == 0  # right padding
    unmasked = collate(ex, AnnotationAnchoringConfig(mask_annotation_loss=False))
    assert unmasked.loss_mask[0].tolist() == [0.0] * 2 + [1.0] * 8
    plain = collate(ex, AnnotationAnchoringConfig(use_annotations=False))
    assert plain.inputs.shape[1] == max(len(e.prompt) + len(e.response) for e in ex) - 1
    assert (plain.roles == ANNOTATION).sum() == 0
    assert trained_roles(AnnotationAnchoringConfig(use_annotations=False, mask_annotation_loss=False)) == (RESPONSE,)
    assert set(trained_roles(AnnotationAnchoringConfig(mask_annotation_loss=False, train_on_prompt=True))) == {
        PROMPT, ANNOTATION, RESPONSE}


@pytest.mark.parametrize("flags", [dict(), dict(mask_annotation_loss=False), dict(train_on_prompt=True),
                                   dict(use_annotations=False)])
def test_loss_and_gradient_match_reference(flags):
    model = _tiny(1)
    trainer = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), AnnotationAnchoringConfig(**flags))
    loss = trainer.loss(collate(_examples(), trainer.config))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = anchored_loss_reference(model, _examples(), **flags)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    assert abs(loss.item() - ref.item()) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert_close("grad vs per-example reference", r.float(), g, 1e-4, atol=1e-8)


def test_no_annotations_is_plain_sft_exactly():
    """use_annotations=False: loss == ordinary SFT on (prompt, response), whatever the annotations are, and three
    trainer steps give bit-identical weights to a hand-written SFT loop."""
    ex = _examples()
    cfg = AnnotationAnchoringConfig(use_annotations=False)
    model = _tiny(2)
    trainer = AnchoredSFTTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), cfg)
    pairs = [(e.prompt, e.response) for e in ex]
    assert abs(trainer.loss(collate(ex, cfg)).item() - plain_sft_loss_reference(model, pairs).item()) < 1e-5
    other = [AnnotatedExample(e.prompt, [3] * 7, e.response) for e in ex]
    assert torch.equal(trainer.loss(collate(ex, cfg)), trainer.loss(collate(other, cfg)))

    plain = _tiny(2)
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    seqs = [list(p) + list(r) for p, r in pairs]
    length = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (length - len(s)) for s in seqs])
    labels = ids.clone()
    for i, (p, r) in enumerate(pairs):  # -100: prompt and padding are not predicted
        labels[i, :len(p)] = -100
        labels[i, len(p) + len(r):] = -100
    for _ in range(3):
        trainer.step(ex)
        logits, _ = plain(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for (k, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k


def test_masked_annotation_gets_no_gradient():
    """The gradient of the loss w.r.t. the logits that predict annotation tokens is exactly zero when masked."""
    model = _tiny(3)
    captured = {}

    class Hook(nn.Module):
        def forward(self, ids):
            logits, _ = model(ids)
            logits.retain_grad()
            captured["logits"] = logits
            return logits

    for masked in (True, False):
        cfg = AnnotationAnchoringConfig(mask_annotation_loss=masked)
        batch = collate(_examples(), cfg)
        AnchoredSFTTrainer(Hook(), torch.optim.SGD(model.parameters(), lr=0.0), cfg).loss(batch).backward()
        grad = captured["logits"].grad
        predicts_annotation = batch.roles[:, 1:] == ANNOTATION
        ann_norm = float(grad[predicts_annotation].abs().sum())
        assert (ann_norm == 0.0) == masked
        assert float(grad[batch.roles[:, 1:] == RESPONSE].abs().sum()) > 0


def test_masked_sft_keeps_annotation_distribution_of_bigram():
    """The paper's mechanism in its cleanest form: with per-context parameters, masked SFT cannot move p(a | prompt)
    at all; training the annotation (unmasked) does."""
    prompt_end, start, end = 1, 10, 11
    ex = [AnnotatedExample([prompt_end], [start, 4, end], [5, 6, 12])] * 4
    for masked, moves in ((True, False), (False, True)):
        model = Bigram()
        before = torch.softmax(model.table[[prompt_end, start]].detach(), -1)
        trainer = AnchoredSFTTrainer(model, torch.optim.Adam(model.parameters(), lr=0.1),
                                     AnnotationAnchoringConfig(mask_annotation_loss=masked))
        for _ in range(5):
            trainer.step(ex)
        after = torch.softmax(model.table[[prompt_end, start]].detach(), -1)
        assert torch.equal(before, after) != moves
        assert not torch.equal(model.table[end].detach(), Bigram().table[end])  # the response row was trained


@pytest.mark.parametrize("make", [_tiny, Bigram])
def test_two_stage_sampling(make):
    model = make()
    cfg = AnnotationAnchoringConfig(annotation_start_ids=(10,), annotation_end_id=11, max_annotation_tokens=3,
                                    max_new_tokens=4, eos_token_id=12)
    trainer = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg,
                                 generator=torch.Generator().manual_seed(0))
    annotations, responses = trainer.sample(torch.tensor([[1, 2], [3, 4]]), n=5)
    assert len(annotations) == len(responses) == 10
    for a, y in zip(annotations, responses):
        assert a[0] == 10 and 2 <= len(a) <= 4
        assert a[-1] == 11 or len(a) == 4
        assert 11 not in a[1:-1].tolist()
        assert 1 <= len(y) <= 4 and 12 not in y[:-1].tolist()
    fixed = AnnotationAnchoringConfig(max_annotation_tokens=2, max_new_tokens=3)
    a, y = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), fixed).sample(
        torch.tensor([[1, 2]]), n=3)
    assert all(len(t) == 2 for t in a) and all(len(t) == 3 for t in y)
    a, y = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                              AnnotationAnchoringConfig(use_annotations=False, max_new_tokens=3)).sample(
        torch.tensor([[1, 2]]), n=2)
    assert all(len(t) == 0 for t in a) and all(len(t) == 3 for t in y)


def test_sampled_annotation_follows_model_distribution():
    """A bigram whose start row puts p = (0.75, 0.25) on two annotation tokens: sample frequencies match."""
    model = Bigram()
    with torch.no_grad():
        model.table.fill_(-30.0)
        model.table[10, 3], model.table[10, 4] = math.log(0.75), math.log(0.25)
        model.table[3, 11] = model.table[4, 11] = 0.0
    cfg = AnnotationAnchoringConfig(annotation_start_ids=(10,), annotation_end_id=11, max_annotation_tokens=4,
                                    max_new_tokens=1)
    trainer = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg,
                                 generator=torch.Generator().manual_seed(0))
    annotations, _ = trainer.sample(torch.tensor([[1]]), n=4000)
    assert all(a.tolist() in ([10, 3, 11], [10, 4, 11]) for a in annotations)
    frac = sum(a[1].item() == 3 for a in annotations) / 4000
    assert abs(frac - 0.75) < 0.03


def test_hf_causal_lm_trains_and_samples():
    from icml26.models.hf import TinyLMForCausalLM, TinyLMHFConfig

    torch.manual_seed(0)
    model = TinyLMForCausalLM(TinyLMHFConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))
    trainer = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                 AnnotationAnchoringConfig(annotation_start_ids=(10,), annotation_end_id=11,
                                                           max_annotation_tokens=2, max_new_tokens=2),
                                 generator=torch.Generator().manual_seed(0))
    ref = anchored_loss_reference(model, _examples()).item()
    first = trainer.step(_examples())["loss"]
    assert abs(first - ref) < 1e-5 and trainer.step(_examples())["loss"] < first
    a, y = trainer.sample(torch.tensor([[1, 2]]), n=3)
    assert len(a) == 3 and all(len(t) == 2 for t in y)


# -- metrics ---------------------------------------------------------------------------------------------------
def test_metrics_on_hand_made_examples():
    assert category_entropy(["a", "a", "b", "b"]) == pytest.approx(math.log(2))
    assert category_entropy(["a", None, "a"]) == 0.0 and math.isnan(category_entropy([None, None]))
    assert category_entropy(list(range(20))) == pytest.approx(math.log(20))
    assert collapse(["a", "b"], math.log(20)) == pytest.approx(math.log(20) - math.log(2))
    assert coverage(["a", "c", None], ["a", "b", "c", "d"]) == 0.5
    uniform = {k: 0.25 for k in "abcd"}
    assert kl_to_reference(["a"] * 7, uniform) == pytest.approx(math.log(4))
    assert kl_to_reference(list("abcd"), uniform) == pytest.approx(0.0, abs=1e-12)
    assert kl_to_reference(["z"], uniform) == math.inf
    assert kl_to_reference(["a", "b"], {"a": 0.5, "b": 0.5}, smoothing=0.5) == pytest.approx(0.0, abs=1e-12)
    assert distinct_n([["x", "y", "x", "y"]], 2) == pytest.approx(2 / 3)
    assert distinct_n([[1, 2], [1, 2]], 1) == 0.5 and math.isnan(distinct_n([[1]], 2))
    assert gap_closed(2.0, 1.0, 3.0) == 0.5 and math.isnan(gap_closed(1.0, 3.0, 3.0))


def test_metrics_match_reference_on_random_labels():
    gen = torch.Generator().manual_seed(0)
    labels = [int(x) if x < 7 else None for x in torch.randint(0, 9, (300,), generator=gen)]
    assert category_entropy(labels) == pytest.approx(entropy_reference(labels), abs=1e-12)
    texts = [torch.randint(0, 4, (int(n),), generator=gen).tolist() for n in torch.randint(0, 9, (30,), generator=gen)]
    for n in (1, 2, 3):
        assert distinct_n(texts, n) == pytest.approx(distinct_n_reference(texts, n))


def test_metric_bad_inputs():
    with pytest.raises(ValueError, match="categories"):
        coverage(["a"], [])
    with pytest.raises(ValueError, match="smoothing"):
        kl_to_reference(["a"], {"a": 1.0}, smoothing=1.0)
    with pytest.raises(ValueError, match="n must"):
        distinct_n([[1]], 0)


def test_topic_corpus_classifier_and_format():
    corpus = TopicCorpus()
    words = [w for lex in corpus.lexicons for w in lex]
    assert len(words) == len(set(words)) == 120
    gen = torch.Generator().manual_seed(0)
    for topic in (0, 7, 19):
        doc = corpus.document(topic, gen)
        assert corpus.classify(doc) == topic and corpus.well_formed(f"<{doc}>") and corpus.on_lexicon(f"<{doc}>")
        assert not corpus.well_formed(doc) and not corpus.well_formed(f"<{doc} abc>")
    a, b = corpus.lexicons[3][0], corpus.lexicons[5][0]
    mixed = "<" + " ".join([a, a, b, "qqq", a][:DOC_WORDS]) + ">"
    assert corpus.classify(mixed) == 3 and corpus.well_formed(mixed) and not corpus.on_lexicon(mixed)
    assert corpus.classify("<zz9 !!>") is None


# -- config ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("use_annotations", 1), ("mask_annotation_loss", "yes"), ("train_on_prompt", None),
    ("annotation_start_ids", (1, -2)), ("annotation_start_ids", "ab"), ("annotation_end_id", -1),
    ("annotation_end_id", True), ("max_annotation_tokens", 0), ("max_new_tokens", 2.5),
    ("annotation_temperature", 0.0), ("temperature", math.inf), ("temperature", math.nan),
    ("eos_token_id", 1.0), ("pad_token_id", -3), ("annotation_position", "middle")])
def test_bad_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AnnotationAnchoringConfig(**{field: value})


def test_config_defaults_and_list_ids():
    cfg = AnnotationAnchoringConfig(annotation_start_ids=[3, 4])
    assert cfg.annotation_start_ids == (3, 4) and cfg.use_annotations and cfg.mask_annotation_loss


def test_bad_inputs_raise():
    trainer = AnchoredSFTTrainer(_tiny(), torch.optim.SGD(_tiny().parameters(), lr=0.0))
    with pytest.raises(ValueError, match="prompts"):
        trainer.sample(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="examples"):
        collate([], AnnotationAnchoringConfig())
    with pytest.raises(ValueError, match="response"):
        collate([AnnotatedExample([1], [], [-4])], AnnotationAnchoringConfig())


def test_before_prompt_placement():
    ex = _examples()
    cfg = AnnotationAnchoringConfig(annotation_position="before_prompt", mask_annotation_loss=False)
    batch = collate(ex, cfg)
    assert batch.roles[0].tolist() == [ANNOTATION] * 3 + [PROMPT] * 3 + [RESPONSE] * 5
    assert batch.loss_mask[0].tolist() == [1.0] * 2 + [0.0] * 3 + [1.0] * 5
    model = _tiny(4)
    trainer = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    ref = anchored_loss_reference(model, ex, mask_annotation_loss=False, annotation_position="before_prompt")
    assert abs(trainer.loss(batch).item() - ref.item()) < 1e-5
    sampler = AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), AnnotationAnchoringConfig(
        annotation_position="before_prompt", annotation_start_ids=(10,), max_annotation_tokens=2, max_new_tokens=3),
        generator=torch.Generator().manual_seed(0))
    a, y = sampler.sample(torch.tensor([[1, 2]]), n=4)
    assert all(t.tolist()[0] == 10 and len(t) == 3 for t in a) and all(len(t) == 3 for t in y)
    with pytest.raises(ValueError, match="annotation_start_ids"):
        AnchoredSFTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), AnnotationAnchoringConfig(
            annotation_position="before_prompt")).sample(torch.tensor([[1, 2]]))


# -- the claim (protocol v2) -----------------------------------------------------------------------------------
def test_null_arm_is_rejected_by_the_comparator(tmp_path, monkeypatch):
    """Anchored switched back to plain SFT (plain base, no annotation, SFT's rate): the statistic is exactly 0."""
    from icml26.methods.annotation_anchoring.experiments import SPECS

    monkeypatch.setenv("ICML26_CACHE", str(tmp_path))
    spec = SPECS[0]
    cfg = {**spec.tiers["smoke"], "n_samples": 16}
    out = spec.run({**cfg, "null": True}, 0, spec.prepare(cfg))
    assert out["arms"]["anchored"]["topic_entropy_good"] == out["arms"]["sft"]["topic_entropy_good"]
    value = out["statistics"][spec.comparator.statistic]
    assert value == 0.0 and not spec.comparator.holds(value)
    assert spec.null_value == 0.0 and not spec.comparator.holds(spec.null_value)
    assert {c.name for c in spec.checks} <= set(out["checks"])


def test_pretraining_mix_puts_annotations_after_the_prompt():
    from icml26.methods.annotation_anchoring.experiments import BOS, PROMPT, pretrain_example

    corpus = TopicCorpus()
    gen = torch.Generator().manual_seed(0)
    docs = [pretrain_example(corpus, True, gen, p_qa=0.5, p_format=0.3) for _ in range(400)]
    qa = [d for d in docs if bytes(d.prompt).decode("latin-1") == BOS + PROMPT]
    assert 150 < len(qa) < 250  # about half are Q/A pages, annotated after the prompt
    formatted = [d for d in qa if d.response[0] == ord("<")]
    assert 0.15 < len(formatted) / len(qa) < 0.45
    assert all(bytes(d.annotation).decode("latin-1").startswith("#") for d in docs)
